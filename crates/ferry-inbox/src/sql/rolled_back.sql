-- Records dead an event whose handler ended the inbox's transaction with
-- its own ROLLBACK, which took the claim with it: the attempt is counted
-- (as claim.sql counts it, $5: it was marked) and the marks cleared.
-- Returns the attempts; nothing when another delivery finished the event
-- (done or dead) meanwhile.
INSERT INTO ferry.inbox AS i (consumer, event_id, state, attempts, last_error, event_type, processed_at)
VALUES ($1, $2, 'dead', 1, $4, $3, now())
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'dead', attempts = i.attempts + greatest(i.unfinished + (NOT $5)::int, 1), unfinished = 0,
        last_error = EXCLUDED.last_error, processed_at = now()
    WHERE i.state = 'failing'
RETURNING attempts
