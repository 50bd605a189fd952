-- One bounded batch of a consumer's done rows older than ?2 microseconds.
DELETE FROM ferry_inbox
WHERE rowid IN (
    SELECT rowid FROM ferry_inbox
    WHERE consumer = ?1 AND state = 'done'
      AND processed_at < CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?2
    LIMIT ?3
)
