-- WAL streaming: ferry.emit writes an outbox row instead of a tableless
-- event whenever no healthy slot would read the event.
--
-- Until now it refused (the producer's transaction failed) while no ready
-- slot read the database, and it wrote tableless events for a slot the
-- server had invalidated: PostgreSQL gives up a slot that holds back more
-- WAL than max_slot_wal_keep_size (pg_replication_slots.wal_status =
-- 'lost'; 'unreserved' while only the next checkpoint stands between it and
-- that), after which it never streams again and such an event was lost
-- without an error.
--
-- Now the event is written as ferry.enqueue writes it whenever the slot is
-- missing, not yet swept (a tableless event could overtake an older row of
-- its key), unreserved or lost: the row is streamed or swept like any
-- other and delivered in order with the rest of its key, and the
-- producer's transaction commits. Tableless events are what a healthy slot
-- gets, and nothing else changes for them.

CREATE OR REPLACE FUNCTION ferry._emit(
    p_id uuid, p_type text, p_key text, p_payload bytea, p_content_type text, p_headers jsonb
) RETURNS uuid
LANGUAGE plpgsql AS $$
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
    PERFORM pg_logical_emit_message(true, 'ferry', convert_to(jsonb_build_object(
        'v', 1, 'id', p_id, 'type', p_type, 'key', p_key,
        'content_type', coalesce(p_content_type, 'application/json'), 'headers', p_headers,
        'payload', translate(encode(p_payload, 'base64'), E'\n', ''),
        'created_at', now())::text, 'UTF8'));
    RETURN p_id;
END
$$;
