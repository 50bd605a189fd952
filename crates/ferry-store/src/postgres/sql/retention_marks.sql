-- Keeps, per (key, route), the latest published delivery of the batch that
-- a kept delivery of its key sits before (retention_kept.sql), as an order
-- mark a requeue reads as a published delivery. Only the batch's rows and
-- marks are read, by primary key.
-- $1 the batch's seqs, $2 keys, $3 their earliest kept seq (index for index)
INSERT INTO ferry.purged_order (key, route, seq)
SELECT d.key, d.route, max(d.seq)
  FROM ferry.deliveries d
  JOIN unnest($2::text[], $3::bigint[]) AS k(key, seq) ON k.key = d.key
 WHERE d.seq = ANY($1::bigint[]) AND d.state = 'published' AND d.seq > k.seq
 GROUP BY d.key, d.route
 ORDER BY d.key, d.route
ON CONFLICT (key, route) DO UPDATE SET seq = greatest(ferry.purged_order.seq, excluded.seq)
