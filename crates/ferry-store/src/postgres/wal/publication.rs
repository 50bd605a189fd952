//! The publication the slot streams through: what the relay needs of it
//! ([`WalSource::check_publication`]), and what follows when it was missing
//! at the time of a change: the slot can never stream past that change,
//! and is replaced (`WalSource::replace_stalled`).

use std::sync::atomic::Ordering;

use ferry_core::StoreError;
use pgwire_replication::{Lsn, PgWireError};
use sqlx::{Connection, PgConnection};

use super::{WalConfig, WalSource, WalStream, explain};
use crate::postgres::store_error;

// What the relay needs of its publication, as SQL on `p`, a row of
// `pg_publication`: shared by the check and the marking for a sweep, which
// reads it again in its own statement. A row filter or a column list
// (PostgreSQL 15 and later) is read through `to_jsonb`, so that earlier
// releases, which have neither column, read none.

/// `ferry.events` is in the publication.
macro_rules! table_published {
    () => {
        "EXISTS (SELECT 1 FROM pg_publication_tables t \
                  WHERE t.pubname = p.pubname AND t.schemaname = 'ferry' AND t.tablename = 'events')"
    };
}

/// The publication streams only the rows of `ferry.events` that match a
/// row filter.
macro_rules! rows_filtered {
    () => {
        "EXISTS (SELECT 1 FROM pg_publication_rel r \
                  WHERE r.prpubid = p.oid AND r.prrelid = to_regclass('ferry.events') \
                    AND to_jsonb(r) ->> 'prqual' IS NOT NULL)"
    };
}

/// The publication streams only some columns of `ferry.events`.
macro_rules! columns_listed {
    () => {
        "EXISTS (SELECT 1 FROM pg_publication_rel r \
                  WHERE r.prpubid = p.oid AND r.prrelid = to_regclass('ferry.events') \
                    AND to_jsonb(r) ->> 'prattrs' IS NOT NULL)"
    };
}

/// Where a stream stopped for good: at a change committed while the
/// publication did not exist.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stall {
    /// The generation of the slot's record the stream started from.
    pub(super) generation: i64,
    /// The furthest position the stream had handed over: the slot was
    /// confirmed no further, and a slot made since starts past it.
    pub(super) reached: u64,
}

/// The server's words, if it ended a stream at a change committed while
/// `publication` did not exist.
pub(super) fn unpublished(e: &PgWireError, publication: &str) -> Option<String> {
    match e {
        // pgoutput looks the publication up by name as of the change
        // (undefined_object); its message may be translated, its name is
        // quoted as it is.
        PgWireError::Server(message)
            if message.contains("SQLSTATE 42704") && message.contains(&format!("\"{publication}\"")) =>
        {
            Some(message.clone())
        }
        _ => None,
    }
}

impl WalSource {
    /// Checks that the publication carries every insert into
    /// `ferry.events`, whole, as the relay creates it. One made by an
    /// administrator without the table, without inserts, with a row filter
    /// or with a column list (or altered so since) streams the tableless
    /// events but not all of the outbox rows: the slot would move past
    /// them, and they would wait in `ferry.unrouted` for ever, nothing said
    /// (or, for a column list, the stream would stop with a misleading
    /// error). So a publication found so stops the stream, and marks the
    /// slot's record for a sweep: once it is mended, the relay takes what is
    /// unrouted into the table path before it streams again, as for a new
    /// slot (PostgreSQL never streams inserts made while they were not
    /// published, even from a slot that had not passed them yet).
    ///
    /// A publication missing while the slot streams is worse: see
    /// [`publication_missing`](Self::publication_missing). It stops the
    /// stream too.
    pub async fn check_publication(&self) -> Result<(), StoreError> {
        let WalConfig { slot, publication, .. } = &self.config;
        let wrong = match publication_fault(&self.pool, publication).await.map_err(store_error)? {
            Some(None) => return Ok(()),
            None => {
                let mut conn = self.pool.acquire().await.map_err(store_error)?;
                self.publication_missing(&mut conn).await?;
                return Err(StoreError::config(format!(
                    "publication {publication} does not exist, though replication slot {slot} does (dropped by \
                     hand?): a change committed in this database while it is missing stops the slot for good \
                     before PostgreSQL 18, and is never streamed from 18 on. The relay makes it again at its \
                     next attempt to stream, sweeps every undelivered outbox row into the table path, and \
                     before 18 replaces the slot (tableless events the slot holds past that change are lost). \
                     Drop the publication only with the slot"
                )));
            }
            Some(Some(wrong)) => format!(
                "publication {publication} {wrong}; the outbox's events are not streamed until it is mended (they \
                 wait, and are taken into the table path then)"
            ),
        };
        self.mark_for_sweep(&self.pool).await?;
        Err(StoreError::config(wrong))
    }

