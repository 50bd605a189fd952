-- Records (consumer, event) as done inside the handler's transaction, or
-- takes over a row whose earlier attempts failed. Returns this attempt's
-- number, the transaction's txid (to tell afterwards whether the handler
-- ended the transaction itself: left.sql) and the session's backend pid (to
-- cancel the statement of a handler stopped at its timeout), and sets the
-- handler's limits (below); returns
-- nothing when the row is done or dead, including when a concurrent
-- delivery committed it while this statement waited on its lock.
--
-- attempts counts every attempt, those the process died in too: the row's
-- `unfinished` ones (start.sql), which include this attempt's own when it
-- was marked ($5), and this one.
INSERT INTO ferry.inbox AS i (consumer, event_id, state, attempts, event_type, processed_at)
VALUES ($1, $2, 'done', 1, $3, now())
ON CONFLICT (consumer, event_id) DO UPDATE
    SET state = 'done', attempts = i.attempts + greatest(i.unfinished + (NOT $5)::int, 1),
        unfinished = 0, processed_at = now()
    WHERE i.state = 'failing'
-- Once the row is this attempt's, the limits the handler runs under, in
-- the same round trip: the session's own lock_timeout back (the inbox's,
-- set at BEGIN, bounds only the claim's wait for another attempt's row; a
-- handler's statements wait on their own locks as long as the session lets
-- them), and with a handler timeout, statement_timeout ($4) just above it.
-- RETURNING runs after the row was written, past any wait for its lock.
RETURNING attempts, txid_current(), pg_backend_pid(),
          set_config('lock_timeout', current_setting('ferry.session_lock_timeout'), true),
          set_config('statement_timeout', coalesce($4, current_setting('statement_timeout')), true)
