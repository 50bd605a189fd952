-- Direct delivery: the next unrouted events of the owned partitions with
-- everything needed to publish them, in seq order (columns as in claim.sql);
-- per event, the routes among $3 on which a delivery of its key is pending
-- or dead, which it must queue behind; and, of the routes in $4 (their
-- destination failed), those that still have pending deliveries in the
-- owned partitions. Events published but not settled yet ($5) are skipped.
-- $1 owned partitions, $2 limit, $3 routes, $4 routes reported down,
-- $5 seqs to skip
--
-- Each event is looked up by its seq (LATERAL, kept apart by its LIMIT): a
-- prepared statement's generic plan otherwise may merge-join the batch with
-- the whole events table, a scan that grows with the outbox. The seqs to
-- skip are a hashed subquery: `seq <> ALL($5)` is hashed only when the
-- array is a constant, and under the generic plan it compared every row
-- scanned with every seq skipped (3.7 ms instead of 0.7 ms for 500 rows
-- behind 1,000 skipped). The batch is a subquery, not a CTE: the planner
-- then knows its rows come in seq order, which the per-event lookups keep,
-- and sorts nothing; behind a CTE it sorted the fetched rows, payloads and
-- all, again (1.0 ms instead of 1.3 to 1.8 ms for 500 events).
SELECT b.seq, b.partition, 0 AS attempts,
       e.id, e.type, e.key, e.payload, e.content_type, e.headers, e.created_at,
       CASE WHEN e.key IS NULL THEN '{}'::text[] ELSE ARRAY(
           SELECT DISTINCT d.route
             FROM ferry.deliveries d
            WHERE d.key = e.key AND d.route = ANY($3::text[]) AND d.state IN ('pending', 'dead'))
       END AS held,
       ARRAY(SELECT r.route
               FROM unnest($4::text[]) AS r(route)
              WHERE EXISTS (SELECT 1 FROM ferry.deliveries d
                             WHERE d.route = r.route AND d.state = 'pending'
                               AND d.partition = ANY($1::int[]))) AS busy
  FROM (SELECT u.seq, u.partition
          FROM ferry.unrouted u
         WHERE u.partition = ANY($1::int[])
           AND u.seq NOT IN (SELECT unnest($5::bigint[]))
         ORDER BY u.seq
         LIMIT $2) b
 CROSS JOIN LATERAL (SELECT * FROM ferry.events e WHERE e.seq = b.seq LIMIT 1) e
 ORDER BY b.seq
