-- One outcome: applied only if the delivery is still pending with the
-- attempt count the relay saw, in a partition whose lease was checked in
-- this same write transaction.
-- ?1 seq, ?2 route, ?3 expected attempts, ?4 state, ?5 attempts,
-- ?6 next attempt (µs, or NULL to keep), ?7 error (or NULL to keep),
-- ?8 published at (µs), ?9 now (µs), ?10 fenced partitions (JSON array)
UPDATE ferry_deliveries
   SET state = ?4,
       attempts = ?5,
       next_attempt_at = coalesce(?6, next_attempt_at),
       last_error = coalesce(?7, last_error),
       published_at = ?8,
       updated_at = ?9
 WHERE seq = ?1 AND route = ?2
   AND state = 'pending' AND attempts = ?3
   AND partition IN (SELECT value FROM json_each(?10))
