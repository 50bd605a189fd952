-- Records (consumer, event) as done inside the handler's transaction, or
-- takes over a row whose earlier attempts failed, marking it with this
-- attempt's claim (?4, random). Returns this attempt's number; returns
-- nothing when the row is done or dead. The transaction began IMMEDIATE,
-- so a concurrent delivery that committed the row first is seen here,
-- never raced. attempts counts the attempts the process died in too (the
-- row's `unfinished`, this attempt's own mark included when ?5 says it was
-- marked: start.sql).
INSERT INTO ferry_inbox AS i (consumer, event_id, state, attempts, event_type, processed_at, claim)
VALUES (?1, ?2, 'done', 1, ?3, CAST(unixepoch('subsec') * 1000000 AS INTEGER), ?4)
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'done', attempts = i.attempts + max(i.unfinished + 1 - ?5, 1), unfinished = 0,
        processed_at = excluded.processed_at, claim = excluded.claim
    WHERE i.state = 'failing'
RETURNING attempts
