-- One bounded batch of a consumer's done rows older than the cutoff.
DELETE FROM ferry.inbox
WHERE ctid IN (
    SELECT ctid FROM ferry.inbox
    WHERE consumer = $1 AND state = 'done' AND processed_at < $2
    LIMIT $3
)
