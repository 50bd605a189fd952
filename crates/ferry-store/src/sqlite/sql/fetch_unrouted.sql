-- ?1 owned partitions (JSON array), ?2 limit
SELECT u.seq, u.partition, e.type, e.key
  FROM ferry_unrouted u
  JOIN ferry_events e ON e.seq = u.seq
 WHERE u.partition IN (SELECT value FROM json_each(?1))
 ORDER BY u.seq
 LIMIT ?2
