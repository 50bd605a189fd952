-- Takes free or expired partitions, lowest first, bumping each fencing token
-- so that an outcome written under the previous lease is refused.
-- ?1 relay, ?2 lease deadline (µs), ?3 now (µs), ?4 how many
UPDATE ferry_partitions
   SET owner = ?1, token = token + 1, expires_at = ?2, acquired_at = ?3
 WHERE partition IN (
       SELECT q.partition FROM ferry_partitions q
        WHERE q.owner IS NULL OR q.expires_at < ?3
        ORDER BY q.partition
        LIMIT ?4)
