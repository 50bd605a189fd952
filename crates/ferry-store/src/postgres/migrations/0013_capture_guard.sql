-- Table capture fails closed in three more ways, so a captured change can no
-- longer go without its event and nobody told.
--
-- 1. A trigger that exists but does not fire. `ALTER TABLE t DISABLE
--    TRIGGER ALL` (what `pg_restore --disable-triggers` runs, and may not
--    undo) left the trigger in place, so ferry.capture_check saw nothing
--    wrong. It now reports every capture trigger, on the table and on each
--    partition, that does not fire always (pg_trigger.tgenabled other than
--    'A'), with the ALTER TABLE that fixes it.
--
-- 2. session_replication_role = replica (logical replication apply, some
--    restore and ETL tools) skips ordinary triggers. Capture triggers are
--    now ENABLE ALWAYS: they fire whatever the session's role. The other
--    choice, documenting that such writes are not captured, leaves a silent
--    drop in exactly the bulk and replicated writes nobody watches, and the
--    contract is that capture never drops silently. What ALWAYS costs: a
--    logical-replication subscriber that also captures a table writes an
--    event for every row the apply worker applies. Where the publisher
--    captures the same table, that is each event twice under two event ids,
--    which no inbox can deduplicate; so capture a replicated table on one
--    side only (docs/OPERATIONS.md, "Table capture"). A duplicate there is
--    a configuration visible in `ferry capture list` on both sides; a drop
--    would be visible nowhere.
--    `ALTER TABLE t ENABLE TRIGGER ALL`, the undo of (1), makes a trigger
--    fire only outside replica mode ('O') again, and capture_check reports
--    that too.
--
-- 3. TRUNCATE fires no row trigger. A statement-level trigger,
--    ferry_capture_truncate, now guards every captured table (and each of
--    its partitions) that captures deletes: in fail mode it refuses the
--    TRUNCATE, naming the table and the fix (DELETE the rows, which writes
--    their events, or stop capturing the table first); in warn mode it lets
--    the TRUNCATE through and counts each row it removes as a dropped event
--    in ferry.capture_dropped, with a WARNING, as warn mode does for any
--    event it cannot write. A capture without deletes loses nothing to a
--    TRUNCATE and gets no guard.
--
-- ferry.capture_install (0004) is renamed capture_install_rows: it still
-- generates and installs the row trigger. The new capture_install calls it,
-- makes that trigger fire always and installs the TRUNCATE guard, so
-- capture_add and capture_refresh do all three. Upgrading, every table
-- already captured gets the same, except that a trigger found disabled
-- stays disabled (someone did that; capture_check reports it).

ALTER FUNCTION ferry.capture_install(int) RENAME TO capture_install_rows;

-- A captured table and, when it is partitioned, every partition under it,
-- at any depth: where its triggers are. `kind` is pg_class.relkind.
CREATE FUNCTION ferry.capture_members(p_table oid)
RETURNS TABLE (rel oid, name text, kind "char", depth int)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE tree (rel, depth) AS (
        SELECT p_table, 0
        UNION ALL
        SELECT i.inhrelid, t.depth + 1
          FROM tree t
          JOIN pg_inherits i ON i.inhparent = t.rel
          JOIN pg_class p ON p.oid = i.inhrelid
         WHERE p.relispartition -- a plain inheritance child is not captured
    )
    SELECT t.rel, format('%I.%I', n.nspname, c.relname), c.relkind, t.depth
      FROM tree t
      JOIN pg_class c ON c.oid = t.rel
      JOIN pg_namespace n ON n.oid = c.relnamespace
     ORDER BY t.depth, 2
$$;

-- (Re)installs the TRUNCATE guard of capture `p_id` on its table and every
-- partition of it, or removes the guard when the capture takes no deletes.
-- Partitions attached later have none until the capture is refreshed:
-- statement triggers are not cloned to partitions, and capture_check
-- reports the gap.
CREATE FUNCTION ferry.capture_install_truncate(p_id int) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_fn text;
    v_type text;
    v_src text;
    m record;
