-- $1 owned partitions, $2 limit. Each event is looked up by its seq
-- (LATERAL, kept apart by its LIMIT) so that no generic plan merge-joins the
-- batch with the whole events table (see fetch_direct.sql).
SELECT b.seq, b.partition, e.type, e.key
  FROM (SELECT u.seq, u.partition
          FROM ferry.unrouted u
         WHERE u.partition = ANY($1::int[])
         ORDER BY u.seq
         LIMIT $2) b
 CROSS JOIN LATERAL (SELECT e.type, e.key FROM ferry.events e WHERE e.seq = b.seq LIMIT 1) e
 ORDER BY b.seq
