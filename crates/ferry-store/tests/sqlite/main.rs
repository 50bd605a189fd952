//! The SQLite store against a real database file per test: the shared
//! conformance and producer suites, the rest of the producer API and
//! migrations here; the
//! relay engine over it in `relay`; the shared admin suite (operator's
//! commands and status) in `admin`; the shared retention suite (retention
//! and gauges) in `retention`.

use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Event, EventId, RelayId, Store};
use ferry_store::Enqueued;
use ferry_store::sqlite::{EnqueueError, SqliteStore, enqueue, enqueue_batch, migrate};
use ferry_testkit::producer_suite::ProducerHarness;
use ferry_testkit::store_suite::StoreHarness;
use serde_json::json;
use sqlx::{Connection, Sqlite, SqliteConnection, SqlitePool, Transaction};
use tempfile::TempDir;

struct SqliteHarness {
    store: SqliteStore,
    pool: SqlitePool,
    path: String,
    _dir: TempDir,
}

async fn harness() -> SqliteHarness {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.db").to_str().unwrap().to_owned();
    let store = SqliteStore::open(&path).await.unwrap();
    migrate(&mut store.pool().acquire().await.unwrap()).await.unwrap();
    SqliteHarness {
        pool: store.pool().clone(),
        store,
        path,
        _dir: dir,
    }
}

#[async_trait]
impl StoreHarness for SqliteHarness {
    type S = SqliteStore;
    fn store(&self) -> &SqliteStore {
        &self.store
    }
    async fn enqueue(&self, events: Vec<Event>) -> Vec<EventId> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let out = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        out.into_iter().map(|e| e.id).collect()
    }
    async fn expire_leases(&self, relay: &RelayId) {
        sqlx::query(
            "UPDATE ferry_partitions SET expires_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 1000000
              WHERE owner = ?1",
        )
        .bind(&relay.0)
        .execute(&self.pool)
        .await
        .unwrap();
        sqlx::query(
            "UPDATE ferry_relays SET heartbeat_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 3600000000
              WHERE id = ?1",
        )
        .bind(&relay.0)
        .execute(&self.pool)
        .await
        .unwrap();
    }
    async fn delivery_state(&self, route: &str, id: EventId) -> Option<(String, u32)> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT d.state, d.attempts FROM ferry_deliveries d JOIN ferry_events e ON e.seq = d.seq
              WHERE d.route = ?1 AND e.id = ?2",
        )
        .bind(route)
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .map(|(s, a)| (s, a as u32))
    }
    async fn failure_history(&self, route: &str, id: EventId) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM ferry_failures f JOIN ferry_events e ON e.seq = f.seq
              WHERE f.route = ?1 AND e.id = ?2",
        )
        .bind(route)
        .bind(id.to_string())
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

#[async_trait]
impl ProducerHarness for SqliteHarness {
    type Db = Sqlite;
    fn pool(&self) -> &SqlitePool {
        &self.pool
    }
    /// One writer at a time: taking the write lock at `BEGIN` makes a
    /// second producer wait for the first one's commit.
    async fn begin(pool: &SqlitePool) -> Transaction<'static, Sqlite> {
        pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
    }
    async fn enqueue_on(conn: &mut SqliteConnection, event: Event) -> Result<Enqueued, EnqueueError> {
        enqueue(conn, event).await
    }
    async fn enqueue_batch_on(conn: &mut SqliteConnection, events: Vec<Event>) -> Result<Vec<Enqueued>, EnqueueError> {
        enqueue_batch(conn, events).await
    }
    async fn counts(&self) -> (i64, i64) {
        (
            count(&self.pool, "SELECT count(*) FROM ferry_events").await,
            count(&self.pool, "SELECT count(*) FROM ferry_unrouted").await,
        )
    }
}

mod admin;
mod relay;
mod retention;

mod conformance {
    use super::harness;
    ferry_testkit::store_conformance!(harness());
    ferry_testkit::producer_conformance!(harness());
}

