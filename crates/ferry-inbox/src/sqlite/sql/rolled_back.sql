-- Records dead an event whose handler went on after the inbox's
-- transaction ended without its claim (a ROLLBACK inside the handler):
-- the attempt is counted (as claim.sql counts it; ?5: it was marked) and
-- the marks cleared. Returns the attempts; nothing when another delivery
-- finished the event (done or dead) meanwhile.
INSERT INTO ferry_inbox AS i (consumer, event_id, state, attempts, last_error, event_type, processed_at)
VALUES (?1, ?2, 'dead', 1, ?4, ?3, CAST(unixepoch('subsec') * 1000000 AS INTEGER))
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'dead', attempts = i.attempts + max(i.unfinished + 1 - ?5, 1), unfinished = 0,
        last_error = excluded.last_error, processed_at = excluded.processed_at
    WHERE i.state = 'failing'
RETURNING attempts
