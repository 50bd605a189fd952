//! A route worker against a real PostgreSQL store and a scripted sink:
//! writes whose answer is lost, and batches the sink held back whole.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{Event, EventId, Glob, Route, Sink, SinkError, Store, StoreError, SystemClock};
use ferry_relay::metrics::{PUBLISHED, REFUSED};
use ferry_relay::{Relay, RelaySettings};
use ferry_store::postgres::{PgStore, enqueue_batch, migrate};
use ferry_testkit::hooked::{AfterWrite, Hook, Hooked};
use ferry_testkit::metrics::Counts;
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::pg::TestDb;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::oneshot;

mod support;
use support::{Running, eventually, eventually_async, settings};

const TYPE: &str = "order.item.created";

struct Env {
    pool: PgPool,
    sink: Arc<MockSink>,
    _db: TestDb,
}

async fn env() -> Env {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    Env {
        pool,
        sink: Arc::new(MockSink::new()),
        _db: db,
    }
}

fn orders_route() -> Route {
    Route {
        name: "orders".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    }
}

fn start_on(e: &Env, store: impl Store, settings: RelaySettings) -> Running {
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(store, SystemClock, settings, vec![orders_route()], sinks).unwrap();
    let (stop, rx) = oneshot::channel();
    let handle = tokio::spawn(async move {
        relay
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap()
    });
    Running { stop, handle }
}

/// Commits `events` and hands each to the route worker as a pending
/// delivery, as a parked event is, waking the workers as parking does.
async fn park(pool: &PgPool, events: Vec<Event>) -> Vec<EventId> {
    let mut tx = pool.begin().await.unwrap();
    let ids = enqueue_batch(&mut tx, events)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    sqlx::raw_sql(
        "INSERT INTO ferry.deliveries (seq, route, partition, key)
         SELECT u.seq, 'orders', u.partition, ev.key FROM ferry.unrouted u JOIN ferry.events ev USING (seq);
         SELECT pg_notify('ferry', 'due:' || p) FROM (SELECT DISTINCT partition AS p FROM ferry.unrouted) ps;
         DELETE FROM ferry.unrouted",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    ids
}

/// Waits until the relay went to sleep, with nothing to do.
async fn asleep(pool: &PgPool) {
    eventually_async("relay asleep", Duration::from_secs(30), async || {
        sqlx::query_scalar("SELECT coalesce(bool_and(sleeping), false) FROM ferry.relays")
            .fetch_one(pool)
            .await
            .unwrap()
    })
    .await;
    // The wake-ups of its start are all taken by now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

async fn published_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'published'")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn pass() -> Hook {
    Arc::new(|_| Box::pin(async { Ok(()) }))
}

/// A record that commits but whose answer is lost is sent again, and the
/// fence finds nothing left to apply: the outcomes were written by the
/// first attempt under a lease never lost. That is no refusal: neither
/// the report nor `ferry_outcomes_refused_total` counts it, and each event
/// counts once as published.
#[tokio::test]
async fn a_record_whose_answer_was_lost_is_no_refusal() {
    let e = env().await;
    let events = (0..10)
        .map(|i| Event::new(TYPE, json!({ "n": i })).key(format!("k{i}")))
        .collect();
    park(&e.pool, events).await;
    let lost = Arc::new(AtomicBool::new(false));
    let after: AfterWrite = {
        let lost = lost.clone();
        Arc::new(move |method, _| {
            (method == "record" && !lost.swap(true, Ordering::SeqCst))
                .then(|| StoreError::transient("connection reset after the commit"))
        })
    };
    let store = Hooked::new(PgStore::new(e.pool.clone()), pass()).losing_write_answers(after);
    let counts = Counts::by_label("route");
    // The relay's tasks run on this thread (a current-thread runtime).
    let _recording = metrics::set_default_local_recorder(&counts);
    let relay = start_on(&e, store, settings("lost-record", 4));
    eventually_async("10 deliveries written", Duration::from_secs(30), async || {
        published_rows(&e.pool).await == 10
    })
    .await;
    // The retry's answer, after its backoff, comes after the rows.
    eventually("the record's retry answered", Duration::from_secs(10), || {
        counts.get(PUBLISHED, "orders") > 0
    })
    .await;
    let report = relay.stop().await;
    assert!(
        lost.load(Ordering::SeqCst),
        "no record answer was lost: the test proves nothing"
    );
    assert_eq!(report.refused, 0, "{report:?}");
    assert_eq!(counts.get(REFUSED, "orders"), 0);
    assert_eq!(report.published, 10);
    assert_eq!(counts.get(PUBLISHED, "orders"), 10);
    assert_eq!(e.sink.delivered("orders").len(), 10, "published once each");
}

/// A sink that holds back every event of a batch (the webhook sink, when
/// no request slot frees in time) leaves nothing to record: the worker
/// must publish those events again soon, in key order, not leave them
/// pending until its slow poll (four poll intervals, here four minutes).
#[tokio::test]
async fn a_batch_held_back_whole_is_published_again_promptly_in_order() {
    let e = env().await;
    let store = PgStore::new(e.pool.clone());
    let relay = start_on(&e, store, settings("held-back", 4));
    asleep(&e.pool).await;
    // Each event is held back the first time it is offered.
    let offered: Arc<Mutex<HashSet<EventId>>> = Arc::default();
    {
        let offered = offered.clone();
        e.sink.fail_when(move |ev| {
            offered
                .lock()
                .unwrap()
                .insert(ev.id)
                .then(|| SinkError::held_back("held back: no request slot freed in time"))
        });
    }
    let ids = park(
        &e.pool,
        (0..3).map(|i| Event::new(TYPE, json!({ "n": i })).key("k")).collect(),
    )
    .await;
    // Generous: the slow poll is 240 s away.
    eventually_async("the held-back events published", Duration::from_secs(20), async || {
        published_rows(&e.pool).await == 3
    })
    .await;
    let report = relay.stop().await;
    assert_eq!(offered.lock().unwrap().len(), 3, "every event was held back once");
    let got = e.sink.delivered_ids("orders");
    assert_eq!(got, ids, "published once each, in key order");
    assert_eq!(report.published, 3);
    assert_eq!(report.refused, 0);
}
