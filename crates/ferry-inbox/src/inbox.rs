//! The inbox: exactly-once effects from at-least-once delivery.
//!
//! [`Inbox::process`] records `(consumer, event id)` and runs the handler's
//! writes in one transaction. The broker is acknowledged only after that
//! commit, so a crash anywhere before it leaves the message to be delivered
//! again, and a redelivery after it finds the row and is skipped.
//!
//! The outcome types, the retry/dead decision and the counting here are
//! shared with the SQLite inbox (`crate::sqlite`); only the SQL differs.

use std::borrow::Cow;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ferry_core::{EventId, RetryPolicy};
use futures::FutureExt;
#[cfg(feature = "postgres")]
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tracing::{debug, error, warn};

use crate::HandlerError;
#[cfg(feature = "postgres")]
use crate::ReceivedEvent;
use crate::metrics;

/// How much longer than the handler's timeout a statement of its attempt
/// may run before PostgreSQL ends it.
#[cfg(feature = "postgres")]
const STATEMENT_MARGIN: Duration = Duration::from_secs(1);
#[cfg(feature = "postgres")]
const CLAIM: &str = include_str!("sql/claim.sql");
#[cfg(feature = "postgres")]
const FAIL: &str = include_str!("sql/fail.sql");
#[cfg(feature = "postgres")]
const PURGE: &str = include_str!("sql/purge.sql");
#[cfg(feature = "postgres")]
const LEFT: &str = include_str!("sql/left.sql");
#[cfg(feature = "postgres")]
const START: &str = include_str!("sql/start.sql");
#[cfg(feature = "postgres")]
const ABANDONED: &str = include_str!("sql/abandoned.sql");
#[cfg(feature = "postgres")]
const ROLLED_BACK: &str = include_str!("sql/rolled_back.sql");
#[cfg(feature = "postgres")]
const CHECK: &str = include_str!("sql/check.sql");
/// How long an attempt waits by default for the event's row while another
/// attempt holds it.
#[cfg(feature = "postgres")]
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// What to do with the broker's message after [`Inbox::process`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler's writes committed with the inbox row: acknowledge.
    Processed,
    /// Already done by an earlier delivery: acknowledge, nothing ran.
    Duplicate,
    /// The handler failed and rolled back: redeliver after `delay`.
    Retry {
        attempts: u32,
        delay: Duration,
        error: String,
    },
    /// Given up: send the message to the dead-letter destination with
    /// `reason`, then acknowledge. Recorded dead in the inbox, so every later
    /// delivery of the event is dead-lettered again, never handled.
    Dead { attempts: u32, reason: String },
    /// Another attempt at the event (a delivery still running elsewhere, or
    /// one whose consumer stalled with its transaction open) held the
    /// event's inbox row for longer than the inbox's lock timeout: nothing
    /// ran and no attempt is counted. Leave the message to be delivered
    /// again, after `delay`: by then the other attempt has committed (the
    /// redelivery is a duplicate) or given the row up.
    InProgress { delay: Duration },
}

/// The decision after a failed attempt, the `attempts`-th: retry with
/// backoff, or dead when the error is permanent or the attempts are used up.
/// `unit` is a random number in `[0, 1)`, passed in so tests are exact.
pub fn after_failure(attempts: u32, error: &HandlerError, policy: &RetryPolicy, unit: f64) -> Outcome {
    if error.is_permanent() {
        return Outcome::Dead {
            attempts,
            reason: error.to_string(),
        };
    }
    if attempts >= policy.max_attempts.max(1) {
        return Outcome::Dead {
            attempts,
            reason: format!("max attempts ({}) reached; last error: {error}", policy.max_attempts),
        };
    }
    Outcome::Retry {
        attempts,
        delay: policy.backoff(attempts, unit),
        error: error.to_string(),
    }
}

/// The inbox failed to reach its own table; nothing was acknowledged, so the
/// broker delivers the message again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The database could not be reached, or failed the statement: an
    /// outage, waited out.
    #[error("inbox database error: {0}")]
    Database(sqlx::Error),
    /// The inbox's table is missing, older than this release needs, or not
    /// the database role's to use: every delivery would fail the same way
    /// until an operator acts, so the runners stop, saying what to do,
    /// instead of waiting it out as an outage. The text names the fix.
    #[error("the inbox cannot use its table: {0}")]
    Schema(String),
    #[error(
        "consumer name {0:?} is invalid; use a non-empty name of at most 200 bytes, without NUL bytes, that identifies this consumer"
    )]
    InvalidConsumer(String),
}

impl From<sqlx::Error> for InboxError {
    fn from(e: sqlx::Error) -> Self {
        match schema_problem(&e) {
            Some(why) => InboxError::Schema(why),
            None => InboxError::Database(e),
        }
    }
}

/// What an operator must do about an error of the inbox's own statements
/// that no redelivery mends, by its SQLSTATE: the table (or the schema) is
/// missing, a column or function of a later migration is, or the role may
/// not use them. Only PostgreSQL's codes match: SQLite's are numbers.
fn schema_problem(e: &sqlx::Error) -> Option<String> {
    let code = e.as_database_error()?.code()?;
    let fix = match code.as_ref() {
        // undefined_table, invalid_schema_name
        "42P01" | "3F000" => "the table ferry.inbox does not exist in this database: run `ferry migrate` against it",
        // undefined_column, undefined_function
        "42703" | "42883" => {
            "the table ferry.inbox is older than this release of the inbox needs (schema 25, which adds \
             `unfinished`): run `ferry migrate`"
        }
        // insufficient_privilege
        "42501" => GRANT_FIX,
        _ => return None,
    };
    Some(format!("{fix} ({e})"))
}

