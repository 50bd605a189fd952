-- WAL streaming: a tableless event's seq is drawn when it is emitted, under
-- its key's lock, instead of when its failed delivery is written to the
-- outbox.
--
-- The table path delivers a route's pending deliveries of a key in seq
-- order, and ferry._enqueue serialises a key's producers so that seq order
-- is commit order. A tableless event got its seq only at the relay's settle,
-- after its transaction committed, so with the destination down:
--   * an outbox row of its key committed after it (ferry.enqueue, a capture
--     trigger, ferry.emit's fallback), or written later in its own
--     transaction, had a lower seq and was delivered first;
--   * two tableless events settled together were numbered in the order the
--     relay listed its outcomes (by route), not the order they committed.
--
-- Now ferry._emit takes the key's lock ferry._enqueue takes (held to
-- commit) and reserves a seq from ferry.events' identity sequence, carried
-- in the message as "seq"; the relay writes a failed event with that seq
-- (OVERRIDING SYSTEM VALUE). A key's seqs follow its commit order whichever
-- door its events came through. The message stays version 1: an older relay
-- ignores the field, and a relay reading a message emitted before this
-- migration (no "seq") draws one when it writes the event, as before.
--
-- Producers have no right to call nextval on the sequence (inserting a row
-- draws from it without one), so ferry._reserve_seq does it with its owner's
-- rights: no grant to add for ferry.emit. All it can do for a caller is
-- advance the sequence, leaving a gap in seq, as any rolled back insert
-- does. A producer granted USAGE on the sequence skips that call, which is
-- faster (OPERATIONS.md).

CREATE FUNCTION ferry._reserve_seq() RETURNS bigint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.nextval('ferry.events_seq_seq'::pg_catalog.regclass)
$$;

CREATE OR REPLACE FUNCTION ferry._emit(
    p_id uuid, p_type text, p_key text, p_payload bytea, p_content_type text, p_headers jsonb
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_seq bigint;
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
