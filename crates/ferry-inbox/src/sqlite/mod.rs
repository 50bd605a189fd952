//! The inbox over SQLite: the same guarantees as the PostgreSQL [`crate::Inbox`],
//! in the `ferry_inbox` table that `ferry migrate` creates in an SQLite file.
//!
//! SQLite runs one writer at a time. Every inbox transaction begins
//! `IMMEDIATE`, taking the write lock before its first read: a deferred
//! transaction that reads the inbox row and then writes could be refused
//! with `SQLITE_BUSY` when another delivery commits in between. So
//! concurrent deliveries of one event queue on the lock (for the pool's busy
//! timeout), and each finds the row the one before it committed.
//!
//! The handler runs while its transaction holds that lock: it must write
//! through the connection it is given, never through the pool (which would
//! wait for the lock its own transaction holds), and should be short, since
//! every other writer of the file waits for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::DateTime;
use ferry_core::{EventId, RetryPolicy};
use sqlx::{Connection, SqliteConnection, SqlitePool};
use tracing::error;

use crate::inbox::{
    already_recorded, checked_consumer, committed_by_handler, count_processed, decide_failure, default_retry,
    log_unfinished, past_attempts, rolled_back_by_handler, run_handler, stored_type,
};
use crate::{HandlerError, InboxError, InboxRecord, Outcome, ReceivedEvent};

const CLAIM: &str = include_str!("sql/claim.sql");
const FAIL: &str = include_str!("sql/fail.sql");
const DEAD: &str = include_str!("sql/dead.sql");
const PURGE: &str = include_str!("sql/purge.sql");
const START: &str = include_str!("sql/start.sql");
const ABANDONED: &str = include_str!("sql/abandoned.sql");
const ROLLED_BACK: &str = include_str!("sql/rolled_back.sql");
/// This attempt's claim, by its number.
const HELD: &str = "SELECT 1 FROM ferry_inbox WHERE consumer = ?1 AND event_id = ?2 AND state = 'done' AND claim = ?3";
/// Every column the inbox's statements use.
const CHECK: &str = "SELECT consumer, event_id, state, attempts, last_error, event_type, processed_at, claim, \
                     unfinished FROM ferry_inbox LIMIT 0";
const RECORD: &str =
    "SELECT state, attempts, last_error, processed_at FROM ferry_inbox WHERE consumer = ?1 AND event_id = ?2";

/// Deduplicates one consumer's events in `ferry_inbox`, in an SQLite file
/// migrated by `ferry migrate` (or `ferry_store::sqlite::migrate`).
///
/// Build the pool from `ferry_store::sqlite::connect_options`, which sets WAL
/// and a busy timeout: without the timeout, a delivery that finds the write
/// lock taken fails at once instead of waiting its turn.
///
/// Rows are kept for a retention window and purged with [`Inbox::purge`],
/// which sets a horizon: an event whose row was purged is applied again if
/// the broker hands it out again. **The window must be longer than the
/// broker keeps messages, plus consumer downtime**: besides late
/// redeliveries (retries, outages, replays from a dead-letter queue), a
/// consumer group, durable or stream group created anew (or whose Kafka
/// offsets expired) re-reads everything the broker still holds. The README
/// ("Retention, order and outages") says how to size it per broker.
#[derive(Debug, Clone)]
pub struct Inbox {
    pool: SqlitePool,
    consumer: String,
    retry: RetryPolicy,
    handler_timeout: Option<Duration>,
}

impl Inbox {
    /// An inbox for `consumer`, a stable name: two deployments of the same
    /// consumer share it, two different consumers of one event must not.
    pub fn new(pool: SqlitePool, consumer: impl Into<String>) -> Result<Self, InboxError> {
        Ok(Self {
            pool,
            consumer: checked_consumer(consumer.into())?,
            retry: default_retry(),
            handler_timeout: None,
        })
    }

