-- Producers: a limit on an event's headers, 64 KiB of names and values
-- together, as the Rust door (Event::validate) has. RabbitMQ refuses
-- message properties over its frame size (128 KiB by default) and Kafka
-- counts headers in a record's size, so an event with larger headers was
-- stored, went dead at every destination and held back every later event
-- of its key. The check costs nothing for an event without headers, and
-- one measure of jsonb's text for one with them.
--
-- Checked in the doors, not on ferry.events: a relay's own rows (the WAL
-- settle's row for a tableless event it could not deliver, emitted before
-- this migration) must still be written.
--
-- The functions are restated as 0017 left them; only this check differs.

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
    v_name text;
    v_bytes bigint;
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
    IF p_key IS NOT NULL AND (strpos(p_key, E'\n') > 0 OR strpos(p_key, E'\r') > 0) THEN
        RAISE EXCEPTION 'ferry: invalid event key: it has a line break'
            USING ERRCODE = '22023',
                  HINT = 'remove CR and LF from the key: NATS and webhooks carry it in a header';
    END IF;
    -- The SQL door and captured tables pass application/json.
    IF p_content_type IS NOT NULL AND p_content_type <> 'application/json'
       AND (p_content_type = '' OR octet_length(p_content_type) > 255 OR p_content_type ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'ferry: invalid event content type: % bytes%', octet_length(p_content_type),
                CASE WHEN p_content_type ~ '[[:cntrl:]]' THEN ', with a control character' ELSE '' END
            USING ERRCODE = '22023',
                  HINT = 'use a media type of 1 to 255 bytes without control characters, e.g. application/octet-stream';
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
    -- 64 KiB of names and values in all. jsonb's text form is longer than
    -- the names and values it holds, so they are counted only past that.
    IF p_headers <> '{}'::jsonb AND octet_length(p_headers::text) > 65536 THEN
        SELECT coalesce(sum(octet_length(h.key) + octet_length(h.value)), 0) INTO v_bytes
          FROM jsonb_each_text(p_headers) h;
        IF v_bytes > 65536 THEN
            RAISE EXCEPTION 'ferry: invalid event headers: they take % bytes (names and values), the limit is 65536',
                    v_bytes
                USING ERRCODE = '22023',
                      HINT = 'carry large values in the payload; keep headers to routing and tracing metadata';
        END IF;
    END IF;
    -- A name outside 1 to 255 bytes (only an empty one or one of 64
    -- characters or more can be), a name that is not an HTTP token, a value
    -- with a control character other than a tab: the JSON path is a cheap
    -- expression, finding which a query.
    IF p_headers <> '{}'::jsonb
       AND jsonb_path_exists(p_headers, 'strict $.keyvalue() ? (@.key == "" || @.key like_regex "^.{64}" flag "s"
           || @.key like_regex "[^-!#$%&''*+.^_`|~0-9A-Za-z]"
           || @.value like_regex "[\u0001-\u0008\u000A-\u001F\u007F]")') THEN
        SELECT octet_length(h.name) INTO v_bad
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE octet_length(h.name) NOT BETWEEN 1 AND 255
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: a header name of % bytes', v_bad
                USING ERRCODE = '22023', HINT = 'use header names of 1 to 255 bytes';
        END IF;
        SELECT h.name INTO v_name
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE h.name ~ '[^-!#$%&''*+.^_`|~0-9A-Za-z]'
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: the header name % is not an HTTP token', quote_literal(v_name)
                USING ERRCODE = '22023',
                      HINT = 'use header names of letters, digits and !#$%&''*+-.^_`|~ (an HTTP token), e.g. tenant-id';
        END IF;
        SELECT h.key INTO v_name
          FROM jsonb_each_text(p_headers) h
         WHERE h.value ~ '[\x01-\x08\x0a-\x1f\x7f]'
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: the value of header % has a control character',
                    quote_literal(v_name)
                USING ERRCODE = '22023',
                      HINT = 'remove control characters (line breaks among them) from header values; a tab is allowed';
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

CREATE OR REPLACE FUNCTION ferry._emit(
    p_id uuid, p_type text, p_key text, p_payload bytea, p_content_type text, p_headers jsonb
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
    v_bad int;
    v_name text;
    v_bytes bigint;
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
    IF p_key IS NOT NULL AND (strpos(p_key, E'\n') > 0 OR strpos(p_key, E'\r') > 0) THEN
        RAISE EXCEPTION 'ferry: invalid event key: it has a line break'
            USING ERRCODE = '22023',
                  HINT = 'remove CR and LF from the key: NATS and webhooks carry it in a header';
    END IF;
    -- The SQL door and captured tables pass application/json.
    IF p_content_type IS NOT NULL AND p_content_type <> 'application/json'
       AND (p_content_type = '' OR octet_length(p_content_type) > 255 OR p_content_type ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'ferry: invalid event content type: % bytes%', octet_length(p_content_type),
                CASE WHEN p_content_type ~ '[[:cntrl:]]' THEN ', with a control character' ELSE '' END
            USING ERRCODE = '22023',
                  HINT = 'use a media type of 1 to 255 bytes without control characters, e.g. application/octet-stream';
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
    -- 64 KiB of names and values in all. jsonb's text form is longer than
    -- the names and values it holds, so they are counted only past that.
    IF p_headers <> '{}'::jsonb AND octet_length(p_headers::text) > 65536 THEN
        SELECT coalesce(sum(octet_length(h.key) + octet_length(h.value)), 0) INTO v_bytes
          FROM jsonb_each_text(p_headers) h;
        IF v_bytes > 65536 THEN
            RAISE EXCEPTION 'ferry: invalid event headers: they take % bytes (names and values), the limit is 65536',
                    v_bytes
                USING ERRCODE = '22023',
                      HINT = 'carry large values in the payload; keep headers to routing and tracing metadata';
        END IF;
    END IF;
    -- A name outside 1 to 255 bytes (only an empty one or one of 64
    -- characters or more can be), a name that is not an HTTP token, a value
    -- with a control character other than a tab: the JSON path is a cheap
    -- expression, finding which a query.
    IF p_headers <> '{}'::jsonb
       AND jsonb_path_exists(p_headers, 'strict $.keyvalue() ? (@.key == "" || @.key like_regex "^.{64}" flag "s"
           || @.key like_regex "[^-!#$%&''*+.^_`|~0-9A-Za-z]"
           || @.value like_regex "[\u0001-\u0008\u000A-\u001F\u007F]")') THEN
        SELECT octet_length(h.name) INTO v_bad
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE octet_length(h.name) NOT BETWEEN 1 AND 255
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: a header name of % bytes', v_bad
                USING ERRCODE = '22023', HINT = 'use header names of 1 to 255 bytes';
        END IF;
        SELECT h.name INTO v_name
          FROM jsonb_object_keys(p_headers) h(name)
         WHERE h.name ~ '[^-!#$%&''*+.^_`|~0-9A-Za-z]'
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: the header name % is not an HTTP token', quote_literal(v_name)
                USING ERRCODE = '22023',
                      HINT = 'use header names of letters, digits and !#$%&''*+-.^_`|~ (an HTTP token), e.g. tenant-id';
        END IF;
        SELECT h.key INTO v_name
          FROM jsonb_each_text(p_headers) h
         WHERE h.value ~ '[\x01-\x08\x0a-\x1f\x7f]'
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'ferry: invalid event headers: the value of header % has a control character',
                    quote_literal(v_name)
                USING ERRCODE = '22023',
                      HINT = 'remove control characters (line breaks among them) from header values; a tab is allowed';
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
