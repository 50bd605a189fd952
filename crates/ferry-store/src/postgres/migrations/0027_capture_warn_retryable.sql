-- Table capture in warn mode: a failure that retrying the transaction
-- clears no longer drops the event.
--
-- Warn mode keeps the business write when its event cannot be written,
-- drops the event and counts the drop. Its handler caught every error, so
-- it also caught those that say the transaction must be retried, not that
-- the event is bad: a deadlock (40P01) on the key's lock, which producers
-- of one key take as they reach it, in whatever order; a serialization
-- failure (40001) under REPEATABLE READ or SERIALIZABLE; a lock timeout
-- (55P03); the server short of memory, disk or shared memory (class 53).
-- Caught, the business write committed without its event, though the
-- application's retry of the failed transaction would have written both.
-- These now fail the statement as they would without the capture: class
-- 40 (transaction_rollback), 55P03 (lock_not_available) and class 53
-- (insufficient_resources). A statement cancelled or timed out (57014)
-- never was caught.
--
-- Existing warn-mode triggers are mended in place: their function's text
-- gets the same handler and nothing else changes, so a table whose columns
-- changed since its last refresh keeps sending what it sent (`ferry check`
-- still reports the drift). A function this role cannot replace (made by
-- another role) is left as it is, with a warning naming the command that
-- mends it.
--
-- Table capture also writes a row's payload in one form whatever the
-- writer's session settings, as schema 14 made its key.
--
-- The trigger built the payload as the writing session prints values.
-- jsonb takes a float as float8out prints it: under extra_float_digits <= 0
-- 0.30000000000000004 became 0.3, and an update from 0.1 to
-- 0.10000000000000003 compared equal, changed no tracked field and wrote
-- no event, in fail mode too. A timestamptz carried the session's offset
-- (+05:30 in one event of a row, +00:00 in the next), bytea read "\x78" or
-- "x" by bytea_output, an interval "1 day" or "P1D" by IntervalStyle, a
-- range of dates or timestamps followed DateStyle, money lc_monetary: a
-- consumer decoding bytea as hex read wrong bytes. The trigger functions
-- now run under the settings ferry.capture_key renders keys under (UTC,
-- ISO dates, shortest exact floats, hex bytea, postgres intervals, the C
-- locale's money), set on the function, so they hold for the trigger's
-- call only. That costs a captured row about 11 us of CPU on PostgreSQL
-- 15, a tenth of the row's cost: the settings are taken on and restored at
-- each call. For a session on the default settings the one change is a
-- timestamptz's offset, +00:00 whatever its TimeZone: the same instant in
-- another text.
--
-- New triggers get the settings from ferry.capture_install_rows, existing
-- ones in place (ALTER FUNCTION ... SET: their text is untouched), but for
-- a trigger that still writes its key as each session prints it (made
-- before schema 14, and not refreshed since): its keys would change text
-- with the migration, which schema 14 left to the operator, as an event
-- of a row still pending under the old text may be delivered after the
-- row's later ones. It keeps its form, with a warning; the refresh `ferry
-- check` asks of it gives it both. A function this role cannot alter
-- (made by another role) is left as it is, with a warning naming the
-- command that mends it.
--
-- An event over the payload limit (1 MiB) of a captured table failed with
-- the producer doors' hint, to store large bodies elsewhere: a row with a
-- 600 KB text column could be inserted, but never updated in fail mode (an
-- update carries a changed column twice, in data and in previous), and
-- nothing said that keeping the column out of the events is the fix. Such
-- an event now fails naming the table and its largest columns, with the
-- `ferry capture add --replace ... --exclude` that keeps them out. The
-- check sits in ferry._enqueue's branch for a payload over the limit, so
-- it costs a write under the limit nothing and holds for triggers made
-- before.
--
-- ferry.capture_install_rows is restated as 0018 left it, with the new
-- handler and the settings; ferry._enqueue as 0023 left it, with the
-- capture's error.

-- The settings a captured row's payload and key are rendered under, as
-- pg_proc.proconfig holds them: those ferry.capture_key is set with
-- (schema 14). Any positive extra_float_digits prints a float's shortest
-- exact form; DateStyle reaches jsonb through the text of ranges.
CREATE FUNCTION ferry.capture_settings() RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['DateStyle=ISO, YMD', 'TimeZone=UTC', 'IntervalStyle=postgres', 'extra_float_digits=1',
                 'bytea_output=hex', 'lc_monetary=C']
$$;

-- ferry.capture_settings as the SET clauses of a function.
CREATE FUNCTION ferry.capture_settings_clauses() RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT string_agg(format('SET %s TO %L', split_part(s, '=', 1), substr(s, strpos(s, '=') + 1)), ' ' ORDER BY n)
      FROM unnest(ferry.capture_settings()) WITH ORDINALITY AS t(s, n)
$$;

CREATE OR REPLACE FUNCTION ferry.capture_install_rows(p_id int) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_all text[];
    v_cols text[];
    v_fn text;
    v_update text;
    v_write text;
    v_src text;
    v_events text[] := '{}';
    v_stable boolean;
BEGIN
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id FOR UPDATE;
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    IF to_regclass(v_rel) IS NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: no such table any more', quote_literal(v_rel)
            USING ERRCODE = '42P01', HINT = format('stop capturing it with `ferry capture remove %s`', v_rel);
    END IF;
    v_all := ferry.capture_table_columns(c.table_schema, c.table_name);
    IF NOT c.key_column = ANY (v_all) THEN
        RAISE EXCEPTION 'ferry: capture key column % is not a column of %', quote_literal(c.key_column), v_rel
            USING ERRCODE = '42703',
                  HINT = format('pass --key one of: %s', array_to_string(v_all, ', '));
    END IF;
    IF c.key_column = ANY (c.exclude) THEN
        RAISE EXCEPTION 'ferry: capture key column % is also excluded', quote_literal(c.key_column)
            USING ERRCODE = '22023', HINT = 'the key must be in the payload: drop it from --exclude';
    END IF;
    IF c.soft_delete IS NOT NULL AND NOT c.soft_delete = ANY (v_all) THEN
        RAISE EXCEPTION 'ferry: capture soft-delete column % is not a column of %', quote_literal(c.soft_delete), v_rel
            USING ERRCODE = '42703',
                  HINT = format('pass --soft-delete one of: %s', array_to_string(v_all, ', '));
    END IF;
    -- An excluded column that is not a column (any more) has nothing to
    -- keep out; capture_add refused it where it was a typo, and the spec
    -- keeps it, so a column of that name added again stays out.
    v_stable := ferry.capture_key_is_stable(c.table_schema, c.table_name, c.key_column);
    SELECT array_agg(x ORDER BY n) INTO v_cols
      FROM unnest(v_all) WITH ORDINALITY AS t(x, n) WHERE NOT x = ANY (c.exclude);

    -- An update: the changed tracked fields, then what kind of event it is.
    v_update := format($b$
            v_old := %s;
            SELECT jsonb_object_agg(o.key, o.value) INTO v_prev
              FROM jsonb_each(v_old) o WHERE o.value IS DISTINCT FROM v_data -> o.key;$b$,
        ferry.capture_row_expr('OLD', v_cols));
    IF c.soft_delete IS NOT NULL THEN
        v_update := v_update || format($b$
            IF OLD.%1$I IS NULL AND NEW.%1$I IS NOT NULL THEN
                %2$s
            ELSIF v_prev IS NULL THEN
                RETURN NULL;
            ELSE
                %3$s
            END IF;$b$,
            c.soft_delete,
            CASE WHEN 'delete' = ANY (c.operations) THEN format('v_type := %L;', c.type_prefix || '.deleted')
                 ELSE 'RETURN NULL;' END,
            CASE WHEN 'update' = ANY (c.operations) THEN format('v_type := %L;', c.type_prefix || '.updated')
                 ELSE 'RETURN NULL;' END);
    ELSE
        v_update := v_update || format($b$
            IF v_prev IS NULL THEN
                RETURN NULL;
            END IF;
            v_type := %L;$b$, c.type_prefix || '.updated');
    END IF;

    v_write := format($b$
    PERFORM ferry._enqueue(ferry.uuid_v7(), v_type, v_key, convert_to(v_payload::text, 'UTF8'), 'application/json',
        jsonb_build_object('initiator', coalesce(nullif(current_setting('ferry.initiator', true), ''), 'user'),
                           'table', %L),
        NULL);$b$, v_rel);

    v_src := format($b$
DECLARE
    v_data jsonb;
    v_old jsonb;
    v_prev jsonb;
    v_payload jsonb;
    v_type text;
    v_key text;
    v_err text;
BEGIN
%1$s
    IF TG_OP = 'DELETE' THEN
        v_data := %2$s;
        v_key := %10$s;
        v_type := %4$L;
    ELSE
        v_data := %5$s;
        v_key := %11$s;
        IF TG_OP = 'INSERT' THEN
            v_type := %6$L;
        ELSE%7$s
        END IF;
    END IF;
    v_payload := jsonb_build_object('data', v_data);
    IF TG_OP = 'UPDATE' THEN
        v_payload := v_payload || jsonb_build_object('previous', coalesce(v_prev, '{}'::jsonb));
    END IF;%8$s
%9$s
    RETURN NULL;
END
$b$,
        CASE WHEN c.on_error = 'warn' THEN '    BEGIN' ELSE '' END,
        ferry.capture_row_expr('OLD', v_cols),
        c.key_column,
        c.type_prefix || '.deleted',
        ferry.capture_row_expr('NEW', v_cols),
        c.type_prefix || '.created',
        v_update,
        v_write,
        -- Warn mode: the event is dropped, never the business write; the
        -- drop is counted where the relay exports it, and logged. A failure
        -- that retrying the transaction clears is no drop: it fails the
        -- statement, as it would without the capture.
        CASE WHEN c.on_error = 'warn' THEN format($b$
    EXCEPTION WHEN transaction_rollback OR lock_not_available OR insufficient_resources THEN
        RAISE;
    WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS v_err = MESSAGE_TEXT;
        RAISE WARNING 'ferry: capture of %% dropped a %% event: %%', %1$L, coalesce(v_type, lower(TG_OP)), v_err;
        INSERT INTO ferry.capture_dropped AS d (table_schema, table_name, count, last_error, last_at)
        VALUES (%2$L, %3$L, 1, v_err, now())
        ON CONFLICT (table_schema, table_name)
        DO UPDATE SET count = d.count + 1, last_error = excluded.last_error, last_at = excluded.last_at;
    END;$b$, v_rel, c.table_schema, c.table_name) ELSE '' END,
        -- The key as text: written as is where that text depends on no
        -- session setting, else through ferry.capture_key.
        format(CASE WHEN v_stable THEN 'OLD.%I::text' ELSE 'ferry.capture_key(OLD.%I)' END, c.key_column),
        format(CASE WHEN v_stable THEN 'NEW.%I::text' ELSE 'ferry.capture_key(NEW.%I)' END, c.key_column));

    v_fn := format('ferry.%I', 'capture_' || c.id);
    -- Under fixed settings, so that every writer's session renders the
    -- row alike; they apply to the call only.
    EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql %s AS %L',
                   v_fn, ferry.capture_settings_clauses(), v_src);
    IF 'insert' = ANY (c.operations) THEN
        v_events := v_events || 'INSERT'::text;
    END IF;
    IF 'update' = ANY (c.operations) OR ('delete' = ANY (c.operations) AND c.soft_delete IS NOT NULL) THEN
        v_events := v_events || 'UPDATE'::text;
    END IF;
    IF 'delete' = ANY (c.operations) THEN
        v_events := v_events || 'DELETE'::text;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_rel::regclass AND t.tgname = 'ferry_capture') THEN
        EXECUTE format('DROP TRIGGER ferry_capture ON %s', v_rel);
    END IF;
    EXECUTE format('CREATE TRIGGER ferry_capture AFTER %s ON %s FOR EACH ROW EXECUTE FUNCTION %s()',
                   array_to_string(v_events, ' OR '), v_rel, v_fn);
    UPDATE ferry.captures k SET columns = v_cols, generated_at = now() WHERE k.id = p_id;
END
$$;

-- The error of an event of a captured table over the payload limit: it
-- names the table and the largest columns that bring the event under the
-- limit once left out, and gives the replace that leaves them out. Returns
-- without a word when `p_type` is no event type of a capture of `p_table`.
-- Runs with its owner's rights: the trigger runs as the writer, whom the
-- producer grants let read no capture spec. All it does for a caller is
-- raise an error with the spec of a capture it names.
CREATE FUNCTION ferry._capture_too_large(p_table text, p_type text, p_payload bytea) RETURNS void
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c ferry.captures;
    v_event jsonb;
    v_over bigint := octet_length(p_payload) - 1048576;
    v_cols text[];
    v_bytes bigint;
    v_fixed ferry.captures;
BEGIN
    SELECT * INTO c FROM ferry.captures k
     WHERE format('%I.%I', k.table_schema, k.table_name) = p_table
       AND p_type IN (k.type_prefix || '.created', k.type_prefix || '.updated', k.type_prefix || '.deleted');
    IF NOT FOUND OR v_over <= 0 THEN
        RETURN;
    END IF;
    v_event := convert_from(p_payload, 'UTF8')::jsonb;
    -- What leaving a column out saves: `"name": value, ` in data and, for
    -- an update that changed it, in previous. The key and the soft-delete
    -- column cannot be left out.
    WITH s AS (
        SELECT d.key AS name,
               octet_length(d.key) + octet_length(d.value::text) + 6
               + coalesce(octet_length(d.key) + octet_length((v_event -> 'previous' -> d.key)::text) + 6, 0) AS bytes
          FROM jsonb_each(v_event -> 'data') d
         WHERE d.key <> c.key_column AND d.key IS DISTINCT FROM c.soft_delete
    ), r AS (
        SELECT s.name, s.bytes, sum(s.bytes) OVER (ORDER BY s.bytes DESC, s.name) - s.bytes AS before
          FROM s
    )
    SELECT array_agg(r.name ORDER BY r.bytes DESC, r.name), sum(r.bytes) INTO v_cols, v_bytes
      FROM r WHERE r.before < v_over;
    IF v_bytes IS NULL OR v_bytes < v_over THEN
        RAISE EXCEPTION 'ferry: capture of %: invalid event payload: % bytes, the limit is 1048576; this % event '
                        'is over it even without the columns a capture may leave out (all but the key column%)',
                        p_table, octet_length(p_payload), p_type,
                        CASE WHEN c.soft_delete IS NOT NULL THEN ' and the soft-delete column' ELSE '' END
            USING ERRCODE = '22023',
                  HINT = 'keep large values in another table, with a reference to them in the row';
    END IF;
    v_fixed := c;
    v_fixed.exclude := c.exclude || v_cols;
    RAISE EXCEPTION 'ferry: capture of %: invalid event payload: % bytes, the limit is 1048576; the column% % '
                    'take% % bytes of this % event%', p_table, octet_length(p_payload),
                    CASE WHEN cardinality(v_cols) > 1 THEN 's' ELSE '' END,
                    (SELECT string_agg(quote_ident(x), ', ' ORDER BY n) FROM unnest(v_cols) WITH ORDINALITY AS t(x, n)),
                    CASE WHEN cardinality(v_cols) > 1 THEN '' ELSE 's' END, v_bytes, p_type,
                    CASE WHEN v_event ? 'previous' AND v_event -> 'previous' ?| v_cols
                         THEN ' (an update carries a changed column twice, in data and in previous)' ELSE '' END
        USING ERRCODE = '22023',
              HINT = format('keep %s out of the table''s events with `%s`, or keep such values in another table',
                            CASE WHEN cardinality(v_cols) > 1 THEN 'them' ELSE 'it' END,
                            ferry.capture_replace_command(v_fixed));
END
$$;

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

-- The existing row trigger functions, mended in place: a warn-mode one's
-- handler, and every one's settings but where they would change the text
-- of its key (above).
DO $$
DECLARE
    c record;
    v_def text;
    v_new text;
    v_unset boolean;
    v_stable boolean;
    v_left text[];
BEGIN
    FOR c IN
        SELECT k AS spec, p.oid AS fn, p.proowner, p.proconfig, p.prosrc
          FROM ferry.captures k
          JOIN pg_proc p ON p.pronamespace = 'ferry'::regnamespace AND p.proname = 'capture_' || k.id
         ORDER BY k.id
    LOOP
        v_def := pg_get_functiondef(c.fn);
        v_new := v_def;
        IF (c.spec).on_error = 'warn' THEN
            v_new := replace(v_def, E'    EXCEPTION WHEN OTHERS THEN\n',
                E'    EXCEPTION WHEN transaction_rollback OR lock_not_available OR insufficient_resources THEN\n'
                || E'        RAISE;\n'
                || E'    WHEN OTHERS THEN\n');
        END IF;
        v_unset := NOT coalesce(c.proconfig @> ferry.capture_settings(), false);
        IF v_unset AND position('ferry.capture_key(' IN c.prosrc) = 0 THEN
            -- The key column's type, where the table has the recorded name
            -- or else where the trigger is (a table renamed since).
            v_stable := ferry.capture_key_is_stable((c.spec).table_schema, (c.spec).table_name, (c.spec).key_column);
            IF v_stable IS NULL THEN
                SELECT ferry.capture_key_is_stable(n.nspname, r.relname, (c.spec).key_column) INTO v_stable
                  FROM pg_trigger t
                  JOIN pg_class r ON r.oid = t.tgrelid
                  JOIN pg_namespace n ON n.oid = r.relnamespace
                 WHERE t.tgfoid = c.fn AND t.tgname = 'ferry_capture'
                 ORDER BY r.relispartition, n.nspname, r.relname
                 LIMIT 1;
            END IF;
            IF v_stable IS FALSE THEN
                RAISE WARNING 'ferry: the capture of %.% still writes its key and its payload as each writer''s '
                              'session prints them', quote_ident((c.spec).table_schema), quote_ident((c.spec).table_name)
                    USING HINT = format('with its events drained, run `ferry capture refresh %s`, which changes '
                                        'the text of its keys; `ferry check` reports the table until then',
                                        ferry.capture_shell_word(format('%I.%I', (c.spec).table_schema,
                                                                        (c.spec).table_name)));
                v_unset := false;
            END IF;
        END IF;
        IF v_new = v_def AND NOT v_unset THEN
            CONTINUE;
        ELSIF NOT pg_has_role(current_user, c.proowner, 'USAGE') THEN
            v_left := '{}';
            IF v_new <> v_def THEN
                v_left := v_left || 'still drops its event on a deadlock or serialization failure'::text;
            END IF;
            IF v_unset THEN
                v_left := v_left || ('still writes its payload as each writer''s session prints the values (a '
                                     'float to fewer digits, and a change in the digits left out sends nothing; '
                                     'a timestamp in the writer''s time zone; bytea by bytea_output)')::text;
            END IF;
            RAISE WARNING 'ferry: the %capture of %.% %', CASE WHEN v_new <> v_def THEN 'warn-mode ' ELSE '' END,
                quote_ident((c.spec).table_schema), quote_ident((c.spec).table_name),
                array_to_string(v_left, ', and ')
                USING HINT = format('as the role that owns %s(), run `%s`', c.fn::regproc,
                                    ferry.capture_replace_command(c.spec));
        ELSE
            -- The definition carries the function's settings, if any.
            IF v_new <> v_def THEN
                EXECUTE v_new;
            END IF;
            IF v_unset THEN
                EXECUTE format('ALTER FUNCTION %s() %s', c.fn::regproc, ferry.capture_settings_clauses());
            END IF;
        END IF;
    END LOOP;
END
$$;
