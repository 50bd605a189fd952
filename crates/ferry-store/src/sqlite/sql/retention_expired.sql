-- Expired events in one stretch of the outbox, oldest first: routed, and
-- every delivery settled before its window, that is published before ?3, or
-- dead or cancelled before ?4 (NULL: kept until an operator acts). Walks the
-- primary key over a bounded stretch, so it never scans the whole table.
-- ?1 after seq, ?2 up to seq, ?3 published cutoff (µs), ?4 settled cutoff (µs), ?5 limit
SELECT e.seq
  FROM ferry_events e
 WHERE e.seq > ?1 AND e.seq <= ?2
   AND NOT EXISTS (SELECT 1 FROM ferry_unrouted u WHERE u.seq = e.seq)
   AND EXISTS (SELECT 1 FROM ferry_deliveries d WHERE d.seq = e.seq)
   AND NOT EXISTS (
       SELECT 1 FROM ferry_deliveries d
        WHERE d.seq = e.seq
          AND NOT coalesce((d.state = 'published' AND d.published_at < ?3)
                        OR (d.state IN ('dead', 'cancelled') AND d.updated_at < ?4), 0))
 ORDER BY e.seq
 LIMIT ?5
