-- Capture: a partitioned table (or a partition) captured for updates must
-- be captured for inserts and deletes too. PostgreSQL runs an UPDATE that
-- moves a row to another partition as a DELETE from the old partition and
-- an INSERT into the new one: the AFTER UPDATE trigger does not fire. A
-- table captured for updates alone committed such an UPDATE with no event;
-- with inserts and deletes captured, the move arrives as the row deleted
-- and created. Tables captured before this migration keep their triggers.
--
-- ferry.capture_add is restated as 0004 left it; only this check differs.

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
