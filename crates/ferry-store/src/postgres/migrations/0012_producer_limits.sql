-- Producers: a transaction holds at most 1,024 key locks, however many keys
-- it writes; and the SQL doors refuse what the Rust door refuses.
--
-- Key locks. ferry._enqueue and ferry._emit serialise the producers of a key
-- with a transaction-scoped advisory lock, so that per key, seq order is
-- commit order. It was one lock per distinct key, held to commit, and every
-- one of them takes an entry in PostgreSQL's shared lock table, which holds
-- max_locks_per_transaction (64) x the number of server processes (122 on a
-- default server) entries, plus whatever spare shared memory the table can
-- borrow: 12,832 advisory locks in one transaction on a default PostgreSQL
-- 15. A bulk transaction of ~13,000 keys (a batch job, or a 15,000-row
-- INSERT into a captured table) failed with "out of shared memory"; and
-- while one held ~12,800, any other connection that needed an entry, a new
-- connection among them, failed too: the relay and every producer stopped.
--
-- Now a key locks its bucket, 1 + (hashtext(key) & 1023), in the same
-- namespace. A key always maps to the same bucket, so a key's producers
-- still wait for each other's commit and per-key order holds; two producers
-- of different keys wait for each other only when their keys share a
-- bucket. Buckets run from 1 to 1024: `ferry migrate` locks (1178948185, 0),
-- which no bucket is.
--
-- Why 1,024. Fewer buckets leave more room in the lock table, more
-- buckets make unrelated keys wait for each other less often:
--   * Room: the table guarantees 64 x 122 = 7,808 entries on a default
--     server. 1,024 buckets let seven bulk transactions hold all their
--     key locks at once within that, with room left for every other lock;
--     4,096 would let one, and a second would live on borrowed memory.
--   * Waiting: two concurrent producers of different keys share a bucket
--     with a chance of 1 in 1,024, and the second then waits for the
--     first's commit. Sampled in pgbench (8 clients, 1,000 keys;
--     BENCHMARKS.md, "Producer"), 0.05 of the 8 clients waited on a key
--     lock on average with 1,024 buckets, 0.11 with 256 and 0.03 with a
--     lock per key: under 1% of the clients' time, and the commit rate
--     was the same within the noise. 1,024 is where the waiting stays
--     negligible and the room ample.
--
-- What it changes for bulk transactions: one that writes more than a few
-- thousand keys holds nearly every bucket until it commits, so keyed
-- producers wait for its commit (with 1,024 buckets, a transaction of k
-- keys holds about 1 - e^(-k/1024) of them: 62% at 1,000 keys). Commit bulk
-- jobs in chunks of a few hundred events where that matters. Two bulk
-- transactions that take their buckets in different orders can deadlock;
-- PostgreSQL then aborts one of them (SQLSTATE 40P01) after
-- deadlock_timeout, and it can be retried. ferry._enqueue_batch (the Rust
-- API's enqueue_batch) takes its buckets first, in ascending order, so two
-- transactions of one batch each wait for each other instead; a loop of
-- ferry.enqueue calls or a bulk write to a captured table takes them in
-- the order of its rows.
--
-- The switch: a producer that took a key's old lock and one that takes its
-- bucket would not wait for each other. This migration first takes a SHARE
-- lock on ferry.events, which waits for every transaction that has written
-- an event (under the old locks) to end, and holds new writes back until
-- the new functions are committed.
--
-- Checks. Header names: 1 to 255 bytes, as the Rust door requires (RabbitMQ
-- refuses a longer name, and the event would go dead and block its key).
-- A NULL payload is reported as such.
--
-- The functions are restated as 0007 (ferry._enqueue), 0001
-- (ferry._enqueue_batch) and 0010 (ferry._emit) left them; only the lock
-- and these checks differ.

LOCK TABLE ferry.events IN SHARE MODE;

CREATE OR REPLACE FUNCTION ferry._enqueue(
    p_id uuid, p_type text, p_key text, p_payload bytea,
    p_content_type text, p_headers jsonb, p_dispatch_key text
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_partition int;
    v_seq bigint;
    v_existing uuid;
    v_sleeping boolean;
    v_bad int;
BEGIN
    IF p_type IS NULL OR length(p_type) > 255
       OR p_type !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+$' THEN
        RAISE EXCEPTION 'ferry: invalid event type %', coalesce(quote_literal(p_type), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'use lowercase segments of [a-z0-9_-] joined by dots, e.g. order.item.created';
    END IF;
    IF p_key IS NOT NULL AND (p_key = '' OR octet_length(p_key) > 512) THEN
        RAISE EXCEPTION 'ferry: invalid event key: % bytes', octet_length(p_key)
            USING ERRCODE = '22023',
                  HINT = 'use a non-empty key of at most 512 bytes, or NULL for unordered events';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > 1048576 THEN
        IF p_payload IS NULL THEN
            RAISE EXCEPTION 'ferry: invalid event payload: it is NULL'
                USING ERRCODE = '22023',
                      HINT = 'pass a JSON value (''null''::jsonb for JSON null), not SQL NULL';
        END IF;
        RAISE EXCEPTION 'ferry: invalid event payload: % bytes, the limit is 1048576', octet_length(p_payload)
            USING ERRCODE = '22023',
                  HINT = 'store large bodies elsewhere and put a reference in the event';
    END IF;
    IF p_headers IS NULL OR jsonb_typeof(p_headers) <> 'object'
       -- Strict: lax mode would unwrap an array value and pass ["x"] and [].
       OR (p_headers <> '{}'::jsonb
           AND jsonb_path_exists(p_headers, 'strict $.* ? (@.type() != "string")', '{}', true)) THEN
        RAISE EXCEPTION 'ferry: invalid event headers: %', p_headers
            USING ERRCODE = '22023',
                  HINT = 'headers must be a JSON object whose values are strings';
    END IF;
    -- Only an empty name or one of 64 characters or more can be outside 1
    -- to 255 bytes: the JSON path is a cheap expression, the count a query.
    IF p_headers <> '{}'::jsonb
       AND jsonb_path_exists(p_headers, 'strict $.keyvalue() ? (@.key == "" || @.key like_regex "^.{64}" flag "s")') THEN
        SELECT octet_length(h.name) INTO v_bad
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE octet_length(h.name) NOT BETWEEN 1 AND 255
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: a header name of % bytes', v_bad
                USING ERRCODE = '22023', HINT = 'use header names of 1 to 255 bytes';
        END IF;
    END IF;
    IF p_dispatch_key IS NOT NULL THEN
        IF p_dispatch_key = '' OR octet_length(p_dispatch_key) > 512 THEN
            RAISE EXCEPTION 'ferry: invalid dispatch key: % bytes', octet_length(p_dispatch_key)
                USING ERRCODE = '22023', HINT = 'use a non-empty dispatch key of at most 512 bytes';
        END IF;
        SELECT e.id INTO v_existing FROM ferry.events e WHERE e.dispatch_key = p_dispatch_key;
        IF FOUND THEN
            RETURN v_existing;
        END IF;
    END IF;
    -- Held to commit: a second producer of this key (or of another key in
    -- its bucket) waits here, so it draws a later seq only after this
    -- transaction's events are visible.
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1178948185, 1 + (hashtext(p_key) & 1023));
    END IF;
    v_partition := ferry.partition_of(p_key, p_id);
    -- The event, its `unrouted` row and whether a relay sleeps, in one
    -- statement.
    WITH e AS (
        INSERT INTO ferry.events (id, type, key, partition, payload, content_type, headers, dispatch_key)
        VALUES (p_id, p_type, p_key, v_partition, p_payload, coalesce(p_content_type, 'application/json'),
                p_headers, p_dispatch_key)
        ON CONFLICT (dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
        RETURNING seq
    ), u AS (
        INSERT INTO ferry.unrouted (seq, partition) SELECT e.seq, v_partition FROM e
    )
    SELECT e.seq, EXISTS (SELECT 1 FROM ferry.relays r WHERE r.sleeping) INTO v_seq, v_sleeping FROM e;
    IF v_seq IS NULL THEN
        -- A concurrent transaction committed the same dispatch key first.
        SELECT e.id INTO v_existing FROM ferry.events e WHERE e.dispatch_key = p_dispatch_key;
        RETURN v_existing;
    END IF;
    -- NOTIFY takes a global lock at commit, so only pay for it when a relay
    -- sleeps; a busy relay polls on its own.
    IF v_sleeping THEN
        PERFORM pg_notify('ferry', v_partition::text);
    END IF;
    RETURN p_id;
END
$$;

-- Many events in one round trip, in the given order.
CREATE OR REPLACE FUNCTION ferry._enqueue_batch(
    p_ids uuid[], p_types text[], p_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers jsonb[], p_dispatch_keys text[]
) RETURNS uuid[]
LANGUAGE plpgsql AS $$
DECLARE
    v_out uuid[] := '{}';
BEGIN
    -- The batch's buckets first, in ascending order (ferry._enqueue takes
    -- each again, at no cost): two batches that share buckets then wait
    -- for each other instead of deadlocking.
    IF coalesce(array_length(p_keys, 1), 0) > 1 THEN
        PERFORM pg_advisory_xact_lock(1178948185, b.bucket)
           FROM (SELECT DISTINCT 1 + (hashtext(k.key) & 1023) AS bucket
                   FROM unnest(p_keys) k(key)
                  WHERE k.key IS NOT NULL
                  ORDER BY 1) b;
    END IF;
    FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP
        v_out := v_out || ferry._enqueue(p_ids[i], p_types[i], p_keys[i], p_payloads[i],
                                         p_content_types[i], p_headers[i], p_dispatch_keys[i]);
    END LOOP;
    RETURN v_out;
END
$$;

CREATE OR REPLACE FUNCTION ferry._emit(
    p_id uuid, p_type text, p_key text, p_payload bytea, p_content_type text, p_headers jsonb
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
    v_bad int;
BEGIN
    -- Only a ready slot that keeps its WAL reads the message for sure.
    -- Otherwise the event becomes an outbox row, which every relay mode
    -- delivers (ferry._enqueue checks it; no dispatch key: ferry.emit
    -- takes none).
    IF NOT EXISTS (SELECT 1 FROM ferry.wal_slots w JOIN pg_replication_slots s ON s.slot_name = w.slot
                    WHERE w.ready AND s.database = current_database()
                      AND s.wal_status IN ('reserved', 'extended')) THEN
        RETURN ferry._enqueue(p_id, p_type, p_key, p_payload, p_content_type, p_headers, NULL);
    END IF;
    IF p_type IS NULL OR length(p_type) > 255
       OR p_type !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+$' THEN
        RAISE EXCEPTION 'ferry: invalid event type %', coalesce(quote_literal(p_type), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'use lowercase segments of [a-z0-9_-] joined by dots, e.g. order.item.created';
    END IF;
    IF p_key IS NOT NULL AND (p_key = '' OR octet_length(p_key) > 512) THEN
        RAISE EXCEPTION 'ferry: invalid event key: % bytes', octet_length(p_key)
            USING ERRCODE = '22023',
                  HINT = 'use a non-empty key of at most 512 bytes, or NULL for unordered events';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > 1048576 THEN
        IF p_payload IS NULL THEN
            RAISE EXCEPTION 'ferry: invalid event payload: it is NULL'
                USING ERRCODE = '22023',
                      HINT = 'pass a JSON value (''null''::jsonb for JSON null), not SQL NULL';
        END IF;
        RAISE EXCEPTION 'ferry: invalid event payload: % bytes, the limit is 1048576', octet_length(p_payload)
            USING ERRCODE = '22023',
                  HINT = 'store large bodies elsewhere and put a reference in the event';
    END IF;
    IF p_headers IS NULL OR jsonb_typeof(p_headers) <> 'object'
       OR (p_headers <> '{}'::jsonb
           AND EXISTS (SELECT 1 FROM jsonb_each(p_headers) h WHERE jsonb_typeof(h.value) <> 'string')) THEN
        RAISE EXCEPTION 'ferry: invalid event headers: %', p_headers
            USING ERRCODE = '22023',
                  HINT = 'headers must be a JSON object whose values are strings';
    END IF;
    -- As in ferry._enqueue.
    IF p_headers <> '{}'::jsonb
       AND jsonb_path_exists(p_headers, 'strict $.keyvalue() ? (@.key == "" || @.key like_regex "^.{64}" flag "s")') THEN
        SELECT octet_length(h.name) INTO v_bad
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE octet_length(h.name) NOT BETWEEN 1 AND 255
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: a header name of % bytes', v_bad
                USING ERRCODE = '22023', HINT = 'use header names of 1 to 255 bytes';
        END IF;
    END IF;
    -- The lock ferry._enqueue takes (the key's bucket), held to commit: a
    -- later producer of this key, through either door, draws its seq after
    -- this one commits.
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1178948185, 1 + (hashtext(p_key) & 1023));
    END IF;
    -- A role that may use the sequence draws from it directly: a SECURITY
    -- DEFINER call costs the tableless path about a sixth of its rate.
    IF has_sequence_privilege('ferry.events_seq_seq', 'USAGE') THEN
        v_seq := nextval('ferry.events_seq_seq');
    ELSE
        v_seq := ferry._reserve_seq();
    END IF;
    PERFORM pg_logical_emit_message(true, 'ferry', convert_to(jsonb_build_object(
        'v', 1, 'id', p_id, 'seq', v_seq, 'type', p_type, 'key', p_key,
        'content_type', coalesce(p_content_type, 'application/json'), 'headers', p_headers,
        'payload', translate(encode(p_payload, 'base64'), E'\n', ''),
        'created_at', now())::text, 'UTF8'));
    RETURN p_id;
END
$$;
