//! Which slot a record speaks of (migration 0026).
//!
//! PostgreSQL gives a replication slot no identity beyond its name: one
//! dropped and made anew under the same name looks the same. But a slot
//! moves only as far as its readers confirm, and a new one starts at the
//! WAL position of its making, ahead of every position written before. So
//! the relays confirm a position to the slot only once it is recorded (the
//! watermark), and a slot found confirmed past every position recorded for
//! it is not the one they streamed: [`judge`] resets the record for it as
//! for a new slot. A crash of the server takes a slot back, never forward,
//! so the slot the relays streamed is never taken for another.

use std::time::Duration;

use ferry_core::StoreError;
use sqlx::{PgConnection, PgPool};
use tokio::time::Instant;

use crate::postgres::store_error;

/// The watermark moves at most this often while the stream moves on by
/// more than [`SMALL`]...
const RAISE_EVERY: Duration = Duration::from_secs(1);
/// ...and at most this often while it moves on by less: the raise is a
/// write, which moves the WAL on a little, which the slot then reports as
/// a position to confirm. Idle, the relay writes once in this while.
const RAISE_SMALL_EVERY: Duration = Duration::from_secs(10);
const SMALL: u64 = 1 << 20;
/// A raise slower than this is given up and tried again later; meanwhile
/// the slot is confirmed only as far as the watermark already allows.
const RAISE_TIMEOUT: Duration = Duration::from_secs(5);

/// Records that this relay made `slot`, confirmed at `start`: the record
/// speaks of it from now on.
pub(super) async fn made(conn: &mut PgConnection, slot: &str, start: i64) -> Result<(), StoreError> {
    sqlx::query(
        // Never lowered: a relay streaming the new slot may have raised it
        // already.
        "UPDATE ferry.wal_slots \
            SET watermark = greatest(CASE WHEN watermark_generation = generation THEN watermark END, $2), \
                watermark_generation = generation, watermark_pid = NULL \
          WHERE slot = $1",
    )
    .bind(slot)
    .bind(start)
    .execute(conn)
    .await
    .map_err(store_error)?;
    Ok(())
}

/// Tells whether the slot that exists is the one the record speaks of, and
/// if not, resets the record as for a slot made anew: its sweep to do, a
/// retirement gone with the old slot, and the old slot's loss reported if it
/// had streamed (`vanished`: it was dropped). A slot moved on by someone
/// else (`pg_replication_slot_advance`) skipped what it passed, and is
/// swept the same way.
///
/// Only a slot nobody streams from is judged. An active one is read by a
/// relay that judged it when its stream opened ([`Keeper::adopt`]) or, when
/// its walsender is not the one the record names, by a relay of an earlier
/// release, which confirms without recording: the watermark then says
/// nothing until a relay of this release streams again, and is set aside.
/// Without a watermark (a record of an earlier release, a slot made by
/// hand, or one just judged new) nothing is judged, and the slot, taken as
/// it is, gets one.
pub(super) async fn judge(conn: &mut PgConnection, slot: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE ferry.wal_slots w SET watermark_generation = NULL \
           FROM pg_replication_slots s \
          WHERE w.slot = $1 AND s.slot_name = w.slot AND s.active AND w.watermark_generation IS NOT NULL \
            AND s.active_pid IS DISTINCT FROM w.watermark_pid",
    )
    .bind(slot)
    .execute(&mut *conn)
    .await
    .map_err(store_error)?;
    sqlx::query(
        "UPDATE ferry.wal_slots w SET ready = false, retired = false, settled_lsn = NULL, part_lsn = NULL, \
                part_events = NULL, generation = w.generation + 1, \
                lost = coalesce(w.lost, CASE WHEN w.ready THEN 'vanished' END), \
                watermark = NULL, watermark_generation = NULL, watermark_pid = NULL \
           FROM pg_replication_slots s \
          WHERE w.slot = $1 AND s.slot_name = w.slot AND NOT s.active \
            AND w.watermark_generation = w.generation \
            AND (s.confirmed_flush_lsn - '0/0'::pg_lsn) > greatest(w.watermark, w.settled_lsn)",
    )
    .bind(slot)
    .execute(&mut *conn)
    .await
    .map_err(store_error)?;
    sqlx::query(
        "UPDATE ferry.wal_slots w \
            SET watermark = greatest(w.settled_lsn, (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint), \
                watermark_generation = w.generation, watermark_pid = NULL \
           FROM pg_replication_slots s \
          WHERE w.slot = $1 AND s.slot_name = w.slot AND NOT s.active \
            AND w.watermark_generation IS DISTINCT FROM w.generation",
    )
    .bind(slot)
    .execute(&mut *conn)
    .await
    .map_err(store_error)?;
    Ok(())
}