/// The fix for a role that may not use the inbox's table.
const GRANT_FIX: &str = "the database role may not use the table ferry.inbox: as its owner, run `GRANT USAGE ON SCHEMA \
     ferry TO <role>; GRANT SELECT, INSERT, UPDATE ON ferry.inbox TO <role>` for the consumer's role (and DELETE \
     for one that runs `purge` or `release`; docs/OPERATIONS.md, \"Least-privilege database roles\")";

/// One inbox row, for operators and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxRecord {
    pub state: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub processed_at: DateTime<Utc>,
}

/// Where a handler left the inbox's transaction when it returned.
#[cfg(feature = "postgres")]
enum Left {
    /// Still open, as it should be.
    Open,
    /// Aborted by a failed statement: it can only roll back.
    Aborted(sqlx::Error),
    /// Ended with a `ROLLBACK` inside the handler: the claim went with it.
    RolledBack,
    /// Ended with a `COMMIT` inside the handler: the inbox row is done, with
    /// the writes the handler made before it.
    Committed,
}

/// Reads where the handler left the transaction that claimed the event
/// (`xid`), from inside it (`left.sql`).
///
/// A handler that swallows a failed statement's error (`let _ = ...`)
/// leaves PostgreSQL's transaction aborted, and `COMMIT` on an aborted
/// transaction rolls it back *without an error*: the handler's writes and
/// the inbox row would be gone while the broker is acknowledged. A handler
/// that runs `ROLLBACK` itself loses them the same way, and one that runs
/// `COMMIT` itself commits the row early: what it does afterwards, failing
/// or not, is outside the inbox's transaction. So the transaction is
/// checked before the inbox commits it or counts a failure.
#[cfg(feature = "postgres")]
async fn left(tx: &mut PgConnection, consumer: &str, id: EventId, xid: i64) -> Result<Left, InboxError> {
    let row: Result<Option<(bool, bool)>, sqlx::Error> = sqlx::query_as(LEFT)
        .bind(consumer)
        .bind(id.0)
        .bind(xid)
        .fetch_optional(tx)
        .await;
    match row {
        Ok(Some((true, _))) => Ok(Left::Open),
        Ok(Some((false, true))) => Ok(Left::Committed),
        // No row, or a done row another delivery committed after the
        // handler's own ROLLBACK let it claim the event.
        Ok(_) => Ok(Left::RolledBack),
        Err(e) if refused_by_server(&e) => Ok(Left::Aborted(e)),
        Err(e) => Err(e.into()),
    }
}

/// Commits a handler's transaction, which [`left`] found open. A `COMMIT`
/// the server refuses (a deferred constraint, a serialization failure) is
/// the handler's failure, counted and retried like any other, not an
/// outage: it would fail the same way on every redelivery.
#[cfg(feature = "postgres")]
async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<Option<HandlerError>, InboxError> {
    match tx.commit().await {
        Ok(()) => Ok(None),
        Err(e) if refused_by_server(&e) => Ok(Some(HandlerError::transient(format!(
            "the handler's transaction could not commit: {e}"
        )))),
        Err(e) => Err(e.into()),
    }
}

/// The server refused the statement for what the transaction did, as
/// opposed to a lost connection or a server in trouble (SQLSTATE classes
/// 08, 53, 57, 58 and XX), after which the outcome is unknown or the
/// database is what needs fixing. Two codes of class 25 end the session
/// too: 25P03 (`idle_in_transaction_session_timeout`) and 25P04
/// (`transaction_timeout`).
#[cfg(feature = "postgres")]
fn refused_by_server(e: &sqlx::Error) -> bool {
    let Some(code) = e.as_database_error().and_then(|d| d.code()) else {
        return false;
    };
    let session_ended = ["08", "53", "57", "58", "XX"]
        .iter()
        .any(|class| code.starts_with(class))
        || code == "25P03"
        || code == "25P04";
    !session_ended
}

/// A lock waited on for longer than `lock_timeout` (SQLSTATE 55P03,
/// `lock_not_available`).
#[cfg(feature = "postgres")]
fn lock_not_available(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03")
}

/// A statement cancelled (`pg_cancel_backend`; SQLSTATE 57014).
#[cfg(feature = "postgres")]
fn cancelled(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("57014")
}

/// The dead letter's reason for an event whose handler ran `COMMIT` itself
/// (and then returned `failure`, if it did), in either inbox.
pub(crate) fn committed_by_handler(failure: Option<HandlerError>) -> String {
    let then = failure.map_or_else(String::new, |e| format!(" and then failed ({e})"));
    format!(
        "the handler committed the inbox's transaction itself (COMMIT inside the handler){then}: its writes \
         before that COMMIT are committed with the event's inbox row, those after it are outside the inbox's \
         transaction; not retried, since a retry would apply the first writes again: let the inbox commit, \
         check the event's effects, and release it only if it must run again"
    )
}

