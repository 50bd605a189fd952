//! The relay engine over the SQLite store: one relay per file, draining in
//! key order, and counting events through a failing sink and a relay that
//! dies mid-drain.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{
    ErrorKind, Event, EventId, Glob, RelayId, RetryPolicy, Route, Sink, SinkError, Store, StoredEvent, SystemClock,
};
use ferry_relay::{Relay, RelaySettings, RunReport};
use ferry_store::sqlite::SqliteStore;
use ferry_testkit::hooked::Hooked;
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::store_suite::StoreHarness;
use serde_json::json;

use super::{SqliteHarness, harness};

/// A second relay on the same file, even in another store instance, is
/// refused with an error naming the file and the fix; once the first store
/// is gone, the next relay starts.
#[tokio::test]
async fn a_second_relay_on_the_same_file_is_refused() {
    let h = harness().await;
    let lease = Duration::from_secs(30);
    h.store.tick(&RelayId("a".into()), lease, &[]).await.unwrap();
    // The same store may tick several relay ids (the conformance suite does).
    h.store.tick(&RelayId("a2".into()), lease, &[]).await.unwrap();

    let other = SqliteStore::open(&h.path).await.unwrap();
    let err = other.tick(&RelayId("b".into()), lease, &[]).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    for needle in [h.path.as_str(), "stop the other relay", "PostgreSQL"] {
        assert!(err.message.contains(needle), "missing {needle:?} in: {err}");
    }
    // However the URL spells the file: a `file:` URI names it too.
    for spelling in [
        format!("sqlite:file:{}", h.path),
        format!("sqlite://{}?mode=rwc", h.path),
    ] {
        let again = SqliteStore::open(&spelling).await.unwrap();
        let err = again.tick(&RelayId("b".into()), lease, &[]).await.unwrap_err();
        assert!(err.message.contains("stop the other relay"), "{spelling}: {err}");
    }
    // In-memory databases are private to their store: no lock to take.
    for _ in 0..2 {
        let memory = SqliteStore::open("sqlite::memory:").await.unwrap();
        ferry_store::sqlite::migrate(&mut memory.pool().acquire().await.unwrap())
            .await
            .unwrap();
        memory.tick(&RelayId("m".into()), lease, &[]).await.unwrap();
    }
    // The relay engine refuses to start on it, publishing nothing.
    let sink = Arc::new(MockSink::new());
    let relay = Relay::new(other.clone(), SystemClock, settings("b"), vec![route()], sinks(&sink)).unwrap();
    let refused = relay.run(std::future::pending()).await.unwrap_err();
    assert!(refused.to_string().contains("stop the other relay"), "{refused}");

    drop(h.store);
    let third = SqliteStore::open(&h.path).await.unwrap();
    let owned = third.tick(&RelayId("c".into()), lease, &[]).await.unwrap();
    assert_eq!(owned.live_relays, 3, "a and a2 are still live by heartbeat");
}

fn route() -> Route {
    Route {
        name: "orders".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    }
}

fn settings(id: &str) -> RelaySettings {
    RelaySettings {
        batch_size: 100,
        lease: Duration::from_secs(3),
        retry: RetryPolicy {
            max_attempts: 1000,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(100),
            jitter: 0.2,
        },
        poll_interval: Duration::from_secs(60),
        shutdown_timeout: Duration::from_secs(5),
        ..RelaySettings::new(id)
    }
}

fn sinks(sink: &Arc<MockSink>) -> HashMap<String, Arc<dyn Sink>> {
    [("mock".to_string(), sink.clone() as Arc<dyn Sink>)].into()
}

struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    handle: tokio::task::JoinHandle<RunReport>,
}

fn start(store: &SqliteStore, sink: &Arc<MockSink>) -> Running {
    start_as(store, sink, "a")
}

