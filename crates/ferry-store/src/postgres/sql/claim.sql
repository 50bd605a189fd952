-- Due deliveries of one route in outbox order. A delivery is held back while
-- an earlier delivery of the same key and route failed and awaits its retry,
-- or is dead: a failing event holds back only its own key. A delivery never
-- attempted (new, parked behind its key, requeued) is due at once whatever
-- clock wrote its next attempt time (another relay's, or the database's on
-- requeue): since it holds nothing back, a later delivery of its key would
-- otherwise go first.
-- $1 route, $2 owned partitions, $3 now, $4 limit, $5 seqs to skip (a hashed
-- subquery: see fetch_direct.sql)
--
-- Each event is looked up by its seq (LATERAL, kept apart by its LIMIT), as
-- in fetch_direct.sql: joined plainly, the planner merge-joined the due
-- deliveries with events from its first row whenever its statistics put the
-- pending deliveries early in the outbox, and read all of the outbox's
-- history before the first due one (150 ms for 500 deliveries behind
-- 190,000 published events).
SELECT d.seq, d.partition, d.attempts,
       e.id, e.type, e.key, e.payload, e.content_type, e.headers, e.created_at
  FROM (SELECT d.seq, d.partition, d.attempts
          FROM ferry.deliveries d
         WHERE d.route = $1
           AND d.state = 'pending'
           AND d.partition = ANY($2::int[])
           AND (d.attempts = 0 OR d.next_attempt_at <= $3)
           AND d.seq NOT IN (SELECT unnest($5::bigint[]))
           AND (d.key IS NULL OR NOT EXISTS (
                SELECT 1 FROM ferry.deliveries b
                 WHERE b.route = d.route AND b.key = d.key AND b.seq < d.seq
                   AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))))
         ORDER BY d.seq
         LIMIT $4) d
 CROSS JOIN LATERAL (SELECT * FROM ferry.events e WHERE e.seq = d.seq LIMIT 1) e
 ORDER BY d.seq
