-- Dead and cancelled deliveries by key. Retention's order marks
-- (`retention_kept.sql`) ask, for each key of a batch about to be deleted,
-- whether a dead or cancelled delivery of it is kept before the batch.
-- Through `deliveries_dead` (by route and seq) that read went over every
-- dead and cancelled delivery older than the batch, and each was compared
-- with every key of the batch: with `dead_window = "never"`, the default,
-- a cost that grew with the outbox's history (0.4 s a batch at 70,000 kept
-- dead deliveries under a generic plan), paid under retention's lock. By
-- key, it reads only the batch's keys.
--
-- Building it reads the whole table once and holds writes to deliveries
-- off for as long as that takes (see the upgrade notes).
CREATE INDEX deliveries_failed_key ON ferry.deliveries (key, seq)
    WHERE key IS NOT NULL AND state IN ('dead', 'cancelled');
