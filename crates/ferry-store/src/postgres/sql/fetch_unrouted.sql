-- $1 owned partitions, $2 limit
SELECT u.seq, u.partition, e.type, e.key
  FROM ferry.unrouted u
  JOIN ferry.events e ON e.seq = u.seq
 WHERE u.partition = ANY($1::int[])
 ORDER BY u.seq
 LIMIT $2