/// The dead letter's reason for an event whose handler ran `ROLLBACK`
/// itself (and then returned `failure`, if it did), in either inbox.
pub(crate) fn rolled_back_by_handler(failure: Option<HandlerError>) -> String {
    let then = failure.map_or_else(String::new, |e| format!(" and then failed ({e})"));
    format!(
        "the handler ended the inbox's transaction itself (ROLLBACK inside the handler){then}: the event's inbox \
         row went with it, and whatever the handler wrote after the ROLLBACK committed on its own, outside the \
         inbox's transaction; not retried, since a retry would apply those writes again: return an error to roll \
         back, check the event's effects, and release it only if it must run again"
    )
}

/// Whether an attempt about to start at an event is past the policy's
/// attempts: `attempts` finished before it and `unfinished` started and did
/// not finish, this one included. Every attempt counts, the ones the
/// process died in too. Returns the dead letter's reason if so.
pub(crate) fn past_attempts(attempts: i32, unfinished: i32, policy: &RetryPolicy) -> Option<String> {
    let started = i64::from(attempts) + i64::from(unfinished);
    if started <= i64::from(policy.max_attempts.max(1)) {
        return None;
    }
    let stopped = unfinished - 1;
    let failed = if attempts > 0 {
        format!(", after {attempts} that failed")
    } else {
        String::new()
    };
    Some(format!(
        "{stopped} attempts did not finish{failed}: the process stopped while handling this event (a crash, an \
         out-of-memory kill, kill -9, an abort); max attempts ({}) reached, the handler is not run again: find \
         what stops the process, then release the event",
        policy.max_attempts
    ))
}

/// Logs a mark that found earlier attempts unfinished, and the decision.
pub(crate) fn log_unfinished(consumer: &str, id: EventId, attempts: i32, unfinished: i32, dead: Option<&str>) {
    match dead {
        Some(reason) => {
            metrics::dead(consumer);
            error!(consumer = %consumer, event = %id, attempts, unfinished = unfinished - 1, %reason, "dead unrun");
        }
        None if unfinished > 1 => warn!(
            consumer = %consumer,
            event = %id,
            attempts,
            unfinished = unfinished - 1,
            "earlier attempts at this event did not finish (the process stopped while handling it); trying again"
        ),
        None => {}
    }
}

/// Runs a handler's future, turning a panic into a failed attempt: left to
/// unwind, it would take the consumer down before the attempt is counted,
/// and on restart the broker hands the same message out first again (the
/// committed offset, the queue's head, the pending entries), for ever. The
/// caller rolls the handler's transaction back, as for any failure.
pub(crate) async fn run_handler(
    handler: impl Future<Output = Result<(), HandlerError>>,
    consumer: &str,
    id: EventId,
    limit: Option<Duration>,
) -> Ran {
    let caught = AssertUnwindSafe(handler).catch_unwind();
    let outcome = match limit {
        None => caught.await,
        Some(limit) => match tokio::time::timeout(limit, caught).await {
            Ok(outcome) => outcome,
            Err(_) => {
                let error = HandlerError::transient(format!(
                    "the handler ran longer than the inbox's handler_timeout ({limit:?}) and was stopped; its \
                     transaction is rolled back: make the handler faster, or raise the timeout"
                ));
                warn!(consumer = %consumer, event = %id, %error, "handler timed out");
                return Ran::TimedOut(error);
            }
        },
    };
    match outcome {
        Ok(result) => Ran::Returned(result),
        Err(panic) => {
            let error = HandlerError::panicked(panic);
            warn!(consumer = %consumer, event = %id, %error, "handler panicked; its transaction is rolled back");
            Ran::Returned(Err(error))
        }
    }
}

/// How a handler run ended.
pub(crate) enum Ran {
    /// It returned (or panicked: an error).
    Returned(Result<(), HandlerError>),
    /// It outlasted the inbox's handler timeout and was dropped where it
    /// stood, perhaps in the middle of a statement.
    TimedOut(HandlerError),
}

impl Ran {
    pub(crate) fn into_result(self) -> Result<(), HandlerError> {
        match self {
            Ran::Returned(result) => result,
            Ran::TimedOut(error) => Err(error),
        }
    }
}

/// A consumer name both inboxes accept: it keys every row, so a blank one
/// would merge unrelated consumers, and one with a NUL byte (which
/// PostgreSQL cannot store in text) would fail every claim.
pub(crate) fn checked_consumer(consumer: String) -> Result<String, InboxError> {
    if consumer.trim().is_empty() || consumer.len() > 200 || consumer.contains('\0') {
        return Err(InboxError::InvalidConsumer(consumer));
    }
    Ok(consumer)
}

/// The event type as the inbox row records it. The column is for operators
/// (rows are keyed by event id), so a NUL byte, which PostgreSQL cannot
/// store in text, is replaced with U+FFFD: an event a caller built with one
/// is deduplicated like any other instead of failing every claim. (The
/// runners' decoders refuse such a type before it gets here.)
pub(crate) fn stored_type(event_type: &str) -> Cow<'_, str> {
    if event_type.contains('\0') {
        Cow::Owned(event_type.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(event_type)
    }
}

/// 5 attempts, 1 s doubling to 60 s.
pub(crate) fn default_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 5,
        base_delay: Duration::from_secs(1),
        max_delay: Duration::from_secs(60),
        jitter: 0.2,
    }
}

