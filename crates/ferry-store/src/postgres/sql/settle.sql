-- Settles a batch delivered straight from the outbox (direct delivery, or
-- WAL streaming): takes its events out of `unrouted` (only those still
-- there: a row routed before is left alone) and writes their deliveries,
-- with a failures row for each failed first attempt.
--
-- An event in `unrouted` has no delivery rows (routing writes them and
-- takes it out in one transaction; a requeue to the router deletes its only
-- row, `(no route)`), so a delivery written here can only collide with
-- another of the same call. The direct path runs this statement without
-- its `ON CONFLICT` line, which spares every row PostgreSQL's speculative
-- insertion, and runs it again with the line if a pair repeats
-- (`direct::settle`).
-- $1 seqs to take; $2..$9 one row per delivery: seq, route, key, state,
-- attempts, next attempt, error, published at; $10 now;
-- $11 relay, $12 partitions, $13 tokens: the fence, or a NULL relay for none
-- (WAL streaming holds the slot instead); $14 notify the partitions that
-- received pending deliveries; $15 commit durably.
WITH fence AS (
    SELECT p.partition
      FROM ferry.partitions p
      JOIN unnest($12::int[], $13::bigint[]) AS l(partition, token)
        ON l.partition = p.partition AND l.token = p.token
     WHERE p.owner = $11
       FOR SHARE OF p
), gone AS (
    DELETE FROM ferry.unrouted u
     WHERE u.seq = ANY($1::bigint[])
       AND ($11::text IS NULL OR u.partition IN (SELECT f.partition FROM fence f))
    RETURNING u.seq, u.partition
), made AS (
    INSERT INTO ferry.deliveries
           (seq, route, partition, key, state, attempts, next_attempt_at, last_error, published_at, updated_at)
    SELECT d.seq, d.route, g.partition, d.key, d.state, d.attempts, d.next_at, d.error, d.published_at, $10
      FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::int[], $7::timestamptz[],
                  $8::text[], $9::timestamptz[])
           AS d(seq, route, key, state, attempts, next_at, error, published_at)
      JOIN gone g ON g.seq = d.seq
    ON CONFLICT (seq, route) DO NOTHING
    RETURNING seq, route, partition, state, attempts, last_error
), failed AS (
    INSERT INTO ferry.failures (seq, route, attempt, at, dead, error)
    SELECT m.seq, m.route, m.attempts, $10, m.state = 'dead', m.last_error
      FROM made m
     WHERE m.attempts > 0 AND m.state <> 'published'
    ON CONFLICT DO NOTHING
), woke AS (
    SELECT pg_notify('ferry', 'due:' || p.partition)
      FROM (SELECT DISTINCT partition FROM made WHERE state = 'pending') p
     WHERE $14
)
SELECT (SELECT count(*) FROM gone) AS gone, (SELECT count(*) FROM made) AS made,
       (SELECT count(*) FROM woke) AS woke,
       -- Durable means flushed to this server's disk whatever the role's or
       -- database's default: WAL streaming confirms the slot's position
       -- right after this commit, and the server may write that position to
       -- disk before a commit made with synchronous_commit = off.
       CASE WHEN NOT $15 THEN set_config('synchronous_commit', 'off', true)
            WHEN current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'local', true)
            ELSE current_setting('synchronous_commit') END AS durability
