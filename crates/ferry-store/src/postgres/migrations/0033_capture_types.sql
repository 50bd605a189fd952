-- Table capture: a captured column whose type changed is reported.
--
-- The trigger function reads each tracked column as NEW.<column> and
-- OLD.<column>, and PL/pgSQL keeps the plan of each such read for the rest
-- of the session. After `ALTER TABLE ... ALTER COLUMN v TYPE bigint` (from
-- integer), a session that wrote the table before fails each later write
-- of it with "type of parameter N (bigint) does not match that when
-- preparing the plan (integer)" until it reconnects or the function is
-- regenerated: in fail mode the business writes fail, in warn mode every
-- event of it is dropped. ferry.capture_check compared the columns' names
-- only, and said nothing.
--
-- ferry.captures now records, in column_types, the type of each tracked
-- column (its OID) as it was when the trigger was generated,
-- and ferry.capture_check reports each column whose type is not that one
-- any more, with `ferry capture refresh <table>` as the fix: the
-- regenerated function is planned afresh in every session.
--
-- The type's OID is what a session's plan was made for, and all it checks:
-- - a type replaced by another of the same name (the recipe that removes
--   an enum value: rename the old type, create the new, ALTER COLUMN ...
--   TYPE to it, drop the old) is another OID, and breaks a session that
--   wrote the table before ("cache lookup failed for type N"): reported;
-- - a change of modifier only (varchar(20) to varchar(40), numeric(10,2)
--   to numeric(12,2)) keeps the OID, and breaks nothing: not reported;
-- - the OID does not depend on the search_path of the session that
--   generated the trigger or of the one that checks, as a type's name
--   printed by format_type does (`mood` under search_path app,
--   `app.mood` under the default).
-- format_type only words the report; the old type, since dropped, may have
-- no name left. A database restored from a dump gives its types new OIDs:
-- a capture of a column of a type made there is reported until refreshed.
--
-- The captures made before record the types their tables have at this
-- migration: a type changed since a capture's last refresh and before the
-- migration is not reported (see the upgrade notes).
--
-- ferry.capture_install is restated as 0013 left it, recording the types;
-- ferry.capture_check_triggers as 0028 left it, with the types compared.

ALTER TABLE ferry.captures ADD COLUMN column_types oid[];

-- The type of each of `p_columns` of table `p_table`, in that order, as
-- its OID (without its modifier, which a session's plan does not check);
-- NULL for a name that is not a column of it.
CREATE FUNCTION ferry.capture_column_types(p_table oid, p_columns text[]) RETURNS oid[]
LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg((SELECT a.atttypid
                                 FROM pg_attribute a
                                WHERE a.attrelid = p_table AND a.attname = t.x
                                  AND a.attnum > 0 AND NOT a.attisdropped) ORDER BY t.n), '{}')
      FROM unnest(p_columns) WITH ORDINALITY AS t(x, n)
$$;

CREATE OR REPLACE FUNCTION ferry.capture_install(p_id int) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
BEGIN
    PERFORM ferry.capture_install_rows(p_id);
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id;
    -- The types the function was generated for: a session plans its reads
    -- of the columns for these.
    UPDATE ferry.captures k
       SET column_types = ferry.capture_column_types(format('%I.%I', c.table_schema, c.table_name)::regclass,
                                                     c.columns)
     WHERE k.id = p_id;
    -- Recurses to the trigger's clones on the partitions.
    EXECUTE format('ALTER TABLE %I.%I ENABLE ALWAYS TRIGGER ferry_capture', c.table_schema, c.table_name);
    PERFORM ferry.capture_install_truncate(p_id);
END
$$;

-- The captures made before: the types their tables have now, where the
-- table has the recorded name or else where the capture's trigger is (a
-- table renamed since).
UPDATE ferry.captures k
   SET column_types = ferry.capture_column_types(
           coalesce(to_regclass(format('%I.%I', k.table_schema, k.table_name)),
                    (SELECT t.tgrelid
                       FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid
                      WHERE t.tgname = 'ferry_capture'
                        AND t.tgfoid = to_regprocedure(format('ferry.%I()', 'capture_' || k.id))
                      ORDER BY r.relispartition, t.tgrelid
                      LIMIT 1)),
           k.columns);

CREATE OR REPLACE FUNCTION ferry.capture_check_triggers() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_oid oid;
    v_now text[];
    v_added text[];
    v_gone text[];
    v_retyped text[];
    v_when text;
    v_unguarded text;
    v_elsewhere text;
    v_owner text;
    v_fixed ferry.captures;
    o record;
    b record;