async fn count(pool: &SqlitePool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn migrate_is_idempotent_and_turns_on_wal() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("m.db").display());
    let mut conn = sqlx::SqliteConnection::connect_with(&ferry_store::sqlite::connect_options(&url).unwrap())
        .await
        .unwrap();
    let every: Vec<i32> = ferry_store::sqlite::MIGRATIONS.iter().map(|m| m.0).collect();
    assert_eq!(migrate(&mut conn).await.unwrap(), every);
    assert!(migrate(&mut conn).await.unwrap().is_empty());
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let partitions: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_partitions")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(partitions, i64::from(ferry_store::sqlite::PARTITIONS));
}

#[tokio::test]
async fn a_store_without_tables_says_to_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("empty.db").to_str().unwrap())
        .await
        .unwrap();
    let err = store
        .tick(&RelayId("a".into()), Duration::from_secs(30), &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("ferry migrate"), "{err}");
}

/// Before `ferry migrate` has run, the producer says to run it rather than
/// that the database refused the event.
#[tokio::test]
async fn a_producer_before_migrate_says_to_run_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("empty.db").to_str().unwrap())
        .await
        .unwrap();
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let err = enqueue(&mut tx, Event::new("order.created", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, EnqueueError::NotMigrated(_)), "{err}");
    assert!(err.to_string().contains("run `ferry migrate`"), "{err}");
}

/// The readiness probe's ping is a round trip, not the gauges' reads,
/// which grow with the backlog (and here cannot run at all).
#[tokio::test]
async fn ping_answers_without_reading_the_gauges() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("empty.db").to_str().unwrap())
        .await
        .unwrap();
    assert!(ferry_store::Gauges::gauges(&store).await.is_err());
    ferry_store::Gauges::ping(&store).await.unwrap();
}

#[tokio::test]
async fn a_directory_that_does_not_exist_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("ferry.db");
    let err = SqliteStore::open(path.to_str().unwrap()).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains(path.to_str().unwrap()), "{err}");
    assert!(err.message.contains("directory exists"), "{err}");
}

/// A pool opened lazily (as `ferry run` opens it) meets the missing
/// directory at the relay's first tick: a configuration error naming the
/// file and the fix, which the relay stops on, not a database down for a
/// moment, which it would retry for ever.
#[tokio::test]
async fn a_lazy_pool_on_a_directory_that_does_not_exist_fails_the_first_tick() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("ferry.db");
    let options = ferry_store::sqlite::connect_options(&format!("sqlite://{}", path.display())).unwrap();
    let store = SqliteStore::new(sqlx::sqlite::SqlitePoolOptions::new().connect_lazy_with(options));
    let err = store
        .tick(&RelayId("a".into()), Duration::from_secs(30), &[])
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains(path.to_str().unwrap()), "{err}");
    assert!(err.message.contains("directory exists and is writable"), "{err}");
}

/// In SQLite a failed statement does not end the transaction: a caller
/// may commit after enqueue returned an error. The event row and its
/// unrouted row were two statements, so a failure of the second left a
/// committed event no relay would ever see, holding its dispatch key: every
/// retry was told it was a duplicate. The event's insert writes its
/// unrouted row now, through its trigger: one statement for both.
#[tokio::test]
async fn an_enqueue_that_failed_half_way_leaves_nothing_behind() {
    let h = harness().await;
    let event = || Event::new("order.created", json!({ "n": 1 })).dispatch_key("order-1:created");
    let mut tx = h.pool.begin().await.unwrap();
    sqlx::query(
        "CREATE TEMP TRIGGER refuse BEFORE INSERT ON ferry_unrouted BEGIN SELECT RAISE(ABORT, 'disk full'); END",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    assert!(enqueue(&mut tx, event()).await.is_err());
    sqlx::query("DROP TRIGGER refuse").execute(&mut *tx).await.unwrap();
    // The caller commits all the same (its business write, say).
    tx.commit().await.unwrap();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0, "an event was committed without its unrouted row");
    let mut tx = h.pool.begin().await.unwrap();
    let again = enqueue(&mut tx, event()).await.unwrap();
    tx.commit().await.unwrap();
    assert!(
        !again.duplicate,
        "the retry was taken for a duplicate of an event never sent"
    );
    let unrouted = count(&h.pool, "SELECT count(*) FROM ferry_unrouted").await;
    assert_eq!(unrouted, 1);
}