    /// The publication is missing while the slot exists (dropped by hand,
    /// say). PostgreSQL 18 and later skip it with a warning: the slot
    /// streams on, but never what committed meanwhile. Before 18, pgoutput
    /// reads the publication as of each change and fails at the first one
    /// committed meanwhile (any table's, the relay's own writes among them,
    /// this one's first), in every session: the slot is doomed whatever
    /// else happens. Either way the record is marked not ready at once
    /// (`ferry.emit` writes outbox rows) and for a sweep of what is
    /// unrouted; before 18 the slot is also to be replaced
    /// ([`replace_stalled`](Self::replace_stalled)), whose new slot is swept
    /// the same way, and until then it is never marked ready. Both
    /// [`check_publication`](Self::check_publication) and
    /// [`prepare`](Self::prepare) come here, so that a publication made
    /// again beside an existing slot always leads to the sweep.
    pub(super) async fn publication_missing(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
        if version < 180000 {
            let generation: Option<i64> = sqlx::query_scalar(
                "SELECT generation FROM ferry.wal_slots \
                  WHERE slot = $1 AND EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            )
            .bind(&self.config.slot)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store_error)?;
            if let Some(generation) = generation {
                // Whatever it has reached: it can stream past none of it.
                let mut stalled = self.stalled.lock().expect("not poisoned");
                if stalled.is_none_or(|s| s.generation != generation) {
                    *stalled = Some(Stall {
                        generation,
                        reached: i64::MAX as u64,
                    });
                }
            }
        }
        self.mark_for_sweep(&mut *conn).await
    }

    /// Marks the slot's record not ready and for a sweep, while the
    /// publication does not carry every insert into `ferry.events`.
    async fn mark_for_sweep<'c>(&self, conn: impl sqlx::PgExecutor<'c>) -> Result<(), StoreError> {
        let WalConfig { slot, publication, .. } = &self.config;
        // Only while it is still wrong, in the same statement: a relay that
        // read it a moment before it was mended must not undo the sweep
        // another relay has made since. A retired slot is not swept again
        // (the relays leave it for polling, which takes what is unrouted).
        sqlx::query(concat!(
            "UPDATE ferry.wal_slots SET ready = false, swept_generation = NULL \
              WHERE slot = $1 AND NOT retired \
                AND NOT EXISTS (SELECT 1 FROM pg_publication p WHERE p.pubname = $2 AND p.pubinsert AND ",
            table_published!(),
            " AND NOT ",
            rows_filtered!(),
            " AND NOT ",
            columns_listed!(),
            ")"
        ))
        .bind(slot)
        .bind(publication)
        .execute(conn)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    /// Drops the slot a stream of this source found stopped for good, at a
    /// change committed while the publication did not exist, and resets its
    /// record as for a lost slot, so that [`prepare`](Self::prepare) makes
    /// a new one and the relay sweeps every outbox row not yet delivered
    /// (the rows committed while the publication was missing among them)
    /// into the table path. PostgreSQL before 18 decodes each change
    /// against the publications of its time: the old slot fails there in
    /// every session, however often the publication is made again, and
    /// would hold its WAL for ever. Tableless events it holds past that
    /// change are lost: said here, as it is dropped, and told in the next
    /// [`Prepared`](super::Prepared) this source returns
    /// ([`SlotLoss::Unpublished`](super::SlotLoss::Unpublished)), however
    /// the rest of this `prepare` goes.
    pub(super) async fn replace_stalled(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        let Some(stall) = *self.stalled.lock().expect("not poisoned") else {
            return Ok(());
        };
        let slot = &self.config.slot;
        // First, whatever follows: a tableless event written from now on
        // would go into WAL nobody reads.
        sqlx::query("UPDATE ferry.wal_slots SET ready = false WHERE slot = $1 AND generation = $2")
            .bind(slot)
            .bind(stall.generation)
            .execute(&mut *conn)
            .await
            .map_err(store_error)?;
        // Only the slot that stopped: of the generation the stream read, and
        // confirmed no further than it reached (a slot made since starts
        // past the change that stopped it). The record's row lock keeps a
        // relay that saw the same stop from replacing the new slot too.
        let mut tx = conn.begin().await.map_err(store_error)?;
        let reset = sqlx::query(
            "UPDATE ferry.wal_slots SET ready = false, retired = false, settled_lsn = NULL, part_lsn = NULL, \
                    part_events = NULL, generation = generation + 1, \
                    watermark = NULL, watermark_generation = NULL, watermark_pid = NULL \
              WHERE slot = $1 AND generation = $2 \
                AND EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active \
                               AND (confirmed_flush_lsn - '0/0'::pg_lsn) <= $3)",
        )
        .bind(slot)
        .bind(stall.generation)
        .bind(stall.reached as i64)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        if reset.rows_affected() == 1 {
            if let Err(e) = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(slot)
                .execute(&mut *tx)
                .await
            {
                // Taken up by a walsender since: tried again next time.
                return Err(explain(e, "drop the replication slot that cannot stream on"));
            }
            tx.commit().await.map_err(store_error)?;
            *self.stalled.lock().expect("not poisoned") = None;
            self.unreported.store(true, Ordering::SeqCst);
            tracing::error!(
                slot = %slot,
                "dropped replication slot {slot}: it stopped at a change committed while publication {} did not \
                 exist, and could never stream past it. A new slot replaces it and every outbox row not yet \
                 delivered is swept into the table path; tableless events (ferry.emit) it held past that change \
                 are lost",
                self.config.publication
            );
            return Ok(());
        }
        tx.rollback().await.map_err(store_error)?;
        // Still there, held by a walsender a moment longer, say: dropped at
        // the next attempt. Otherwise another relay replaced it already.
        let still: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM ferry.wal_slots w JOIN pg_replication_slots s ON s.slot_name = w.slot \
                             WHERE w.slot = $1 AND w.generation = $2 \
                               AND (s.confirmed_flush_lsn - '0/0'::pg_lsn) <= $3)",
        )
        .bind(slot)
        .bind(stall.generation)
        .bind(stall.reached as i64)
        .fetch_one(&mut *conn)
        .await
        .map_err(store_error)?;
        if !still {
            *self.stalled.lock().expect("not poisoned") = None;
        }
        Ok(())
    }
}

