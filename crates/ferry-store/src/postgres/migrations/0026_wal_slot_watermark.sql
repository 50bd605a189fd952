-- WAL streaming: which slot a record speaks of.
--
-- A record names its slot, but a slot dropped and made anew under the same
-- name (by hand, as OPERATIONS.md has an administrator make the first one)
-- is another slot: it streams only what commits after it was made, and
-- rows still unrouted then must be swept, its tableless events may be
-- lost, and a retirement does not carry over to it. PostgreSQL gives a
-- slot no identity to tell it by, but a new slot starts at the WAL
-- position of its making, ahead of every position written before, and a
-- slot moves only as far as its readers confirm. So the relays confirm a
-- position only once it is recorded here: a slot found confirmed past
-- every position recorded for it is not the one they streamed.
--
-- watermark             a position the relay may confirm to the slot; the
--                       slot's confirmed position never passes it (nor
--                       `settled_lsn`, a position of the same slot).
--                       Written when the relay makes the slot, when it
--                       opens a stream, and as its confirmations move on.
-- watermark_generation  the generation `watermark` belongs to: a record
--                       reset by a relay of an earlier release keeps a
--                       watermark of the slot before, which says nothing
--                       of the new one. NULL while nobody can tell (a
--                       record of an earlier release, or a relay of one
--                       streaming, which confirms without recording).
-- watermark_pid         the walsender of the stream that keeps the
--                       watermark: a slot active under another process is
--                       read by a relay of an earlier release.
ALTER TABLE ferry.wal_slots
    ADD COLUMN watermark bigint,
    ADD COLUMN watermark_generation bigint,
    ADD COLUMN watermark_pid integer;
