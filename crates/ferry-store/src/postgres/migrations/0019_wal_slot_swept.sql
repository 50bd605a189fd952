-- WAL streaming: whether the sweep of a slot's generation is done.
--
-- swept  set with `ready` once a relay has swept into the table path what
--        was committed before the slot existed; cleared with it when the
--        record is reset for a new slot. Unlike `ready`, `ferry wal retire`
--        leaves it alone: a relay reconnecting to a retired slot must not
--        sweep again, or an outbox row written after the retirement (the
--        fallback of ferry.emit) would be routed ahead of an older tableless
--        event of the same key that the slot still holds.
--
-- A record written before this column existed is taken as swept when it is
-- ready. A retired one cannot tell: it is swept again, as before.
ALTER TABLE ferry.wal_slots ADD COLUMN swept boolean NOT NULL DEFAULT false;
UPDATE ferry.wal_slots SET swept = ready;
