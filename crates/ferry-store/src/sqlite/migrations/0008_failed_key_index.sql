-- Dead and cancelled deliveries by key, for retention's order marks.
-- Mirrors `deliveries_failed_key` (PostgreSQL migration 32); see there.
CREATE INDEX ferry_deliveries_failed_key ON ferry_deliveries (key, seq)
    WHERE key IS NOT NULL AND state IN ('dead', 'cancelled');
