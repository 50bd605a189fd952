-- Table capture: triggers that write Ferry events for a table's changes, in
-- the transaction that made them.
--
-- captures         one row per captured table: its spec, and the tracked
--                  columns its trigger was generated from. Drift is any
--                  difference between these and the table's columns now.
-- capture_dropped  per table, the events a `warn` trigger failed to write
--                  and dropped: how many, the last error and when. The
--                  count is what makes warn mode's loss visible.
--
-- Trigger functions are generated (ferry.capture_install) with the column
-- list written into their body, so a row costs no catalog query. After a
-- schema change, ferry.capture_refresh regenerates them; calling it in the
-- same migration that alters the table leaves no window.

CREATE TABLE ferry.captures (
    id           int GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    table_schema text        NOT NULL,
    table_name   text        NOT NULL,
    type_prefix  text        NOT NULL,
    key_column   text        NOT NULL,
    exclude      text[]      NOT NULL DEFAULT '{}',
    soft_delete  text,
    operations   text[]      NOT NULL,
    on_error     text        NOT NULL CHECK (on_error IN ('fail', 'warn')),
    columns      text[]      NOT NULL DEFAULT '{}',
    generated_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (table_schema, table_name)
);

CREATE TABLE ferry.capture_dropped (
    table_schema text        NOT NULL,
    table_name   text        NOT NULL,
    count        bigint      NOT NULL DEFAULT 0,
    last_error   text,
    last_at      timestamptz,
    PRIMARY KEY (table_schema, table_name)
);

-- A table as a user names it (SQL syntax: `orders`, `app.orders`,
-- `app."Order Items"`), resolved to its schema and name.
CREATE FUNCTION ferry.capture_resolve(p_table text, OUT o_schema text, OUT o_name text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_oid oid;
    v_kind "char";
BEGIN
    BEGIN
        v_oid := to_regclass(p_table);
    EXCEPTION WHEN OTHERS THEN
        v_oid := NULL; -- not a valid name at all: reported as not found
    END;
    IF v_oid IS NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: no such table', coalesce(quote_literal(p_table), 'NULL')
            USING ERRCODE = '42P01',
                  HINT = 'name an existing table, schema-qualified when it is not on the search_path '
                         '(app.orders), double-quoting names with capitals or odd characters (app."Order Items")';
    END IF;
    SELECT n.nspname, c.relname, c.relkind INTO o_schema, o_name, v_kind
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = v_oid;
    IF v_kind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION 'ferry: capture table %: not a table', quote_literal(p_table)
            USING ERRCODE = '22023', HINT = 'capture an ordinary or partitioned table, not a view or other relation';
    END IF;
    IF o_schema = 'ferry' THEN
        RAISE EXCEPTION 'ferry: capture table %: Ferry''s own tables cannot be captured', quote_literal(p_table)
            USING ERRCODE = '22023', HINT = 'capture a table of your application';
    END IF;
END
$$;

-- The captured table named `p_table`: as `ferry capture list` prints it
-- (which still works once the table is gone), or as a table name.
CREATE FUNCTION ferry.capture_find(p_table text) RETURNS ferry.captures
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_schema text;
    v_name text;
BEGIN
    SELECT * INTO c FROM ferry.captures k WHERE format('%I.%I', k.table_schema, k.table_name) = p_table FOR UPDATE;
    IF FOUND THEN
        RETURN c;
    END IF;
    SELECT r.o_schema, r.o_name INTO v_schema, v_name FROM ferry.capture_resolve(p_table) r;
    SELECT * INTO c FROM ferry.captures k WHERE k.table_schema = v_schema AND k.table_name = v_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ferry: capture table %: not captured', quote_literal(p_table)
            USING ERRCODE = '22023', HINT = 'see `ferry capture list` for the captured tables';
    END IF;
    RETURN c;
END
$$;

-- The columns of a table, in order.
CREATE FUNCTION ferry.capture_table_columns(p_schema text, p_name text) RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(a.attname::text ORDER BY a.attnum), '{}')
      FROM pg_attribute a
     WHERE a.attrelid = to_regclass(format('%I.%I', p_schema, p_name))
       AND a.attnum > 0 AND NOT a.attisdropped
$$;

-- `jsonb_build_object(<name>, <rec>.<column>, ...)` over `p_columns`, in
-- pieces of 50 pairs: a function takes at most 100 arguments.
CREATE FUNCTION ferry.capture_row_expr(p_rec text, p_columns text[]) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_parts text[] := '{}';
    v_pairs text[] := '{}';
