//! WAL streaming: the outbox read from a logical replication slot.
//!
//! [`WalSource`] holds what the relay needs from the database in this mode:
//! the slot and publication it streams from ([`WalSource::prepare`]), the
//! replication connection ([`WalSource::open`], yielding committed
//! transactions in commit order), and the writes that settle a streamed
//! batch into the delivery table ([`WalSource::settle`]). The relay confirms
//! a position to the slot only after the batch up to it is settled, so a
//! crash replays from the last settled transaction and never skips one.
//!
//! [`emit`] is the tableless producer: the event travels as a logical
//! decoding message and is written to the outbox only if its delivery fails.

mod decode;
mod diagnose;
mod gone;
mod missed;
mod publication;
mod settle;
mod watermark;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{Event, EventId, StoreError};
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};

use crate::postgres::{EnqueueError, store_error};

pub use decode::{PART_BYTES, PART_EVENTS, UNDECODABLE_TYPE, WalEvent, WalTxn};
pub use diagnose::{Finding, diagnose};
pub use gone::unreachable;
pub use missed::Mark;
use publication::{Stall, publication_fault};
pub use settle::{Look, Outcome, Settled, Settlement};

/// Where a relay in WAL mode streams from.
#[derive(Clone)]
pub struct WalConfig {
    /// The database URL (`postgres://user:password@host:port/db`); the
    /// replication connection uses the same credentials and TLS mode.
    pub url: String,
    /// The logical replication slot; created on first use.
    pub slot: String,
    /// The publication on `ferry.events`; created on first use.
    pub publication: String,
}

// The URL carries the password: the relay's own Debug output hides it.
impl std::fmt::Debug for WalConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalConfig")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .finish()
    }
}

/// A replication slot or publication name PostgreSQL accepts unquoted.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// What [`WalSource::prepare`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared {
    /// The events committed before the slot existed still wait for their
    /// sweep into the table path.
    pub unswept: bool,
    /// A slot that had streamed was lost, and a new one made in its place.
    /// Reported once, by the first relay to have a slot again, however many
    /// attempts (or relays) it took to make it.
    pub replaced: Option<SlotLoss>,
    /// Which slot this is: bumped each time a slot replaces another, for
    /// [`WalSource::mark_swept`].
    pub generation: i64,
    /// The slot is [`retire`]d: `ferry.emit` writes outbox rows, and the
    /// slot is never marked ready again.
    pub retired: bool,
}

/// How the slot a relay had streamed from was lost. Whichever way, the outbox
/// rows are safe (the new slot's sweep delivers them), but tableless events
/// the old slot had not yet handed over, and those whose failed delivery the
/// relay had not yet written to the outbox, are gone: they lived only in
/// the slot's WAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotLoss {
    /// PostgreSQL invalidated it (`wal_status = lost`): it removed WAL the
    /// slot still needed, past `max_slot_wal_keep_size`.
    Lost,
    /// It no longer exists, though `ferry.wal_slots` says it had streamed:
    /// a failover to a standby (before PostgreSQL 17 slots exist only on
    /// the primary), a restore from backup, or a drop by hand, whether or
    /// not a slot of the same name was made anew since.
    Vanished,
    /// It stopped at a change committed while its publication did not
    /// exist (dropped by hand, say, and made again): PostgreSQL before 18
    /// decodes each change against the publications of its time, so the
    /// slot could never stream past it. Reported by the relay that replaced
    /// it only: `ferry.wal_slots.lost` does not record it.
    Unpublished,
}

impl SlotLoss {
    fn parse(label: &str) -> Option<SlotLoss> {
        match label {
            "lost" => Some(SlotLoss::Lost),
            "vanished" => Some(SlotLoss::Vanished),
            _ => None,
        }
    }

    /// A label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            SlotLoss::Lost => "lost",
            SlotLoss::Vanished => "vanished",
            SlotLoss::Unpublished => "unpublished",
        }
    }
}

impl std::fmt::Display for SlotLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SlotLoss::Lost => {
                "PostgreSQL invalidated the replication slot (wal_status = lost: it removed WAL the slot \
                 still needed, see max_slot_wal_keep_size)"
            }
            SlotLoss::Vanished => {
                "the replication slot is gone though it had streamed (a failover to a standby, a restore \
                 from backup, or a drop by hand; a slot of the same name made since is a new one)"
            }
            SlotLoss::Unpublished => {
                "the replication slot stopped at a change committed while its publication did not exist, and \
                 can never stream past it (PostgreSQL reads the publication as of each change, even once it is \
                 made again)"
            }
        })
    }
}

/// The database side of WAL streaming mode.
#[derive(Debug, Clone)]
pub struct WalSource {
    pool: PgPool,
    config: WalConfig,
    read_ahead: usize,
    /// Set by a stream of this source that the server ended at a change
    /// committed while the publication did not exist, or when the
    /// publication was found missing beside the slot (PostgreSQL before
    /// 18); the next [`prepare`](Self::prepare) replaces the slot.
    stalled: Arc<Mutex<Option<Stall>>>,
    /// A slot this source dropped as [`SlotLoss::Unpublished`], not yet
    /// told in a [`Prepared`]: a `prepare` that fails after the drop leaves
    /// it for the next one.
    unreported: Arc<AtomicBool>,
    /// The walsender of this source's last session. A session ended in a
    /// hurry ([`WalStream::abandon`]) closes its connection at once, but
    /// the server takes a moment to end that walsender and free the slot:
    /// the next [`open`](Self::open) waits for it rather than take it for
    /// another relay's.
    walsender: Arc<Mutex<Option<i32>>>,
}

/// How many bytes of change data a stream reads ahead of the relay, by
/// default: enough to keep a fast relay fed, a small share of its memory
/// however large the events in the backlog.
pub const READ_AHEAD_BYTES: usize = 64 * 1024 * 1024;

/// Messages the replication client itself buffers; the byte budget bounds
/// what is read beyond them.
const CLIENT_BUFFER_EVENTS: usize = 8;

impl WalSource {
    /// Checks the names; connects nothing yet.
    pub fn new(pool: PgPool, config: WalConfig) -> Result<Self, StoreError> {
        for (field, name) in [("wal_slot", &config.slot), ("wal_publication", &config.publication)] {
            if !valid_name(name) {
                return Err(StoreError::config(format!(
                    "[relay] {field} = {name:?}: use 1 to 63 characters of a-z, 0-9 and _"
                )));
            }
        }
        Ok(Self {
            pool,
            config,
            read_ahead: READ_AHEAD_BYTES,
            stalled: Arc::default(),
            unreported: Arc::default(),
            walsender: Arc::default(),
        })
    }