impl WalStream {
    /// Records that the slot stopped for good past the position reached,
    /// for the source's next [`prepare`](WalSource::prepare) to replace it,
    /// and says so: the error names the cause, where, and what follows.
    pub(super) fn stall(&self, server: &str) -> StoreError {
        *self.stalled.lock().expect("not poisoned") = Some(Stall {
            generation: self.generation,
            reached: self.reached,
        });
        let WalConfig { slot, publication, .. } = &self.config;
        let at = Lsn::from_u64(self.reached);
        let message = format!(
            "replication slot {slot} cannot stream past a change committed after WAL position {at}: publication \
             {publication} did not exist when it was committed ({server}), and PostgreSQL reads the publication \
             as of each change, so no session ever will, even once it is made again. The relay replaces the \
             slot at its next attempt: every outbox row not yet delivered is swept into the table path, and \
             ferry.emit writes outbox rows until the new slot is ready; tableless events (ferry.emit) the slot \
             holds past that position are lost. Drop the publication only with the slot"
        );
        tracing::error!(slot = %slot, lsn = %at, "{message}");
        StoreError::transient(message)
    }
}

/// Whether `publication` exists (`None` when not) and, if so, what is wrong
/// with it for the relay, with the fix (`Some(None)` when it publishes
/// every insert into `ferry.events`, with all its columns).
pub(crate) async fn publication_fault<'c>(
    conn: impl sqlx::PgExecutor<'c>,
    publication: &str,
) -> Result<Option<Option<String>>, sqlx::Error> {
    let row: Option<(bool, bool, bool, bool)> = sqlx::query_as(concat!(
        "SELECT p.pubinsert, ",
        table_published!(),
        ", ",
        rows_filtered!(),
        ", ",
        columns_listed!(),
        " FROM pg_publication p WHERE p.pubname = $1"
    ))
    .bind(publication)
    .fetch_optional(conn)
    .await?;
    // SET TABLE names the table alone: no filter, every column.
    let set_table = format!("ALTER PUBLICATION {publication} SET TABLE ferry.events");
    Ok(row.map(|row| match row {
        (false, ..) => Some(format!(
            "does not publish inserts; run ALTER PUBLICATION {publication} SET (publish = 'insert')"
        )),
        (_, false, ..) => Some(format!(
            "does not include ferry.events; run ALTER PUBLICATION {publication} ADD TABLE ferry.events"
        )),
        (_, _, true, _) => Some(format!(
            "publishes only the rows of ferry.events that match its row filter (WHERE), so the others would \
             never be streamed; run {set_table}"
        )),
        (_, _, _, true) => Some(format!(
            "publishes only some columns of ferry.events (a column list), which the relay cannot read; run \
             {set_table}"
        )),
        (true, true, false, false) => None,
    }))
}