/// A producer upgraded before `ferry migrate` ran writes to a schema
/// without the trigger that writes the unrouted row: it writes that row
/// itself, or its events would never be delivered.
#[tokio::test]
async fn a_producer_ahead_of_the_schema_still_writes_the_unrouted_row() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("old.db").to_str().unwrap())
        .await
        .unwrap();
    for (version, _, sql) in ferry_store::sqlite::MIGRATIONS {
        if *version < 4 {
            sqlx::raw_sql(sqlx::AssertSqlSafe(*sql))
                .execute(store.pool())
                .await
                .unwrap();
        }
    }
    let mut tx = store.pool().begin().await.unwrap();
    enqueue(&mut tx, Event::new("order.created", json!({ "n": 1 })))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let unrouted = count(store.pool(), "SELECT count(*) FROM ferry_unrouted").await;
    assert_eq!(
        unrouted, 1,
        "an event enqueued on the old schema was never to be delivered"
    );
}

/// A producer built before the unrouted row came with the event's insert
/// still writes that row itself: it must go on working against the
/// migrated schema (the relay may be upgraded first).
#[tokio::test]
async fn a_producer_of_the_release_before_still_enqueues() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let seq: i64 = sqlx::query_scalar(
        "INSERT INTO ferry_events (id, type, key, partition, payload, created_at)
         VALUES ('0190a0a0-0000-7000-8000-000000000001', 'order.created', 'k', 3, x'7b7d', 0) RETURNING seq",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    sqlx::query("INSERT INTO ferry_unrouted (seq, partition) VALUES (?1, 3)")
        .bind(seq)
        .execute(&mut *tx)
        .await
        .expect("the old second insert is taken as done");
    tx.commit().await.unwrap();
    let unrouted = count(&h.pool, "SELECT count(*) FROM ferry_unrouted").await;
    assert_eq!(unrouted, 1);
}

#[tokio::test]
async fn a_committed_event_is_stored_whole() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let sent = enqueue(
        &mut tx,
        Event::new("billing.invoice.paid", json!({"total": 12}))
            .key("inv-1")
            .header("tenant", "acme"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(!sent.duplicate);
    assert_eq!(sent.id.0.get_version_num(), 7);
    let (payload, headers, key): (Vec<u8>, String, Option<String>) =
        sqlx::query_as("SELECT payload, headers, key FROM ferry_events WHERE id = ?1")
            .bind(sent.id.to_string())
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&payload).unwrap(),
        json!({"total": 12})
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&headers).unwrap(),
        json!({"tenant": "acme"})
    );
    assert_eq!(key.as_deref(), Some("inv-1"));
    assert_eq!(count(&h.pool, "SELECT count(*) FROM ferry_unrouted").await, 1);
}

#[tokio::test]
async fn an_event_after_sqlite_rolled_the_transaction_back_is_refused() {
    // SQLite ends a transaction on its own (here: ON CONFLICT ROLLBACK) while
    // sqlx still counts it open; each statement after that would commit
    // alone, the event without the business write it belongs to.
    let h = harness().await;
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY ON CONFLICT ROLLBACK, state TEXT)")
        .execute(&h.pool)
        .await
        .unwrap();
    let mut tx = h.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1, 'new')")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders VALUES (1, 'again')")
        .execute(&mut *tx)
        .await
        .expect_err("the duplicate rolls the transaction back");
    let err = enqueue(&mut tx, Event::new("order.created", json!({"id": 1})).key("order-1"))
        .await
        .expect_err("the transaction is gone");
    assert!(matches!(err, EnqueueError::TransactionEnded), "{err}");
    assert!(err.to_string().contains("run the whole transaction again"), "{err}");
    let _ = tx.rollback().await;
    let (orders, events): (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM ferry_events)")
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!((orders, events), (0, 0), "neither the order nor an event without it");
}

