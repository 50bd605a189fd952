//! The admin view of the SQLite store: the shared admin suite (listing,
//! history, status, and the guardrails of requeue and cancel, down to a
//! running relay delivering what was requeued).

use async_trait::async_trait;
use ferry_testkit::admin_suite::AdminHarness;

use super::{SqliteHarness, harness};

#[async_trait]
impl AdminHarness for SqliteHarness {
    async fn snapshot(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT concat_ws('|', seq, route, state, attempts, next_attempt_at, last_error, published_at, updated_at)
               FROM ferry_deliveries ORDER BY seq, route",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
    async fn release_partitions(&self) {
        sqlx::query("UPDATE ferry_partitions SET owner = NULL, expires_at = NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn expire_partitions(&self) {
        sqlx::query("UPDATE ferry_partitions SET expires_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 1000000 WHERE owner IS NOT NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn dead_failures(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry_failures WHERE dead = 1")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

ferry_testkit::admin_conformance!(harness());

#[path = "../shared/no_route.rs"]
mod no_route;

#[tokio::test]
async fn a_no_route_requeue_is_refused_once_a_later_event_of_its_key_went_ahead() {
    let h = harness().await;
    no_route::a_no_route_requeue_is_refused_once_a_later_event_of_its_key_went_ahead(&h).await;
}

#[tokio::test]
async fn a_no_route_requeue_is_refused_beside_a_later_event_of_its_key() {
    let h = harness().await;
    no_route::a_no_route_requeue_is_refused_beside_a_later_event_of_its_key(&h).await;
}

/// How much work each connection does, in SQLite's virtual machine steps
/// (counted per thousand by a progress handler): while it holds the write
/// lock, and in all.
#[derive(Default)]
struct Work {
    writing: std::sync::atomic::AtomicU64,
    all: std::sync::atomic::AtomicU64,
}

impl Work {
    fn take(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::SeqCst;
        (self.writing.swap(0, SeqCst), self.all.swap(0, SeqCst))
    }
}

/// A store whose connections count their [`Work`].
async fn counted_store(path: &str, work: &std::sync::Arc<Work>) -> ferry_store::sqlite::SqliteStore {
    let work = work.clone();
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .after_connect(move |conn, _| {
            let work = work.clone();
            Box::pin(async move {
                let mut handle = conn.lock_handle().await?;
                let db = handle.as_raw_handle().as_ptr() as usize;
                handle.set_progress_handler(1000, move || {
                    use std::sync::atomic::Ordering::SeqCst;
                    // SAFETY: called by SQLite on this connection, while it
                    // runs a statement; the state is only read.
                    let state = unsafe { libsqlite3_sys::sqlite3_txn_state(db as *mut _, std::ptr::null()) };
                    if state == libsqlite3_sys::SQLITE_TXN_WRITE {
                        work.writing.fetch_add(1, SeqCst);
                    }
                    work.all.fetch_add(1, SeqCst);
                    true
                });
                Ok(())
            })
        })
        .connect_with(ferry_store::sqlite::connect_options(path).unwrap())
        .await
        .unwrap();
    let store = ferry_store::sqlite::SqliteStore::new(pool);
    ferry_store::sqlite::migrate(&mut store.pool().acquire().await.unwrap())
        .await
        .unwrap();
    store
}

/// Requeueing cancelled deliveries behind a backlog of unrouted events
/// checks, per delivery, whether a later event of its key waits unrouted.
/// Under the write lock, a scan of the backlog per delivery held SQLite's
/// one write lock for seconds (the producers' writes failed on their busy
/// timeout): the write lock is now held for less work than one such scan.
#[tokio::test]
async fn a_requeue_behind_a_backlog_holds_the_write_lock_for_its_targets_not_the_backlog() {
    use std::time::Duration;

    use chrono::Utc;
    use ferry_core::{Event, Glob, RelayId, Route, Store};
    use ferry_store::{Action, Admin, Filter};
    use serde_json::json;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("backlog.db").to_str().unwrap().to_owned();
    let work = std::sync::Arc::new(Work::default());
    let store = counted_store(&path, &work).await;
    let pool = store.pool().clone();

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let events = (0..20)
        .map(|i| Event::new("order.updated", json!({})).key(format!("k{i}")))
        .collect();
    let targets: Vec<_> = ferry_store::sqlite::enqueue_batch(&mut tx, events)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    tx.commit().await.unwrap();
    let relay = RelayId("r".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let route = Route {
        name: "orders".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    };
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &ferry_relay::plan_routes(&[route], unrouted), Utc::now())
        .await
        .unwrap();
    sqlx::query("UPDATE ferry_deliveries SET state = 'cancelled'")
        .execute(&pool)
        .await
        .unwrap();
    // The backlog, after them: events a relay has yet to route.
    sqlx::raw_sql(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
         INSERT INTO ferry_events (id, type, key, partition, payload, created_at)
         SELECT 'backlog-' || i, 'order.bulk', NULL, i % 32, x'7b7d', 0 FROM n",
    )
    .execute(&pool)
    .await
    .unwrap();

    let requeue = Action::Requeue {
        include_published: false,
    };
    let filter = Filter {
        ids: targets.clone(),
        ..Filter::default()
    };
    let plan = store.plan(&requeue, &filter).await.unwrap();
    assert_eq!(plan.changes.len(), targets.len(), "{plan:?}");
    // One pass over the backlog, as a delivery's check makes it.
    work.take();
    let unrouted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ferry_unrouted u
          WHERE (SELECT e.key FROM ferry_events e WHERE e.seq = u.seq) IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unrouted, 20_000);
    let (_, one_pass) = work.take();
    assert!(one_pass > 0, "the progress handler counted nothing");

    let applied = store.apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert_eq!(applied.changed.len(), targets.len(), "{applied:?}");
    let (writing, all) = work.take();
    assert!(
        writing < one_pass,
        "the write lock was held for {writing} thousand steps of {all}, one pass over the backlog takes {one_pass}"
    );
}