/// Counts a handler whose writes committed with the inbox row.
pub(crate) fn count_processed(consumer: &str, id: EventId, attempts: i32) {
    metrics::processed(consumer);
    debug!(consumer = %consumer, event = %id, attempts, "processed");
}

/// The outcome for an event whose row was already done or dead when this
/// delivery came to claim it (`record` is that row, read afterwards).
pub(crate) fn already_recorded(consumer: &str, id: EventId, record: Option<InboxRecord>) -> Outcome {
    match record {
        Some(r) if r.state == "dead" => {
            metrics::dead(consumer);
            Outcome::Dead {
                attempts: u32::try_from(r.attempts).unwrap_or(0),
                reason: r.last_error.unwrap_or_else(|| "dead".into()),
            }
        }
        _ => {
            metrics::duplicate(consumer);
            debug!(consumer = %consumer, event = %id, "duplicate skipped");
            Outcome::Duplicate
        }
    }
}

/// Decides retry or dead after the `attempts`-th failure (already counted in
/// the table) and counts it. The caller records a dead outcome in its row.
pub(crate) fn decide_failure(
    consumer: &str,
    id: EventId,
    attempts: i32,
    error: &HandlerError,
    policy: &RetryPolicy,
) -> Outcome {
    let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
    let outcome = after_failure(attempts, error, policy, rand::random::<f64>());
    if let Outcome::Dead { reason, .. } = &outcome {
        metrics::dead(consumer);
        warn!(consumer = %consumer, event = %id, attempts, %reason, "dead");
    } else {
        metrics::retry(consumer);
        debug!(consumer = %consumer, event = %id, attempts, %error, "will retry");
    }
    outcome
}

/// Deduplicates one consumer's events in `ferry.inbox` (created by
/// `ferry migrate`).
///
/// Rows are kept for a retention window and purged with [`Inbox::purge`],
/// which sets a horizon: an event whose row was purged is applied again if
/// the broker hands it out again. **The window must be longer than the
/// broker keeps messages, plus consumer downtime**: besides late
/// redeliveries (retries, outages, replays from a dead-letter queue), a
/// consumer group, durable or stream group created anew (or whose Kafka
/// offsets expired) re-reads everything the broker still holds. The README
/// ("Retention, order and outages") says how to size it per broker.
#[cfg(feature = "postgres")]
#[derive(Debug, Clone)]
pub struct Inbox {
    pool: PgPool,
    consumer: String,
    retry: RetryPolicy,
    handler_timeout: Option<Duration>,
    lock_timeout: Duration,
}

#[cfg(feature = "postgres")]
impl Inbox {
    /// An inbox for `consumer`, a stable name: two deployments of the same
    /// consumer share it, two different consumers of one event must not.
    pub fn new(pool: PgPool, consumer: impl Into<String>) -> Result<Self, InboxError> {
        Ok(Self {
            pool,
            consumer: checked_consumer(consumer.into())?,
            retry: default_retry(),
            handler_timeout: None,
            lock_timeout: LOCK_TIMEOUT,
        })
    }

    /// How failed handlers are retried; default 5 attempts, 1 s doubling to 60 s.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long an attempt waits for the event's inbox row while another
    /// attempt at the same event holds it (`lock_timeout` on the inbox's
    /// own statements; the handler's run under the session's). Default 5 s.
    ///
    /// Two deliveries of one event meet when the broker hands it out again
    /// while a first attempt still runs: a slow handler past NATS
    /// `ack_wait` or Redis `claim_idle`, a consumer that lost its broker
    /// connection but not its database session, one paused or hung with its
    /// transaction open. Past this wait the delivery is
    /// [`Outcome::InProgress`]: not an attempt, nothing counted, the message
    /// left to the broker for later (after the retry policy's `max_delay`),
    /// and this consumer goes on with other messages instead of waiting, as
    /// long as the other attempt lasts, on a row it cannot have. Each such
    /// delivery costs its consumer this long, so keep it short; within it, a
    /// delivery that meets a live attempt finishing sees the event done. A
    /// table lock held that long (a migration, `VACUUM FULL`) has the same
    /// outcome. At least 1 ms, and at most PostgreSQL's largest
    /// `lock_timeout` (about 24.8 days).
    pub fn with_lock_timeout(mut self, limit: Duration) -> Self {
        self.lock_timeout = limit.clamp(Duration::from_millis(1), Duration::from_millis(i32::MAX as u64));
        self
    }

