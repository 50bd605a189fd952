-- Direct delivery: the next unrouted events of the owned partitions with
-- everything needed to publish them, in seq order (columns as in claim.sql);
-- per event, the routes among ?3 on which a delivery of its key is pending
-- or dead (a JSON array), which it must queue behind; and, of the routes in
-- ?4 (their destination failed), those that still have pending deliveries in
-- the owned partitions. Events published but not settled yet (?5) are
-- skipped.
-- ?1 owned partitions, ?2 limit, ?3 routes, ?4 routes reported down,
-- ?5 seqs to skip (all JSON arrays but the limit)
SELECT b.seq, b.partition, 0 AS attempts,
       e.id, e.type, e.key, e.payload, e.content_type, e.headers, e.created_at,
       CASE WHEN e.key IS NULL THEN '[]' ELSE (
           SELECT json_group_array(DISTINCT d.route)
             FROM ferry_deliveries d
            WHERE d.key = e.key AND d.route IN (SELECT value FROM json_each(?3))
              AND d.state IN ('pending', 'dead'))
       END AS held,
       (SELECT json_group_array(r.value)
          FROM json_each(?4) r
         WHERE EXISTS (SELECT 1 FROM ferry_deliveries d
                        WHERE d.route = r.value AND d.state = 'pending'
                          AND d.partition IN (SELECT value FROM json_each(?1)))) AS busy
  FROM (SELECT u.seq, u.partition
          FROM ferry_unrouted u
         WHERE u.partition IN (SELECT value FROM json_each(?1))
           AND u.seq NOT IN (SELECT value FROM json_each(?5))
         ORDER BY u.seq
         LIMIT ?2) b
  JOIN ferry_events e ON e.seq = b.seq
 ORDER BY b.seq