fn start_as(store: &SqliteStore, sink: &Arc<MockSink>, id: &str) -> Running {
    let relay = Relay::new(store.clone(), SystemClock, settings(id), vec![route()], sinks(sink)).unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel();
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

async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every id in `ids` arrived; per key, first arrivals keep `ids` order.
fn assert_complete_and_ordered(ids: &[EventId], got: &[StoredEvent]) {
    let mut seen = std::collections::HashSet::new();
    let mut last_by_key: HashMap<Option<String>, i64> = HashMap::new();
    for e in got {
        if !seen.insert(e.id) {
            continue;
        }
        let last = last_by_key.entry(e.key.clone()).or_insert(i64::MIN);
        assert!(e.seq > *last, "key {:?}: seq {} delivered after {}", e.key, e.seq, last);
        *last = e.seq;
    }
    let lost = ids.iter().filter(|id| !seen.contains(id)).count();
    assert_eq!(lost, 0, "{lost} events lost");
}

fn orders(n: usize, keys: usize) -> Vec<Event> {
    (0..n)
        .map(|i| Event::new("order.item.created", json!({ "n": i })).key(format!("k{}", i % keys)))
        .collect()
}

async fn produce(h: &SqliteHarness, events: Vec<Event>) -> Vec<EventId> {
    let mut ids = Vec::new();
    for chunk in events.chunks(100) {
        ids.extend(h.enqueue(chunk.to_vec()).await);
    }
    ids
}

/// The relay drains a backlog and then events committed while it runs (woken
/// by the data_version listener), in key order, each exactly once.
#[tokio::test]
async fn the_relay_drains_sqlite_in_key_order() {
    let h = harness().await;
    let sink = Arc::new(MockSink::new());
    let mut ids = produce(&h, orders(500, 10)).await;
    let relay = start(&h.store, &sink);
    eventually("the backlog delivered", Duration::from_secs(60), || {
        sink.delivered("orders").len() >= 500
    })
    .await;
    // Committed while the relay sleeps, past the router's quick re-checks
    // (500 ms at most): the listener wakes it, not the 60-second fallback poll.
    let store = h.store.clone();
    let mut asleep = false;
    for _ in 0..500 {
        asleep = store.status().await.unwrap().leases.iter().all(|l| l.sleeping);
        if asleep {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(asleep, "the relay goes to sleep when idle");
    tokio::time::sleep(Duration::from_millis(700)).await;
    ids.extend(produce(&h, orders(200, 10)).await);
    // Well inside the 60-second poll, and slack for a loaded machine.
    eventually("live events delivered", Duration::from_secs(30), || {
        sink.delivered("orders").len() >= 700
    })
    .await;
    let report = relay.handle_stop().await;
    let got = sink.delivered("orders");
    assert_complete_and_ordered(&ids, &got);
    assert_eq!(got.len(), 700, "no duplicates without a crash");
    assert_eq!(report.published, 700);
    let s = h.store.status().await.unwrap();
    let orders = s.routes.iter().find(|r| r.route == "orders").unwrap();
    assert_eq!((orders.published, orders.pending, orders.dead), (700, 0, 0));
}

/// A destination down for a while, then one poison event: nothing is lost,
/// order per key holds, and the poison event holds back only its own key
/// until it is dead with its reason.
#[tokio::test]
async fn a_failing_sink_loses_nothing() {
    let h = harness().await;
    let sink = Arc::new(MockSink::new());
    sink.set_down(true);
    let ids = produce(&h, orders(300, 6)).await;
    let poison = produce(
        &h,
        vec![Event::new("order.item.created", json!({"poison": true})).key("bad")],
    )
    .await[0];
    let after_poison = produce(&h, vec![Event::new("order.item.created", json!({})).key("bad")]).await[0];
    sink.fail_when(move |e: &StoredEvent| (e.id == poison).then(|| SinkError::permanent("rejected as malformed")));
    let relay = start(&h.store, &sink);
    // Generous: retries back off, and a loaded host runs them slowly.
    eventually("attempts while down", Duration::from_secs(60), || sink.attempts() > 600).await;
    assert!(sink.delivered("orders").is_empty());
    sink.set_down(false);
    eventually("all good events delivered", Duration::from_secs(60), || {
        sink.delivered("orders").len() >= 300
    })
    .await;
    let report = relay.handle_stop().await;
    let got = sink.delivered("orders");
    assert_complete_and_ordered(&ids, &got);
    assert!(
        !got.iter().any(|e| e.id == poison || e.id == after_poison),
        "the bad key is held back"
    );
    assert!(report.retried > 0);
    assert_eq!(report.dead, 1);
    assert_eq!(
        h.delivery_state("orders", poison).await.map(|d| d.0),
        Some("dead".to_string())
    );
    assert_eq!(
        h.delivery_state("orders", after_poison).await.map(|d| d.0),
        Some("pending".to_string()),
        "waits behind the dead event"
    );
    let s = h.store.status().await.unwrap();
    assert!(
        s.dead_reasons
            .iter()
            .any(|d| d.reason.contains("rejected as malformed"))
    );
    let orders = s.routes.iter().find(|r| r.route == "orders").unwrap();
    assert_eq!((orders.published, orders.dead, orders.blocked.waiting), (300, 1, 1));
}

/// A relay that dies mid-drain (no clean shutdown, leases left behind) loses
/// nothing: its leases expire and the next relay takes the work over.
/// Duplicates are allowed (published, not yet recorded); order per key holds.
#[tokio::test]
async fn a_relay_that_dies_mid_drain_loses_nothing() {
    let h = harness().await;
    let sink = Arc::new(MockSink::new());
    let ids = produce(&h, orders(3000, 30)).await;
    // Fails every call once killed: how a relay that died looks to the
    // database (no more heartbeats, renewals or writes). Aborting the
    // relay's task alone is not enough, since the engine's lease keeper and
    // listener are spawned apart from it.
    let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killed = dead.clone();
    let doomed = Hooked::new(
        h.store.clone(),
        Arc::new(move |_| {
            let dead = killed.load(std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move {
                if dead {
                    Err(ferry_core::StoreError::transient("the relay process is gone"))
                } else {
                    Ok(())
                }
            })
        }),
    );
    let relay = Relay::new(
        doomed.clone(),
        SystemClock,
        settings("dies"),
        vec![route()],
        sinks(&sink),
    )
    .unwrap();
    let first = tokio::spawn(relay.run(std::future::pending()));
    eventually("some delivered", Duration::from_secs(30), || {
        !sink.delivered("orders").is_empty()
    })
    .await;
    dead.store(true, std::sync::atomic::Ordering::SeqCst);
    first.abort();
    let _ = first.await;
    let before = sink.delivered("orders").len();
    assert!(before < 3000, "the relay must die mid-drain ({before} delivered)");
    let held = h.store.status().await.unwrap().leases;
    assert!(held.iter().any(|l| l.relay == "dies" && l.partitions > 0), "{held:?}");

    let second = start_as(&h.store, &sink, "takes-over");
    eventually("all delivered after the takeover", Duration::from_secs(60), || {
        let seen: std::collections::HashSet<_> = sink.delivered_ids("orders").into_iter().collect();
        ids.iter().all(|id| seen.contains(id))
    })
    .await;
    second.handle_stop().await;
    assert_complete_and_ordered(&ids, &sink.delivered("orders"));
    let s = h.store.status().await.unwrap();
    let orders = s.routes.iter().find(|r| r.route == "orders").unwrap();
    assert_eq!((orders.published, orders.pending, orders.dead), (3000, 0, 0));
}

impl Running {
    async fn handle_stop(self) -> RunReport {
        let _ = self.stop.send(());
        self.handle.await.unwrap()
    }
}