    /// Bounds the change data a stream reads ahead of the relay to about
    /// `bytes` (one message over it is still read whole). The server waits,
    /// holding the rest in its WAL, while the relay catches up.
    pub fn with_read_ahead(mut self, bytes: usize) -> Self {
        self.read_ahead = bytes.clamp(1, u32::MAX as usize);
        self
    }

    pub fn config(&self) -> &WalConfig {
        &self.config
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates the publication and the slot when they are missing, after
    /// checking that the server can stream at all. A configuration problem
    /// comes back as a `Config` error naming the fix. Says whether the
    /// events committed before the slot existed still wait for their sweep
    /// ([`unrouted`](Self::unrouted), then [`mark_swept`](Self::mark_swept)),
    /// and whether a slot that had streamed was lost and replaced.
    ///
    /// A slot PostgreSQL invalidated (`wal_status = lost`: it removed WAL
    /// the slot still needed) can never stream again, and until it is gone
    /// every outbox row waits in `unrouted` undelivered. So it is dropped
    /// and made anew here, which sweeps those rows into the table path.
    /// Tableless events of the lost WAL are gone either way; the caller
    /// reports the loss ([`SlotLoss`]).
    ///
    /// A slot that exists may still not be the one the record speaks of:
    /// dropped and made anew under the same name (by hand, say, before any
    /// relay ran), it streams only what commits after it was made. It is
    /// told apart by its position (see `watermark.rs`) and taken as a new
    /// slot: swept, its predecessor's loss reported if that had streamed,
    /// and not retired.
    ///
    /// A slot a stream of this source found stopped at a change committed
    /// while the publication did not exist ([`SlotLoss::Unpublished`]) is
    /// replaced the same way: it can never stream past that change. So is
    /// one found beside a missing publication, here or by
    /// [`check_publication`](Self::check_publication), on PostgreSQL before
    /// 18 (see [`publication_missing`](Self::publication_missing)).
    pub async fn prepare(&self) -> Result<Prepared, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let wal_level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        if wal_level != "logical" {
            return Err(StoreError::config(format!(
                "wal_level is {wal_level}; WAL streaming needs logical: run ALTER SYSTEM SET wal_level = logical \
                 and restart PostgreSQL, or set [relay] mode = \"poll\""
            )));
        }
        let WalConfig { slot, publication, .. } = &self.config;
        if let Some(other) = emit_slots(&self.pool, Some(slot)).await?.first() {
            return Err(StoreError::config(another_slot(other, slot)));
        }
        let (has_publication, has_slot): (bool, bool) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1), \
                    EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $2)",
        )
        .bind(publication)
        .bind(slot)
        .fetch_one(&mut *conn)
        .await
        .map_err(store_error)?;
        if !has_publication && has_slot {
            // Said where the cause is seen: the stream, if it stops, says
            // only where.
            tracing::error!(
                slot = %slot,
                publication = %publication,
                "publication {publication} does not exist, though replication slot {slot} does (dropped by \
                 hand?); the relay makes it again, and every outbox row not yet delivered is swept into the \
                 table path, since none committed while it was missing is ever streamed. Before PostgreSQL 18 \
                 the slot can never stream past a change committed meanwhile: the relay replaces it, and \
                 tableless events it holds past that change are lost. Drop the publication only with the \
                 slot (see the operations guide, \"WAL streaming\")"
            );
            self.publication_missing(&mut conn).await?;
        }
        // Before the publication is made again, if it is missing: the new
        // slot must start where every change decodes.
        self.replace_stalled(&mut conn).await?;
        if self.stalled.lock().expect("not poisoned").is_some() {
            // Held by a walsender a moment longer, say: swept now, it would
            // be marked ready, and tableless events written into WAL it can
            // never stream.
            return Err(StoreError::transient(format!(
                "replication slot {slot} cannot stream on and is not dropped yet (still in use?); the relay \
                 replaces it at its next attempt"
            )));
        }
        if !has_publication {
            // Two relays starting at once may both try; the loser's error is harmless.
            let made = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE PUBLICATION {publication} FOR TABLE ferry.events WITH (publish = 'insert')"
            )))
            .execute(&mut *conn)
            .await;
            if let Err(e) = made
                && !already_exists(&e)
            {
                return Err(explain(e, "create the publication"));
            }
        }
        self.check_publication().await?;
        type SlotRow = (Option<String>, Option<String>, Option<String>);
        const SLOT_ROW: &str =
            "SELECT database::text, plugin::text, wal_status FROM pg_replication_slots WHERE slot_name = $1";
        let mut slot_row: Option<SlotRow> = sqlx::query_as(SLOT_ROW)
            .bind(slot)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store_error)?;
        let here: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        if let Some((db, plugin, status)) = &slot_row {
            if db.as_deref() != Some(here.as_str()) || plugin.as_deref() != Some("pgoutput") {
                return Err(StoreError::config(format!(
                    "replication slot {slot} exists but is not a pgoutput slot of database {here} \
                     (database {db:?}, plugin {plugin:?}); choose another [relay] wal_slot"
                )));
            }
            if status.as_deref() == Some("lost") {
                // Reset the record (ferry.emit writes outbox rows while the
                // slot is lost anyway) and note the loss for whichever relay
                // makes the new slot, then drop it. Both only while it is
                // still the lost one: another relay may have replaced it
                // meanwhile, and its new slot must survive.
                sqlx::query(
                    "UPDATE ferry.wal_slots SET ready = false, retired = false, settled_lsn = NULL, \
                            part_lsn = NULL, part_events = NULL, generation = generation + 1, lost = coalesce(lost, 'lost'), \
                            watermark = NULL, watermark_generation = NULL, watermark_pid = NULL \
                      WHERE slot = $1 AND EXISTS (SELECT 1 FROM pg_replication_slots \
                                                   WHERE slot_name = $1 AND wal_status = 'lost')",
                )
                .bind(slot)
                .execute(&mut *conn)
                .await
                .map_err(store_error)?;
                let dropped = sqlx::query(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                      WHERE slot_name = $1 AND wal_status = 'lost'",
                )
                .bind(slot)
                .execute(&mut *conn)
                .await;
                match dropped {
                    Ok(done) if done.rows_affected() == 1 => slot_row = None,
                    // Another relay dropped it first: take the slot as it
                    // is now, gone or made anew.
                    Ok(_) => {
                        slot_row = sqlx::query_as(SLOT_ROW)
                            .bind(slot)
                            .fetch_optional(&mut *conn)
                            .await
                            .map_err(store_error)?;
                    }
                    Err(e) if undefined_object(&e) => slot_row = None,
                    Err(e) => return Err(explain(e, "drop the lost replication slot")),
                }
            }
        }
        if slot_row.is_none() {
            // A new slot streams only what commits after it: whatever is
            // unrouted now must be swept before tableless events may be
            // written (they could overtake it). A record that says its slot
            // had streamed (`ready`) tells of a slot that vanished. Unless
            // another relay made the slot since we looked: it reset the
            // record itself before, and may have swept and marked it ready
            // already, which must stand.
            sqlx::query(
                "INSERT INTO ferry.wal_slots (slot, publication, ready) VALUES ($1, $2, false) \
                 ON CONFLICT (slot) DO UPDATE SET publication = EXCLUDED.publication, ready = false, \
                 retired = false, settled_lsn = NULL, part_lsn = NULL, part_events = NULL, \
                 watermark = NULL, watermark_generation = NULL, watermark_pid = NULL, \
                 generation = ferry.wal_slots.generation + 1, \
                 lost = coalesce(ferry.wal_slots.lost, CASE WHEN ferry.wal_slots.ready THEN 'vanished' END) \
                 WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots s \
                                    WHERE s.slot_name = EXCLUDED.slot AND s.wal_status IS DISTINCT FROM 'lost')",
            )
            .bind(slot)
            .bind(publication)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
            // The slot's confirmed position starts at its consistent point.
            let made: Result<i64, _> = sqlx::query_scalar(
                "SELECT (lsn - '0/0'::pg_lsn)::bigint FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            )
            .bind(slot)
            .fetch_one(&mut *conn)
            .await;
            match made {
                // This relay made it: the record speaks of it from now on.
                Ok(start) => watermark::made(&mut conn, slot, start).await?,
                Err(e) if already_exists(&e) => {}
                Err(e) => {
                    let mut err = explain(e, "create the replication slot");
                    // The record keeps the loss for the attempt that makes the
                    // slot; say it here too, where the operator looks now.
                    let lost: Option<String> = sqlx::query_scalar("SELECT lost FROM ferry.wal_slots WHERE slot = $1")
                        .bind(slot)
                        .fetch_optional(&mut *conn)
                        .await
                        .ok()
                        .flatten()
                        .flatten();
                    if let Some(loss) = lost.as_deref().and_then(SlotLoss::parse) {
                        err.message = format!("{}; before that, {loss}", err.message);
                    }
                    return Err(err);
                }
            }
        }
        // A slot made by hand (or by an administrator, see OPERATIONS.md)
        // has no record yet.
        sqlx::query("INSERT INTO ferry.wal_slots (slot, publication) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(slot)
            .bind(publication)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        // Dropped and made anew since a relay streamed from it, by hand
        // say, it is a new slot all the same.
        watermark::judge(&mut conn, slot).await?;
        // The slot exists: the first relay here since a loss reports it.
        let reported: Option<String> = sqlx::query_scalar(
            "UPDATE ferry.wal_slots w SET lost = NULL \
               FROM (SELECT slot, lost FROM ferry.wal_slots WHERE slot = $1 AND lost IS NOT NULL FOR UPDATE) old \
              WHERE w.slot = old.slot RETURNING old.lost",
        )
        .bind(slot)
        .fetch_optional(&mut *conn)
        .await
        .map_err(store_error)?;
        // Ready means swept too: a relay of the release before schema 19,
        // during a rolling upgrade, marks the slot ready only.
        let (swept, retired, generation): (bool, bool, i64) = sqlx::query_as(
            "SELECT ready OR coalesce(swept_generation = generation, false), retired, generation \
               FROM ferry.wal_slots WHERE slot = $1",
        )
        .bind(slot)
        .fetch_one(&mut *conn)
        .await
        .map_err(store_error)?;
        // One loss a time: an unpublished slot not told yet waits for the
        // next prepare.
        let replaced = match reported.as_deref().and_then(SlotLoss::parse) {
            Some(loss) => Some(loss),
            None => self
                .unreported
                .swap(false, Ordering::SeqCst)
                .then_some(SlotLoss::Unpublished),
        };
        Ok(Prepared {
            unswept: !swept,
            replaced,
            generation,
            retired,
        })
    }

    /// Records that the events committed before the slot existed are swept
    /// into the table path: from now on everything reaches the relay through
    /// the slot, and ferry.emit may write tableless events. Only for the
    /// slot `prepared` found: if the slot was replaced during the sweep, the
    /// new one is not swept yet, and this fails (transient) so that the
    /// relay starts over with it. A slot [`retire`]d stays not ready:
    /// returns `false`, and the relay streams on without tableless events.
    ///
    /// Two relays configured with different slot names that start at once
    /// both pass [`prepare`](Self::prepare)'s check; markings are taken one
    /// at a time, and the second is refused as `prepare` would refuse it.
    pub async fn mark_swept(&self, prepared: &Prepared) -> Result<bool, StoreError> {
        let slot = &self.config.slot;
        // Never ready a slot that is to be replaced: the tableless events
        // written then would be lost with it.
        if self.stalled.lock().expect("not poisoned").is_some() {
            return Err(StoreError::transient(format!(
                "replication slot {slot} cannot stream on and is to be replaced; starting over"
            )));
        }
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('ferry.wal_slots: mark ready'))")
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        if let Some(other) = emit_slots(&mut *tx, Some(slot)).await?.first() {
            return Err(StoreError::config(another_slot(other, slot)));
        }
        let marked: Option<bool> = sqlx::query_scalar(
            "UPDATE ferry.wal_slots SET ready = NOT retired, swept_generation = generation \
              WHERE slot = $1 AND generation = $2 RETURNING ready",
        )
        .bind(slot)
        .bind(prepared.generation)
        .fetch_optional(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        marked.ok_or_else(|| {
            StoreError::transient("the replication slot was replaced during the sweep; starting over with the new slot")
        })
    }

    /// Waits until every transaction writing in this database now has
    /// ended, then returns: call it once the slot exists, before the sweep.
    ///
    /// A new slot streams what commits after its consistent point; the sweep
    /// must see everything committed before. But a transaction is committed
    /// (its commit record written) a moment before other sessions can see
    /// it, and under synchronous replication that moment lasts until a
    /// standby confirms. A sweep in that moment would miss the transaction's
    /// rows, and the slot would never stream them: lost. Such a transaction
    /// still holds the lock on its own id, as does every other writer; once
    /// those are gone, a fresh snapshot sees all that the slot will not
    /// stream. Transactions prepared for two-phase commit hold theirs too.
    /// `waiting` hears the server process ids still waited for, every time
    /// they are read (about five times a second).
    pub async fn await_writers(&self, mut waiting: impl FnMut(&[i32])) -> Result<(), StoreError> {
        let writers: Vec<String> = sqlx::query_scalar(
            "SELECT l.transactionid::text FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
              WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted \
                AND l.pid IS DISTINCT FROM pg_backend_pid() \
                AND (a.datname = current_database() \
                     OR l.pid IS NULL AND l.transactionid IN (SELECT p.transaction FROM pg_prepared_xacts p \
                                                               WHERE p.database = current_database()))",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        if writers.is_empty() {
            return Ok(());
        }
        loop {
            let pids: Vec<Option<i32>> = sqlx::query_scalar(
                "SELECT pid FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' \
                    AND granted AND transactionid::text = ANY($1)",
            )
            .bind(&writers)
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
            if pids.is_empty() {
                return Ok(());
            }
            // A prepared transaction has no process: 0 stands for it.
            let pids: Vec<i32> = pids.into_iter().map(Option::unwrap_or_default).collect();
            waiting(&pids);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Starts streaming after the last settled transaction: from the
    /// position the last settle recorded, or the slot's confirmed position
    /// if that is later (the server takes the later of the two). The slot's
    /// own position alone is not enough after a crash of the server, which
    /// can take it back (see migration 0008). Returns once the server has
    /// handed the slot to this session; fails while another relay streams
    /// from it (this one is then a standby).
    ///
    /// Streams only the slot `prepared` judged: if the record has moved on
    /// to another generation since (another relay found the slot lost or
    /// gone and made a new one), that slot's sweep is not done, and this
    /// fails (transient) so that the relay prepares again. So does a slot
    /// found confirmed past every position recorded for it: it is not the
    /// one the record speaks of (see [`prepare`](Self::prepare)).
    pub async fn open(&self, prepared: &Prepared) -> Result<WalStream, StoreError> {
        let mut cfg = replication_config(&self.config)?;
        type Record = (Option<i64>, i64, Option<i64>, Option<i64>, Option<i64>);
        let record: Option<Record> = sqlx::query_as(
            "SELECT settled_lsn, generation, part_lsn, part_events, \
                    (SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots \
                      WHERE slot_name = $1) \
               FROM ferry.wal_slots WHERE slot = $1",
        )
        .bind(&self.config.slot)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        let (settled, generation, part_lsn, part_events, confirmed) = record.unwrap_or_default();
        if generation != prepared.generation {
            return Err(StoreError::transient(
                "the replication slot was replaced since it was prepared; starting over with the new slot",
            ));
        }
        // A transaction partly settled by an earlier session: the stream
        // skips that part of it.
        let resume = part_lsn.zip(part_events).map(|(lsn, n)| (lsn as u64, n as u64));
        if let Some(lsn) = settled {
            cfg = cfg.with_start_lsn(Lsn::from_u64(lsn as u64));
        }
        self.await_last_walsender().await?;
        let mut client = ReplicationClient::connect(cfg)
            .await
            .map_err(|e| StoreError::transient(format!("replication connection: {e}")))?;
        // `connect` returns before the server has answered START_REPLICATION:
        // wait for its answer, so that a slot another relay streams from
        // fails here, before this relay says it streams or sweeps.
        client
            .wait_started()
            .await
            .map_err(|e| StoreError::transient(format!("replication stream: {e}")))?;
        // The start position read above belongs to the slot of that
        // generation: if another relay replaced the slot meanwhile, it would
        // be a position of the old one (after a failover, possibly ahead of
        // what the new slot has to stream). Start over instead.
        // The slot's walsender is this session's now.
        let now: Option<(i64, Option<i32>)> = sqlx::query_as(
            "SELECT generation, (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1) \
               FROM ferry.wal_slots WHERE slot = $1",
        )
        .bind(&self.config.slot)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        let (now, walsender) = now.unwrap_or_default();
        *self.walsender.lock().expect("not poisoned") = walsender;
        if now != generation {
            client.abort();
            return Err(StoreError::transient(
                "the replication slot was replaced while the stream opened; starting over with the new slot",
            ));
        }
        // The slot is this session's now: from here on it moves only as
        // far as the watermark, which this session keeps.
        let keeper = match watermark::Keeper::adopt(&self.pool, &self.config.slot, generation).await {
            Ok(Some(keeper)) => keeper,
            Ok(None) => {
                client.abort();
                return Err(StoreError::transient(
                    "the replication slot is confirmed past every position recorded for it: it was made anew \
                     (or moved on by hand) since a relay streamed from it; starting over with it as a new slot",
                ));
            }
            Err(e) => {
                client.abort();
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let (applied, applied_rx) = watch::channel(0);
        let (stop, stop_rx) = oneshot::channel();
        let budget = Arc::new(Semaphore::new(self.read_ahead));
        let forwarder = tokio::spawn(forward(
            client,
            tx,
            budget,
            self.read_ahead,
            Confirms {
                applied: applied_rx,
                keeper,
            },
            stop_rx,
            self.config.publication.clone(),
        ));
        Ok(WalStream {
            rx,
            applied,
            stop: Some(stop),
            forwarder,
            decoder: decode::Decoder::resuming(resume),
            generation,
            // The server starts at the later of the two.
            reached: settled.max(confirmed).unwrap_or(0).max(0) as u64,
            stalled: self.stalled.clone(),
            config: self.config.clone(),
        })
    }

    /// Waits, up to 10 s, for the walsender of this source's last session
    /// to let the slot go; an error if it has not (not the one of a slot
    /// another relay streams from), after which it is no longer waited for.
    async fn await_last_walsender(&self) -> Result<(), StoreError> {
        let Some(pid) = *self.walsender.lock().expect("not poisoned") else {
            return Ok(());
        };
        let started = tokio::time::Instant::now();
        loop {
            let holds: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2)",
            )
            .bind(&self.config.slot)
            .bind(pid)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
            if !holds {
                *self.walsender.lock().expect("not poisoned") = None;
                return Ok(());
            }
            if started.elapsed() >= Duration::from_secs(10) {
                *self.walsender.lock().expect("not poisoned") = None;
                return Err(StoreError::transient(format!(
                    "the walsender of this relay's last stream (PID {pid}) still holds the replication slot"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The slot's state: whether a relay streams from it, how far behind
    /// it is and how far from being lost.
    pub async fn status(&self) -> Result<SlotStatus, StoreError> {
        slot_status(&self.pool, &self.config.slot).await
    }
}

/// Whether a relay starting at the same time created the object first.
fn already_exists(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42710")
}

/// Whether the object was gone already (another relay dropped it first).
fn undefined_object(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42704")
}

/// The slots of this database, other than `except`, that `ferry.emit`
/// writes tableless events for: marked ready and kept by the server, as
/// `ferry._emit` checks. Only a relay streaming from such a slot reads
/// those events, so a relay polling, or streaming from another slot, must
/// not start while one exists: what `ferry.emit` writes would be lost.
pub async fn emit_slots<'c>(conn: impl sqlx::PgExecutor<'c>, except: Option<&str>) -> Result<Vec<String>, StoreError> {
    sqlx::query_scalar(
        "SELECT w.slot FROM ferry.wal_slots w JOIN pg_replication_slots s ON s.slot_name = w.slot \
          WHERE w.ready AND s.database = current_database() AND s.wal_status IN ('reserved', 'extended') \
            AND w.slot IS DISTINCT FROM $1 \
          ORDER BY 1",
    )
    .bind(except)
    .fetch_all(conn)
    .await
    .map_err(store_error)
}

/// Why a relay on `slot` is refused while `other` is ready, and the fix.
fn another_slot(other: &str, slot: &str) -> String {
    format!(
        "replication slot {other} is this database's WAL slot: ferry.emit writes tableless events for it, \
         which a relay on slot {slot} would never read; set [relay] wal_slot = \"{other}\", or retire slot \
         {other} first (`ferry wal retire --slot {other}`, see the operations guide)"
    )
}

/// Where [`retire`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retiring {
    /// The slot is marked not ready: new `ferry.emit` calls write outbox
    /// rows. Waiting for transactions that may still emit for the slot.
    Marked,
    /// Those transactions still running: sessions by server process id (a
    /// session left idle in a transaction holds the retirement until it
    /// ends), then transactions prepared for two-phase commit by gid.
    Waiting { pids: Vec<i32>, prepared: Vec<String> },
    /// Every such transaction has ended; waiting for the streaming relay to
    /// settle the WAL through `through` (bytes still to go: `behind`).
    Draining { through: u64, behind: u64 },
    /// No relay streams from the slot: nothing moves until one does.
    NoRelay,
}

/// Takes `slot` out of use without losing a tableless event: marks it
/// retired and not ready, so that `ferry.emit` writes outbox rows from then
/// on, waits until every transaction that may have seen it ready has ended
/// (prepared ones included), then until the relay streaming from it has
/// settled the WAL through that point. Returns that position. Afterwards
/// the slot holds no event the relay has not settled: stop the relays in
/// WAL mode and drop it (`SELECT pg_drop_replication_slot(...)`), then
/// start them polling, or on another slot. Relays in WAL mode may stream,
/// reconnect and restart meanwhile: they never mark a retired slot ready
/// again ([`WalSource::mark_swept`]). A new slot of the same name starts
/// afresh.
///
/// `report` hears each step, whom it waits for each time it looks (about
/// five times a second, for the caller to say as often as it likes), and
/// every second how far the relay has to go; the wait ends only when the
/// slot has caught up, or fails on a database error.
pub async fn retire(pool: &PgPool, slot: &str, mut report: impl FnMut(Retiring)) -> Result<u64, StoreError> {
    let marked: Option<i64> = sqlx::query_scalar(
        "UPDATE ferry.wal_slots SET ready = false, retired = true WHERE slot = $1 RETURNING generation",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(store_error)?;
    let Some(generation) = marked else {
        return Err(StoreError::config(format!(
            "no WAL slot {slot} is recorded in ferry.wal_slots: no relay has streamed from it, so it holds \
             no tableless event; check the slot's name ([relay] wal_slot)"
        )));
    };
    report(Retiring::Marked);
    // A transaction running when the marking committed may have read the
    // slot as ready and emit for it still; one begun after cannot. Every
    // transaction holds the lock on its virtual id until it ends; both that
    // lock and the session's database are visible to any role (unlike
    // pg_stat_activity's other columns, `backend_type` among them). The
    // walsender streaming from the slot is left out: it runs for good.
    let running: Vec<String> = sqlx::query_scalar(
        "SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
          WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_backend_pid() \
            AND a.datname = current_database() \
            AND l.pid IS DISTINCT FROM (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(slot)
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    wait_until_none(
        pool,
        "SELECT DISTINCT coalesce(pid, 0)::text FROM pg_locks \
          WHERE locktype = 'virtualxid' AND mode = 'ExclusiveLock' AND granted AND virtualxid = ANY($1)",
        &running,
        |pids| {
            report(Retiring::Waiting {
                pids: pids.iter().filter_map(|pid| pid.parse().ok()).collect(),
                prepared: Vec::new(),
            })
        },
    )
    .await?;
    // A transaction prepared for two-phase commit has let its virtual id go
    // but commits later: wait for those of this database too.
    let prepared: Vec<String> =
        sqlx::query_scalar("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
            .fetch_all(pool)
            .await
            .map_err(store_error)?;
    wait_until_none(
        pool,
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND gid = ANY($1)",
        &prepared,
        |prepared| {
            report(Retiring::Waiting {
                pids: Vec::new(),
                prepared,
            })
        },
    )
    .await?;
    // The insert position, not the write position: a transaction committed
    // with synchronous_commit off may not have its commit record written yet.
    let through: i64 = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    let mut said = tokio::time::Instant::now() - Duration::from_secs(1);
    loop {
        type Row = (Option<i64>, bool, bool, i64);
        let row: Option<Row> = sqlx::query_as(
            "SELECT (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, s.active, w.ready, w.generation \
               FROM pg_replication_slots s JOIN ferry.wal_slots w ON w.slot = s.slot_name \
              WHERE s.slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(pool)
        .await
        .map_err(store_error)?;
        let Some((confirmed, active, ready, now_generation)) = row else {
            return Err(StoreError::config(format!(
                "replication slot {slot} is gone: tableless events it had not handed over are lost, as after a \
                 failover; ferry.emit writes outbox rows while no ready slot exists"
            )));
        };
        if ready || now_generation != generation {
            return Err(StoreError::config(format!(
                "slot {slot} was replaced by a new one while it was being retired (it was lost, or dropped \
                 and made anew); tableless events the old one had not handed over are lost, as after a failover; \
                 retire the new one if you still mean to"
            )));
        }
        let confirmed = confirmed.unwrap_or(0);
        if confirmed >= through {
            return Ok(through as u64);
        }
        if said.elapsed() >= Duration::from_secs(1) {
            said = tokio::time::Instant::now();
            report(if active {
                Retiring::Draining {
                    through: through as u64,
                    behind: (through - confirmed) as u64,
                }
            } else {
                Retiring::NoRelay
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `left` (a query naming, as text, what of `$1` remains) until none
/// does, telling `waiting` what remains each time.
async fn wait_until_none(
    pool: &PgPool,
    left: &'static str,
    of: &[String],
    mut waiting: impl FnMut(Vec<String>),
) -> Result<(), StoreError> {
    if of.is_empty() {
        return Ok(());
    }
    loop {
        let remain: Vec<String> = sqlx::query_scalar(left)
            .bind(of)
            .fetch_all(pool)
            .await
            .map_err(store_error)?;
        if remain.is_empty() {
            return Ok(());
        }
        waiting(remain);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether a relay streams from `slot` and has swept what was committed
/// before the slot existed (from then on `ferry.emit` is allowed).
pub async fn streaming(pool: &PgPool, slot: &str) -> Result<bool, StoreError> {
    let ready: Option<bool> = sqlx::query_scalar(
        "SELECT s.active AND w.ready FROM pg_replication_slots s \
           JOIN ferry.wal_slots w ON w.slot = s.slot_name WHERE s.slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(store_error)?;
    Ok(ready == Some(true))
}

/// A slot's state as `ferry status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SlotStatus {
    pub slot: String,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`,
    /// `unreserved` (the next checkpoint invalidates it) or `lost`; `None`
    /// when the slot does not exist.
    pub wal_status: Option<String>,
    /// A relay streams from it (its walsender's process id).
    pub streaming_pid: Option<i32>,
    /// Its start-up sweep is done: tableless events are written for it.
    pub ready: bool,
    /// Bytes of WAL it holds back.
    pub behind_bytes: Option<i64>,
    /// Bytes of WAL the server writes before it invalidates the slot, under
    /// `max_slot_wal_keep_size`.
    pub safe_bytes: Option<i64>,
}

/// The slot's state; a slot that does not exist comes back with no
/// `wal_status`.
pub async fn slot_status(pool: &PgPool, slot: &str) -> Result<SlotStatus, StoreError> {
    type Row = (Option<String>, Option<i32>, Option<i64>, Option<i64>, bool);
    let row: Option<Row> = sqlx::query_as(
        "SELECT s.wal_status, s.active_pid, \
                pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint, s.safe_wal_size, \
                coalesce(w.ready, false) \
           FROM pg_replication_slots s LEFT JOIN ferry.wal_slots w ON w.slot = s.slot_name \
          WHERE s.slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(store_error)?;
    let (wal_status, streaming_pid, behind_bytes, safe_bytes, ready) = row.unwrap_or_default();
    Ok(SlotStatus {
        slot: slot.to_owned(),
        wal_status,
        streaming_pid,
        ready,
        behind_bytes,
        safe_bytes,
    })
}

/// A permission or configuration error while setting up, with the fix.
fn explain(e: sqlx::Error, doing: &str) -> StoreError {
    let code = e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
    match code.as_deref() {
        Some("42501") => StoreError::config(format!(
            "cannot {doing}: {e}; the relay's role needs REPLICATION (ALTER ROLE <role> REPLICATION) \
             and ownership of ferry.events, or create it once as an administrator (OPERATIONS.md, \"WAL streaming\")"
        )),
        Some("53400") => StoreError::config(format!(
            "cannot {doing}: {e}; raise max_replication_slots (and max_wal_senders) and restart PostgreSQL"
        )),
        Some("55000") => StoreError::config(format!("cannot {doing}: {e}")),
        _ => store_error(e),
    }
}

fn replication_config(config: &WalConfig) -> Result<ReplicationConfig, StoreError> {
    let bad = |why: &str| StoreError::config(format!("database.url: {why}; WAL streaming connects with it"));
    let url = url::Url::parse(&config.url).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "postgres" | "postgresql") {
        return Err(bad("use a postgres:// URL"));
    }
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    let params: HashMap<String, String> = url.query_pairs().into_owned().collect();
    let user = match url.username() {
        "" => params
            .get("user")
            .cloned()
            .or_else(|| std::env::var("PGUSER").ok())
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "postgres".into()),
        u => decode(u),
    };
    let password = url
        .password()
        .map(decode)
        .or_else(|| params.get("password").cloned())
        .or_else(|| std::env::var("PGPASSWORD").ok())
        .unwrap_or_default();
    let database = match url.path().trim_start_matches('/') {
        "" => params.get("dbname").cloned().unwrap_or_else(|| user.clone()),
        d => decode(d),
    };
    let host = match url.host_str() {
        Some(h) if !h.is_empty() => h.trim_matches(|c| c == '[' || c == ']').to_owned(),
        _ => params.get("host").cloned().unwrap_or_else(|| "localhost".into()),
    };
    // The replication connection speaks plain TCP or a Unix socket: its TLS
    // layer would bring a second crypto provider into the binary.
    let sslmode = params.get("sslmode").or_else(|| params.get("ssl-mode"));
    let tls = match sslmode.map(String::as_str) {
        None | Some("disable" | "allow" | "prefer") => TlsConfig::disabled(),
        Some(mode @ ("require" | "verify-ca" | "verify-full")) => {
            return Err(bad(&format!(
                "sslmode={mode}, but the WAL stream connects without TLS; run the relay beside the \
                 database (a Unix socket or a private network) with sslmode=prefer, or use [relay] mode = \"poll\""
            )));
        }
        Some(other) => return Err(bad(&format!("unknown sslmode {other:?}"))),
    };
    // As the relay's pool reads it: the URL's port, else `?port=`.
    let port = match (url.port(), params.get("port")) {
        (Some(port), _) => port,
        (None, Some(port)) => port
            .parse()
            .map_err(|_| bad(&format!("port={port:?} is not a port number")))?,
        (None, None) => 5432,
    };
    let cfg = if host.starts_with('/') {
        ReplicationConfig::unix(host, port, user, password, database, &config.slot, &*config.publication)
    } else {
        ReplicationConfig::new(host, user, password, database, &config.slot, &*config.publication)
            .with_port(port)
            .with_tls(tls)
    };
    Ok(cfg
        // Text values are parsed by the decoder: pin their formats.
        .with_options("-c datestyle=ISO -c timezone=UTC -c bytea_output=hex -c extra_float_digits=3")
        .with_application_name("ferry-relay")
        // The slot's confirmed position follows the relay closely, so the
        // lag a monitor reads off pg_replication_slots is the real one.
        .with_status_interval(Duration::from_millis(500))
        .with_wakeup_interval(Duration::from_secs(5))
        // Counted in messages, whatever their size: kept small, and the
        // stream's byte budget bounds what is read beyond it.
        .with_buffer_size(CLIENT_BUFFER_EVENTS))
}

/// The positions the relay has settled ([`WalStream::confirm`]), and what
/// of them the slot may be told: no more than its record's watermark.
struct Confirms {
    applied: watch::Receiver<u64>,
    keeper: watermark::Keeper,
}

/// A message read from the replication connection, with its share of the
/// stream's read-ahead budget, given back once decoded.
type Forwarded = Result<(ReplicationEvent, OwnedSemaphorePermit), Ended>;

/// Why the replication connection ended.
enum Ended {
    Failed(StoreError),
    /// The server could not decode a change, committed while the
    /// publication did not exist: no session ever will (see
    /// [`WalSource::prepare`]). With the server's words.
    Unpublished(String),
}

impl Ended {
    fn of(e: PgWireError, publication: &str) -> Ended {
        match publication::unpublished(&e, publication) {
            Some(server) => Ended::Unpublished(server),
            None => Ended::Failed(StoreError::transient(format!("replication stream: {e}"))),
        }
    }
}

/// The bytes a message holds the budget for: its change data.
fn weight(event: &ReplicationEvent) -> usize {
    match event {
        ReplicationEvent::XLogData { data, .. } => data.len(),
        ReplicationEvent::Message { content, prefix, .. } => content.len() + prefix.len(),
        _ => 0,
    }
    .max(64)
}

/// Owns the replication client: reads messages while the budget allows,
/// passes confirmed positions on, and ends the session when told to, or
/// at once (no watermark write, no clean end) when the stream is dropped
/// or abandoned. While the budget is spent it stops
/// reading; the client's buffer fills, the server waits (the client keeps
/// answering it) and the rest stays in the WAL until the relay catches up.
async fn forward(
    mut client: ReplicationClient,
    tx: mpsc::UnboundedSender<Forwarded>,
    budget: Arc<Semaphore>,
    read_ahead: usize,
    confirms: Confirms,
    mut stop: oneshot::Receiver<()>,
    publication: String,
) {
    let Confirms {
        mut applied,
        mut keeper,
    } = confirms;
    // A raise of the watermark runs in an arm's body, not as a branch of
    // the select: busy, the stream would cut it short every time, and the
    // slot would be confirmed no further.
    let far = || tokio::time::Instant::now() + Duration::from_secs(3600);
    loop {
        let due = keeper.due();
        let event = tokio::select! {
            biased;
            stopped = &mut stop => match stopped {
                Ok(()) => break,
                Err(_) => {
                    client.abort();
                    return;
                }
            },
            _ = tx.closed() => {
                client.abort();
                return;
            }
            Ok(()) = applied.changed() => {
                keeper.want(*applied.borrow_and_update());
                client.update_applied_lsn(Lsn::from_u64(keeper.confirmable()));
                continue;
            }
            _ = tokio::time::sleep_until(due.unwrap_or_else(far)), if due.is_some() => {
                if !raise_or_end(&mut keeper, &mut client, &tx).await {
                    return;
                }
                continue;
            }
            event = client.recv() => event,
        };
        let event = match event {
            Ok(Some(event)) => event,
            Ok(None) => {
                let _ = tx.send(Err(Ended::Failed(StoreError::transient("replication stream ended"))));
                return;
            }
            Err(e) => {
                let _ = tx.send(Err(Ended::of(e, &publication)));
                return;
            }
        };
        // A message larger than the whole budget waits for all of it.
        let wanted = weight(&event).min(read_ahead) as u32;
        let permit = loop {
            let due = keeper.due();
            tokio::select! {
                biased;
                stopped = &mut stop => match stopped {
                    Ok(()) => break None,
                    Err(_) => {
                        client.abort();
                        return;
                    }
                },
                _ = tx.closed() => {
                    client.abort();
                    return;
                }
                Ok(()) = applied.changed() => {
                    keeper.want(*applied.borrow_and_update());
                    client.update_applied_lsn(Lsn::from_u64(keeper.confirmable()));
                }
                _ = tokio::time::sleep_until(due.unwrap_or_else(far)), if due.is_some() => {
                    if !raise_or_end(&mut keeper, &mut client, &tx).await {
                        return;
                    }
                }
                permit = budget.clone().acquire_many_owned(wanted) => break permit.ok(),
            }
        };
        let Some(permit) = permit else { break };
        if tx.send(Ok((event, permit))).is_err() {
            client.abort();
            return;
        }
    }
    // Closing: the last confirmed position first (recorded first, however
    // soon after the last raise), then a clean end.
    keeper.want(*applied.borrow());
    if keeper.due().is_some() {
        // Failed, the slot is confirmed as far as recorded: the stream
        // ends below, either way.
        keeper.raise().await;
    }
    client.update_applied_lsn(Lsn::from_u64(keeper.confirmable()));
    let _ = tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await;
    client.abort();
}

/// Raises the watermark and confirms the slot as far as it now allows;
/// `false` when it could not be raised, the session then ended with an
/// error (see [`watermark::Keeper::raise`]).
async fn raise_or_end(
    keeper: &mut watermark::Keeper,
    client: &mut ReplicationClient,
    tx: &mpsc::UnboundedSender<Forwarded>,
) -> bool {
    if keeper.raise().await {
        client.update_applied_lsn(Lsn::from_u64(keeper.confirmable()));
        return true;
    }
    client.abort();
    let _ = tx.send(Err(Ended::Failed(StoreError::transient(
        "the slot's watermark could not be recorded",
    ))));
    false
}

/// What the stream hands over.
#[derive(Debug)]
pub enum WalItem {
    /// A committed transaction, with the Ferry events it wrote (possibly
    /// none), or a part of a large one ([`WalTxn`]).
    Txn(WalTxn),
    /// Everything before `lsn` has been sent and nothing is open: once the
    /// transactions before it are settled, `lsn` may be confirmed.
    Idle { lsn: u64 },
}

/// A replication session on the slot.
pub struct WalStream {
    /// From the task that owns the replication client ([`forward`]),
    /// which ends the session when this is dropped.
    rx: mpsc::UnboundedReceiver<Forwarded>,
    applied: watch::Sender<u64>,
    stop: Option<oneshot::Sender<()>>,
    forwarder: tokio::task::JoinHandle<()>,
    decoder: decode::Decoder,
    generation: i64,
    /// The furthest position handed over (or the start).
    reached: u64,
    /// The source's: set when the server ends the stream at a change it can
    /// never decode ([`Ended::Unpublished`]).
    stalled: Arc<Mutex<Option<Stall>>>,
    config: WalConfig,
}

impl WalStream {
    /// The generation of the slot record this session started from, for
    /// [`Settlement::generation`].
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// The next committed transaction or idle position.
    pub async fn next(&mut self) -> Result<WalItem, StoreError> {
        loop {
            let forwarded = self.rx.recv().await;
            if let Some(item) = self.feed(forwarded)? {
                return Ok(item);
            }
        }
    }

    /// Like [`next`](Self::next), but only what has already arrived.
    pub fn try_next(&mut self) -> Result<Option<WalItem>, StoreError> {
        loop {
            let forwarded = match self.rx.try_recv() {
                Ok(forwarded) => Some(forwarded),
                Err(mpsc::error::TryRecvError::Empty) => return Ok(None),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
            };
            if let Some(item) = self.feed(forwarded)? {
                return Ok(Some(item));
            }
        }
    }

    /// Decodes one message; its read-ahead budget is given back after.
    fn feed(&mut self, forwarded: Option<Forwarded>) -> Result<Option<WalItem>, StoreError> {
        let (event, _permit) = match forwarded {
            Some(Ok(forwarded)) => forwarded,
            Some(Err(Ended::Failed(e))) => return Err(e),
            Some(Err(Ended::Unpublished(server))) => return Err(self.stall(&server)),
            None => return Err(StoreError::transient("replication stream ended")),
        };
        let item = self.decoder.feed(event)?;
        match &item {
            Some(WalItem::Txn(t)) => self.reached = self.reached.max(t.end_lsn),
            Some(WalItem::Idle { lsn }) => self.reached = self.reached.max(*lsn),
            None => {}
        }
        Ok(item)
    }

    /// Tells the slot that everything before `lsn` is settled; the server
    /// may then recycle that WAL, and a restart resumes from there. The
    /// position is recorded first (the slot's watermark, written at most
    /// every second, or every ten while the stream moves on by little), so
    /// the slot may be told a moment later: a slot confirmed past every
    /// position recorded for it is taken for one made anew (see
    /// [`WalSource::prepare`]).
    pub fn confirm(&self, lsn: u64) {
        self.applied.send_if_modified(|applied| {
            let raised = lsn > *applied;
            if raised {
                *applied = lsn;
            }
            raised
        });
    }

    /// The furthest position [`confirm`](Self::confirm)ed: the relay has
    /// settled everything the stream handed over before it.
    pub fn settled(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Ends the session. The last confirmed position reaches the slot if a
    /// status update carried it before the end (one goes every 500 ms);
    /// if not, the next session reads from an earlier position and skips
    /// what was settled, as after a crash (see [`WalSource::open`]).
    pub async fn close(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // The forwarder gives the server 2 s to end the session cleanly.
        if tokio::time::timeout(Duration::from_secs(3), &mut self.forwarder)
            .await
            .is_err()
        {
            self.forwarder.abort();
        }
    }

    /// Ends the session at once, without the watermark write and the clean
    /// end [`close`](Self::close) tries: for a relay giving up because the
    /// database cannot be reached. The replication connection is closed
    /// when this returns; the next [`WalSource::open`] of the same source
    /// waits for the server to end its walsender.
    pub async fn abandon(mut self) {
        // Dropped unsent, the stop tells the forwarder to abort; one busy
        // recording the watermark (which may wait on the database for a
        // while) is aborted itself, its client dropped.
        drop(self.stop.take());
        if tokio::time::timeout(Duration::from_millis(200), &mut self.forwarder)
            .await
            .is_err()
        {
            self.forwarder.abort();
        }
    }
}

/// Writes `event` as a tableless event in the caller's transaction: a
/// logical decoding message that the WAL relay publishes at commit. No
/// outbox row is written unless its delivery fails, or unless no healthy
/// slot would read the message (none yet, not swept yet, or invalidated or
/// about to be by the server): then the event is written as [`enqueue`]
/// writes it, so it is never lost and the transaction still commits.
/// Refuses an event with a dispatch key: there is no row to deduplicate
/// against, so a producer's retry would send the event twice.
///
/// [`enqueue`]: crate::postgres::enqueue
pub async fn emit(conn: &mut PgConnection, event: Event) -> Result<EventId, EnqueueError> {
    if !conn.is_in_transaction() {
        return Err(EnqueueError::NotInTransaction);
    }
    // The producer's span travels with the event, as `enqueue` writes it
    // (an explicit `traceparent` header wins).
    #[cfg(feature = "otel")]
    let event = event.with_current_trace_context();
    event.validate()?;
    if event.get_dispatch_key().is_some() {
        return Err(EnqueueError::Invalid(ferry_core::ValidationError {
            field: "dispatch_key",
            problem: "is set, but a tableless event has no outbox row to deduplicate against".into(),
            fix: "use enqueue, which deduplicates by dispatch key, or leave the dispatch key out",
        }));
    }
    let headers = serde_json::to_value(event.headers()).expect("string map serialises");
    let id: uuid::Uuid = sqlx::query_scalar("SELECT ferry._emit($1, $2, $3, $4, $5, $6)")
        .bind(event.id().0)
        .bind(event.event_type())
        .bind(event.get_key())
        .bind(event.payload().to_bytes().to_vec())
        .bind(event.payload().content_type())
        .bind(headers)
        .fetch_one(&mut *conn)
        .await?;
    Ok(EventId(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> Result<ReplicationConfig, StoreError> {
        replication_config(&WalConfig {
            url: url.into(),
            slot: "ferry".into(),
            publication: "ferry".into(),
        })
    }

    #[test]
    fn the_stream_reads_the_url_as_the_relays_pool_does() {
        // sqlx takes `ssl-mode` for `sslmode`: the stream must refuse TLS it
        // cannot speak either way, not connect in plain text.
        for url in [
            "postgres://u@db/app?sslmode=require",
            "postgres://u@db/app?ssl-mode=require",
        ] {
            let err = config(url).expect_err(url);
            assert!(err.message.contains("without TLS"), "{url}: {err}");
        }
        assert_eq!(config("postgres://u@db:6543/app").unwrap().port, 6543);
        assert_eq!(config("postgres://u@db/app?port=6543").unwrap().port, 6543);
        assert_eq!(config("postgres://u@db/app").unwrap().port, 5432);
        assert!(config("postgres://u@db/app?port=many").is_err());
    }

    #[test]
    fn debug_output_hides_the_database_password() {
        let config = WalConfig {
            url: "postgres://ferry:s3cr3t-pw@db:5432/app".into(),
            slot: "ferry".into(),
            publication: "ferry".into(),
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("db:5432/app"), "{shown}");
    }
}
