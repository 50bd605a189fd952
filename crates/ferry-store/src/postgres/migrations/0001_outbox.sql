-- Ferry's outbox schema. Everything lives in the `ferry` schema.
--
-- events      append-only: what producers committed. `seq` is the outbox
--             order; per key it is commit order (see ferry._enqueue).
-- unrouted    the events no relay has routed yet; a row per event, deleted
--             when routed. Kept apart so `events` is never updated.
-- deliveries  one row per (event, route): state, attempts, next attempt,
--             last error, publish time. Partial indexes keep the claim path
--             proportional to the work left, not to history.
-- failures    one row per failed attempt, for `ferry show`.
-- partitions  the lease table: a relay works only partitions it leases;
--             `token` is the fencing token, bumped on every takeover.
-- relays      live relays (heartbeat), and whether each sleeps and wants a
--             notification on commit.

CREATE SCHEMA IF NOT EXISTS ferry;

CREATE TABLE ferry.events (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id           uuid        NOT NULL,
    type         text        NOT NULL,
    key          text,
    partition    int         NOT NULL,
    payload      bytea       NOT NULL,
    content_type text        NOT NULL DEFAULT 'application/json',
    headers      jsonb       NOT NULL DEFAULT '{}',
    dispatch_key text,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX events_id ON ferry.events (id);
CREATE UNIQUE INDEX events_dispatch_key ON ferry.events (dispatch_key) WHERE dispatch_key IS NOT NULL;

CREATE TABLE ferry.unrouted (
    seq       bigint PRIMARY KEY,
    partition int    NOT NULL
);

CREATE TABLE ferry.deliveries (
    seq             bigint      NOT NULL,
    route           text        NOT NULL,
    partition       int         NOT NULL,
    key             text,
    state           text        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'published', 'dead', 'cancelled')),
    attempts        int         NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    published_at    timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (seq, route)
);
-- The claim path: pending deliveries of a route in outbox order.
CREATE INDEX deliveries_pending ON ferry.deliveries (route, seq) WHERE state = 'pending';
-- What holds a key back: a delivery that failed and waits for its retry, or is dead.
CREATE INDEX deliveries_blocking ON ferry.deliveries (route, key, seq)
    WHERE key IS NOT NULL AND (state = 'dead' OR (state = 'pending' AND attempts > 0));
CREATE INDEX deliveries_dead ON ferry.deliveries (route, seq) WHERE state IN ('dead', 'cancelled');

CREATE TABLE ferry.failures (
    seq     bigint      NOT NULL,
    route   text        NOT NULL,
    attempt int         NOT NULL,
    at      timestamptz NOT NULL,
    dead    boolean     NOT NULL,
    error   text        NOT NULL,
    PRIMARY KEY (seq, route, attempt)
);

CREATE TABLE ferry.partitions (
    partition   int PRIMARY KEY,
    owner       text,
    token       bigint NOT NULL DEFAULT 0,
    expires_at  timestamptz,
    acquired_at timestamptz
);
INSERT INTO ferry.partitions (partition) SELECT generate_series(0, 31);

CREATE TABLE ferry.relays (
    id           text PRIMARY KEY,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    sleeping     boolean     NOT NULL DEFAULT false
);

-- UUID v7 (RFC 9562): 48 bits of Unix milliseconds, then random bits.
CREATE FUNCTION ferry.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- The partition of an event: by key, so a key's events share one; keyless
-- events spread by id. Must match the partition count in ferry.partitions.
CREATE FUNCTION ferry.partition_of(p_key text, p_id uuid) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT abs(hashtextextended(coalesce(p_key, p_id::text), 0) % 32)::int
$$;

