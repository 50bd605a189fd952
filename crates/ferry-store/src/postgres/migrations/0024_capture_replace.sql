-- Table capture: a spec changed in one step, and partitioned tables
-- captured only where their events can be right.
--
-- Replace. A capture's spec could only be changed by `ferry capture
-- remove` then `ferry capture add`, each committed on its own, and the
-- hints said to do just that: a change committed between the two wrote no
-- event, no error and no drop count. ferry.capture_replace removes and adds
-- in one transaction, holding the table's lock from before the remove to
-- the commit, so every change commits under the old spec or the new one
-- (`ferry capture add --replace`). The table's dropped-event count is kept:
-- it is the record of what warn mode lost there, spec changed or not.
--
-- Partitioned tables. PostgreSQL runs an UPDATE that moves a row to
-- another partition as a DELETE from the old partition and an INSERT into
-- the new one: AFTER DELETE and AFTER INSERT fire, AFTER UPDATE does not.
-- Schema 18 refused updates without inserts and deletes (the move sent
-- nothing); the other partial captures sent wrong events: captured for
-- deletes, a moved row arrived as `.deleted` though it still exists; for
-- inserts, as `.created` though it already existed; for both, as deleted
-- and created though updates were not captured. A soft-delete column is
-- wrong there too: a soft delete that moves the row, or any move of a
-- soft-deleted row, arrived as `.deleted` then `.created`, the row alive
-- again, and a trigger cannot tell such a move from a delete and an insert.
-- ferry.capture_add now refuses a partitioned table, or a partition,
-- captured without all of insert, update and delete, or with a soft-delete
-- column; ferry.capture_check reports one captured so before, or one that
-- became a partition since. Their triggers are left as they are.
--
-- Fixes and hints that said to remove and add again now give the one
-- `ferry capture add --replace` command line, with the capture's whole
-- spec (an --exclude left out of a retyped command would send the column
-- meant to be kept out).
--
-- ferry.capture_add_spec is restated as 0018 left it (there named
-- capture_add), but for the partition checks and the already-captured
-- hint; ferry.capture_check_partitions as 0020 left it (there named
-- capture_check), but for what it reports and the fix.

-- `p_word` as one word of a POSIX shell command line: as it is when it
-- needs no quoting, else in single quotes.
CREATE FUNCTION ferry.capture_shell_word(p_word text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_word ~ '^[A-Za-z0-9_./,=:@+-]+$' THEN p_word
                ELSE '''' || replace(p_word, '''', '''\''''') || '''' END
$$;

-- The `ferry capture add --replace` command that gives a captured table
-- the spec `c`.
CREATE FUNCTION ferry.capture_replace_command(c ferry.captures) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT concat_ws(' ',
        'ferry capture add', ferry.capture_shell_word(format('%I.%I', c.table_schema, c.table_name)),
        '--replace --type-prefix', ferry.capture_shell_word(c.type_prefix),
        '--key', ferry.capture_shell_word(c.key_column),
        (SELECT string_agg('--exclude ' || ferry.capture_shell_word(x), ' ' ORDER BY n)
           FROM unnest(c.exclude) WITH ORDINALITY AS t(x, n)),
        '--soft-delete ' || ferry.capture_shell_word(c.soft_delete),
        '--on ' || (SELECT string_agg(x, ',' ORDER BY array_position(ARRAY['insert', 'update', 'delete'], x))
                      FROM unnest(c.operations) x),
        CASE WHEN c.on_error <> 'fail' THEN '--on-error ' || c.on_error END)
$$;

-- What an UPDATE that moves a row to another partition sends, on a table
-- captured for `p_operations`: it reaches the triggers as a DELETE and an
-- INSERT. NULL when all three are captured: the move then arrives as the
-- row deleted and created, in that order, as documented since schema 18.
CREATE FUNCTION ferry.capture_partition_move(p_operations text[]) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN 'insert' = ANY (p_operations) AND 'update' = ANY (p_operations) AND 'delete' = ANY (p_operations)
            THEN NULL
        WHEN 'insert' = ANY (p_operations) AND 'delete' = ANY (p_operations)
            THEN 'a deleted and a created event, though updates are not captured'
        WHEN 'delete' = ANY (p_operations) THEN 'a deleted event for a row that still exists'
        WHEN 'insert' = ANY (p_operations) THEN 'a created event for a row that already existed'
        ELSE 'no event'
    END
$$;

CREATE OR REPLACE FUNCTION ferry.capture_add_spec(
    p_table text, p_type_prefix text, p_key_column text, p_exclude text[],
    p_soft_delete text, p_operations text[], p_on_error text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_schema text;
    v_name text;
    v_id int;
    v_bad text;
    v_partitioned boolean;
    v_move text;
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
    v_partitioned := EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                              WHERE n.nspname = v_schema AND c.relname = v_name
                                AND (c.relkind = 'p' OR c.relispartition));
    v_move := ferry.capture_partition_move(p_operations);
    IF v_partitioned AND v_move IS NOT NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: partitioned, and an UPDATE that moves a row to another partition '
                        'reaches triggers as a DELETE and an INSERT, not an update: captured for % only, such an '
                        'UPDATE would send %', format('%I.%I', v_schema, v_name),
                        (SELECT string_agg(x, ', ' ORDER BY array_position(ARRAY['insert', 'update', 'delete'], x))
                           FROM (SELECT DISTINCT x FROM unnest(p_operations) x) o), v_move
            USING ERRCODE = '22023',
                  HINT = 'capture it --on insert,update,delete, the default (a moved row then arrives as deleted '
                         'and created)';
    END IF;
    IF v_partitioned AND p_soft_delete IS NOT NULL THEN
        RAISE EXCEPTION 'ferry: capture table %: partitioned, and an UPDATE that moves a row to another partition '
                        'reaches triggers as a DELETE and an INSERT: with the soft-delete column %, a soft delete '
                        'that moves the row, or any move of a soft-deleted row, would arrive as deleted and then '
                        'created, the row alive again', format('%I.%I', v_schema, v_name), quote_ident(p_soft_delete)
            USING ERRCODE = '22023',
                  HINT = format('leave out --soft-delete: a soft delete then arrives as updated (or, when it moves '
                                'the row, as deleted and created) with %I set in its data', p_soft_delete);
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
                  HINT = format('`ferry capture add %1$s --replace` with the new spec changes it in one step, '
                                'or `ferry capture refresh %1$s` regenerates its trigger (never a remove then '
                                'an add: changes committed between them send no event)',
                                ferry.capture_shell_word(format('%I.%I', v_schema, v_name)));
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

-- Gives a captured table a new spec: ferry.capture_remove then
-- ferry.capture_add, with every check of the add, in the caller's
-- transaction. The table (and its partitions) is locked before the remove,
-- as the remove would lock it, and stays locked to the commit: no change of
-- it commits between the old triggers and the new. A refused spec leaves
-- the old capture as it was. Returns the table as `ferry capture list`
-- names it.
CREATE FUNCTION ferry.capture_replace(
    p_table text, p_type_prefix text, p_key_column text, p_exclude text[],
    p_soft_delete text, p_operations text[], p_on_error text
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_schema text;
    v_name text;
    v_rel text;
    v_table text;
    d ferry.capture_dropped;
BEGIN
    SELECT r.o_schema, r.o_name INTO v_schema, v_name FROM ferry.capture_resolve(p_table) r;
    v_rel := format('%I.%I', v_schema, v_name);
    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', v_rel);
    PERFORM 1 FROM ferry.captures k WHERE k.table_schema = v_schema AND k.table_name = v_name FOR UPDATE;
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
    RETURN v_table;
END
$$;

CREATE OR REPLACE FUNCTION ferry.capture_check_partitions() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
    v_move text;
    v_fixed ferry.captures;
BEGIN
    RETURN QUERY SELECT k.table_name, k.problem, k.fix FROM ferry.capture_check_keys() k;
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM pg_class r WHERE r.oid = to_regclass(v_rel)
                                                             AND (r.relkind = 'p' OR r.relispartition));
        -- One fix for both problems: the spec with neither.
        v_fixed := c;
        v_fixed.operations := ARRAY['delete', 'insert', 'update'];
        v_fixed.soft_delete := NULL;
        v_move := ferry.capture_partition_move(c.operations);
        IF v_move IS NOT NULL THEN
            table_name := v_rel;
            problem := format('partitioned, and captured for %s only: an UPDATE that moves a row to another '
                              'partition reaches triggers as a DELETE and an INSERT, so it sends %s (captured '
                              '--on insert,update,delete, a moved row arrives as deleted and created)',
                              (SELECT string_agg(x, ', ' ORDER BY array_position(ARRAY['insert', 'update', 'delete'], x))
                                 FROM unnest(c.operations) x),
                              v_move);
            fix := ferry.capture_replace_command(v_fixed);
            RETURN NEXT;
        END IF;
        IF c.soft_delete IS NOT NULL THEN
            table_name := v_rel;
            problem := format('partitioned, and captured with the soft-delete column %I: an UPDATE that moves a '
                              'row to another partition reaches triggers as a DELETE and an INSERT, so a soft '
                              'delete that moves the row, or any move of a soft-deleted row, arrives as deleted '
                              'and then created, the row alive again', c.soft_delete);
            fix := ferry.capture_replace_command(v_fixed);
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