BEGIN
    FOR i IN 1 .. cardinality(p_columns) LOOP
        v_pairs := v_pairs || format('%L, %s.%I', p_columns[i], p_rec, p_columns[i]);
        IF cardinality(v_pairs) = 50 OR i = cardinality(p_columns) THEN
            v_parts := v_parts || format('jsonb_build_object(%s)', array_to_string(v_pairs, ', '));
            v_pairs := '{}';
        END IF;
    END LOOP;
    RETURN array_to_string(v_parts, ' || ');
END
$$;

-- (Re)generates the trigger function of capture `p_id` from its spec and
-- the table's columns now, installs the trigger, and records the columns.
CREATE FUNCTION ferry.capture_install(p_id int) RETURNS void
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
    v_missing text;
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
    SELECT x INTO v_missing FROM unnest(c.exclude) x WHERE NOT x = ANY (v_all) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ferry: capture exclude column % is not a column of %', quote_literal(v_missing), v_rel
            USING ERRCODE = '42703',
                  HINT = format('pass --exclude only columns of the table: %s', array_to_string(v_all, ', '));
    END IF;
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
        v_key := OLD.%3$I::text;
        v_type := %4$L;
    ELSE
        v_data := %5$s;
        v_key := NEW.%3$I::text;
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
        -- drop is counted where the relay exports it, and logged.
        CASE WHEN c.on_error = 'warn' THEN format($b$
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS v_err = MESSAGE_TEXT;
        RAISE WARNING 'ferry: capture of %% dropped a %% event: %%', %1$L, coalesce(v_type, lower(TG_OP)), v_err;
        INSERT INTO ferry.capture_dropped AS d (table_schema, table_name, count, last_error, last_at)
        VALUES (%2$L, %3$L, 1, v_err, now())
        ON CONFLICT (table_schema, table_name)
        DO UPDATE SET count = d.count + 1, last_error = excluded.last_error, last_at = excluded.last_at;
    END;$b$, v_rel, c.table_schema, c.table_name) ELSE '' END);

    v_fn := format('ferry.%I', 'capture_' || c.id);
    EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', v_fn, v_src);
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