-- Every producer path ends here. Validates, deduplicates by dispatch key,
-- serialises producers of one key so that per key, seq order is commit order,
-- and wakes a sleeping relay. Returns the event id: the existing event's id
-- when the dispatch key was seen before.
CREATE FUNCTION ferry._enqueue(
    p_id uuid, p_type text, p_key text, p_payload bytea,
    p_content_type text, p_headers jsonb, p_dispatch_key text
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_partition int;
    v_seq bigint;
    v_existing uuid;
BEGIN
    IF p_type IS NULL OR length(p_type) > 255
       OR p_type !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)+$' THEN
        RAISE EXCEPTION 'ferry: invalid event type %', coalesce(quote_literal(p_type), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'use lowercase segments of [a-z0-9_-] joined by dots, e.g. order.item.created';
    END IF;
    IF p_key IS NOT NULL AND (p_key = '' OR octet_length(p_key) > 512) THEN
        RAISE EXCEPTION 'ferry: invalid event key: % bytes', octet_length(p_key)
            USING ERRCODE = '22023',
                  HINT = 'use a non-empty key of at most 512 bytes, or NULL for unordered events';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > 1048576 THEN
        RAISE EXCEPTION 'ferry: invalid event payload: % bytes, the limit is 1048576', octet_length(p_payload)
            USING ERRCODE = '22023',
                  HINT = 'store large bodies elsewhere and put a reference in the event';
    END IF;
    IF p_headers IS NULL OR jsonb_typeof(p_headers) <> 'object'
       OR (p_headers <> '{}'::jsonb
           AND EXISTS (SELECT 1 FROM jsonb_each(p_headers) h WHERE jsonb_typeof(h.value) <> 'string')) THEN
        RAISE EXCEPTION 'ferry: invalid event headers: %', p_headers
            USING ERRCODE = '22023',
                  HINT = 'headers must be a JSON object whose values are strings';
    END IF;
    IF p_dispatch_key IS NOT NULL THEN
        IF p_dispatch_key = '' OR octet_length(p_dispatch_key) > 512 THEN
            RAISE EXCEPTION 'ferry: invalid dispatch key: % bytes', octet_length(p_dispatch_key)
                USING ERRCODE = '22023', HINT = 'use a non-empty dispatch key of at most 512 bytes';
        END IF;
        SELECT e.id INTO v_existing FROM ferry.events e WHERE e.dispatch_key = p_dispatch_key;
        IF FOUND THEN
            RETURN v_existing;
        END IF;
    END IF;
    -- Held to commit: a second producer of this key waits here, so it draws
    -- a later seq only after this transaction's events are visible.
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1178948185, hashtext(p_key));
    END IF;
    v_partition := ferry.partition_of(p_key, p_id);
    INSERT INTO ferry.events (id, type, key, partition, payload, content_type, headers, dispatch_key)
    VALUES (p_id, p_type, p_key, v_partition, p_payload, coalesce(p_content_type, 'application/json'),
            p_headers, p_dispatch_key)
    ON CONFLICT (dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
    RETURNING seq INTO v_seq;
    IF v_seq IS NULL THEN
        -- A concurrent transaction committed the same dispatch key first.
        SELECT e.id INTO v_existing FROM ferry.events e WHERE e.dispatch_key = p_dispatch_key;
        RETURN v_existing;
    END IF;
    INSERT INTO ferry.unrouted (seq, partition) VALUES (v_seq, v_partition);
    -- NOTIFY takes a global lock at commit, so only pay for it when a relay
    -- sleeps; a busy relay polls on its own.
    IF EXISTS (SELECT 1 FROM ferry.relays r WHERE r.sleeping) THEN
        PERFORM pg_notify('ferry', v_partition::text);
    END IF;
    RETURN p_id;
END
$$;

-- The SQL door for producers in any language, inside their own transaction.
CREATE FUNCTION ferry.enqueue(
    event_type text, key text, payload jsonb,
    headers jsonb DEFAULT '{}', dispatch_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE sql AS $$
    SELECT ferry._enqueue(ferry.uuid_v7(), event_type, key, convert_to(payload::text, 'UTF8'),
                          'application/json', coalesce(headers, '{}'::jsonb), dispatch_key)
$$;

-- Applies a batch of outcomes of one route: each only if its delivery is
-- still pending with the attempt count the relay saw, and its partition is
-- still leased to this relay under the token it was granted (the partition
-- rows are share-locked, so a takeover waits for this transaction). Failed
-- attempts are logged to `failures`. Returns how many outcomes applied.
--
-- One primary-key update per outcome, on purpose: as a single set-based
-- UPDATE the plan depends on statistics, and on a table that just took a
-- burst of inserts (or with a generic plan) it degrades to a scan per
-- outcome, seconds per batch.
--
-- The commit is asynchronous: if the database crashes before the WAL flush,
-- the outcomes are lost together and the relay publishes those events
-- again; a duplicate, never a loss (ARCHITECTURE.md, "Durability of the
-- relay's own writes").
CREATE FUNCTION ferry.record_outcomes(
    p_relay text, p_partitions int[], p_tokens bigint[], p_route text,
    p_seq bigint[], p_expected int[], p_state text[], p_attempts int[],
    p_next_at timestamptz[], p_error text[], p_published_at timestamptz[], p_now timestamptz
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_fenced int[];
    v_applied bigint := 0;
    v_rows int;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT coalesce(array_agg(f.partition), '{}') INTO v_fenced
      FROM (SELECT p.partition
              FROM ferry.partitions p
              JOIN unnest(p_partitions, p_tokens) AS l(partition, token)
                ON l.partition = p.partition AND l.token = p.token
             WHERE p.owner = p_relay
               FOR SHARE OF p) f;
    IF cardinality(v_fenced) = 0 THEN
        RETURN 0;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_seq), 0) LOOP
        UPDATE ferry.deliveries d
           SET state = p_state[i],
               attempts = p_attempts[i],
               next_attempt_at = coalesce(p_next_at[i], d.next_attempt_at),
               last_error = coalesce(p_error[i], d.last_error),
               published_at = p_published_at[i],
               updated_at = p_now
         WHERE d.seq = p_seq[i] AND d.route = p_route
           AND d.state = 'pending' AND d.attempts = p_expected[i]
           AND d.partition = ANY (v_fenced);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows > 0 THEN
            v_applied := v_applied + 1;
            IF p_state[i] <> 'published' THEN
                INSERT INTO ferry.failures (seq, route, attempt, at, dead, error)
                VALUES (p_seq[i], p_route, p_attempts[i], p_now, p_state[i] = 'dead', p_error[i])
                ON CONFLICT DO NOTHING;
            END IF;
        END IF;
    END LOOP;
    RETURN v_applied;
END
$$;

-- One relay heartbeat: renew this relay's leases, release what it hands
-- back, and take free or expired partitions up to its fair share.
CREATE FUNCTION ferry.relay_tick(p_relay text, p_lease interval, p_release int[])
RETURNS TABLE (partition int, token bigint, live_relays int, total_partitions int)
LANGUAGE plpgsql AS $$
DECLARE
    v_live int;
    v_total int;
    v_fair int;
    v_owned int;
BEGIN
    INSERT INTO ferry.relays AS r (id) VALUES (p_relay)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now();
    DELETE FROM ferry.relays r WHERE r.heartbeat_at < now() - greatest(p_lease * 10, interval '10 minutes');
    UPDATE ferry.partitions p SET owner = NULL, expires_at = NULL
     WHERE p.owner = p_relay AND p.partition = ANY(p_release);
    UPDATE ferry.partitions p SET expires_at = now() + p_lease WHERE p.owner = p_relay;
    SELECT count(*) INTO v_live FROM ferry.relays r WHERE r.heartbeat_at > now() - p_lease;
    SELECT count(*) INTO v_total FROM ferry.partitions;
    v_fair := ceil(v_total::numeric / greatest(v_live, 1));
    SELECT count(*) INTO v_owned FROM ferry.partitions p WHERE p.owner = p_relay;
    IF v_owned < v_fair THEN
        UPDATE ferry.partitions p
           SET owner = p_relay, token = p.token + 1, expires_at = now() + p_lease, acquired_at = now()
         WHERE p.partition IN (
               SELECT q.partition FROM ferry.partitions q
                WHERE q.owner IS NULL OR q.expires_at < now()
                ORDER BY q.partition
                LIMIT v_fair - v_owned
                FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN QUERY
        SELECT p.partition, p.token, v_live, v_total
          FROM ferry.partitions p WHERE p.owner = p_relay ORDER BY p.partition;
END
$$;

-- Many events in one round trip, in the given order.
CREATE FUNCTION ferry._enqueue_batch(
    p_ids uuid[], p_types text[], p_keys text[], p_payloads bytea[],
    p_content_types text[], p_headers jsonb[], p_dispatch_keys text[]
) RETURNS uuid[]
LANGUAGE plpgsql AS $$
DECLARE
    v_out uuid[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP
        v_out := v_out || ferry._enqueue(p_ids[i], p_types[i], p_keys[i], p_payloads[i],
                                         p_content_types[i], p_headers[i], p_dispatch_keys[i]);
    END LOOP;
    RETURN v_out;
END
$$;
