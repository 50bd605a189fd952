-- Table capture: a renamed table keeps its events, an undelete is never
-- lost to the spec, and a replace that changes the key says what it does to
-- the events still waiting.
--
-- A renamed table. `ALTER TABLE app.r RENAME TO r2` (or `SET SCHEMA`)
-- takes the capture's trigger along, and it goes on firing, but its events
-- named app.r in their `table` header. ferry.capture_check said the table
-- no longer existed and gave `ferry capture remove app.r` as the fix; that
-- remove dropped the capture's function with CASCADE (schema 22), which
-- took the trigger off app.r2 with a NOTICE only, and app.r2's later
-- changes sent no event, with nothing to report it. A refresh of every
-- table stopped at it. Now:
-- - ferry.capture_check finds the capture's trigger where it went (through
--   pg_trigger, by the capture's function) and reports the rename, with
--   `ferry capture refresh app.r` as the fix;
-- - a refresh follows the rename: it records the table's new schema and
--   name (its dropped-event count goes along) and regenerates the
--   triggers, so the events name app.r2. A refresh of every table follows
--   each rename and passes over, with a WARNING, a table that is gone;
-- - ferry.capture_remove refuses while the capture's trigger sits on a
--   table other than the one named (its partitions aside), naming that
--   table and what to run, and drops the function without CASCADE;
-- - ferry.capture_check reports such a trigger left on another table when
--   a new table has taken the old name (a rename then a CREATE TABLE):
--   that table's changes send events under the capture's name. A refresh
--   of the name refuses while it is there: the capture's function, which
--   that trigger calls too, would be made from the new table's columns;
-- - a rename onto the name another capture records (its table dropped
--   first) is refused by the refresh, which would break that capture's
--   uniqueness, with the remove of the other capture to run first; a
--   refresh of that other capture refuses to take the renamed table's
--   trigger over, its remove drops only its own triggers, and
--   ferry.capture_check reports both. A refresh of every table reports
--   each refusal as a WARNING and goes on.
--
-- A soft-delete column that is also excluded. Setting it sent `.deleted`;
-- setting it back to NULL (an undelete) changed no tracked column, so the
-- update sent nothing and consumers kept the row deleted. ferry.capture_add
-- (and so a replace) refuses that spec; ferry.capture_check reports a
-- capture so specified before, with the replace that fixes it.
--
-- A replace that changes the key column while events of the capture's
-- type prefix are unpublished puts one row's events under two keys, whose
-- order against each other is not kept. ferry.capture_replace raises a
-- WARNING with their number (`ferry capture add --replace` prints it), and
-- ferry.capture_unpublished counts them, so that a caller can drain first.
--
-- Restated whole: ferry.capture_check_triggers as 0013 left it (there named
-- capture_check), with the rename, the trigger left elsewhere and the
-- excluded soft-delete column; ferry.capture_refresh as 0004 left it,
-- following renames; ferry.capture_remove as 0022 left it, with the
-- refusal and without the CASCADE; ferry.capture_add as 0022 left it, with
-- the soft-delete check; ferry.capture_replace as 0024 left it, with the
-- warning. Nothing is done to existing captures: `ferry check` reports
-- what is to be done.

-- The tables whose triggers call the row trigger function of capture
-- `p_id`, other than `p_table` and its partitions (none left out when
-- `p_table` is NULL): where the trigger went when its table was renamed or
-- moved to another schema. A partition's clone of a trigger is left out:
-- it goes with its parent.
CREATE FUNCTION ferry.capture_trigger_elsewhere(p_id int, p_table oid)
RETURNS TABLE (rel oid, name text, trigger text)
LANGUAGE sql STABLE AS $$
    WITH calls AS (
        SELECT t.tgrelid AS rel, t.tgname::text AS trigger
          FROM pg_trigger t
         WHERE t.tgfoid = to_regprocedure(format('ferry.%I()', 'capture_' || p_id))
    )
    SELECT c.rel, format('%I.%I', n.nspname, r.relname), c.trigger
      FROM calls c
      JOIN pg_class r ON r.oid = c.rel
      JOIN pg_namespace n ON n.oid = r.relnamespace
     WHERE NOT (r.relispartition AND EXISTS (SELECT 1 FROM pg_inherits i JOIN calls p ON p.rel = i.inhparent
                                              WHERE i.inhrelid = c.rel))
       AND (p_table IS NULL OR c.rel NOT IN (SELECT m.rel FROM ferry.capture_members(p_table) m))
     ORDER BY 2, 3
