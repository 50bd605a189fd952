-- What the inbox's statements need of ferry.inbox, asked before a runner
-- consumes: reading every column they use fails if the table is missing
-- (42P01), older than this release needs (42703), or not the role's to read
-- (42501); the rights the runners write it with are asked. DELETE is not:
-- only `purge` and `release` delete, and a consumer's role may lack it.
SELECT has_table_privilege('ferry.inbox', 'INSERT') AS may_insert,
       has_table_privilege('ferry.inbox', 'UPDATE') AS may_update,
       (SELECT count(*)
        FROM (SELECT consumer, event_id, state, attempts, unfinished, last_error, event_type, processed_at
              FROM ferry.inbox LIMIT 0) AS columns) AS none
