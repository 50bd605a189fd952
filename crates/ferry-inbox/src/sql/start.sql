-- Marks the start of an attempt at a delivery that may be a replay, in a
-- transaction of its own committed before the handler runs: an attempt
-- that never finishes (the process killed, out of memory, aborted inside
-- the handler) rolls its claim back, and this mark is all that remains of
-- it. A finished attempt clears the marks (claim.sql, fail.sql). Returns
-- the finished attempts and the unfinished ones, this one included;
-- nothing when the row is done or dead.
INSERT INTO ferry.inbox AS i (consumer, event_id, state, attempts, unfinished, event_type, processed_at)
VALUES ($1, $2, 'failing', 0, 1, $3, now())
ON CONFLICT (consumer, event_id) DO UPDATE
    SET unfinished = i.unfinished + 1
    WHERE i.state = 'failing'
RETURNING attempts, unfinished