    /// Stops a handler run that takes longer than `limit`: the attempt
    /// fails (counted and retried like any failure), its transaction rolled
    /// back, a statement it was waiting on cancelled, so that a handler
    /// hung on a lock or a remote call does not hold its consumer, and the
    /// event's row lock, for ever. The attempt's transaction also runs with
    /// `statement_timeout` a second above `limit` (a handler may set its
    /// own). Off by default. An effect outside the database the handler had
    /// started may still happen: like any retried attempt, such effects
    /// must be idempotent.
    pub fn with_handler_timeout(mut self, limit: Duration) -> Self {
        self.handler_timeout = Some(limit);
        self
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Checks that `ferry.inbox` exists as this release needs it and that
    /// the pool's role may read and write it: [`InboxError::Schema`],
    /// naming the fix, if not. Each runner checks before it consumes: an
    /// application deployed before `ferry migrate`, or run as a role without
    /// the grants, would otherwise fail every delivery, taken for a
    /// database outage and retried for ever (and past a broker's delivery
    /// limit, dropped). [`InboxError::Database`] when the database cannot
    /// be reached.
    pub async fn check(&self) -> Result<(), InboxError> {
        // Not DELETE: the runners never delete, only `purge` and `release`.
        let (insert, update, _): (bool, bool, i64) = sqlx::query_as(CHECK).fetch_one(&self.pool).await?;
        let missing: Vec<&str> = [("INSERT", insert), ("UPDATE", update)]
            .into_iter()
            .filter_map(|(right, held)| (!held).then_some(right))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(InboxError::Schema(format!(
            "{GRANT_FIX} (it lacks {})",
            missing.join(", ")
        )))
    }

    /// Runs `handler` for `event` unless this consumer already processed it.
    ///
    /// The handler writes through the transaction it is given and leaves it
    /// open: the inbox commits it. A handler that returns `Ok` from a
    /// transaction a failed statement aborted has a failed attempt,
    /// retried. One that ran `COMMIT` committed the inbox row with its
    /// writes up to there, and one that ran `ROLLBACK` lost the row; either
    /// way nothing it wrote afterwards is atomic with the row: the event is
    /// recorded [`Outcome::Dead`] with a reason naming the bug, never
    /// retried (which would repeat those writes) nor acknowledged as
    /// processed. A handler that panics has a failed attempt, its
    /// transaction rolled back.
    ///
    /// ```no_run
    /// # async fn demo(inbox: ferry_inbox::Inbox, event: ferry_inbox::ReceivedEvent) -> Result<(), ferry_inbox::InboxError> {
    /// let outcome = inbox
    ///     .process(&event, async |tx, event| {
    ///         sqlx::query("INSERT INTO paid (order_id) VALUES ($1)").bind(&event.key).execute(tx).await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn process(
        &self,
        event: &ReceivedEvent,
        handler: impl AsyncFnOnce(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        self.run(event, false, async |tx| handler(tx, event).await).await
    }

    /// [`process`](Self::process) for a delivery the broker may have handed
    /// out before: a redelivery, or a record read again after a restart.
    ///
    /// An attempt is counted in the handler's transaction, so one the
    /// process dies in (killed, out of memory, aborted inside the handler)
    /// leaves no count, and the broker hands the event out again, for ever.
    /// This first records, in a statement of its own committed before the
    /// handler runs, that an attempt starts; a finished attempt clears that
    /// mark. Unfinished attempts count toward the retry policy's
    /// `max_attempts` like failed ones: past it the event is
    /// [`Outcome::Dead`] without running the handler again. A mark costs a
    /// transaction, so the runners mark only what may be a replay
    /// (RabbitMQ `redelivered`, a NATS delivery count above 1, a Redis
    /// entry pending or claimed, a Kafka partition's records after an
    /// assignment until one is processed anew). A first delivery is not
    /// marked, so an event whose handler kills the process is run at most
    /// `max_attempts + 1` times.
    pub async fn process_redelivered(
        &self,
        event: &ReceivedEvent,
        handler: impl AsyncFnOnce(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        match self.start(event).await? {
            Some(outcome) => Ok(outcome),
            None => self.run(event, true, async |tx| handler(tx, event).await).await,
        }
    }

    /// Marks an attempt's start (`start.sql`). `None` to run the handler;
    /// otherwise the outcome without it: the event done or dead, past its
    /// attempts, or held by another attempt.
    async fn start(&self, event: &ReceivedEvent) -> Result<Option<Outcome>, InboxError> {
        let mut tx = self.begin().await?;
        let marked: Result<Option<(i32, i32)>, sqlx::Error> = sqlx::query_as(START)
            .bind(&self.consumer)
            .bind(event.id.0)
            .bind(stored_type(&event.event_type))
            .fetch_optional(&mut *tx)
            .await;
        let (attempts, unfinished) = match marked {
            Ok(Some(marked)) => marked,
            Ok(None) => return self.recorded_in(tx, event.id).await.map(Some),
            Err(e) if lock_not_available(&e) => return Ok(Some(self.in_progress(event.id))),
            Err(e) => return Err(e.into()),
        };
        let Some(reason) = past_attempts(attempts, unfinished, &self.retry) else {
            tx.commit().await?;
            log_unfinished(&self.consumer, event.id, attempts, unfinished, None);
            return Ok(None);
        };
        let attempts: i32 = sqlx::query_scalar(ABANDONED)
            .bind(&self.consumer)
            .bind(event.id.0)
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
        handler: impl AsyncFnOnce(&mut PgConnection) -> Result<(), HandlerError>,
    ) -> Result<Outcome, InboxError> {
        let mut tx = self.begin().await?;
        // Inserts the row, or takes over a failing one; a done or dead row
        // (committed, or committed while this statement waited on its lock)
        // returns nothing. Concurrent deliveries of one event serialise
        // here, each waiting at most the lock timeout.
        //
        // The claim also sets what the handler runs under: the session's
        // lock_timeout back, and with a handler timeout, the backstop to the
        // cancel below: no statement of the attempt outlives the handler's
        // own limit by much, even if the cancel cannot be delivered. The
        // second's margin lets the handler's timeout, which names itself,
        // come first.
        let statement_timeout = self
            .handler_timeout
            .map(|limit| format!("{}ms", (limit + STATEMENT_MARGIN).as_millis()));
        type Claimed = (i32, i64, i32, String, String);
        let claimed: Result<Option<Claimed>, sqlx::Error> = sqlx::query_as(CLAIM)
            .bind(&self.consumer)
            .bind(event.id.0)
            .bind(stored_type(&event.event_type))
            .bind(statement_timeout)
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await;
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) if lock_not_available(&e) => return Ok(self.in_progress(event.id)),
            Err(e) => return Err(e.into()),
        };
        let Some((attempts, xid, backend, _, _)) = claimed else {
            return self.recorded_in(tx, event.id).await;
        };
        let ran = run_handler(handler(&mut tx), &self.consumer, event.id, self.handler_timeout).await;
        let timed_out = matches!(ran, Ran::TimedOut(_));
        if timed_out {
            self.cancel_statement(backend, event.id).await;
        }
        let result = ran.into_result();
        let left = match left(&mut tx, &self.consumer, event.id, xid).await {
            // A cancelled statement's answer, read first: ask again. The
            // statement is the one the timeout above stopped, or one the
            // handler stopped waiting for itself (its own timeout around
            // it) and the server then cancelled (`statement_timeout`): its
            // transaction is aborted, which the second answer says.
            Err(InboxError::Database(e)) if cancelled(&e) => left(&mut tx, &self.consumer, event.id, xid).await,
            left => left,
        };
        let left = match left {
            Ok(left) => left,
            Err(lost) => {
                // Ended before the failure is counted on another
                // connection: open, the transaction would hold the event's
                // row, and the count would wait on it for ever.
                let _ = tx.rollback().await;
                return self.lost_mid_attempt(event, lost, marked).await;
            }
        };
        let error = match (result, left) {
            (result, Left::Aborted(e)) => {
                tx.rollback().await?;
                // The transaction a failed statement aborted can be one the
                // handler began after a COMMIT of its own, which took the
                // claim with it: now that it is rolled back, read whether
                // the done row is this attempt's claim.
                if self.claim_committed(event.id, xid).await? {
                    return self.committed_by_handler(event, result.err()).await;
                }
                match result {
                    Ok(()) => HandlerError::transient(format!(
                        "a statement in the handler failed and the handler did not return the error, so \
                         PostgreSQL rolled back the whole transaction ({e}); return the error, or run the \
                         statement in a savepoint"
                    )),
                    Err(error) => error,
                }
            }
            (result, Left::Committed) => {
                // Ends whatever the handler began after its COMMIT; after a
                // bare COMMIT there is nothing to end (PostgreSQL warns).
                tx.rollback().await?;
                return self.committed_by_handler(event, result.err()).await;
            }
            (Ok(()), Left::Open) => match commit(tx).await {
                Ok(None) => {
                    count_processed(&self.consumer, event.id, attempts);
                    return Ok(Outcome::Processed);
                }
                Ok(Some(error)) => error,
                Err(lost) => return self.lost_mid_attempt(event, lost, marked).await,
            },
            (result, Left::RolledBack) => {
                // Nothing to end: the handler's ROLLBACK did (PostgreSQL
                // warns), and its writes after it committed one by one.
                tx.rollback().await?;
                return self.rolled_back_by_handler(event, result.err(), marked).await;
            }
            (Err(error), Left::Open) => {
                tx.rollback().await?;
                error
            }
        };
        self.failed(event, &error, marked).await
    }

