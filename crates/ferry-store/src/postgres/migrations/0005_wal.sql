-- WAL streaming mode: the relay reads committed outbox rows (and tableless
-- events) from a logical replication slot in commit order.
--
-- wal_slots  the slots Ferry relays stream from, with their publication.
--            Written by the relay when it creates a slot; `ready` once the
--            relay has swept the events committed before the slot existed
--            into the table path. ferry.emit refuses to write an event no
--            ready slot would read: a tableless event streamed before that
--            sweep could overtake an older row of its key.
--
-- Tableless events: ferry.emit writes no outbox row at all, only a
-- transactional logical decoding message (prefix `ferry`) that the slot
-- hands over at commit. No table bloat and no vacuum; in exchange there is
-- no dispatch-key deduplication, `ferry list/show` see such an event only
-- once its delivery failed (it is then written to the outbox for the retry
-- path), and the WAL it lives in is kept until the relay confirms it, so a
-- stopped relay grows the WAL instead of a table (OPERATIONS.md, "WAL
-- streaming").

CREATE TABLE ferry.wal_slots (
    slot        text PRIMARY KEY,
    publication text        NOT NULL,
    ready       boolean     NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Validates like ferry._enqueue, then emits the event as a logical decoding
-- message in the caller's transaction. Returns the event id.
CREATE FUNCTION ferry._emit(
    p_id uuid, p_type text, p_key text, p_payload bytea, p_content_type text, p_headers jsonb
) RETURNS uuid
LANGUAGE plpgsql AS $$
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
    -- Without a slot nobody would ever read the message: fail closed.
    IF NOT EXISTS (SELECT 1 FROM ferry.wal_slots w JOIN pg_replication_slots s ON s.slot_name = w.slot
                    WHERE w.ready AND s.database = current_database()) THEN
        RAISE EXCEPTION 'ferry: no WAL slot reads this database, so a tableless event would be lost'
            USING ERRCODE = '55000',
                  HINT = 'start a relay with [relay] mode = "wal" once (it creates the slot), or use ferry.enqueue';
    END IF;
    PERFORM pg_logical_emit_message(true, 'ferry', convert_to(jsonb_build_object(
        'v', 1, 'id', p_id, 'type', p_type, 'key', p_key,
        'content_type', coalesce(p_content_type, 'application/json'), 'headers', p_headers,
        'payload', translate(encode(p_payload, 'base64'), E'\n', ''),
        'created_at', now())::text, 'UTF8'));
    RETURN p_id;
END
$$;

-- The SQL door for tableless producing, inside the caller's transaction.
CREATE FUNCTION ferry.emit(event_type text, key text, payload jsonb, headers jsonb DEFAULT '{}')
RETURNS uuid
LANGUAGE sql AS $$
    SELECT ferry._emit(ferry.uuid_v7(), event_type, key, convert_to(payload::text, 'UTF8'),
                       'application/json', coalesce(headers, '{}'::jsonb))
$$;
