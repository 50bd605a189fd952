-- What a streamed batch may publish directly. $1 the batch's outbox seqs,
-- $2 the routes it touches, $3 its keys, $4 the ids of its transactions
-- (every one with events, tableless ones included). Rows: (0, seq) still unrouted; (1, route) has pending
-- deliveries; (2, route, key) held by a dead delivery; (3, xid) a transaction
-- not yet visible to this statement's snapshot.
--
-- The slot hands a transaction over once its commit is in the WAL, which
-- can be a moment before other sessions see it (and much longer with
-- synchronous replication). Until its xid is visible, "not in unrouted"
-- would wrongly read as "routed before", and a tableless event would be
-- published while a failover could still lose its commit: the relay waits
-- instead. The
-- 32-bit xid is placed within 2^31 of the snapshot's xmax, on either side:
-- a transaction whose commit is in the WAL but not yet in the snapshots'
-- view can be at or above xmax (the newest of all), and one from long ago
-- below it, in the epoch before xmax's or in its own.
WITH snap AS (
    SELECT pg_current_snapshot() AS s, pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax
)
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
UNION ALL
SELECT 3, x.xid, NULL, NULL
  FROM unnest($4::bigint[]) AS x(xid), snap
 CROSS JOIN LATERAL (SELECT x.xid - (snap.xmax & 4294967295) AS d) AS diff
 WHERE NOT pg_visible_in_snapshot(
           (snap.xmax + CASE WHEN diff.d >= 2147483648 THEN diff.d - 4294967296
                             WHEN diff.d < -2147483648 THEN diff.d + 4294967296
                             ELSE diff.d END)::text::xid8,
           snap.s)