BEGIN
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        v_oid := to_regclass(v_rel);
        table_name := v_rel;
        IF v_oid IS NULL THEN
            -- Renamed, or moved to another schema: the trigger went along.
            SELECT string_agg(e.name, ', ' ORDER BY e.name) INTO v_elsewhere
              FROM ferry.capture_trigger_elsewhere(c.id, NULL) e;
            IF v_elsewhere IS NOT NULL THEN
                problem := format('renamed (or moved to another schema) since it was captured: its trigger fires '
                                  'on %s now, and its events still name the table %s; a refresh records the new '
                                  'name and goes on capturing', v_elsewhere, v_rel);
                fix := format('ferry capture refresh %s', ferry.capture_shell_word(v_rel));
                -- Another capture still records the new name: its table
                -- was dropped (or renamed too) first, and a refresh waits
                -- for its remove.
                SELECT format('%I.%I', k.table_schema, k.table_name) INTO v_owner
                  FROM ferry.captures k
                 WHERE k.id <> c.id AND format('%I.%I', k.table_schema, k.table_name) = v_elsewhere;
                IF v_owner IS NOT NULL THEN
                    problem := problem || format(', once the capture of %s, whose table is gone, is removed', v_owner);
                    fix := format('ferry capture remove %s, then %s', ferry.capture_shell_word(v_owner), fix);
                END IF;
            ELSE
                problem := 'the table no longer exists';
                fix := format('ferry capture remove %s', v_rel);
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;

        -- The table of this name is another capture's, renamed since: this
        -- one's table is gone, and its trigger with it.
        v_owner := ferry.capture_taken_by(c.id, v_oid);
        IF v_owner IS NOT NULL THEN
            problem := format('the table no longer exists: %s now is the table captured as %s, renamed since '
                              '(the trigger on it is that capture''s)', v_rel, v_owner);
            fix := format('ferry capture remove %s', ferry.capture_shell_word(v_rel));
            RETURN NEXT;
            CONTINUE;
        END IF;

        -- The trigger left on a table renamed from this name, which a new
        -- table has taken since: that table's changes still send events,
        -- under this capture's type prefix and table name.
        v_elsewhere := NULL;
        FOR o IN SELECT e.name, e.trigger FROM ferry.capture_trigger_elsewhere(c.id, v_oid) e LOOP
            v_elsewhere := concat_ws(', ', v_elsewhere, o.name);
            problem := format('its trigger also fires on %s (renamed from %s, a table of that name made since?): '
                              'changes there send %s.* events that name the table %s',
                              o.name, v_rel, c.type_prefix, v_rel);
            fix := format('DROP TRIGGER %I ON %s to stop them, or ferry capture add %s with a type prefix of its '
                          'own to capture that table on its own', o.trigger, o.name,
                          ferry.capture_shell_word(o.name));
            RETURN NEXT;
        END LOOP;

        IF NOT EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_oid AND t.tgname = 'ferry_capture')
           OR to_regprocedure(format('ferry.%I()', 'capture_' || c.id)) IS NULL THEN
            problem := 'its trigger is missing';
            fix := format('ferry capture refresh %s', v_rel);
            IF v_elsewhere IS NOT NULL THEN
                -- The refresh refuses while the trigger is there too.
                fix := format('%s, once %s no longer has its trigger (above)', fix, v_elsewhere);
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;

        -- Triggers that are there but do not fire for every session: one
        -- row per trigger and state, naming the tables (the table itself,
        -- or some of its partitions).
        FOR b IN
            SELECT t.tgname::text AS trigger, t.tgenabled AS state,
                   string_agg(m.name, ', ' ORDER BY m.depth, m.name) AS tables,
                   string_agg(format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %I', m.name, t.tgname), '; '
                              ORDER BY m.depth, m.name) AS fixes
              FROM ferry.capture_members(v_oid) m
              JOIN pg_trigger t ON t.tgrelid = m.rel
             WHERE t.tgname IN ('ferry_capture', 'ferry_capture_truncate') AND t.tgenabled <> 'A'
             GROUP BY t.tgname, t.tgenabled
             ORDER BY t.tgname, t.tgenabled
        LOOP
            v_when := CASE b.state
                WHEN 'D' THEN ''
                WHEN 'O' THEN ' made under session_replication_role = replica '
                              '(logical replication apply, some restore and ETL tools)'
                ELSE ' made outside session_replication_role = replica' END;
            problem := format('its trigger %s %s on %s: %s', b.trigger,
                CASE b.state WHEN 'D' THEN 'is disabled'
                             WHEN 'O' THEN 'fires only outside replica mode'
                             ELSE 'fires only in replica mode' END,
                b.tables,
                CASE WHEN b.trigger = 'ferry_capture'
                     THEN format('changes%s write no events', v_when)
                     ELSE format('a TRUNCATE%s deletes the rows without refusing or counting their events', v_when)
                END);
            fix := b.fixes;
            RETURN NEXT;
        END LOOP;

        IF 'delete' = ANY (c.operations) THEN
            SELECT string_agg(m.name, ', ' ORDER BY m.depth, m.name) INTO v_unguarded
              FROM ferry.capture_members(v_oid) m
             WHERE m.kind IN ('r', 'p')
               AND NOT EXISTS (SELECT 1 FROM pg_trigger t
                                WHERE t.tgrelid = m.rel AND t.tgname = 'ferry_capture_truncate');
            IF v_unguarded IS NOT NULL
               OR to_regprocedure(format('ferry.%I()', 'capture_' || c.id || '_truncate')) IS NULL THEN
                problem := format('its TRUNCATE guard is missing on %s: a TRUNCATE there deletes the rows '
                                  'without refusing or counting their events',
                                  coalesce(v_unguarded, v_rel));
                fix := format('ferry capture refresh %s', v_rel);
                RETURN NEXT;
            END IF;
        END IF;

        fix := format('ferry capture refresh %s', v_rel);
        v_now := ferry.capture_table_columns(c.table_schema, c.table_name);
        SELECT coalesce(array_agg(x ORDER BY n), '{}') INTO v_added
          FROM unnest(v_now) WITH ORDINALITY AS t(x, n) WHERE NOT x = ANY (c.exclude) AND NOT x = ANY (c.columns);
        SELECT coalesce(array_agg(x ORDER BY n), '{}') INTO v_gone
          FROM unnest(c.columns) WITH ORDINALITY AS t(x, n) WHERE NOT x = ANY (v_now);
        -- A tracked column whose type is not the one the trigger was
        -- generated for: a session that wrote the table before keeps its
        -- plans for the old type and fails on the new.
        -- The OIDs are compared (a modifier changed alone breaks no plan);
        -- the names only word the report, the old type's if it still has
        -- one.
        SELECT coalesce(array_agg(format('%s (%s, now %s)', t.x,
                                         CASE WHEN EXISTS (SELECT 1 FROM pg_type y WHERE y.oid = t.was)
                                              THEN format_type(t.was, NULL)
                                              ELSE 'a type since dropped' END,
                                         format_type(a.atttypid, a.atttypmod)) ORDER BY t.n), '{}')
          INTO v_retyped
          FROM unnest(c.columns, c.column_types) WITH ORDINALITY AS t(x, was, n)
          JOIN pg_attribute a ON a.attrelid = v_oid AND a.attname = t.x AND a.attnum > 0 AND NOT a.attisdropped
         WHERE t.was IS NOT NULL AND a.atttypid <> t.was;
        IF cardinality(v_added) > 0 OR cardinality(v_gone) > 0 OR cardinality(v_retyped) > 0 THEN
            problem := concat_ws('; ',
                CASE WHEN cardinality(v_added) > 0
                     THEN 'columns added since its trigger was generated: ' || array_to_string(v_added, ', ') END,
                CASE WHEN cardinality(v_gone) > 0
                     THEN 'columns gone (writes to the table fail until refreshed): ' || array_to_string(v_gone, ', ') END,
                CASE WHEN cardinality(v_retyped) > 0
                     THEN 'columns whose type changed since its trigger was generated (a session that wrote the '
                          'table before fails each later write of it, or in on-error warn drops its event, until '
                          'refreshed): ' || array_to_string(v_retyped, ', ') END);
            RETURN NEXT;
        ELSIF c.soft_delete IS NOT NULL AND NOT c.soft_delete = ANY (v_now) THEN
            problem := format('its soft-delete column %s is gone', c.soft_delete);
            RETURN NEXT;
        END IF;

        IF c.soft_delete = ANY (c.exclude) THEN
            v_fixed := c;
            v_fixed.exclude := array_remove(c.exclude, c.soft_delete);
            problem := format('its soft-delete column %I is also excluded: setting it back to NULL (an undelete) '
                              'changes no tracked column, so it sends no event and consumers keep the row deleted',
                              c.soft_delete);
            fix := ferry.capture_replace_command(v_fixed);
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
