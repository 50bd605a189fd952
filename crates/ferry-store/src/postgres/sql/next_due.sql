-- When the earliest failed delivery of a route becomes due again.
-- $1 route, $2 owned partitions, $3 now
SELECT min(d.next_attempt_at)
  FROM ferry.deliveries d
 WHERE d.route = $1
   AND d.state = 'pending'
   AND d.partition = ANY($2::int[])
   AND d.attempts > 0
   AND d.next_attempt_at > $3
