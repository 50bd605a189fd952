-- Records (consumer, event) as done inside the handler's transaction, or
-- takes over a row whose earlier attempts failed. Returns this attempt's
-- number, the transaction's txid (to tell afterwards whether the handler
-- ended the transaction itself: left.sql) and the session's backend pid (to
-- cancel the statement of a handler stopped at its timeout); returns
-- nothing when the row is done or dead, including when a concurrent
-- delivery committed it while this statement waited on its lock.
INSERT INTO ferry.inbox AS i (consumer, event_id, state, attempts, event_type, processed_at)
VALUES ($1, $2, 'done', 1, $3, now())
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'done', attempts = i.attempts + 1, processed_at = now()
    WHERE i.state = 'failing'
RETURNING attempts, txid_current(), pg_backend_pid()
