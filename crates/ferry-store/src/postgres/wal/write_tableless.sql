-- Tableless events whose delivery failed: into the outbox, so the table path
-- can retry them, and into `unrouted`, which settle.sql takes them out of in
-- the same transaction. Returns (id, seq) of the events written.
--
-- Each event takes the seq ferry._emit reserved for it (migration 0010), so
-- the table path orders it by when it committed, not by when it failed; a
-- message emitted before that migration carries none ($8 NULL) and draws one
-- now. An id already present (a replay after a crash) writes nothing. A
-- reserved seq is never drawn twice, so it is taken only by the same event
-- on a replay; should another event hold it all the same (the sequence set
-- back by hand), this one draws a new seq rather than be lost.
WITH made AS (
    INSERT INTO ferry.events (seq, id, type, key, partition, payload, content_type, headers, created_at)
    OVERRIDING SYSTEM VALUE
    SELECT CASE WHEN t.seq IS NULL OR EXISTS (SELECT 1 FROM ferry.events e WHERE e.seq = t.seq)
                THEN ferry._reserve_seq() ELSE t.seq END,
           t.id, t.type, t.key, ferry.partition_of(t.key, t.id), t.payload, t.content_type, t.headers, t.created_at
      FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::timestamptz[],
                  $8::bigint[])
           WITH ORDINALITY AS t(id, type, key, payload, content_type, headers, created_at, seq, n)
     WHERE NOT EXISTS (SELECT 1 FROM ferry.events e WHERE e.id = t.id)
     ORDER BY t.n
    ON CONFLICT (id) DO NOTHING
    RETURNING id, seq, partition
), queued AS (
    INSERT INTO ferry.unrouted (seq, partition) SELECT seq, partition FROM made
)
SELECT id, seq FROM made
