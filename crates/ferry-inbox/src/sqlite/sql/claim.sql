-- Records (consumer, event) as done inside the handler's transaction, or
-- takes over a row whose earlier attempts failed. Returns this attempt's
-- number and its stamp; returns nothing when the row is done or dead. The transaction
-- began IMMEDIATE, so a concurrent delivery that committed the row first is
-- seen here, never raced.
INSERT INTO ferry_inbox AS i (consumer, event_id, state, attempts, event_type, processed_at)
VALUES (?1, ?2, 'done', 1, ?3, CAST(unixepoch('subsec') * 1000000 AS INTEGER))
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'done', attempts = i.attempts + 1, processed_at = excluded.processed_at
    WHERE i.state = 'failing'
RETURNING attempts, processed_at