#[tokio::test]
async fn validation_names_the_field_and_a_bad_batch_writes_nothing() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let cases = [
        (Event::new("Order", json!({})), "type"),
        (Event::new("order.created", json!({})).key(""), "key"),
        (
            Event::bytes(
                "order.created",
                vec![0u8; ferry_core::MAX_PAYLOAD_BYTES + 1],
                "application/pdf",
            ),
            "payload",
        ),
        (Event::new("order.created", json!({})).header("", "x"), "headers"),
        (Event::new("order.created", json!({})).dispatch_key(""), "dispatch_key"),
    ];
    for (event, field) in cases {
        match enqueue(&mut tx, event).await.unwrap_err() {
            EnqueueError::Invalid(v) => assert_eq!(v.field, field),
            other => panic!("expected a validation error on {field}, got {other}"),
        }
    }
    let err = enqueue_batch(
        &mut tx,
        vec![
            Event::new("order.created", json!({})).key("a"),
            Event::new("order..created", json!({})),
        ],
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("invalid event type"), "{err}");
    tx.commit().await.unwrap();
    assert_eq!(
        count(&h.pool, "SELECT count(*) FROM ferry_events").await,
        0,
        "nothing of a batch with a bad event is written"
    );
}

#[tokio::test]
async fn a_batch_is_written_in_order() {
    let h = harness().await;
    let events: Vec<Event> = (0..50)
        .map(|i| Event::new("order.item.created", json!({"n": i})).key(format!("k{}", i % 4)))
        .collect();
    let ids: Vec<EventId> = events.iter().map(Event::id).collect();
    let mut tx = h.pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(out.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    let stored: Vec<String> = sqlx::query_scalar("SELECT id FROM ferry_events ORDER BY seq")
        .fetch_all(&h.pool)
        .await
        .unwrap();
    assert_eq!(stored, ids.iter().map(EventId::to_string).collect::<Vec<_>>());
    // All events of a key share a partition.
    let spread: i64 = count(
        &h.pool,
        "SELECT max(n) FROM (SELECT count(DISTINCT partition) AS n FROM ferry_events GROUP BY key)",
    )
    .await;
    assert_eq!(spread, 1);
}

fn plan_orders(events: Vec<ferry_core::UnroutedEvent>) -> Vec<ferry_core::RoutePlan> {
    events
        .into_iter()
        .map(|event| {
            let routes = if event.event_type.starts_with("order.") {
                vec!["orders".to_string()]
            } else {
                vec![]
            };
            ferry_core::RoutePlan { event, routes }
        })
        .collect()
}

/// An operator's requeue of a `no route` event sends it back to the router,
/// and the commit listener notices it there as it does a new commit.
#[tokio::test]
async fn a_requeued_unroutable_event_wakes_the_router() {
    use ferry_store::{Action, Admin, Filter};
    let h = harness().await;
    let id = h.enqueue(vec![Event::new("user.account.created", json!({}))]).await[0];
    let owned = h
        .store
        .tick(&RelayId("r".into()), Duration::from_secs(30), &[])
        .await
        .unwrap();
    let events = h.store.fetch_unrouted(&owned, 10).await.unwrap();
    h.store
        .route(&owned, &plan_orders(events), chrono::Utc::now())
        .await
        .unwrap();
    let mut source = h.store.listen().await.unwrap();
    let requeue = Action::Requeue {
        include_published: false,
    };
    let only = Filter {
        ids: vec![id],
        ..Filter::default()
    };
    let plan = h.store.plan(&requeue, &only).await.unwrap();
    assert_eq!(plan.changes.len(), 1);
    h.store.apply(&requeue, "ops", &plan.changes).await.unwrap();
    // An operator's action wakes the whole relay (`None`: look at
    // everything), the router and the workers alike.
    let woke = tokio::time::timeout(Duration::from_secs(10), source.wait())
        .await
        .expect("a wake-up")
        .unwrap();
    let unrouted = h.store.fetch_unrouted(&owned, 10).await.unwrap();
    assert_eq!(unrouted.len(), 1);
    assert!(woke.is_none_or(|w| w.partition() == unrouted[0].partition), "{woke:?}");
}
