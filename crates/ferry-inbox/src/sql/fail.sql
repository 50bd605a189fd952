-- Counts a failed attempt after the handler's transaction rolled back.
-- Returns the attempts so far; returns nothing when another delivery of the
-- event finished it (done or dead) in the meantime.
INSERT INTO ferry.inbox AS i (consumer, event_id, state, attempts, last_error, event_type, processed_at)
VALUES ($1, $2, 'failing', 1, $4, $3, now())
ON CONFLICT (consumer, event_id) DO UPDATE
    SET attempts = i.attempts + 1, last_error = EXCLUDED.last_error, processed_at = now()
    WHERE i.state = 'failing'
RETURNING attempts