-- Starts capturing a table. Every argument is checked, with the fix in the
-- error's hint; returns the table as `ferry capture list` names it.
CREATE FUNCTION ferry.capture_add(
    p_table text, p_type_prefix text, p_key_column text, p_exclude text[],
    p_soft_delete text, p_operations text[], p_on_error text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_schema text;
    v_name text;
    v_id int;
    v_bad text;
BEGIN
    SELECT r.o_schema, r.o_name INTO v_schema, v_name FROM ferry.capture_resolve(p_table) r;
    IF p_key_column IS NULL OR p_key_column = '' THEN
        RAISE EXCEPTION 'ferry: capture key column is missing'
            USING ERRCODE = '22023', HINT = 'pass --key with the column whose value orders the events, e.g. id';
    END IF;
    IF p_soft_delete = '' THEN
        RAISE EXCEPTION 'ferry: capture soft-delete column is empty'
            USING ERRCODE = '22023', HINT = 'pass --soft-delete a column name, or leave it out';
    END IF;
    IF p_type_prefix IS NULL OR length(p_type_prefix) > 240
       OR p_type_prefix !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*$' THEN
        RAISE EXCEPTION 'ferry: capture type prefix % is not valid', coalesce(quote_literal(p_type_prefix), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'pass --type-prefix as lowercase segments of [a-z0-9_-] joined by dots, e.g. shop.order';
    END IF;
    SELECT x INTO v_bad FROM unnest(p_operations) x WHERE x IS NULL OR x NOT IN ('insert', 'update', 'delete') LIMIT 1;
    IF FOUND OR cardinality(p_operations) = 0 THEN
        RAISE EXCEPTION 'ferry: capture operation % is not valid', coalesce(quote_literal(v_bad), 'list empty')
            USING ERRCODE = '22023', HINT = 'pass --on with one or more of insert, update, delete';
    END IF;
    IF p_on_error IS NULL OR p_on_error NOT IN ('fail', 'warn') THEN
        RAISE EXCEPTION 'ferry: capture on-error % is not valid', coalesce(quote_literal(p_on_error), 'NULL')
            USING ERRCODE = '22023', HINT = 'pass --on-error fail (the default) or warn';
    END IF;
    IF EXISTS (SELECT 1 FROM ferry.captures k WHERE k.table_schema = v_schema AND k.table_name = v_name) THEN
        RAISE EXCEPTION 'ferry: capture table %: already captured', format('%I.%I', v_schema, v_name)
            USING ERRCODE = '23505',
                  HINT = format('`ferry capture remove %1$s` first to change its spec, '
                                'or `ferry capture refresh %1$s` to regenerate its trigger',
                                format('%I.%I', v_schema, v_name));
    END IF;
    INSERT INTO ferry.captures (table_schema, table_name, type_prefix, key_column, exclude, soft_delete,
                                operations, on_error)
    VALUES (v_schema, v_name, p_type_prefix, p_key_column, coalesce(p_exclude, '{}'), p_soft_delete,
            (SELECT array_agg(DISTINCT x ORDER BY x) FROM unnest(p_operations) x), p_on_error)
    RETURNING id INTO v_id;
    PERFORM ferry.capture_install(v_id);
    RETURN format('%I.%I', v_schema, v_name);
END
$$;

-- Regenerates the trigger of one captured table, or of all when `p_table`
-- is NULL; returns the tables refreshed. Call it in the migration that
-- alters a captured table.
CREATE FUNCTION ferry.capture_refresh(p_table text DEFAULT NULL) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
BEGIN
    IF p_table IS NOT NULL THEN
        c := ferry.capture_find(p_table);
        PERFORM ferry.capture_install(c.id);
        RETURN NEXT format('%I.%I', c.table_schema, c.table_name);
        RETURN;
    END IF;
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        PERFORM ferry.capture_install(c.id);
        RETURN NEXT format('%I.%I', c.table_schema, c.table_name);
    END LOOP;
END
$$;

-- Stops capturing a table: drops its trigger and function and forgets it.
CREATE FUNCTION ferry.capture_remove(p_table text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
BEGIN
    c := ferry.capture_find(p_table);
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    IF EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = to_regclass(v_rel) AND t.tgname = 'ferry_capture') THEN
        EXECUTE format('DROP TRIGGER ferry_capture ON %s', v_rel);
    END IF;
    EXECUTE format('DROP FUNCTION IF EXISTS ferry.%I()', 'capture_' || c.id);
    DELETE FROM ferry.captures k WHERE k.id = c.id;
    DELETE FROM ferry.capture_dropped d WHERE d.table_schema = c.table_schema AND d.table_name = c.table_name;
    RETURN v_rel;
END
$$;

-- Captured tables whose trigger no longer matches the table: what differs,
-- and the command that fixes it.
CREATE FUNCTION ferry.capture_check() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_oid oid;
    v_now text[];
    v_added text[];
    v_gone text[];
BEGIN
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        v_oid := to_regclass(v_rel);
        table_name := v_rel;
        IF v_oid IS NULL THEN
            problem := 'the table no longer exists';
            fix := format('ferry capture remove %s', v_rel);
            RETURN NEXT;
            CONTINUE;
        END IF;
        fix := format('ferry capture refresh %s', v_rel);
        IF NOT EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_oid AND t.tgname = 'ferry_capture')
           OR to_regprocedure(format('ferry.%I()', 'capture_' || c.id)) IS NULL THEN
            problem := 'its trigger is missing';
            RETURN NEXT;
            CONTINUE;
        END IF;
        v_now := ferry.capture_table_columns(c.table_schema, c.table_name);
        SELECT coalesce(array_agg(x ORDER BY n), '{}') INTO v_added
          FROM unnest(v_now) WITH ORDINALITY AS t(x, n) WHERE NOT x = ANY (c.exclude) AND NOT x = ANY (c.columns);
        SELECT coalesce(array_agg(x ORDER BY n), '{}') INTO v_gone
          FROM unnest(c.columns) WITH ORDINALITY AS t(x, n) WHERE NOT x = ANY (v_now);
        IF cardinality(v_added) > 0 OR cardinality(v_gone) > 0 THEN
            problem := concat_ws('; ',
                CASE WHEN cardinality(v_added) > 0
                     THEN 'columns added since its trigger was generated: ' || array_to_string(v_added, ', ') END,
                CASE WHEN cardinality(v_gone) > 0
                     THEN 'columns gone (writes to the table fail until refreshed): ' || array_to_string(v_gone, ', ') END);
            RETURN NEXT;
        ELSIF c.soft_delete IS NOT NULL AND NOT c.soft_delete = ANY (v_now) THEN
            problem := format('its soft-delete column %s is gone', c.soft_delete);
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
