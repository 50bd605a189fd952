-- Applies outcomes, each only if its delivery is still pending with the
-- attempt count the relay saw, and its partition lease is still this relay's.
-- Failed attempts are logged to `failures`.
-- "Still pending" is spelled as NOT IN the other states (equivalent under the
-- table's CHECK constraint) on purpose: `state = 'pending'` lets the planner,
-- on statistics that lag a burst of inserts, scan the whole pending index
-- once per outcome; this form keeps it on one primary-key lookup per outcome.
-- The commit is asynchronous (no wait for the WAL flush): if the database
-- crashes before the flush, this write is lost as a whole and the relay
-- repeats the work: a duplicate publish, never a lost event (ARCHITECTURE.md,
-- "Durability of the relay's own writes").
-- $1 relay, $2 partitions, $3 tokens, $4 route,
-- $5..$11 per outcome: seq, expected attempts, state, attempts, next attempt, error, published at
WITH fence AS (
    SELECT p.partition
      FROM ferry.partitions p
      JOIN unnest($2::int[], $3::bigint[]) AS l(partition, token)
        ON l.partition = p.partition AND l.token = p.token
     WHERE p.owner = $1
), o AS (
    SELECT * FROM unnest($5::bigint[], $6::int[], $7::text[], $8::int[], $9::timestamptz[],
                         $10::text[], $11::timestamptz[])
           AS o(seq, expected, state, attempts, next_at, error, published_at)
), done AS (
    UPDATE ferry.deliveries d
       SET state = o.state,
           attempts = o.attempts,
           next_attempt_at = coalesce(o.next_at, d.next_attempt_at),
           last_error = coalesce(o.error, d.last_error),
           published_at = o.published_at,
           updated_at = $12
      FROM o, fence
     WHERE d.route = $4 AND d.seq = o.seq AND d.partition = fence.partition
       AND d.state NOT IN ('published', 'dead', 'cancelled') AND d.attempts = o.expected
    RETURNING d.seq, d.attempts, d.state, o.error
), logged AS (
    INSERT INTO ferry.failures (seq, route, attempt, at, dead, error)
    SELECT done.seq, $4, done.attempts, $12, done.state = 'dead', done.error
      FROM done WHERE done.state <> 'published'
    ON CONFLICT DO NOTHING
)
SELECT count(*), set_config('synchronous_commit', 'off', true) AS durability FROM done
