-- Table capture writes a row's key in one form whatever the writer's
-- session settings.
--
-- A captured event's key was its key column's value as text (`::text`),
-- and for many types that text depends on the writing session: a
-- timestamptz on TimeZone and DateStyle, a date on DateStyle, an interval
-- on IntervalStyle, a float on extra_float_digits, bytea on bytea_output,
-- money on lc_monetary, and arrays and composites of them likewise. Two
-- writers with different settings (an application in UTC beside a psql
-- session in local time, a job that sets DateStyle) gave one row's events
-- different keys: their order was no longer kept, and on Kafka they could
-- land on different partitions.
--
-- Key columns of types whose text form depends on no setting (integers,
-- numeric, text and its kin, uuid, boolean, enums, and domains over them)
-- are written as before. Any other key column is now written through
-- ferry.capture_key, which renders it under fixed settings (UTC, ISO
-- dates, shortest exact floats, hex bytea, the C locale's money).
--
-- Triggers generated before keep the session-dependent form until they
-- are regenerated: ferry.capture_check (so `ferry check`) reports each
-- such table, and `ferry capture refresh` fixes it. The regeneration is
-- left to the operator because it changes those keys' text: events of a
-- row written before it and still pending may be delivered after later
-- ones (docs/OPERATIONS.md, "Upgrading to schema 14").

-- A value as text under fixed settings, so that the same value gives the
-- same text in every session. SET clauses apply for the call only.
CREATE FUNCTION ferry.capture_key(p_value anyelement) RETURNS text
LANGUAGE sql STABLE
SET DateStyle TO 'ISO, YMD'
SET TimeZone TO 'UTC'
SET IntervalStyle TO 'postgres'
SET extra_float_digits TO 1
SET bytea_output TO 'hex'
SET lc_monetary TO 'C'
AS $$ SELECT p_value::text $$;

-- Whether the text form of column `p_column` of table `p_schema.p_name`
-- depends on no session setting: its type, or a domain's base type, is
-- an integer, numeric, text, varchar, char, name, uuid, boolean, oid or an
-- enum. NULL when there is no such column.
CREATE FUNCTION ferry.capture_key_is_stable(p_schema text, p_name text, p_column text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_type oid;
    v_kind "char";
    v_base oid;
BEGIN
    SELECT a.atttypid INTO v_type
      FROM pg_attribute a
     WHERE a.attrelid = to_regclass(format('%I.%I', p_schema, p_name))
       AND a.attname = p_column AND a.attnum > 0 AND NOT a.attisdropped;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    LOOP
        SELECT t.typtype, t.typbasetype INTO v_kind, v_base FROM pg_type t WHERE t.oid = v_type;
        EXIT WHEN v_kind <> 'd';
        v_type := v_base;
    END LOOP;
    RETURN v_kind = 'e'
        OR v_type IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype, 'numeric'::regtype,
                      'text'::regtype, 'varchar'::regtype, 'bpchar'::regtype, 'name'::regtype,
                      '"char"'::regtype, 'uuid'::regtype, 'bool'::regtype, 'oid'::regtype);
END
$$;

-- capture_install_rows as 0004 (there named capture_install) left it, but
-- for the key expression.
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
    v_missing text;
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
    SELECT x INTO v_missing FROM unnest(c.exclude) x WHERE NOT x = ANY (v_all) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ferry: capture exclude column % is not a column of %', quote_literal(v_missing), v_rel
            USING ERRCODE = '42703',
                  HINT = format('pass --exclude only columns of the table: %s', array_to_string(v_all, ', '));
    END IF;
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

-- The checks of 0013, then per table whether its trigger writes a key
-- whose text depends on the writer's session.
ALTER FUNCTION ferry.capture_check() RENAME TO capture_check_triggers;

CREATE FUNCTION ferry.capture_check() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_tables text[];
    v_problems text[];
    v_fixes text[];
    v_src text;
BEGIN
    SELECT array_agg(t.table_name ORDER BY t.n), array_agg(t.problem ORDER BY t.n), array_agg(t.fix ORDER BY t.n)
      INTO v_tables, v_problems, v_fixes
      FROM ferry.capture_check_triggers() WITH ORDINALITY AS t(table_name, problem, fix, n);
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        RETURN QUERY SELECT f.t, f.p, f.f
                       FROM unnest(v_tables, v_problems, v_fixes) WITH ORDINALITY AS f(t, p, f, n)
                      WHERE f.t = v_rel
                      ORDER BY f.n;
        IF NOT ferry.capture_key_is_stable(c.table_schema, c.table_name, c.key_column) THEN
            SELECT p.prosrc INTO v_src FROM pg_proc p
             WHERE p.oid = to_regprocedure(format('ferry.%I()', 'capture_' || c.id));
            IF FOUND AND position('ferry.capture_key(' IN v_src) = 0 THEN
                table_name := v_rel;
                problem := format('its key column %I (%s) is written as each session formats it (TimeZone, '
                                  'DateStyle, IntervalStyle, extra_float_digits, bytea_output, lc_monetary): '
                                  'writers with different settings give one row''s events different keys, '
                                  'and their order is lost',
                                  c.key_column,
                                  (SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
                                    WHERE a.attrelid = to_regclass(v_rel) AND a.attname = c.key_column));
                fix := format('ferry capture refresh %s', v_rel);
                RETURN NEXT;
            END IF;
        END IF;
    END LOOP;
END
$$;
