-- Producers: the SQL doors refuse what the Rust door refuses, and say
-- what is wrong.
--
-- Header names: 1 to 255 bytes, as the Rust door requires. ferry.enqueue
-- and ferry.emit took an empty name and one of 300 bytes; RabbitMQ refuses
-- a name over 255 bytes (AMQP short string), so such an event went dead
-- and blocked its key until an operator cancelled it.
--
-- A NULL payload was reported as "<NULL> bytes, the limit is 1048576"; it
-- is now reported as NULL, with the fix.
--
-- The functions are restated as 0007 (ferry._enqueue) and 0010
-- (ferry._emit) left them; only these checks differ.

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
    -- Held to commit: a second producer of this key waits here, so it draws
    -- a later seq only after this transaction's events are visible.
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1178948185, hashtext(p_key));
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
    -- The lock ferry._enqueue takes, held to commit: a later producer of
    -- this key, through either door, draws its seq after this one commits.
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1178948185, hashtext(p_key));
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
