-- Where the handler left the transaction that claimed the event ($3, its
-- txid as the claim returned it), read inside that transaction:
--   open      the claiming transaction is still the one in progress;
--   ours      the done row is the claim's own version (its xmin is the
--             claim's xid), so if the transaction is not open any more the
--             handler committed it;
--   no row    the handler rolled the claim back.
-- In a transaction a failed statement aborted, this fails (SQLSTATE 25P02).
SELECT coalesce(txid_current_if_assigned() = $3, false) AS open,
       xmin::text::bigint = $3 % 4294967296 AS ours
FROM ferry.inbox
WHERE consumer = $1 AND event_id = $2 AND state = 'done'