    /// How failed handlers are retried; default 5 attempts, 1 s doubling to 60 s.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Stops a handler run that takes longer than `limit`: the attempt
    /// fails (counted and retried like any failure) and its transaction is
    /// rolled back, so that a handler hung on a remote call does not hold
    /// its consumer, and the database's write lock, for ever. Off by
    /// default. A statement already running finishes first (SQLite bounds
    /// a wait for a lock by the pool's `busy_timeout`). An effect outside
    /// the database the handler had started may still happen: like any
    /// retried attempt, such effects must be idempotent.
    pub fn with_handler_timeout(mut self, limit: Duration) -> Self {
        self.handler_timeout = Some(limit);
        self
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Checks that `ferry_inbox` exists in the file as this release needs
    /// it: [`InboxError::Schema`], naming the fix, if not. Call it before
    /// consuming: an application started before `ferry migrate` brought the
    /// file up to date fails every delivery with an error that looks like
    /// any other database error.
    pub async fn check(&self) -> Result<(), InboxError> {
        match sqlx::query(CHECK).execute(&self.pool).await {
            Ok(_) => Ok(()),
            // SQLITE_ERROR: for this statement, a table or column missing.
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("1") => {
                Err(InboxError::Schema(format!(
                    "the table ferry_inbox is missing from this SQLite file, or older than this release of the \
                     inbox needs (schema 6, which adds `unfinished`): run `ferry migrate` against the file ({e})"
                )))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Runs `handler` for `event` unless this consumer already processed it.
    ///
    /// ```no_run
    /// # async fn demo(inbox: ferry_inbox::sqlite::Inbox, event: ferry_inbox::ReceivedEvent) -> Result<(), ferry_inbox::InboxError> {
    /// let outcome = inbox
    ///     .process(&event, async |tx, event| {
    ///         sqlx::query("INSERT INTO paid (order_id) VALUES (?1)").bind(&event.key).execute(tx).await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn process(
        &self,
        event: &ReceivedEvent,
        handler: impl AsyncFnOnce(&mut SqliteConnection, &ReceivedEvent) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        self.run(event, false, handler).await
    }

    /// [`process`](Self::process) for a delivery the broker may have handed
    /// out before, as [`crate::Inbox::process_redelivered`]: first records,
    /// in a transaction of its own, that an attempt starts, so that an
    /// attempt the process dies in counts toward the retry policy's
    /// `max_attempts`; past it the event is [`Outcome::Dead`] without
    /// running the handler again.
    pub async fn process_redelivered(
        &self,
        event: &ReceivedEvent,
        handler: impl AsyncFnOnce(&mut SqliteConnection, &ReceivedEvent) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        match self.start(event).await? {
            Some(outcome) => Ok(outcome),
            None => self.run(event, true, handler).await,
        }
    }

    /// Marks an attempt's start (`start.sql`). `None` to run the handler;
    /// otherwise the outcome without it: the event done, or dead.
    async fn start(&self, event: &ReceivedEvent) -> Result<Option<Outcome>, InboxError> {
        let id = event.id.to_string();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let marked: Option<(i32, i32)> = sqlx::query_as(START)
            .bind(&self.consumer)
            .bind(&id)
            .bind(stored_type(&event.event_type))
            .fetch_optional(&mut *tx)
            .await?;
        let Some((attempts, unfinished)) = marked else {
            let record = read(&mut tx, &self.consumer, event.id).await?;
            tx.rollback().await?;
            return Ok(Some(already_recorded(&self.consumer, event.id, record)));
        };
        let Some(reason) = past_attempts(attempts, unfinished, &self.retry) else {
            tx.commit().await?;
            log_unfinished(&self.consumer, event.id, attempts, unfinished, None);
            return Ok(None);
        };
        let attempts: i32 = sqlx::query_scalar(ABANDONED)
            .bind(&self.consumer)
            .bind(&id)
            .bind(&reason)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        log_unfinished(&self.consumer, event.id, attempts, unfinished, Some(&reason));
        Ok(Some(Outcome::Dead {
            attempts: u32::try_from(attempts).unwrap_or(0),
            reason,
        }))
    }

    /// Runs one attempt; `marked` when [`start`](Self::start) marked it.
    async fn run(
        &self,
        event: &ReceivedEvent,
        marked: bool,
        handler: impl AsyncFnOnce(&mut SqliteConnection, &ReceivedEvent) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        let id = event.id.to_string();
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        // Inserts the row, or takes over a failing one; a done or dead row
        // returns nothing.
        // This attempt's own: a second delivery of the event, claiming in
        // the same instant after this one's transaction was rolled back,
        // draws another.
        let claim: i64 = rand::random();
        let claimed: Option<i32> = sqlx::query_scalar(CLAIM)
            .bind(&self.consumer)
            .bind(&id)
            .bind(stored_type(&event.event_type))
            .bind(claim)
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(attempts) = claimed else {
            // Read under the same lock, so the row cannot change in between.
            let record = read(&mut tx, &self.consumer, event.id).await?;
            tx.rollback().await?;
            return Ok(already_recorded(&self.consumer, event.id, record));
        };
        let committed = watch_commits(&mut tx).await?;
        let result = run_handler(handler(&mut tx, event), &self.consumer, event.id, self.handler_timeout)
            .await
            .into_result();
        let open = in_transaction(&mut tx).await?;
        if committed.load(Ordering::SeqCst) {
            // The handler ran COMMIT, which committed the claim with it,
            // whatever it began afterwards.
            if open {
                tx.rollback().await?;
            } else {
                drop(tx);
                let _ = conn.close().await;
            }
            return self.ended_by_handler(event, result.err(), claim, marked).await;
        }
        if !open {
            // sqlx still counts the transaction SQLite ended: the connection
            // is closed, not handed back to the pool so counting.
            drop(tx);
            let _ = conn.close().await;
            return self.ended_by_handler(event, result.err(), claim, marked).await;
        }
        // Open, but perhaps a transaction the handler began after ending the
        // inbox's: then the claim is not in it.
        let held: Option<i32> = sqlx::query_scalar(HELD)
            .bind(&self.consumer)
            .bind(&id)
            .bind(claim)
            .fetch_optional(&mut *tx)
            .await?;
        if held.is_none() {
            tx.rollback().await?;
            return self.ended_by_handler(event, result.err(), claim, marked).await;
        }
        let error = match result {
            Ok(()) => match tx.commit().await {
                Ok(()) => {
                    count_processed(&self.consumer, event.id, attempts);
                    return Ok(Outcome::Processed);
                }
                // A deferred foreign key the handler's writes break fails the
                // commit on every redelivery: the handler's failure, counted
                // and retried until dead, not an outage to wait out.
                Err(e) if constraint_failed(&e) => {
                    HandlerError::transient(format!("the handler's transaction could not commit: {e}"))
                }
                Err(e) => return Err(e.into()),
            },
            Err(error) => {
                tx.rollback().await?;
                error
            }
        };
        self.failed(event, &error, marked).await
    }

    /// The handler's transaction ended before the inbox could commit it,
    /// and each statement after that committed alone: the handler ran
    /// `COMMIT` or `ROLLBACK` itself, or SQLite rolled back on its own after
    /// an error the handler went on from (`SQLITE_FULL`, an I/O error, a
    /// `RAISE(ROLLBACK)` trigger). As the PostgreSQL inbox does: if this
    /// attempt's claim committed, the event is recorded dead (a retry would
    /// apply the writes before the COMMIT again); so it is if the handler
    /// went on to return `Ok` (its writes after the end committed alone,
    /// and a retry would apply them again). A handler that returned an
    /// error (SQLite's own rollback after it, say) failed: counted and
    /// retried.
    async fn ended_by_handler(
        &self,
        event: &ReceivedEvent,
        failure: Option<HandlerError>,
        claim: i64,
        marked: bool,
    ) -> Result<Outcome, InboxError> {
        let returned_ok = failure.is_none();
        if let Some(outcome) = self.dead_if_committed(event, failure, claim).await? {
            return Ok(outcome);
        }
        if returned_ok {
            return self.rolled_back_by_handler(event, marked).await;
        }
        let error = HandlerError::transient(
            "the handler's transaction ended before the inbox committed it (ROLLBACK inside the handler, or \
             SQLite rolled it back after an error the handler returned); the handler's writes after that \
             committed on their own and are not recorded with the event: let the inbox end the transaction",
        );
        self.failed(event, &error, marked).await
    }

    /// Records dead, if this attempt's claim committed (the handler ran
    /// `COMMIT`), the event, with the reason.
    async fn dead_if_committed(
        &self,
        event: &ReceivedEvent,
        failure: Option<HandlerError>,
        claim: i64,
    ) -> Result<Option<Outcome>, InboxError> {
        let reason = committed_by_handler(failure);
        // This attempt's own claim, committed: done, with its number.
        let committed: Option<i32> = sqlx::query_scalar(
            "UPDATE ferry_inbox SET state = 'dead', last_error = ?3 \
             WHERE consumer = ?1 AND event_id = ?2 AND state = 'done' AND claim = ?4 RETURNING attempts",
        )
        .bind(&self.consumer)
        .bind(event.id.to_string())
        .bind(&reason)
        .bind(claim)
        .fetch_optional(&self.pool)
        .await?;
        Ok(committed.map(|attempts| {
            crate::metrics::dead(&self.consumer);
            error!(consumer = %self.consumer, event = %event.id, attempts, %reason, "handler bug: dead");
            Outcome::Dead {
                attempts: u32::try_from(attempts).unwrap_or(0),
                reason,
            }
        }))
    }

    /// The handler ended the inbox's transaction, its claim not committed,
    /// and returned `Ok`: recorded dead, the attempt counted.
    async fn rolled_back_by_handler(&self, event: &ReceivedEvent, marked: bool) -> Result<Outcome, InboxError> {
        let reason = rolled_back_by_handler(None);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let recorded: Option<i32> = sqlx::query_scalar(ROLLED_BACK)
            .bind(&self.consumer)
            .bind(event.id.to_string())
            .bind(stored_type(&event.event_type))
            .bind(&reason)
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(attempts) = recorded else {
            // Another delivery of the same event finished it meanwhile.
            let record = read(&mut tx, &self.consumer, event.id).await?;
            tx.rollback().await?;
            return Ok(already_recorded(&self.consumer, event.id, record));
        };
        tx.commit().await?;
        crate::metrics::dead(&self.consumer);
        error!(consumer = %self.consumer, event = %event.id, attempts, %reason, "handler bug: dead");
        Ok(Outcome::Dead {
            attempts: u32::try_from(attempts).unwrap_or(0),
            reason,
        })
    }

    /// Counts the failed attempt in its own transaction (the handler's was
    /// rolled back) and decides between retry and dead.
    async fn failed(&self, event: &ReceivedEvent, error: &HandlerError, marked: bool) -> Result<Outcome, InboxError> {
        let id = event.id.to_string();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let counted: Option<i32> = sqlx::query_scalar(FAIL)
            .bind(&self.consumer)
            .bind(&id)
            .bind(stored_type(&event.event_type))
            .bind(error.message())
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(attempts) = counted else {
            // Another delivery of the same event finished it meanwhile.
            let record = read(&mut tx, &self.consumer, event.id).await?;
            tx.rollback().await?;
            return Ok(already_recorded(&self.consumer, event.id, record));
        };
        let outcome = decide_failure(&self.consumer, event.id, attempts, error, &self.retry);
        if let Outcome::Dead { reason, .. } = &outcome {
            sqlx::query(DEAD)
                .bind(&self.consumer)
                .bind(&id)
                .bind(reason)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(outcome)
    }

    /// The inbox row for `id`, if any.
    pub async fn record(&self, id: EventId) -> Result<Option<InboxRecord>, InboxError> {
        let mut conn = self.pool.acquire().await?;
        read(&mut conn, &self.consumer, id).await
    }

    /// Forgets a dead or failing event so that a replay (from the dead-letter
    /// queue, say) is handled afresh; a done event is kept. Returns whether a
    /// row went.
    pub async fn release(&self, id: EventId) -> Result<bool, InboxError> {
        // One statement: SQLite takes the write lock before it reads.
        let deleted = sqlx::query("DELETE FROM ferry_inbox WHERE consumer = ?1 AND event_id = ?2 AND state <> 'done'")
            .bind(&self.consumer)
            .bind(id.to_string())
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// Deletes this consumer's done rows older than `window`, `batch` rows per
    /// statement so no other writer waits long for the lock, and returns how
    /// many went. Dead and failing rows stay until an operator releases them.
    ///
    /// `window` must exceed what the broker can hand out again (see
    /// [`Inbox`]): its retention, for a consumer that starts from the
    /// beginning; a shorter one lets the handler run twice for one event.
    pub async fn purge(&self, window: Duration, batch: u32) -> Result<u64, InboxError> {
        // Measured against SQLite's clock, the one that stamped the rows.
        let window = i64::try_from(window.as_micros()).unwrap_or(i64::MAX);
        let batch = i64::from(batch.max(1));
        let mut total = 0;
        loop {
            let deleted = sqlx::query(PURGE)
                .bind(&self.consumer)
                .bind(window)
                .bind(batch)
                .execute(&self.pool)
                .await?
                .rows_affected();
            total += deleted;
            if deleted < batch as u64 {
                return Ok(total);
            }
        }
    }
}

/// Watches the connection for a `COMMIT` until [`in_transaction`] next
/// looks at it: run by a handler, it commits the inbox's claim with the
/// handler's writes up to there, and whatever transaction the handler
/// begins afterwards holds the claim row too, committed, so finding the row
/// does not say whose transaction is open.
async fn watch_commits(conn: &mut SqliteConnection) -> Result<Arc<AtomicBool>, InboxError> {
    let committed = Arc::new(AtomicBool::new(false));
    let seen = committed.clone();
    conn.lock_handle().await?.set_commit_hook(move || {
        seen.store(true, Ordering::SeqCst);
        // Let the commit go through (false turns it into a rollback).
        true
    });
    Ok(committed)
}

/// Whether SQLite has the connection inside a transaction: sqlx counts the
/// transactions it began, but SQLite ends one on its own, or at the
/// handler's `COMMIT` or `ROLLBACK`.
async fn in_transaction(conn: &mut SqliteConnection) -> Result<bool, InboxError> {
    let mut handle = conn.lock_handle().await?;
    // The inbox's own commit is not the handler's.
    handle.remove_commit_hook();
    // SAFETY: the handle is locked for the call, so no statement runs on the
    // connection meanwhile, and `sqlite3_get_autocommit` only reads a flag.
    let autocommit = unsafe { libsqlite3_sys::sqlite3_get_autocommit(handle.as_raw_handle().as_ptr()) };
    Ok(autocommit == 0)
}

async fn read(conn: &mut SqliteConnection, consumer: &str, id: EventId) -> Result<Option<InboxRecord>, InboxError> {
    let row: Option<(String, i32, Option<String>, i64)> = sqlx::query_as(RECORD)
        .bind(consumer)
        .bind(id.to_string())
        .fetch_optional(conn)
        .await?;
    Ok(row.map(|(state, attempts, last_error, processed_at)| InboxRecord {
        state,
        attempts,
        last_error,
        processed_at: DateTime::from_timestamp_micros(processed_at).unwrap_or_default(),
    }))
}

/// SQLite refused the commit for a constraint (result code
/// SQLITE_CONSTRAINT, 19, in its low byte: a deferred foreign key).
fn constraint_failed(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == 19)
}
