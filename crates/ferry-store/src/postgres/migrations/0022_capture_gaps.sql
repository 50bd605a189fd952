-- Table capture: two gaps closed, and a remove that works once the table
-- was renamed.
--
-- Plain inheritance children. Row triggers fire for the table a row is in,
-- and a child made with CREATE TABLE c (...) INHERITS (p) has none of its
-- captured parent's (a partition gets a clone; an inheritance child does
-- not): a write to the child's rows, through the child or through the
-- parent, committed with no event and no error. ferry.capture_add now
-- refuses a table with such a child that is not captured itself (capture
-- the children first, each under a type prefix of its own), and
-- ferry.capture_check reports one added later.
--
-- Nullable key columns. A row whose key column is NULL writes keyless
-- events, which keep no order: its deleted event can arrive before its
-- created one. ferry.capture_check reports a nullable key column, and
-- `ferry capture add` prints it.
--
-- Remove after a rename. ferry.capture_remove dropped the triggers by the
-- table's recorded name; renamed, the table kept its trigger, and dropping
-- the trigger's function then failed on it, so the remove `ferry check`
-- suggested for a table gone by that name always failed (and a refresh of
-- every table stopped at it). The function is now dropped with whatever
-- triggers still call it, wherever their table is.

-- Plain inheritance children of `p_table`, at any depth, that are not
-- captured themselves.
CREATE FUNCTION ferry.capture_uncaptured_children(p_table oid) RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE tree (rel) AS (
        SELECT i.inhrelid FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = p_table AND NOT c.relispartition
        UNION
        SELECT i.inhrelid FROM tree t JOIN pg_inherits i ON i.inhparent = t.rel
          JOIN pg_class c ON c.oid = i.inhrelid
         WHERE NOT c.relispartition
    )
    SELECT format('%I.%I', n.nspname, c.relname)
      FROM tree t
      JOIN pg_class c ON c.oid = t.rel
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE NOT EXISTS (SELECT 1 FROM ferry.captures k WHERE k.table_schema = n.nspname AND k.table_name = c.relname)
     ORDER BY 1
$$;

ALTER FUNCTION ferry.capture_add(text, text, text, text[], text, text[], text) RENAME TO capture_add_spec;

CREATE FUNCTION ferry.capture_add(
    p_table text, p_type_prefix text, p_key_column text, p_exclude text[],
    p_soft_delete text, p_operations text[], p_on_error text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_schema text;
    v_name text;
    v_child text;
BEGIN
    SELECT r.o_schema, r.o_name INTO v_schema, v_name FROM ferry.capture_resolve(p_table) r;
    SELECT ch INTO v_child
      FROM ferry.capture_uncaptured_children(format('%I.%I', v_schema, v_name)::regclass) ch LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ferry: capture table %: it has the inheritance child %, whose rows its triggers do not '
                        'see: a write to them would send no event', format('%I.%I', v_schema, v_name), v_child
            USING ERRCODE = '22023',
                  HINT = format('capture %s first (ferry capture add %s with a type prefix of its own), '
                                'or detach it (ALTER TABLE %s NO INHERIT %s)',
                                v_child, v_child, v_child, format('%I.%I', v_schema, v_name));
    END IF;
    RETURN ferry.capture_add_spec(p_table, p_type_prefix, p_key_column, p_exclude,
                                  p_soft_delete, p_operations, p_on_error);
END
$$;

ALTER FUNCTION ferry.capture_check() RENAME TO capture_check_partitions;

CREATE FUNCTION ferry.capture_check() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_child text;
BEGIN
    RETURN QUERY SELECT k.table_name, k.problem, k.fix FROM ferry.capture_check_partitions() k;
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        CONTINUE WHEN to_regclass(v_rel) IS NULL;
        FOR v_child IN SELECT ch FROM ferry.capture_uncaptured_children(to_regclass(v_rel)) ch LOOP
            table_name := v_rel;
            problem := format('its inheritance child %s is not captured: its triggers do not see that table''s '
                              'rows, and a write to them sends no event', v_child);
            fix := format('ferry capture add %s with a type prefix of its own, or ALTER TABLE %s NO INHERIT %s',
                          v_child, v_child, v_rel);
            RETURN NEXT;
        END LOOP;
        IF EXISTS (SELECT 1 FROM pg_attribute a
                    WHERE a.attrelid = to_regclass(v_rel) AND a.attname = c.key_column
                      AND NOT a.attnotnull AND NOT a.attisdropped) THEN
            table_name := v_rel;
            problem := format('its key column %I may be NULL: a row whose key is NULL writes keyless events, '
                              'which keep no order (its deleted event can arrive before its created one)',
                              c.key_column);
            fix := format('ALTER TABLE %s ALTER COLUMN %I SET NOT NULL, or capture it by a column that is',
                          v_rel, c.key_column);
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- Restated as 0013 left it, except the last drop: with CASCADE, it takes
-- the triggers that still call the function on a table renamed since.
CREATE OR REPLACE FUNCTION ferry.capture_remove(p_table text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    m record;
BEGIN
    c := ferry.capture_find(p_table);
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    IF to_regclass(v_rel) IS NOT NULL THEN
        FOR m IN SELECT mm.name FROM ferry.capture_members(v_rel::regclass) mm
                   JOIN pg_trigger t ON t.tgrelid = mm.rel WHERE t.tgname = 'ferry_capture_truncate' LOOP
            EXECUTE format('DROP TRIGGER ferry_capture_truncate ON %s', m.name);
        END LOOP;
        IF EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_rel::regclass AND t.tgname = 'ferry_capture') THEN
            -- Drops its clones on the partitions too.
            EXECUTE format('DROP TRIGGER ferry_capture ON %s', v_rel);
        END IF;
    END IF;
    IF to_regprocedure(format('ferry.%I()', 'capture_' || c.id || '_truncate')) IS NOT NULL THEN
        -- CASCADE: also a guard left on a partition detached since.
        EXECUTE format('DROP FUNCTION ferry.%I() CASCADE', 'capture_' || c.id || '_truncate');
    END IF;
    -- CASCADE: also the trigger of a table renamed since.
    EXECUTE format('DROP FUNCTION IF EXISTS ferry.%I() CASCADE', 'capture_' || c.id);
    DELETE FROM ferry.captures k WHERE k.id = c.id;
    DELETE FROM ferry.capture_dropped d WHERE d.table_schema = c.table_schema AND d.table_name = c.table_name;
    RETURN v_rel;
END
$$;
