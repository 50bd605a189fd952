-- Relays: a hand-back frees a partition only under the token it was held by.
--
-- ferry.relay_tick(p_relay, p_lease, p_release) frees every partition of
-- p_release that p_relay owns, whatever its token. A relay waited on a tick
-- handing partitions back however long it took: given up on, the tick could
-- still run on the server much later (a connection gone silent delivers it
-- when it recovers), after the relay had taken some of those partitions
-- again under a new token, and it would free them while the relay still
-- worked them, for another relay to take and publish beside it. A
-- connection gone silent during a hand-back then held the relay for ever:
-- no renewal, no work, until it was restarted.
--
-- This overload takes the token each partition was held under
-- (p_release_tokens, index for index with p_release) and frees a partition
-- only where the owner and the token both still match; one taken again
-- since, by this relay or another, is left as it is. A late hand-back can
-- then do no harm, and the relay bounds it like a renewal. The body is
-- 0001's but for the release condition and the renewal: a lease of this
-- relay that had expired (a restarted relay keeping its relay.id waits its
-- old leases out, then renews them) is renewed under a new token, so that
-- a hand-back of the earlier run, sent under the old token and delivered
-- late, cannot free it either.
--
-- The three-argument function stays: a relay of an earlier release still
-- calls it during a rolling upgrade.

CREATE FUNCTION ferry.relay_tick(p_relay text, p_lease interval, p_release int[], p_release_tokens bigint[])
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
     WHERE p.owner = p_relay
       AND (p.partition, p.token) IN (SELECT b.partition, b.token
                                        FROM unnest(p_release, p_release_tokens) AS b(partition, token));
    -- A lease that had expired is renewed under a new token, as if taken
    -- again: a hand-back sent under the old one (by an earlier run of this
    -- relay.id, given up on) must not free it when it reaches the server.
    UPDATE ferry.partitions p
       SET expires_at = now() + p_lease,
           token = p.token + CASE WHEN p.expires_at < now() THEN 1 ELSE 0 END
     WHERE p.owner = p_relay;
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
