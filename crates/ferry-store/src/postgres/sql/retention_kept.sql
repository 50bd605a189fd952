-- Of each key of a batch about to be deleted, the earliest delivery or
-- unrouted event the delete leaves before the batch's last event: what a
-- requeue could still send after the batch's published deliveries of that
-- key, which the order marks (ferry.purged_order) are kept for. Read through
-- indexes by the batch's keys, never the whole outbox nor every delivery
-- failed and kept: pending and dead deliveries (deliveries_held), dead and
-- cancelled ones before the batch's end (deliveries_failed_key, migration
-- 32), and the unrouted events before it. A published delivery kept because its event has a dead,
-- cancelled or pending one is found through that one (same seq and key).
-- $1 the batch's seqs, $2 its keys, $3 its last seq
SELECT k.key, min(k.seq)
  FROM (SELECT r.key, r.seq FROM ferry.deliveries r
         WHERE r.key = ANY($2::text[]) AND r.key IS NOT NULL AND r.state IN ('pending', 'dead')
           AND r.seq < $3
        UNION ALL
        SELECT r.key, r.seq FROM ferry.deliveries r
         WHERE r.state IN ('dead', 'cancelled') AND r.seq < $3 AND r.key = ANY($2::text[])
        UNION ALL
        SELECT e.key, e.seq
          FROM ferry.unrouted u
         CROSS JOIN LATERAL (SELECT ev.key, ev.seq FROM ferry.events ev WHERE ev.seq = u.seq LIMIT 1) e
         WHERE u.seq < $3 AND e.key = ANY($2::text[])) k
 WHERE k.seq <> ALL($1::bigint[])
 GROUP BY k.key