BEGIN
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id FOR UPDATE;
    v_rel := format('%I.%I', c.table_schema, c.table_name);
    v_fn := format('ferry.%I', 'capture_' || c.id || '_truncate');
    v_type := c.type_prefix || '.deleted';
    FOR m IN SELECT mm.name FROM ferry.capture_members(v_rel::regclass) mm
               JOIN pg_trigger t ON t.tgrelid = mm.rel WHERE t.tgname = 'ferry_capture_truncate' LOOP
        EXECUTE format('DROP TRIGGER ferry_capture_truncate ON %s', m.name);
    END LOOP;
    IF NOT 'delete' = ANY (c.operations) THEN
        IF to_regprocedure(v_fn || '()') IS NOT NULL THEN
            -- CASCADE: also a guard left on a partition detached since.
            EXECUTE format('DROP FUNCTION %s() CASCADE', v_fn);
        END IF;
        RETURN;
    END IF;

    v_src := format($b$
DECLARE
    v_at text := format('%%I.%%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_rows bigint;
    v_err text;
BEGIN
    -- A partition detached since keeps this trigger, but its rows are no
    -- longer captured: detaching dropped its row trigger.
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = TG_RELID AND t.tgname = 'ferry_capture') THEN
        RETURN NULL;
    END IF;%s
    RETURN NULL;
END
$b$,
        CASE WHEN c.on_error = 'fail' THEN format($b$
    RAISE EXCEPTION 'ferry: TRUNCATE of %% would delete its rows without their %% events', v_at, %2$L
        USING ERRCODE = '55000',
              HINT = format('delete the rows instead (DELETE FROM %%s writes their events), '
                            'or stop capturing %%s first (ferry capture remove %%s)', v_at, %1$L, %1$L);$b$,
            v_rel, v_type)
        -- Warn mode: the TRUNCATE goes through, and each row it removes is
        -- a dropped event, counted where the relay exports it, and logged.
        ELSE format($b$
    EXECUTE format('SELECT count(*) FROM ONLY %%s', v_at) INTO v_rows;
    IF v_rows > 0 THEN
        v_err := format('TRUNCATE of %%s deleted %%s rows without their %%s events', v_at, v_rows, %1$L);
        RAISE WARNING 'ferry: capture of %% dropped %% events: %%', %2$L, v_rows, v_err;
        INSERT INTO ferry.capture_dropped AS d (table_schema, table_name, count, last_error, last_at)
        VALUES (%3$L, %4$L, v_rows, v_err, now())
        ON CONFLICT (table_schema, table_name)
        DO UPDATE SET count = d.count + excluded.count, last_error = excluded.last_error,
                      last_at = excluded.last_at;
    END IF;$b$,
            v_type, v_rel, c.table_schema, c.table_name) END);
    EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', v_fn, v_src);

    -- Foreign partitions take no TRUNCATE trigger.
    FOR m IN SELECT * FROM ferry.capture_members(v_rel::regclass) WHERE kind IN ('r', 'p') LOOP
        EXECUTE format('CREATE TRIGGER ferry_capture_truncate BEFORE TRUNCATE ON %s FOR EACH STATEMENT '
                       'EXECUTE FUNCTION %s()', m.name, v_fn);
        EXECUTE format('ALTER TABLE ONLY %s ENABLE ALWAYS TRIGGER ferry_capture_truncate', m.name);
    END LOOP;
END
$$;

-- (Re)generates the triggers of capture `p_id`: the row trigger, firing
-- always, and the TRUNCATE guard.
CREATE FUNCTION ferry.capture_install(p_id int) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    c ferry.captures;
BEGIN
    PERFORM ferry.capture_install_rows(p_id);
    SELECT * INTO c FROM ferry.captures k WHERE k.id = p_id;
    -- Recurses to the trigger's clones on the partitions.
    EXECUTE format('ALTER TABLE %I.%I ENABLE ALWAYS TRIGGER ferry_capture', c.table_schema, c.table_name);
    PERFORM ferry.capture_install_truncate(p_id);
END
$$;

-- Stops capturing a table: drops its triggers and functions and forgets it.
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
    EXECUTE format('DROP FUNCTION IF EXISTS ferry.%I()', 'capture_' || c.id);
    DELETE FROM ferry.captures k WHERE k.id = c.id;
    DELETE FROM ferry.capture_dropped d WHERE d.table_schema = c.table_schema AND d.table_name = c.table_name;
    RETURN v_rel;
END
$$;

-- Captured tables whose triggers would miss changes or no longer match the
-- table: what differs, and the command that fixes it. A table can have
-- several rows; the worst comes first (a trigger that does not fire loses
-- every event).
CREATE OR REPLACE FUNCTION ferry.capture_check() RETURNS TABLE (table_name text, problem text, fix text)
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
    b record;
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
        IF NOT EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_oid AND t.tgname = 'ferry_capture')
           OR to_regprocedure(format('ferry.%I()', 'capture_' || c.id)) IS NULL THEN
            problem := 'its trigger is missing';
            fix := format('ferry capture refresh %s', v_rel);
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
    END LOOP;
END
$$;

-- Tables captured before this migration: their row trigger fires always
-- where it fired by default ('O'), and they get the TRUNCATE guard. Each
-- ALTER takes a brief lock on the table; waiting behind a long transaction
-- would queue every writer of the table behind this migration, so it gives
-- up after 5 s instead, and `ferry migrate` can be run again.
DO $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_timeout text := current_setting('lock_timeout');
    m record;
BEGIN
    PERFORM set_config('lock_timeout', '5s', true);
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        IF to_regclass(v_rel) IS NULL THEN
            CONTINUE; -- capture_check reports the table gone
        END IF;
        BEGIN
            FOR m IN SELECT mm.name FROM ferry.capture_members(v_rel::regclass) mm
                       JOIN pg_trigger t ON t.tgrelid = mm.rel
                      WHERE t.tgname = 'ferry_capture' AND t.tgenabled = 'O' LOOP
                EXECUTE format('ALTER TABLE ONLY %s ENABLE ALWAYS TRIGGER ferry_capture', m.name);
            END LOOP;
            PERFORM ferry.capture_install_truncate(c.id);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'ferry: upgrading the capture triggers of % needs a brief lock on it, '
                            'and another transaction has held it for 5 s', v_rel
                USING ERRCODE = '55P03', HINT = 'run `ferry migrate` again once that transaction has finished';
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', v_timeout, true);
END
$$;
