-- Counts a failed attempt after the handler's transaction rolled back, with
-- the attempts the process died in before it (see claim.sql; ?5: this
-- attempt was marked), and clears them: this one finished.
-- Returns the attempts so far; returns nothing when another delivery of the
-- event finished it (done or dead) in the meantime.
INSERT INTO ferry_inbox AS i (consumer, event_id, state, attempts, last_error, event_type, processed_at)
VALUES (?1, ?2, 'failing', 1, ?4, ?3, CAST(unixepoch('subsec') * 1000000 AS INTEGER))
ON CONFLICT (consumer, event_id) DO UPDATE
    SET attempts = i.attempts + max(i.unfinished + 1 - ?5, 1), unfinished = 0,
        last_error = excluded.last_error, processed_at = excluded.processed_at
    WHERE i.state = 'failing'
RETURNING attempts
