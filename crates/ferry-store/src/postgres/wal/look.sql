-- What a streamed batch may publish directly. $1 the batch's outbox seqs,
-- $2 the routes it touches, $3 its keys. Rows: (0, seq) still unrouted;
-- (1, route) has pending deliveries; (2, route, key) held by a dead delivery.
SELECT 0 AS kind, u.seq, NULL::text AS route, NULL::text AS key
  FROM ferry.unrouted u
 WHERE u.seq = ANY($1::bigint[])
UNION ALL
SELECT 1, NULL, r.route, NULL
  FROM unnest($2::text[]) AS r(route)
 WHERE EXISTS (SELECT 1 FROM ferry.deliveries d WHERE d.route = r.route AND d.state = 'pending')
UNION ALL
SELECT DISTINCT 2, NULL::bigint, d.route, d.key
  FROM ferry.deliveries d
 WHERE d.key = ANY($3::text[]) AND d.route = ANY($2::text[]) AND d.state = 'dead'
