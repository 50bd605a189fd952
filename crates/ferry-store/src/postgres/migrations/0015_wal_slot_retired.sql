-- WAL streaming: a slot taken out of use by `ferry wal retire`.
--
-- retired  set by retire, which also clears `ready`: ferry.emit writes
--          outbox rows from then on. A relay still streaming from the slot
--          (or one that reconnects, or a standby taking over) sweeps and
--          streams as before but never marks it ready again, so that the
--          slot can be dropped without a tableless event in it. Cleared
--          when the record is reset for a new slot of the same name.
ALTER TABLE ferry.wal_slots ADD COLUMN retired boolean NOT NULL DEFAULT false;
