-- Gives up on an event whose last attempts did not finish, without running
-- the handler again: every attempt counted, the marks cleared.
UPDATE ferry.inbox
SET state = 'dead', attempts = attempts + unfinished - 1, unfinished = 0, last_error = $3, processed_at = now()
WHERE consumer = $1 AND event_id = $2 AND state = 'failing'
RETURNING attempts