    /// Begins one of the inbox's transactions, with `lock_timeout` set to
    /// the inbox's for its own statements, the session's saved in
    /// `ferry.session_lock_timeout` for `claim.sql` to give back to
    /// the handler: all in the `BEGIN`'s round trip.
    async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let begin = format!(
            "BEGIN; SELECT set_config('ferry.session_lock_timeout', current_setting('lock_timeout'), true); \
             SET LOCAL lock_timeout = '{}ms'",
            self.lock_timeout.as_millis()
        );
        self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await
    }

    /// A delivery that found another attempt holding the event's row past
    /// the lock timeout, at its claim (its handler did not run) or when
    /// counting its failure: no attempt is counted.
    fn in_progress(&self, id: EventId) -> Outcome {
        metrics::in_progress(&self.consumer);
        let delay = self.retry.backoff(u32::MAX, rand::random::<f64>());
        warn!(
            consumer = %self.consumer,
            event = %id,
            lock_timeout = ?self.lock_timeout,
            ?delay,
            "another attempt at the event holds its inbox row (a delivery still running, or a consumer stalled \
             with its transaction open); no attempt is counted, the message is left for redelivery"
        );
        Outcome::InProgress { delay }
    }

    /// Cancels the statement, if any, that a handler stopped at its timeout
    /// left running on `backend`, the attempt's session: without that, the
    /// next statement on the connection (the inbox's own) would wait for it.
    /// A session between statements ignores the cancel. It is sent on a
    /// connection of its own, not one of the pool's (hung handlers may hold
    /// them all), within a bound; should it not arrive, the attempt's
    /// `statement_timeout` ends the statement.
    async fn cancel_statement(&self, backend: i32, id: EventId) {
        const BOUND: Duration = Duration::from_secs(5);
        let options = self.pool.connect_options();
        let cancel = async {
            let mut conn = options.connect().await?;
            let sent: bool = sqlx::query_scalar("SELECT pg_cancel_backend($1)")
                .bind(backend)
                .fetch_one(&mut conn)
                .await?;
            let _ = conn.close().await;
            Ok::<_, sqlx::Error>(sent)
        };
        let why = match tokio::time::timeout(BOUND, cancel).await {
            Ok(Ok(true)) => return,
            Ok(Ok(false)) => "PostgreSQL found no such session of this user".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {BOUND:?}"),
        };
        warn!(consumer = %self.consumer, event = %id, backend, %why, "could not cancel the timed-out handler's statement; it ends at the attempt's statement_timeout");
    }

    /// The connection failed after the claim, the handler's transaction
    /// open: the server ended the session (`idle_in_transaction_session_timeout`
    /// under a slow handler, a terminated backend, a failover) or the
    /// network dropped. If the transaction committed all the same, its row
    /// is done and this is a duplicate; if not, the attempt is counted, on
    /// another connection, so that a handler that always outlasts its
    /// session goes dead after its attempts rather than being put back for
    /// ever, uncounted, as an outage. Only when the database cannot be
    /// reached for that either is it one.
    async fn lost_mid_attempt(
        &self,
        event: &ReceivedEvent,
        lost: InboxError,
        marked: bool,
    ) -> Result<Outcome, InboxError> {
        let error = HandlerError::transient(format!(
            "the database connection failed during the attempt ({lost}); the handler's writes, uncommitted, \
             are gone"
        ));
        match self.failed(event, &error, marked).await {
            Ok(outcome) => Ok(outcome),
            Err(_) => Err(lost),
        }
    }

    /// Whether the done row of `id` is the claim of the attempt whose
    /// transaction was `xid`: committed by the handler itself.
    async fn claim_committed(&self, id: EventId, xid: i64) -> Result<bool, InboxError> {
        let ours: Option<bool> = sqlx::query_scalar(
            "SELECT xmin::text::bigint = $3 % 4294967296 FROM ferry.inbox \
              WHERE consumer = $1 AND event_id = $2 AND state = 'done'",
        )
        .bind(&self.consumer)
        .bind(id.0)
        .bind(xid)
        .fetch_optional(&self.pool)
        .await?;
        Ok(ours == Some(true))
    }

    /// The handler ran `COMMIT` itself, so the event's inbox row committed
    /// done with the writes the handler made before it, and what it did
    /// afterwards (a failure it returned, or writes that each committed on
    /// their own) was outside the inbox's transaction. A retry would apply
    /// the first writes again and acknowledging it as processed would hide
    /// the rest: the event is recorded dead and dead-lettered with the
    /// reason, loudly, as the handler bug it is, the attempt counted.
    async fn committed_by_handler(
        &self,
        event: &ReceivedEvent,
        failure: Option<HandlerError>,
    ) -> Result<Outcome, InboxError> {
        let reason = committed_by_handler(failure);
        let attempts: Option<i32> = sqlx::query_scalar(
            "UPDATE ferry.inbox SET state = 'dead', last_error = $3, processed_at = now() \
             WHERE consumer = $1 AND event_id = $2 AND state = 'done' RETURNING attempts",
        )
        .bind(&self.consumer)
        .bind(event.id.0)
        .bind(&reason)
        .fetch_optional(&self.pool)
        .await?;
        let Some(attempts) = attempts else {
            return self.already_recorded(event.id).await;
        };
        metrics::dead(&self.consumer);
        error!(consumer = %self.consumer, event = %event.id, attempts, %reason, "handler bug: dead");
        Ok(Outcome::Dead {
            attempts: u32::try_from(attempts).unwrap_or(0),
            reason,
        })
    }

    /// The handler ran `ROLLBACK` itself, which took the event's claim with
    /// it, and whatever it wrote afterwards committed statement by
    /// statement, outside the inbox's transaction: a retry would apply
    /// those writes again. As for a `COMMIT` inside the handler, the event
    /// is recorded dead, the attempt counted, and dead-lettered with the
    /// reason.
    async fn rolled_back_by_handler(
        &self,
        event: &ReceivedEvent,
        failure: Option<HandlerError>,
        marked: bool,
    ) -> Result<Outcome, InboxError> {
        let reason = rolled_back_by_handler(failure);
        let mut tx = self.begin().await?;
        let recorded: Result<Option<i32>, sqlx::Error> = sqlx::query_scalar(ROLLED_BACK)
            .bind(&self.consumer)
            .bind(event.id.0)
            .bind(stored_type(&event.event_type))
            .bind(&reason)
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await;
        let attempts = match recorded {
            Ok(Some(attempts)) => attempts,
            // Another delivery of the event finished it meanwhile.
            Ok(None) => return self.recorded_in(tx, event.id).await,
            Err(e) if lock_not_available(&e) => return Ok(self.in_progress(event.id)),
            Err(e) => return Err(e.into()),
        };
        tx.commit().await?;
        metrics::dead(&self.consumer);
        error!(consumer = %self.consumer, event = %event.id, attempts, %reason, "handler bug: dead");
        Ok(Outcome::Dead {
            attempts: u32::try_from(attempts).unwrap_or(0),
            reason,
        })
    }

    /// A row exists and is done or dead.
    async fn already_recorded(&self, id: EventId) -> Result<Outcome, InboxError> {
        let record = record_on(&self.pool, &self.consumer, id).await?;
        Ok(already_recorded(&self.consumer, id, record))
    }

    /// [`already_recorded`](Self::already_recorded) for a claim (or a
    /// failure count) that found the row done or dead, read in its own
    /// transaction: the statement locked the row (`ON CONFLICT DO UPDATE`
    /// locks it even when its `WHERE` refuses the update), so a `release`
    /// cannot delete it before it is read. Read afterwards, a row released
    /// meanwhile looked like a purged one: a duplicate, acknowledged
    /// without ever running the handler.
    async fn recorded_in(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        id: EventId,
    ) -> Result<Outcome, InboxError> {
        let record = record_on(&mut *tx, &self.consumer, id).await?;
        drop(tx);
        Ok(already_recorded(&self.consumer, id, record))
    }

    /// Counts the failed attempt in its own transaction (the handler's was
    /// rolled back) and decides between retry and dead.
    ///
    /// Another attempt may have claimed the row since this one's rolled
    /// back; should it hold it past the lock timeout, this failure goes
    /// uncounted ([`Outcome::InProgress`]): that attempt's own is.
    async fn failed(&self, event: &ReceivedEvent, error: &HandlerError, marked: bool) -> Result<Outcome, InboxError> {
        let mut tx = self.begin().await?;
        let counted: Result<Option<i32>, sqlx::Error> = sqlx::query_scalar(FAIL)
            .bind(&self.consumer)
            .bind(event.id.0)
            .bind(stored_type(&event.event_type))
            .bind(error.message())
            .bind(marked)
            .fetch_optional(&mut *tx)
            .await;
        let counted = match counted {
            Ok(counted) => counted,
            Err(e) if lock_not_available(&e) => return Ok(self.in_progress(event.id)),
            Err(e) => return Err(e.into()),
        };
        let Some(attempts) = counted else {
            // Another delivery of the same event finished it meanwhile.
            return self.recorded_in(tx, event.id).await;
        };
        let outcome = decide_failure(&self.consumer, event.id, attempts, error, &self.retry);
        if let Outcome::Dead { reason, .. } = &outcome {
            sqlx::query(
                "UPDATE ferry.inbox SET state = 'dead', last_error = $3, processed_at = now() \
                 WHERE consumer = $1 AND event_id = $2",
            )
            .bind(&self.consumer)
            .bind(event.id.0)
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(outcome)
    }

    /// The inbox row for `id`, if any.
    pub async fn record(&self, id: EventId) -> Result<Option<InboxRecord>, InboxError> {
        record_on(&self.pool, &self.consumer, id).await
    }

    /// Forgets a dead or failing event so that a replay (from the dead-letter
    /// queue, say) is handled afresh; a done event is kept. Returns whether a
    /// row went.
    pub async fn release(&self, id: EventId) -> Result<bool, InboxError> {
        let deleted = sqlx::query("DELETE FROM ferry.inbox WHERE consumer = $1 AND event_id = $2 AND state <> 'done'")
            .bind(&self.consumer)
            .bind(id.0)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// Deletes this consumer's done rows older than `window`, `batch` rows per
    /// statement so no transaction holds many locks, and returns how many
    /// went. Dead and failing rows stay until an operator releases them.
    ///
    /// `window` must exceed what the broker can hand out again (see
    /// [`Inbox`]): its retention, for a consumer that starts from the
    /// beginning; a shorter one lets the handler run twice for one event.
    pub async fn purge(&self, window: Duration, batch: u32) -> Result<u64, InboxError> {
        // The cutoff is taken from the database's clock, which wrote
        // `processed_at`: a consumer host whose clock runs ahead must not
        // purge rows still inside the window. Past 300 years the window
        // reaches before any row (and within PostgreSQL's range).
        let window = window.as_secs_f64().min(1e10);
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

/// `consumer`'s inbox row for `id`, read through `conn`.
#[cfg(feature = "postgres")]
async fn record_on<'c>(
    conn: impl sqlx::PgExecutor<'c>,
    consumer: &str,
    id: EventId,
) -> Result<Option<InboxRecord>, InboxError> {
    let row: Option<(String, i32, Option<String>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT state, attempts, last_error, processed_at FROM ferry.inbox WHERE consumer = $1 AND event_id = $2",
    )
    .bind(consumer)
    .bind(id.0)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|(state, attempts, last_error, processed_at)| InboxRecord {
        state,
        attempts,
        last_error,
        processed_at,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            jitter: 0.0,
        }
    }

    #[test]
    fn retries_with_backoff_then_dead() {
        let err = HandlerError::transient("db busy");
        assert_eq!(
            after_failure(1, &err, &policy(), 0.0),
            Outcome::Retry {
                attempts: 1,
                delay: Duration::from_millis(100),
                error: "db busy".into()
            }
        );
        assert!(matches!(
            after_failure(2, &err, &policy(), 0.0),
            Outcome::Retry { delay, .. } if delay == Duration::from_millis(200)
        ));
        assert_eq!(
            after_failure(3, &err, &policy(), 0.0),
            Outcome::Dead {
                attempts: 3,
                reason: "max attempts (3) reached; last error: db busy".into()
            }
        );
    }

    #[test]
    fn permanent_errors_are_dead_at_once() {
        let err = HandlerError::permanent("no such order");
        assert!(matches!(
            after_failure(1, &err, &policy(), 0.5),
            Outcome::Dead { attempts: 1, reason } if reason == "no such order"
        ));
    }
}
