-- Table capture: `ferry check` reports a table captured for updates
-- without both inserts and deletes that is partitioned now. capture_add
-- refuses such a capture (schema 18), but a table can become a partition
-- (ATTACH PARTITION) or be captured before schema 18: an UPDATE that moves
-- a row to another partition reaches triggers as a DELETE and an INSERT,
-- so such a change committed with no event and no error.
ALTER FUNCTION ferry.capture_check() RENAME TO capture_check_keys;

CREATE FUNCTION ferry.capture_check() RETURNS TABLE (table_name text, problem text, fix text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c ferry.captures;
    v_rel text;
BEGIN
    RETURN QUERY SELECT k.table_name, k.problem, k.fix FROM ferry.capture_check_keys() k;
    FOR c IN SELECT * FROM ferry.captures k ORDER BY k.table_schema, k.table_name LOOP
        v_rel := format('%I.%I', c.table_schema, c.table_name);
        IF 'update' = ANY (c.operations) AND NOT ('insert' = ANY (c.operations) AND 'delete' = ANY (c.operations))
           AND EXISTS (SELECT 1 FROM pg_class r WHERE r.oid = to_regclass(v_rel)
                                                  AND (r.relkind = 'p' OR r.relispartition)) THEN
            table_name := v_rel;
            problem := 'partitioned, and captured for updates without both inserts and deletes: an UPDATE '
                       'that moves a row to another partition reaches triggers as a DELETE and an INSERT, '
                       'so it sends no event';
            fix := format('ferry capture remove %1$s, then ferry capture add %1$s --on insert,update,delete '
                          '(a moved row then arrives as deleted and created)', v_rel);
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
