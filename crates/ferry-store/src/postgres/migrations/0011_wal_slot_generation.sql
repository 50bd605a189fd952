-- WAL streaming: what a slot's record must remember across relays and
-- restarts while a slot is replaced.
--
-- generation  bumped each time the record is reset for a new slot. A relay
--             marks the slot ready (its sweep done) only for the generation
--             it swept: a relay whose slot was replaced while it swept must
--             not mark the new slot ready, or a relay that crashes before
--             its own sweep of the new slot is done would leave the rows
--             committed before that slot unrouted for good.
-- lost        why the slot a relay had streamed from was replaced ('lost':
--             PostgreSQL invalidated it; 'vanished': it was gone), until a
--             relay that has a slot again reports it. Written in the reset
--             itself, so a relay killed between the reset and the new slot
--             leaves the report to the next one.
ALTER TABLE ferry.wal_slots
    ADD COLUMN generation bigint NOT NULL DEFAULT 0,
    ADD COLUMN lost text CHECK (lost IN ('lost', 'vanished'));
