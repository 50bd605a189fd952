-- WAL streaming: which slot's sweep is done.
--
-- swept_generation  the generation whose sweep is done: set with `ready`
--                   by the relay that swept. Unlike `ready`, `ferry wal
--                   retire` leaves it alone: a relay reconnecting to a
--                   retired slot must not sweep again, or an outbox row
--                   written after the retirement (the fallback of
--                   ferry.emit) would be routed ahead of an older tableless
--                   event of the same key that the slot still holds. A
--                   generation, not a flag: a record reset for a new slot
--                   (by any release, one that does not know this column
--                   included) bumps the generation, and the new slot is
--                   unswept however the record was reset.
--
-- A record written before this column existed is taken as swept when it is
-- ready. A retired one cannot tell: it is swept again, as before.
ALTER TABLE ferry.wal_slots ADD COLUMN swept_generation bigint;
UPDATE ferry.wal_slots SET swept_generation = generation WHERE ready;
