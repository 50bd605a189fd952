-- The consumer side: one row per (consumer, event) an SQLite inbox has seen.
-- It mirrors `ferry.inbox` in the PostgreSQL store's migration 2; see there
-- for what each state means.
--
-- event_id is TEXT (hyphenated UUID, as in ferry_events) and processed_at
-- INTEGER microseconds since the Unix epoch, like every time in these tables.
--
-- The primary key is what makes a redelivery harmless: the inbox's upsert on
-- (consumer, event_id) finds the row of an earlier delivery and does nothing.

CREATE TABLE ferry_inbox (
    consumer     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('done', 'failing', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT,
    event_type   TEXT,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) STRICT;

-- Retention walks one consumer's done rows by age; operators look for what
-- is dead or failing.
CREATE INDEX ferry_inbox_done ON ferry_inbox (consumer, processed_at) WHERE state = 'done';
CREATE INDEX ferry_inbox_unfinished ON ferry_inbox (consumer, state) WHERE state <> 'done';
