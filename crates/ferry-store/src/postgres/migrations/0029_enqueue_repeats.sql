-- Producers: a repeat that raced its first attempt is reported as one.
--
-- The Rust door tells a repeat (`Enqueued::duplicate`) by the id that comes
-- back: another event's, or its own id stored before the call. It read
-- "before" with its statement's snapshot, and ferry._enqueue finds the
-- existing event with later ones. An `Event` retried while its first
-- attempt's commit was in flight (the retry's insert waits for it, then
-- does nothing), or committed between the retry's statement start and its
-- insert, came back with its own id, unseen by the snapshot: reported as
-- written, though nothing was. A caller that skips its business write for a
-- repeat applied it twice.
--
-- Now ferry._enqueue, when it returns an existing event's id instead of
-- writing, says so in the transaction-local setting ferry.enqueue_repeat
-- (the id), and ferry._enqueue_batch gathers which of its events did into
-- ferry.enqueue_repeats (their positions in the batch from 1,
-- comma-separated; empty for none), which the Rust door reads in the same
-- statement. Positions, not ids: an event that wrote its id and a later
-- one of the batch that found it share the id. Only a repeat pays for the
-- mark; a batch reads it once per event with a dispatch key and writes the
-- list once, so a retried batch of any size stays linear (appending to one
-- text setting per repeat made a retried 10,000-event batch 25 times
-- slower). Written anew by every batch, the list is never stale; and the
-- settings are rolled back with a savepoint.
--
-- The signatures are unchanged: a producer of an older version calls them
-- as before, and a newer one on an older schema finds no setting and falls
-- back to its snapshot's check. The functions are restated as 0027 and 0012
-- left them; only the marks differ.

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
        -- A captured table's event: the fix is to keep columns out of the
        -- table's events, which the capture's error names.
        IF pg_trigger_depth() > 0 AND jsonb_typeof(p_headers) = 'object' AND p_headers ? 'table' THEN
            PERFORM ferry._capture_too_large(p_headers ->> 'table', p_type, p_payload);
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
            PERFORM set_config('ferry.enqueue_repeat', v_existing::text, true);
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
        PERFORM set_config('ferry.enqueue_repeat', v_existing::text, true);
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
    v_id uuid;
    v_repeats int[] := '{}';
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
    -- Cleared here and after each repeat: set, it names this call's.
    PERFORM set_config('ferry.enqueue_repeat', '', true);
    FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP
        v_id := ferry._enqueue(p_ids[i], p_types[i], p_keys[i], p_payloads[i],
                               p_content_types[i], p_headers[i], p_dispatch_keys[i]);
        IF p_dispatch_keys[i] IS NOT NULL AND current_setting('ferry.enqueue_repeat') <> '' THEN
            v_repeats := v_repeats || i;
            PERFORM set_config('ferry.enqueue_repeat', '', true);
        END IF;
        v_out := v_out || v_id;
    END LOOP;
    PERFORM set_config('ferry.enqueue_repeats', array_to_string(v_repeats, ','), true);
    RETURN v_out;
END
$$;
