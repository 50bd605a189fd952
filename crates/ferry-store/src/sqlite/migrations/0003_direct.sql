-- Direct delivery: the relay publishes new events straight from the outbox
-- and writes their delivery rows afterwards. A new event of a key waits in
-- the table behind a delivery of the same key and route that is pending or
-- dead; this index answers "which routes hold this key" per event.
CREATE INDEX ferry_deliveries_held ON ferry_deliveries (key, route)
    WHERE key IS NOT NULL AND state IN ('pending', 'dead');
