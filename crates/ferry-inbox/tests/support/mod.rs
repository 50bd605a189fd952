//! What the end-to-end tests share: a database with the ferry schema and an
//! `effects` table, a relay publishing through a real sink, and waiting on
//! conditions with a deadline.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferry_core::{Event, EventId, Glob, RetryPolicy, Route, Sink, SystemClock};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_relay::{Relay, RelaySettings, RunReport};
use ferry_store::postgres::{PgStore, enqueue_batch, migrate};
use ferry_testkit::pg::TestDb;
use ferry_testkit::rabbit::unique_name;
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const WITHIN: Duration = Duration::from_secs(60);

pub struct Db {
    pub pool: PgPool,
    /// The database's URL, to connect through a fault proxy.
    pub url: String,
    _db: TestDb,
}

impl Db {
    pub async fn new() -> Db {
        let db = TestDb::create().await;
        let pool = db.pool().await;
        migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
        // No unique constraint: a second effect of one event must show, not fail.
        sqlx::query("CREATE TABLE effects (event_id uuid NOT NULL, n int NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        Db {
            pool,
            url: db.url().to_owned(),
            _db: db,
        }
    }

    /// A relay with one route per name, all to `destination` on `sink`.
    pub fn relay(&self, sink: Arc<dyn Sink>, routes: &[&str], destination: &str) -> RelayRun {
        let routes = routes
            .iter()
            .map(|name| Route {
                name: (*name).into(),
                matcher: Glob::new("**").unwrap(),
                sink: "sink".into(),
                destination: destination.into(),
                routing_key: None,
            })
            .collect();
        let settings = RelaySettings {
            batch_size: 100,
            // Longer than the sinks' publish timeouts (10 s by default), as
            // `ferry run` requires: on a loaded machine a shorter lease lapses
            // under a slow confirm, and the relay publishes again, a duplicate
            // the tests that count dead letters would take for a bug.
            lease: Duration::from_secs(15),
            retry: RetryPolicy {
                max_attempts: 20,
                base_delay: Duration::from_millis(20),
                max_delay: Duration::from_millis(200),
                jitter: 0.2,
            },
            ..RelaySettings::new(unique_name("relay"))
        };
        let sinks = HashMap::from([("sink".to_owned(), sink)]);
        let relay = Relay::new(PgStore::new(self.pool.clone()), SystemClock, settings, routes, sinks).unwrap();
        let (stop, rx) = oneshot::channel();
        let handle = tokio::spawn(async move {
            relay
                .run(async {
                    let _ = rx.await;
                })
                .await
                .unwrap()
        });
        RelayRun { stop, handle }
    }

    /// The `billing` inbox, retrying a failed event quickly and giving up
    /// (dead-lettering it) after `attempts`.
    pub fn inbox_giving_up_after(&self, attempts: u32) -> Inbox {
        Inbox::new(self.pool.clone(), "billing")
            .unwrap()
            .with_retry(RetryPolicy {
                max_attempts: attempts,
                base_delay: Duration::from_millis(20),
                max_delay: Duration::from_millis(100),
                jitter: 0.0,
            })
    }

    pub async fn produce(&self, events: Vec<Event>) -> Vec<EventId> {
        let mut tx = self.pool.begin().await.unwrap();
        let ids = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        ids.into_iter().map(|e| e.id).collect()
    }

    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    /// Waits until every delivery of `routes` routes of `n` events is published.
    pub async fn all_published(&self, deliveries: i64) {
        wait("every delivery published", || async {
            self.scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'published'")
                .await
                == deliveries
        })
        .await;
    }

    /// Forgets that a third of the deliveries were published, as a crash of
    /// the relay between publishing and recording does (see ARCHITECTURE.md,
    /// durability); returns how many.
    pub async fn forget_a_third(&self) -> u64 {
        sqlx::query(
            "UPDATE ferry.deliveries SET state = 'pending', attempts = 0, published_at = NULL WHERE seq % 3 = 0",
        )
        .execute(&self.pool)
        .await
        .unwrap()
        .rows_affected()
    }

    /// Exactly one effect per event: `n` rows, `n` distinct events.
    pub async fn assert_effects_once(&self, n: usize) {
        assert_eq!(self.scalar("SELECT count(*) FROM effects").await, n as i64, "effects");
        assert_eq!(
            self.scalar("SELECT count(DISTINCT event_id) FROM effects").await,
            n as i64,
            "distinct events with an effect"
        );
    }
}

pub struct RelayRun {
    stop: oneshot::Sender<()>,
    handle: JoinHandle<RunReport>,
}

impl RelayRun {
    pub async fn stop(self) -> RunReport {
        let _ = self.stop.send(());
        self.handle.await.unwrap()
    }
}

/// Polls `cond` until it holds, failing the test after [`WITHIN`].
pub async fn wait<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The business effect: one row per handling.
pub async fn effect(tx: &mut PgConnection, event: &ReceivedEvent) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, n) VALUES ($1, $2)")
        .bind(event.id.0)
        .bind(number(event) as i32)
        .execute(tx)
        .await?;
    Ok(())
}

/// The test events' payload `{"n": ...}`.
pub fn number(event: &ReceivedEvent) -> i64 {
    event
        .json::<serde_json::Value>()
        .ok()
        .and_then(|v| v["n"].as_i64())
        .unwrap_or(-1)
}

/// The handler of the tests of an event whose handler kills the process:
/// applies every event but the one numbered `number`, on which it counts a
/// run and never returns, as a process dying inside the handler would.
pub struct Killer {
    pub number: i64,
    runs: AtomicU32,
}

impl Killer {
    pub fn new(number: i64) -> Killer {
        Killer {
            number,
            runs: AtomicU32::new(0),
        }
    }

    pub async fn handle(&self, tx: &mut PgConnection, event: &ReceivedEvent) -> Result<(), HandlerError> {
        if number(event) == self.number {
            self.runs.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        effect(tx, event).await
    }

    /// How often the handler took the killer event.
    pub fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits until the consumer counts the killer dead (`dead`) and the
    /// other `n - 1` events are applied, or the killer ran again; asserts
    /// that it ran `lives` times in all, then stops the consumer.
    pub async fn until_dead(&self, db: &Db, dead: impl Fn() -> u64, n: i64, lives: u32, stop: oneshot::Sender<()>) {
        wait(
            "the killer dead, the rest applied (or the killer run again)",
            || async {
                let applied = db.scalar("SELECT count(*) FROM effects").await;
                (dead() == 1 && applied == n - 1) || self.runs() > lives
            },
        )
        .await;
        // Run again, the handler never returns, and neither would the stop.
        assert_eq!(self.runs(), lives, "the handler ran again");
        let _ = stop.send(());
    }
}

/// The killer event's inbox row is dead after `attempts`, and its dead
/// letter's `reason` says the attempts did not finish.
pub async fn assert_dead_unfinished(inbox: &Inbox, id: EventId, attempts: u32, reason: &str) {
    let record = inbox.record(id).await.unwrap().unwrap();
    assert_eq!((record.state.as_str(), record.attempts), ("dead", attempts as i32));
    assert!(
        reason.starts_with(&format!(
            "{attempts} attempts did not finish: the process stopped while handling this event"
        )),
        "{reason}"
    );
}
