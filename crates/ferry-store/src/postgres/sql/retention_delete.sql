-- Deletes events with their deliveries, failure history and operators'
-- actions, all in one statement. Returns (deliveries, events) deleted.
-- $1 seqs
WITH f AS (DELETE FROM ferry.failures WHERE seq = ANY($1::bigint[])),
     a AS (DELETE FROM ferry.admin_log WHERE seq = ANY($1::bigint[])),
     d AS (DELETE FROM ferry.deliveries WHERE seq = ANY($1::bigint[]) RETURNING 1),
     e AS (DELETE FROM ferry.events WHERE seq = ANY($1::bigint[]) RETURNING 1)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM e)
