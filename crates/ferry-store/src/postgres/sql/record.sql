-- Applies outcomes through ferry.record_outcomes (see the migration for why
-- it is one primary-key update per outcome).
-- $1 relay, $2 partitions, $3 tokens, $4 route,
-- $5..$11 per outcome: seq, expected attempts, state, attempts, next attempt, error, published at
-- $12 now
SELECT ferry.record_outcomes($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
