-- Ferry's outbox schema for SQLite. SQLite has no schemas, so every table is
-- prefixed `ferry_`. The tables mirror the PostgreSQL store's; see its
-- migrations for what each holds.
--
-- Times are INTEGER microseconds since the Unix epoch: they compare exactly
-- and sort as numbers. Event ids are TEXT (hyphenated UUID v7) so that the
-- sqlite3 shell shows them as `ferry show` takes them.
--
-- SQLite runs one writer at a time, and a producer's transaction holds the
-- write lock from its first write to its commit. So `seq` order is commit
-- order for every event, not only per key, without any extra lock.

CREATE TABLE ferry_events (
    -- AUTOINCREMENT: a seq is never reused, even after the newest events are
    -- deleted by retention.
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT    NOT NULL UNIQUE,
    type         TEXT    NOT NULL,
    key          TEXT,
    partition    INTEGER NOT NULL,
    payload      BLOB    NOT NULL,
    content_type TEXT    NOT NULL DEFAULT 'application/json',
    headers      TEXT    NOT NULL DEFAULT '{}',
    -- NULLs are distinct in a UNIQUE index, so only real keys collide.
    dispatch_key TEXT    UNIQUE,
    created_at   INTEGER NOT NULL
) STRICT;

CREATE TABLE ferry_unrouted (
    seq       INTEGER PRIMARY KEY,
    partition INTEGER NOT NULL
) STRICT;
CREATE INDEX ferry_unrouted_partition ON ferry_unrouted (partition, seq);

CREATE TABLE ferry_deliveries (
    seq             INTEGER NOT NULL,
    route           TEXT    NOT NULL,
    partition       INTEGER NOT NULL,
    key             TEXT,
    state           TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'published', 'dead', 'cancelled')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    last_error      TEXT,
    published_at    INTEGER,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (seq, route)
) STRICT;
-- The claim path: pending deliveries of a route in outbox order.
CREATE INDEX ferry_deliveries_pending ON ferry_deliveries (route, seq) WHERE state = 'pending';
-- What holds a key back: a delivery that failed and waits for its retry, or is dead.
CREATE INDEX ferry_deliveries_blocking ON ferry_deliveries (route, key, seq)
    WHERE key IS NOT NULL AND (state = 'dead' OR (state = 'pending' AND attempts > 0));
CREATE INDEX ferry_deliveries_dead ON ferry_deliveries (route, seq) WHERE state IN ('dead', 'cancelled');
-- `ferry tail` follows outcomes by their change time.
CREATE INDEX ferry_deliveries_updated ON ferry_deliveries (updated_at);

-- One row per failed attempt, for `ferry show`. A requeue starts a
-- delivery's attempt count again, so attempt numbers repeat: each failure
-- has its own id, and none is lost.
CREATE TABLE ferry_failures (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    seq     INTEGER NOT NULL,
    route   TEXT    NOT NULL,
    attempt INTEGER NOT NULL,
    at      INTEGER NOT NULL,
    dead    INTEGER NOT NULL,
    error   TEXT    NOT NULL
) STRICT;
CREATE INDEX ferry_failures_delivery ON ferry_failures (seq, route, attempt);

-- One row per delivery an operator requeued or cancelled: who, when, from
-- which state, and why.
CREATE TABLE ferry_admin_log (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    seq        INTEGER NOT NULL,
    route      TEXT    NOT NULL,
    at         INTEGER NOT NULL,
    actor      TEXT    NOT NULL,
    action     TEXT    NOT NULL CHECK (action IN ('requeue', 'cancel')),
    from_state TEXT    NOT NULL,
    attempts   INTEGER NOT NULL,
    reason     TEXT
) STRICT;
CREATE INDEX ferry_admin_log_delivery ON ferry_admin_log (seq, route);

CREATE TABLE ferry_partitions (
    partition   INTEGER PRIMARY KEY,
    owner       TEXT,
    token       INTEGER NOT NULL DEFAULT 0,
    expires_at  INTEGER,
    acquired_at INTEGER
) STRICT;
WITH RECURSIVE n(p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM n WHERE p < 31)
INSERT INTO ferry_partitions (partition) SELECT p FROM n;

CREATE TABLE ferry_relays (
    id           TEXT    PRIMARY KEY,
    started_at   INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL,
    sleeping     INTEGER NOT NULL DEFAULT 0
) STRICT;