$$;

-- The capture, by its recorded name, whose row trigger sits on table
-- `p_table`, when it is not capture `p_id`: the table that had the name
-- `p_id` records is gone, and another capture's table, renamed since,
-- took it. NULL when the trigger there is `p_id`'s own, or none is.
CREATE FUNCTION ferry.capture_taken_by(p_id int, p_table oid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT format('%I.%I', k.table_schema, k.table_name)
      FROM pg_trigger t
      JOIN ferry.captures k ON t.tgfoid = to_regprocedure(format('ferry.%I()', 'capture_' || k.id))
     WHERE t.tgrelid = p_table AND t.tgname = 'ferry_capture' AND k.id <> p_id
$$;

-- Capture `p_id` after its table was renamed or moved to another schema:
-- when no table has the recorded name and the capture's trigger sits on
-- one table, records that table's schema and name, and moves the table's
-- dropped-event count with it. Returns the table's name as recorded now;
-- the recorded one, unchanged, when that table exists or none has the
-- trigger (it is gone: ferry.capture_install says so).
CREATE FUNCTION ferry.capture_follow(p_id int) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_to oid[];
    v_names text[];
    v_schema text;
    v_name text;
BEGIN
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id FOR UPDATE;
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    IF to_regclass(v_rel) IS NOT NULL THEN
        RETURN v_rel;
    END IF;
    SELECT array_agg(e.rel ORDER BY e.name), array_agg(e.name ORDER BY e.name) INTO v_to, v_names
      FROM ferry.capture_trigger_elsewhere(p_id, NULL) e;
    IF v_to IS NULL THEN
        RETURN v_rel;
    ELSIF cardinality(v_to) > 1 THEN
        RAISE EXCEPTION 'ferry: capture table %: no table has that name any more, and its trigger fires on % '
                        'tables: %', v_rel, cardinality(v_to), array_to_string(v_names, ', ')
            USING ERRCODE = '55000',
                  HINT = format('keep it on the table renamed from %s alone (DROP TRIGGER ... ON each other '
                                'one), then refresh again', v_rel);
    END IF;
    SELECT n.nspname, r.relname INTO v_schema, v_name
      FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
     WHERE r.oid = v_to[1];
    -- Another capture recording the new name is one whose table was
    -- dropped (or renamed too) before this one took the name.
    IF EXISTS (SELECT 1 FROM ferry.captures k
                WHERE k.table_schema = v_schema AND k.table_name = v_name AND k.id <> p_id) THEN
        RAISE EXCEPTION 'ferry: capture table %: renamed (or moved to another schema) to %, a name the capture of '
                        'another table still records (that table dropped or renamed since)', v_rel, v_names[1]
            USING ERRCODE = '55000',
                  HINT = format('stop capturing the table gone with `ferry capture remove %s`, then run '
                                '`ferry capture refresh %s` again', ferry.capture_shell_word(v_names[1]),
                                ferry.capture_shell_word(v_rel));
    END IF;
    UPDATE ferry.captures k SET table_schema = v_schema, table_name = v_name WHERE k.id = p_id;
    WITH moved AS (
        DELETE FROM ferry.capture_dropped d
         WHERE d.table_schema = c.table_schema AND d.table_name = c.table_name
        RETURNING d.count, d.last_error, d.last_at
    )
    INSERT INTO ferry.capture_dropped AS d (table_schema, table_name, count, last_error, last_at)
    SELECT v_schema, v_name, m.count, m.last_error, m.last_at FROM moved m
    ON CONFLICT (table_schema, table_name) DO UPDATE
       SET count = d.count + excluded.count,
           last_error = CASE WHEN d.last_at IS NULL OR excluded.last_at > d.last_at
                             THEN excluded.last_error ELSE d.last_error END,
           last_at = greatest(d.last_at, excluded.last_at);
    RETURN format('%I.%I', v_schema, v_name);
END
$$;

-- Unpublished events of the types `p_type_prefix`.created, .updated and
-- .deleted: not routed yet, or with a delivery pending (in flight, or
-- waiting for a retry) or dead. Reads the outbox by the work left, not by
-- its history.
CREATE FUNCTION ferry.capture_unpublished(p_type_prefix text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*)
      FROM ferry.events e
     WHERE e.seq IN (SELECT u.seq FROM ferry.unrouted u
                     UNION SELECT d.seq FROM ferry.deliveries d WHERE d.state = 'pending'
                     UNION SELECT d.seq FROM ferry.deliveries d WHERE d.state = 'dead')
       AND e.type IN (p_type_prefix || '.created', p_type_prefix || '.updated', p_type_prefix || '.deleted')
$$;

CREATE OR REPLACE FUNCTION ferry.capture_check_triggers() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_oid oid;
    v_now text[];
    v_added text[];
    v_gone text[];
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

-- Refreshes capture `p_id`, following a rename; returns its table's name
-- now. Refused (55000) where regenerating the capture's function would
-- break a table that calls it: the function is one, shared by every
-- trigger that calls it, and is made from one table's columns.
CREATE FUNCTION ferry.capture_refresh_one(p_id int) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_oid oid;
    v_owner text;
    v_elsewhere text;
    v_drops text;
BEGIN
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id FOR UPDATE;
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    v_oid := to_regclass(v_rel);
    IF v_oid IS NOT NULL THEN
        -- The install would take that capture's trigger over.
        v_owner := ferry.capture_taken_by(p_id, v_oid);
        IF v_owner IS NOT NULL THEN
            RAISE EXCEPTION 'ferry: capture table %: the table of that name is gone: % now is the table captured '
                            'as %, renamed since, and a refresh would take its trigger over', v_rel, v_rel, v_owner
                USING ERRCODE = '55000',
                      HINT = format('stop capturing the table gone with `ferry capture remove %s`, then run '
                                    '`ferry capture refresh %s`', ferry.capture_shell_word(v_rel),
                                    ferry.capture_shell_word(v_owner));
        END IF;
        -- The trigger left on a table renamed away would call a function
        -- made from this table's columns.
        SELECT string_agg(e.name, ', ' ORDER BY e.name),
               string_agg(format('DROP TRIGGER %I ON %s', e.trigger, e.name), '; ' ORDER BY e.name)
          INTO v_elsewhere, v_drops
          FROM ferry.capture_trigger_elsewhere(p_id, v_oid) e;
        IF v_elsewhere IS NOT NULL THEN
            RAISE EXCEPTION 'ferry: capture table %: its trigger also fires on % (renamed from %, a table of that '
                            'name made since?): a refresh would make the function that trigger calls from %''s '
                            'columns, failing or mislabelling that table''s writes', v_rel, v_elsewhere, v_rel, v_rel
                USING ERRCODE = '55000',
                      HINT = format('capture %s on its own first (ferry capture add %s with a type prefix of its '
                                    'own), or stop its events (%s); then refresh again', v_elsewhere,
                                    v_elsewhere, v_drops);
        END IF;
    END IF;
    v_rel := ferry.capture_follow(p_id);
    PERFORM ferry.capture_install(p_id);
    RETURN v_rel;
END
$$;

CREATE OR REPLACE FUNCTION ferry.capture_refresh(p_table text DEFAULT NULL) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_done text;
    v_message text;
    v_hint text;
BEGIN
    IF p_table IS NOT NULL THEN
        c := ferry.capture_find(p_table);
        RETURN NEXT ferry.capture_refresh_one(c.id);
        RETURN;
    END IF;
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        -- A table gone, by its name and by its trigger, has nothing to
        -- refresh; the others' triggers are still brought up to date.
        IF to_regclass(v_rel) IS NULL
           AND (SELECT count(*) FROM ferry.capture_trigger_elsewhere(c.id, NULL)) <> 1 THEN
            RAISE WARNING 'ferry: capture table %: no table of that name, nor one table with its trigger, so not '
                          'refreshed', v_rel
                USING HINT = 'see `ferry check` for the fix';
            CONTINUE;
        END IF;
        -- A refusal leaves that capture as it was and the others go on:
        -- `ferry check` reports it, with its fix.
        BEGIN
            v_done := ferry.capture_refresh_one(c.id);
        EXCEPTION WHEN object_not_in_prerequisite_state THEN
            GET STACKED DIAGNOSTICS v_message = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
            RAISE WARNING '%, so not refreshed', v_message USING HINT = v_hint;
            CONTINUE;
        END;
        RETURN NEXT v_done;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION ferry.capture_remove(p_table text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_oid oid;
    v_elsewhere text;
    v_drops text;
    m record;
BEGIN
    c := ferry.capture_find(p_table);
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    v_oid := to_regclass(v_rel);
    -- The capture's trigger on another table (renamed or moved since) goes
    -- on writing that table's events; dropping the function would drop it
    -- with a NOTICE only.
    SELECT string_agg(e.name, ', ' ORDER BY e.name),
           string_agg(format('DROP TRIGGER %I ON %s', e.trigger, e.name), '; ' ORDER BY e.name)
      INTO v_elsewhere, v_drops
      FROM ferry.capture_trigger_elsewhere(c.id, v_oid) e;
    IF v_elsewhere IS NOT NULL AND v_oid IS NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: renamed (or moved to another schema) since it was captured, and '
                        'its trigger fires on % now: removing the capture would drop that trigger, and the '
                        'table''s changes would send no event', v_rel, v_elsewhere
            USING ERRCODE = '55000',
                  HINT = format('to go on capturing it, run `ferry capture refresh %s`, which follows the rename; '
                                'to stop capturing it, run that, then `ferry capture remove %s`',
                                ferry.capture_shell_word(v_rel), v_elsewhere);
    ELSIF v_elsewhere IS NOT NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: its trigger also fires on %: removing the capture would drop it '
                        'there too, and that table''s changes would send no event', v_rel, v_elsewhere
            USING ERRCODE = '55000',
                  HINT = format('capture %s on its own first (ferry capture add %s with a type prefix of its own), '
                                'or stop its events (%s); then remove again', v_elsewhere, v_elsewhere, v_drops);
    END IF;
    IF v_oid IS NOT NULL THEN
        -- Its own triggers only: where another capture's table, renamed
        -- since, took the name, the triggers there are that capture's.
        FOR m IN SELECT mm.name FROM ferry.capture_members(v_oid) mm
                   JOIN pg_trigger t ON t.tgrelid = mm.rel
                  WHERE t.tgname = 'ferry_capture_truncate'
                    AND t.tgfoid = to_regprocedure(format('ferry.%I()', 'capture_' || c.id || '_truncate')) LOOP
            EXECUTE format('DROP TRIGGER ferry_capture_truncate ON %s', m.name);
        END LOOP;
        IF EXISTS (SELECT 1 FROM pg_trigger t
                    WHERE t.tgrelid = v_oid AND t.tgname = 'ferry_capture'
                      AND t.tgfoid = to_regprocedure(format('ferry.%I()', 'capture_' || c.id))) THEN
            -- Drops its clones on the partitions too.
            EXECUTE format('DROP TRIGGER ferry_capture ON %s', v_rel);
        END IF;
    END IF;
    IF to_regprocedure(format('ferry.%I()', 'capture_' || c.id || '_truncate')) IS NOT NULL THEN
        -- CASCADE: also a guard left on a partition detached since, which
        -- guards nothing without the row trigger.
        EXECUTE format('DROP FUNCTION ferry.%I() CASCADE', 'capture_' || c.id || '_truncate');
    END IF;
    -- No CASCADE: nothing else calls it now, and a trigger that did would
    -- fail the remove rather than be dropped with a NOTICE.
    EXECUTE format('DROP FUNCTION IF EXISTS ferry.%I()', 'capture_' || c.id);
    DELETE FROM ferry.captures k WHERE k.id = c.id;
    DELETE FROM ferry.capture_dropped d WHERE d.table_schema = c.table_schema AND d.table_name = c.table_name;
    RETURN v_rel;
END
$$;

CREATE OR REPLACE FUNCTION ferry.capture_add(
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
    IF p_soft_delete = ANY (p_exclude) THEN
        RAISE EXCEPTION 'ferry: capture soft-delete column % is also excluded: setting it back to NULL (an undelete) '
                        'would change no tracked column and send no event, so consumers would keep the row deleted',
                        quote_literal(p_soft_delete)
            USING ERRCODE = '22023',
                  HINT = format('drop %s from --exclude (--soft-delete needs it in the events), or leave out '
                                '--soft-delete', p_soft_delete);
    END IF;
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

CREATE OR REPLACE FUNCTION ferry.capture_replace(
    p_table text, p_type_prefix text, p_key_column text, p_exclude text[],
    p_soft_delete text, p_operations text[], p_on_error text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_schema text;
    v_name text;
    v_rel text;
    v_table text;
    v_old ferry.captures;
    v_unpublished bigint;
    d ferry.capture_dropped;
BEGIN
    SELECT r.o_schema, r.o_name INTO v_schema, v_name FROM ferry.capture_resolve(p_table) r;
    v_rel := format('%I.%I', v_schema, v_name);
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', v_rel);
    SELECT * INTO v_old FROM ferry.captures k WHERE k.table_schema = v_schema AND k.table_name = v_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ferry: capture table %: not captured, so there is no spec to replace', v_rel
            USING ERRCODE = '22023',
                  HINT = format('capture it with `ferry capture add %s` (without --replace)',
                                ferry.capture_shell_word(v_rel));
    END IF;
    SELECT * INTO d FROM ferry.capture_dropped k WHERE k.table_schema = v_schema AND k.table_name = v_name;
    PERFORM ferry.capture_remove(v_rel);
    v_table := ferry.capture_add(v_rel, p_type_prefix, p_key_column, p_exclude, p_soft_delete, p_operations,
                                 p_on_error);
    IF d.table_schema IS NOT NULL THEN
        INSERT INTO ferry.capture_dropped (table_schema, table_name, count, last_error, last_at)
        VALUES (d.table_schema, d.table_name, d.count, d.last_error, d.last_at);
    END IF;
    -- Counted under the table's lock: no event of it commits from here on
    -- under the old key.
    IF p_key_column IS DISTINCT FROM v_old.key_column THEN
        v_unpublished := ferry.capture_unpublished(v_old.type_prefix);
        IF v_unpublished > 0 THEN
            RAISE WARNING 'ferry: capture table %: key column changed from % to % while % events of %.* are '
                          'unpublished: a row''s events under the new key may be delivered before its events '
                          'still waiting under the old one', v_rel, quote_ident(v_old.key_column),
                          quote_ident(p_key_column), v_unpublished, v_old.type_prefix
                USING HINT = 'change the key with the table''s events drained (`ferry status` shows none pending '
                             'or dead for their routes), at a quiet moment';
        END IF;
    END IF;
    RETURN v_table;
END
$$;
