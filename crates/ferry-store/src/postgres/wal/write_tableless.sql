-- Tableless events whose delivery failed: into the outbox, so the table path
-- can retry them, and into `unrouted`, which settle.sql takes them out of in
-- the same transaction. An id already present (a replay after a crash)
-- writes nothing. Returns (id, seq) of the events written.
WITH made AS (
    INSERT INTO ferry.events (id, type, key, partition, payload, content_type, headers, created_at)
    SELECT t.id, t.type, t.key, ferry.partition_of(t.key, t.id), t.payload, t.content_type, t.headers, t.created_at
      FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::timestamptz[])
           AS t(id, type, key, payload, content_type, headers, created_at)
    ON CONFLICT (id) DO NOTHING
    RETURNING id, seq, partition
), queued AS (
    INSERT INTO ferry.unrouted (seq, partition) SELECT seq, partition FROM made
)
SELECT id, seq FROM made
