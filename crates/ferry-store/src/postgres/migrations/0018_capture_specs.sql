-- Capture, two changes.
--
-- A dropped excluded column no longer stops a refresh. ferry.capture_add
-- checks the --exclude columns against the table (a typo would send the
-- column meant to be kept out); the trigger's install no longer does, so a
-- column excluded and later dropped has nothing left to keep out, and a
-- refresh goes on. Before, it refused, and a refresh of every table
-- stopped there, leaving the others' triggers stale. The spec keeps the
-- exclusion: a column of that name added again stays out of the events.
--
-- A partitioned table (or a partition) captured for updates must
-- be captured for inserts and deletes too. PostgreSQL runs an UPDATE that
-- moves a row to another partition as a DELETE from the old partition and
-- an INSERT into the new one: the AFTER UPDATE trigger does not fire. A
-- table captured for updates alone committed such an UPDATE with no event;
-- with inserts and deletes captured, the move arrives as the row deleted
-- and created. Tables captured before this migration keep their triggers.
--
-- ferry.capture_add is restated as 0004 left it, with these two checks;
-- ferry.capture_install_rows as 0014 left it, without its exclude check.

CREATE OR REPLACE FUNCTION ferry.capture_add(
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
    IF 'update' = ANY (p_operations) AND NOT ('insert' = ANY (p_operations) AND 'delete' = ANY (p_operations))
       AND EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = v_schema AND c.relname = v_name AND (c.relkind = 'p' OR c.relispartition)) THEN
        RAISE EXCEPTION 'ferry: capture table %: partitioned, and an UPDATE that moves a row to another partition '
                        'reaches triggers as a DELETE and an INSERT, not an update: captured for updates without '
                        'both, such an UPDATE would send no event', format('%I.%I', v_schema, v_name)
            USING ERRCODE = '22023',
                  HINT = 'capture it --on insert,update,delete (a moved row then arrives as deleted and created)';
    END IF;
    SELECT x INTO v_bad FROM unnest(coalesce(p_exclude, '{}')) x
     WHERE NOT x = ANY (ferry.capture_table_columns(v_schema, v_name)) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ferry: capture exclude column % is not a column of %', quote_literal(v_bad),
                format('%I.%I', v_schema, v_name)
            USING ERRCODE = '42703',
                  HINT = format('pass --exclude only columns of the table: %s',
                                array_to_string(ferry.capture_table_columns(v_schema, v_name), ', '));
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
        -- drop is counted where the relay exports it, and logged.
        CASE WHEN c.on_error = 'warn' THEN format($b$
    EXCEPTION WHEN OTHERS THEN
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
