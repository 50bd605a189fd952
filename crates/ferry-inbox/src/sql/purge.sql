-- One bounded batch of a consumer's done rows older than the window ($2,
-- in seconds), measured by the database's clock, which wrote processed_at.
DELETE FROM ferry.inbox
WHERE ctid IN (
    SELECT ctid FROM ferry.inbox
    WHERE consumer = $1 AND state = 'done' AND processed_at < now() - make_interval(secs => $2)
    LIMIT $3
)
