-- Creates deliveries for routed events and removes them from `unrouted`, in
-- one statement, only for partitions whose lease this relay still holds.
-- The commit is asynchronous (no wait for the WAL flush): if the database
-- crashes before the flush, this write is lost as a whole and the relay
-- repeats the work: a duplicate publish, never a lost event (ARCHITECTURE.md,
-- "Durability of the relay's own writes").
-- $1 relay, $2 partitions, $3 tokens, $4 event seqs,
-- $5..$10 one row per delivery: seq, route, partition, key, state, error; $11 now
WITH fence AS (
    SELECT p.partition
      FROM ferry.partitions p
      JOIN unnest($2::int[], $3::bigint[]) AS l(partition, token)
        ON l.partition = p.partition AND l.token = p.token
     WHERE p.owner = $1
), gone AS (
    DELETE FROM ferry.unrouted u
     USING fence
     WHERE u.partition = fence.partition AND u.seq = ANY($4::bigint[])
    RETURNING u.seq
), made AS (
    INSERT INTO ferry.deliveries (seq, route, partition, key, state, next_attempt_at, last_error, updated_at)
    SELECT d.seq, d.route, d.partition, d.key, d.state, $11, d.error, $11
      FROM unnest($5::bigint[], $6::text[], $7::int[], $8::text[], $9::text[], $10::text[])
           AS d(seq, route, partition, key, state, error)
      JOIN gone g ON g.seq = d.seq
    ON CONFLICT (seq, route) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS routed, (SELECT count(*) FROM made) AS deliveries,
       set_config('synchronous_commit', 'off', true) AS durability
