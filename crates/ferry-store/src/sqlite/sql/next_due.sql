-- When the earliest failed delivery of a route becomes due again.
-- ?1 route, ?2 owned partitions (JSON array), ?3 now (µs)
SELECT min(d.next_attempt_at)
  FROM ferry_deliveries d
 WHERE d.route = ?1
   AND d.state = 'pending'
   AND d.partition IN (SELECT value FROM json_each(?2))
   AND d.attempts > 0
   AND d.next_attempt_at > ?3