/// Keeps a stream's confirmations at or below the watermark, raising it
/// as the relay settles more: a position is confirmed to the slot only
/// once it is recorded, durably (a server crash that kept the slot's
/// position but lost the record would make the slot look made anew).
pub(super) struct Keeper {
    pool: PgPool,
    slot: String,
    generation: i64,
    /// How far the slot may be confirmed: the watermark as last written.
    recorded: u64,
    /// How far the relay has settled, and would confirm.
    wanted: u64,
    raised_at: Option<Instant>,
}

impl Keeper {
    /// Takes the slot, which this session now streams from, as the one of
    /// `generation`'s record, unless it is confirmed past every position
    /// recorded for it (`None`: made anew since). A record without a
    /// watermark for its generation (of an earlier release, or one whose
    /// slot a relay of such a release read) takes the slot as it is.
    pub(super) async fn adopt(pool: &PgPool, slot: &str, generation: i64) -> Result<Option<Keeper>, StoreError> {
        let recorded: Option<i64> = sqlx::query_scalar(
            "UPDATE ferry.wal_slots w \
                SET watermark = greatest(CASE WHEN w.watermark_generation = w.generation THEN w.watermark END, \
                                         w.settled_lsn, s.confirmed), \
                    watermark_generation = w.generation, watermark_pid = s.active_pid \
               FROM (SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS confirmed, active_pid \
                       FROM pg_replication_slots WHERE slot_name = $1) s \
              WHERE w.slot = $1 AND w.generation = $2 \
                AND (w.watermark_generation IS DISTINCT FROM w.generation \
                     OR greatest(w.watermark, w.settled_lsn) IS NULL \
                     OR s.confirmed <= greatest(w.watermark, w.settled_lsn)) \
             RETURNING w.watermark",
        )
        .bind(slot)
        .bind(generation)
        .fetch_optional(pool)
        .await
        .map_err(store_error)?
        .flatten();
        Ok(recorded.map(|recorded| Keeper {
            pool: pool.clone(),
            slot: slot.to_owned(),
            generation,
            recorded: recorded.max(0) as u64,
            wanted: 0,
            raised_at: None,
        }))
    }

    /// The relay has settled everything before `lsn`.
    pub(super) fn want(&mut self, lsn: u64) {
        self.wanted = self.wanted.max(lsn);
    }

    /// How far the slot may be confirmed now.
    pub(super) fn confirmable(&self) -> u64 {
        self.wanted.min(self.recorded)
    }

    /// When the watermark is next to be raised, if the relay has settled
    /// past it.
    pub(super) fn due(&self) -> Option<Instant> {
        if self.wanted <= self.recorded {
            return None;
        }
        let every = if self.wanted - self.recorded >= SMALL {
            RAISE_EVERY
        } else {
            RAISE_SMALL_EVERY
        };
        Some(self.raised_at.map_or_else(Instant::now, |at| at + every))
    }

    /// Records the watermark up to what the relay has settled; `false`
    /// when it could not, and the slot is confirmed no further: the record
    /// could not be written (the database unreachable, or shutting down),
    /// or it has moved on to another generation (the slot replaced). The
    /// stream must then end: a walsender told to stop waits for its client
    /// to confirm everything sent, so a stream kept open below the
    /// watermark would hold a clean shutdown of the server for ever.
    pub(super) async fn raise(&mut self) -> bool {
        self.raised_at = Some(Instant::now());
        // The commit must be durable before the position is confirmed, even
        // where commits default to asynchronous: see settle.rs.
        let raised = sqlx::query_scalar::<_, Option<i64>>(
            "UPDATE ferry.wal_slots \
                SET watermark = greatest(CASE WHEN watermark_generation = generation THEN watermark END, $3), \
                    watermark_generation = generation, \
                    watermark_pid = coalesce((SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1), \
                                             watermark_pid) \
               FROM (SELECT CASE WHEN current_setting('synchronous_commit') = 'off' \
                                 THEN set_config('synchronous_commit', 'local', true) END) durable \
              WHERE slot = $1 AND generation = $2 \
             RETURNING greatest(watermark, settled_lsn)",
        )
        .bind(&self.slot)
        .bind(self.generation)
        // The same 64 bits: WAL positions stay far below 2^63.
        .bind(self.wanted as i64)
        .fetch_optional(&self.pool);
        match tokio::time::timeout(RAISE_TIMEOUT, raised).await {
            Ok(Ok(Some(Some(recorded)))) => {
                self.recorded = self.recorded.max(recorded.max(0) as u64);
                return true;
            }
            Ok(Ok(_)) => {
                tracing::info!(slot = %self.slot, "the slot's record has moved on to a new slot; ending this stream")
            }
            Ok(Err(e)) => tracing::warn!(
                slot = %self.slot,
                error = %e,
                "could not record the slot's watermark; ending the stream, to stream again once it can be"
            ),
            Err(_) => tracing::warn!(
                slot = %self.slot,
                "recording the slot's watermark took over {RAISE_TIMEOUT:?}; ending the stream, to stream again once \
                 it can be"
            ),
        }
        false
    }
}
