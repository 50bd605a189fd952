-- A limit on an event's headers: 64 KiB of names and values together.
-- RabbitMQ refuses message properties over its frame size (128 KiB by
-- default) and Kafka counts headers in a record's size, so an event with
-- larger headers committed and then went dead at every destination,
-- holding back its key. The Rust door refuses it in Event::validate; this
-- check refuses it on every row written into the outbox, whichever door
-- wrote it (the SQL door, a tableless event's fallback row, a capture).
--
-- NOT VALID: rows already stored are not read (no table scan under the
-- lock); new rows are checked. The check raises the door's own error, with
-- the field and the fix, rather than name a constraint.

CREATE FUNCTION ferry._headers_within_limit(p_headers jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bytes bigint;
BEGIN
    IF p_headers = '{}'::jsonb OR jsonb_typeof(p_headers) <> 'object' THEN
        RETURN true;
    END IF;
    SELECT coalesce(sum(octet_length(h.key) + octet_length(h.value)), 0) INTO v_bytes
      FROM jsonb_each_text(p_headers) h;
    IF v_bytes > 65536 THEN
        RAISE EXCEPTION 'ferry: invalid event headers: they take % bytes (names and values), the limit is 65536', v_bytes
            USING ERRCODE = '22023',
                  HINT = 'carry large values in the payload; keep headers to routing and tracing metadata';
    END IF;
    RETURN true;
END;
$$;

ALTER TABLE ferry.events
    ADD CONSTRAINT events_headers_within_limit CHECK (ferry._headers_within_limit(headers)) NOT VALID;
