-- The consumer side: one row per (consumer, event) an inbox has seen.
--
-- state         'done'    the handler's writes committed with this row;
--                         a redelivery is acknowledged and skipped.
--               'failing' the handler failed `attempts` times and rolled
--                         back; the next delivery tries again.
--               'dead'    given up after `attempts` attempts, or refused
--                         for good; the message went to the consumer's
--                         dead-letter destination with `last_error`.
-- processed_at  when the row reached its state; retention purges by it.
--
-- A handler's success writes 'done' in its own transaction, so the row and
-- the business write commit together or not at all. Failures are counted in
-- a transaction of their own, after the rollback, so attempts survive
-- redeliveries and restarts.

CREATE TABLE ferry.inbox (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    state        text        NOT NULL CHECK (state IN ('done', 'failing', 'dead')),
    attempts     int         NOT NULL DEFAULT 0,
    last_error   text,
    event_type   text,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Retention walks rows by age; operators look for what is dead or failing.
CREATE INDEX inbox_processed_at ON ferry.inbox (processed_at);
CREATE INDEX inbox_unfinished ON ferry.inbox (consumer, state) WHERE state <> 'done';
