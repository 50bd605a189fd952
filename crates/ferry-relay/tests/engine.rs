//! The relay engine against a real PostgreSQL store and a scripted sink:
//! counting events through failures, restarts and concurrent relays.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry_core::{Event, EventId, Glob, NO_ROUTE, Route, Sink, SinkError, Store, SystemClock};
use ferry_relay::{Relay, RelaySettings};
use ferry_store::postgres::{PgStore, enqueue_batch, migrate};
use ferry_testkit::hooked::Hooked;
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::pg::TestDb;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::oneshot;

mod support;
use support::{Running, eventually, eventually_async, settings};

struct Env {
    pool: PgPool,
    sink: Arc<MockSink>,
    /// A second destination, for routes with `sink = "other"`.
    other: Arc<MockSink>,
    _db: TestDb,
}

async fn env() -> Env {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    Env {
        pool,
        sink: Arc::new(MockSink::new()),
        other: Arc::new(MockSink::new()),
        _db: db,
    }
}

fn route(name: &str, glob: &str) -> Route {
    route_to(name, glob, "mock")
}

fn route_to(name: &str, glob: &str, sink: &str) -> Route {
    Route {
        name: name.into(),
        matcher: Glob::new(glob).unwrap(),
        sink: sink.into(),
        destination: "d".into(),
        routing_key: None,
    }
}

fn start(e: &Env, id: &str, routes: Vec<Route>) -> Running {
    start_with(e, settings(id, 4), routes)
}

fn start_with(e: &Env, settings: RelaySettings, routes: Vec<Route>) -> Running {
    start_on(e, PgStore::new(e.pool.clone()), settings, routes)
}

fn start_on(e: &Env, store: impl Store, settings: RelaySettings, routes: Vec<Route>) -> Running {
    let sinks: HashMap<String, Arc<dyn Sink>> = [
        ("mock".to_string(), e.sink.clone() as Arc<dyn Sink>),
        ("other".to_string(), e.other.clone() as Arc<dyn Sink>),
    ]
    .into();
    let relay = Relay::new(store, SystemClock, settings, routes, sinks).unwrap();
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

async fn produce(pool: &PgPool, events: Vec<Event>) -> Vec<EventId> {
    let mut ids = Vec::with_capacity(events.len());
    for chunk in events.chunks(500) {
        let mut tx = pool.begin().await.unwrap();
        ids.extend(
            enqueue_batch(&mut tx, chunk.to_vec())
                .await
                .unwrap()
                .into_iter()
                .map(|e| e.id),
        );
        tx.commit().await.unwrap();
    }
    ids
}

/// Delays the first publish of a batch holding `id` by `delay`; the flag
/// turns true as that publish starts.
fn delay_first_publish(e: &Env, id: EventId, delay: Duration) -> Arc<AtomicBool> {
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    e.sink
        .delay_when(move |ev| (ev.id == id && !flag.swap(true, Ordering::SeqCst)).then_some(delay));
    started
}

/// Partitions leased to `owner`, or to anyone.
async fn leased(pool: &PgPool, owner: Option<&str>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ferry.partitions WHERE owner IS NOT NULL AND owner = coalesce($1, owner)")
        .bind(owner)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn orders(n: usize, keys: usize) -> Vec<Event> {
    (0..n)
        .map(|i| Event::new("order.item.created", json!({ "n": i })).key(format!("k{}", i % keys)))
        .collect()
}

/// Every id in `ids` appears in `got`; per key, first appearances keep `ids` order.
fn assert_complete_and_ordered(ids: &[EventId], got: &[ferry_core::StoredEvent]) {
    let mut first: HashMap<EventId, usize> = HashMap::new();
    for (i, e) in got.iter().enumerate() {
        first.entry(e.id).or_insert(i);
    }
    let missing: Vec<_> = ids.iter().filter(|id| !first.contains_key(id)).collect();
    assert!(
        missing.is_empty(),
        "{} events lost, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    let mut last_by_key: HashMap<Option<String>, i64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for e in got {
        if !seen.insert(e.id) {
            continue;
        }
        let last = last_by_key.entry(e.key.clone()).or_insert(i64::MIN);
        assert!(e.seq > *last, "key {:?}: seq {} delivered after {}", e.key, e.seq, last);
        *last = e.seq;
    }
}

#[tokio::test]
async fn delivers_every_event_once_in_per_key_order() {
    let e = env().await;
    let ids = produce(&e.pool, orders(2000, 20)).await;
    // A lease long enough that a stall of a loaded machine cannot lose it
    // (and republish what was in flight): no duplicates is asserted below.
    let long_lease = RelaySettings {
        lease: Duration::from_secs(30),
        ..settings("a", 4)
    };
    let relay = start_with(&e, long_lease, vec![route("orders", "order.**")]);
    eventually("2000 delivered", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 2000
    })
    .await;
    let report = relay.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 2000, "no duplicates without a fault");
    assert_complete_and_ordered(&ids, &got);
    assert_eq!(report.published, 2000);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state <> 'published'")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn an_idle_relay_wakes_on_commit_not_on_its_poll() {
    let e = env().await;
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    // Let it go idle (it tells producers to notify it), then produce.
    eventually_async("relay asleep", Duration::from_secs(30), async || {
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry.relays WHERE sleeping)")
            .fetch_one(&e.pool)
            .await
            .unwrap()
    })
    .await;
    for i in 0..5 {
        let ids = produce(&e.pool, orders(1, 1)).await;
        // The fallback poll is 60 s: only a notification delivers this in time.
        eventually(&format!("event {i} delivered"), Duration::from_secs(20), || {
            e.sink.delivered_ids("orders").contains(&ids[0])
        })
        .await;
    }
    relay.stop().await;
}

/// A producer decides whether to notify when it writes its event, not when
/// it commits. One that wrote while the relay was busy (no notification
/// asked for) and commits well after the relay went to sleep must still
/// have its event delivered promptly, not at the next fallback poll.
#[tokio::test]
async fn a_producer_that_wrote_while_the_relay_was_busy_and_commits_late_is_not_left_to_the_poll() {
    let e = env().await;
    // Small batches published slowly: a burst keeps the relay busy (no
    // notifications asked for) for a while.
    e.sink
        .delay_when(|ev| (ev.event_type == "order.busy").then_some(Duration::from_millis(20)));
    let busy_settings = RelaySettings {
        batch_size: 10,
        lease: Duration::from_secs(30),
        ..settings("a", 4)
    };
    let relay = start_with(&e, busy_settings, vec![route("orders", "order.**")]);
    let flag = async || -> Option<bool> {
        sqlx::query_scalar("SELECT bool_or(sleeping) FROM ferry.relays")
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    eventually_async("relay asleep", Duration::from_secs(30), async || {
        flag().await == Some(true)
    })
    .await;
    let mut late = None;
    for _ in 0..10 {
        let burst = (0..300)
            .map(|i| Event::new("order.busy", json!({ "i": i })).key(format!("b{}", i % 50)))
            .collect();
        produce(&e.pool, burst).await;
        eventually_async("relay busy", Duration::from_secs(30), async || {
            flag().await == Some(false)
        })
        .await;
        // The snapshot of the flag's read is the enqueue's: a repeatable
        // read transaction that sees the relay awake writes without asking
        // for a notification.
        let mut tx = e.pool.begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        let sleeping: bool = sqlx::query_scalar("SELECT bool_or(sleeping) FROM ferry.relays")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        if sleeping {
            continue;
        }
        let id = ferry_store::postgres::enqueue(&mut tx, Event::new("order.late", json!({})).key("late"))
            .await
            .unwrap()
            .id;
        late = Some((tx, id));
        break;
    }
    let (tx, id) = late.expect("the relay was never seen busy");
    // The relay goes to sleep and its re-checks after that pass; only then
    // does the producer commit.
    eventually_async("relay asleep again", Duration::from_secs(60), async || {
        flag().await == Some(true)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tx.commit().await.unwrap();
    // The fallback poll is 60 s away.
    eventually("the late event delivered", Duration::from_secs(20), || {
        e.sink.delivered_ids("orders").contains(&id)
    })
    .await;
    relay.stop().await;
}

/// A steady stream of commits that the relay keeps up with: it stops asking
/// producers to notify it (NOTIFY serialises their commits) and polls
/// instead, delivers every event in per-key order, and asks for
/// notifications again once the stream stops.
#[tokio::test]
async fn a_stream_of_commits_spares_producers_the_notify_and_loses_nothing() {
    const PRODUCERS: usize = 4;
    const COMMITS: usize = 60;
    const PER_COMMIT: usize = 50;
    let e = env().await;
    // Batches never fill, so only the arrival rate can keep the relay awake.
    let never_full = RelaySettings {
        batch_size: 100_000,
        lease: Duration::from_secs(30),
        ..settings("a", 4)
    };
    let relay = start_with(&e, never_full, vec![route("orders", "order.**")]);
    let asleep = async || -> bool {
        sqlx::query_scalar("SELECT coalesce(bool_and(sleeping), false) FROM ferry.relays")
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    eventually_async("relay asleep", Duration::from_secs(30), asleep).await;

    let producing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (pool, producing) = (e.pool.clone(), Arc::clone(&producing));
        tokio::spawn(async move {
            let mut awake = 0;
            while producing.load(std::sync::atomic::Ordering::SeqCst) {
                let sleeping: bool = sqlx::query_scalar("SELECT bool_and(sleeping) FROM ferry.relays")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                awake += usize::from(!sleeping);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            awake
        })
    };
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let pool = e.pool.clone();
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for c in 0..COMMITS {
                    let events = (0..PER_COMMIT)
                        .map(|i| {
                            Event::new("order.item.created", json!({ "p": p, "c": c, "i": i }))
                                .key(format!("p{p}-k{}", i % 10))
                        })
                        .collect();
                    ids.extend(produce(&pool, events).await);
                }
                ids
            })
        })
        .collect();
    let mut ids = Vec::new();
    for p in producers {
        ids.extend(p.await.unwrap());
    }
    producing.store(false, std::sync::atomic::Ordering::SeqCst);
    let awake = sampler.await.unwrap();
    let total = PRODUCERS * COMMITS * PER_COMMIT;
    eventually("every event delivered", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= total
    })
    .await;
    assert!(
        awake > 0,
        "the relay slept through a stream of {total} events: every commit paid for NOTIFY"
    );
    // The stream is over: notifications again, not polls.
    eventually_async("relay asleep again", Duration::from_secs(30), asleep).await;
    let report = relay.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), total, "no duplicates without a fault");
    assert_complete_and_ordered(&ids, &got);
    assert_eq!(report.published, total as u64);
}

#[tokio::test]
async fn a_poison_event_goes_dead_and_holds_back_only_its_key() {
    let e = env().await;
    let ids = produce(&e.pool, orders(300, 10)).await;
    let poison = ids[13]; // key k3
    e.sink
        .fail_when(move |ev| (ev.id == poison).then(|| SinkError::transient("always times out")));
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    // Every other key completes: 9 keys x 30 events, plus k3's event before the poison.
    eventually("other keys flow", Duration::from_secs(60), || {
        e.sink
            .delivered("orders")
            .iter()
            .filter(|ev| ev.key.as_deref() != Some("k3"))
            .count()
            >= 270
    })
    .await;
    // No row until the first attempt is settled (direct delivery).
    let state = || async {
        sqlx::query_as::<_, (String, i32)>(
            "SELECT d.state, d.attempts FROM ferry.deliveries d JOIN ferry.events e USING (seq) WHERE e.id = $1",
        )
        .bind(poison.0)
        .fetch_optional(&e.pool)
        .await
        .unwrap()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while state().await.is_none_or(|(s, _)| s != "dead") {
        assert!(tokio::time::Instant::now() < deadline, "poison never went dead");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state().await, Some(("dead".to_string(), 4)), "dead after max attempts");
    let report = relay.stop().await;
    assert_eq!(report.dead, 1);
    let got = e.sink.delivered("orders");
    let poison_seq = 14; // seqs start at 1 in a fresh database
    let k3_after: Vec<_> = got
        .iter()
        .filter(|ev| ev.key.as_deref() == Some("k3") && ev.seq > poison_seq)
        .collect();
    // Only events already in flight beside the poison's first attempt got
    // past it, and each of those is counted; none went after that.
    assert_eq!(k3_after.len() as u64, report.order_breaks);
    assert!(report.order_breaks < 28, "later batches must hold k3 back");
    assert_eq!(
        got.iter()
            .filter(|ev| ev.key.as_deref() == Some("k3") && ev.seq < poison_seq)
            .count(),
        1
    );
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'pending'")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(
        waiting as u64,
        28 - report.order_breaks,
        "k3's later events are pending, not lost"
    );
}

#[tokio::test]
async fn an_event_the_sink_refuses_before_sending_holds_its_key_strictly() {
    refused_event_holds_its_key(false).await;
}

#[tokio::test]
async fn an_event_a_sink_refuses_in_publish_holds_its_key_without_attempts() {
    refused_event_holds_its_key(true).await;
}

/// k3's 14th event is refused before sending, permanently: it is dead, the
/// rest of k3 is never sent and waits pending behind it, not attempted.
async fn refused_event_holds_its_key(admit_in_publish: bool) {
    let e = env().await;
    let ids = produce(&e.pool, orders(300, 10)).await;
    let poison = ids[13]; // key k3
    e.sink
        .refuse_when(move |ev| (ev.id == poison).then(|| SinkError::permanent("payload too large")));
    if admit_in_publish {
        e.sink.admit_in_publish();
    }
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    eventually("other keys flow", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 271
    })
    .await;
    let report = relay.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 271, "no k3 event after the refused one is sent");
    assert_eq!(report.order_breaks, 0);
    assert_eq!(report.dead, 1);
    let behind: Vec<(String, i32)> = sqlx::query_as(
        "SELECT d.state, d.attempts FROM ferry.deliveries d JOIN ferry.events e USING (seq)
          WHERE e.key = 'k3' AND e.seq > (SELECT seq FROM ferry.events WHERE id = $1)",
    )
    .bind(poison.0)
    .fetch_all(&e.pool)
    .await
    .unwrap();
    let unrouted: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(
        behind.len() as i64 + unrouted,
        28,
        "k3's later events are all kept: {behind:?}"
    );
    for (state, attempts) in &behind {
        assert_eq!((state.as_str(), *attempts), ("pending", 0), "held back, not attempted");
    }
}

#[tokio::test]
async fn a_destination_down_for_a_while_loses_nothing() {
    let e = env().await;
    e.sink.set_down(true);
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    let ids = produce(&e.pool, orders(500, 5)).await;
    eventually("attempts while down", Duration::from_secs(20), || {
        e.sink.attempts() >= 5
    })
    .await;
    e.sink.set_down(false);
    eventually("all delivered after recovery", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 500
    })
    .await;
    relay.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 500);
    assert_complete_and_ordered(&ids, &got);
}

#[tokio::test]
async fn a_failing_route_never_delays_another() {
    let e = env().await;
    e.sink.set_down(true);
    let audit = Route {
        sink: "other".into(),
        ..route("audit", "**")
    };
    let mut s = settings("a", 4);
    s.retry.max_attempts = u32::MAX; // the outage must not outlast the retry budget
    let relay = start_with(&e, s, vec![route("orders", "order.**"), audit]);
    let ids = produce(&e.pool, orders(400, 4)).await;
    eventually("audit gets everything", Duration::from_secs(30), || {
        e.other.delivered("audit").len() >= 400
    })
    .await;
    assert!(e.sink.delivered("orders").is_empty());
    assert_complete_and_ordered(&ids, &e.other.delivered("audit"));
    e.sink.set_down(false);
    eventually("orders catches up", Duration::from_secs(30), || {
        e.sink.delivered("orders").len() >= 400
    })
    .await;
    relay.stop().await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}

#[tokio::test]
async fn a_slow_route_holds_the_others_up_for_one_bound_at_most() {
    // A destination that answers, only slowly (a webhook taking nearly its
    // timeout per request), never looks down. Unbounded, every batch would
    // wait for it, and every other route's events with it.
    let e = env().await;
    let slow = Arc::new(AtomicBool::new(true));
    let flag = slow.clone();
    e.other
        .delay_when(move |_| flag.load(Ordering::SeqCst).then_some(Duration::from_secs(30)));
    let audit = Route {
        sink: "other".into(),
        ..route("audit", "**")
    };
    let mut s = settings("a", 4);
    s.retry.max_attempts = u32::MAX;
    // The abandoned share is retried by the route's worker after this, by
    // when the destination is fast again: the test need not wait it out.
    s.retry.base_delay = Duration::from_secs(2);
    s.retry.max_delay = Duration::from_secs(2);
    s.direct_publish_timeout = Duration::from_millis(300);
    let relay = start_with(&e, s, vec![route("orders", "order.**"), audit]);
    let mut ids = produce(&e.pool, orders(1, 1)).await;
    eventually("orders gets the first event", Duration::from_secs(20), || {
        !e.sink.delivered("orders").is_empty()
    })
    .await;
    ids.extend(produce(&e.pool, orders(1, 1)).await);
    // Unbounded, the second batch would wait the 30 s out.
    eventually(
        "orders gets the second event while audit is still slow",
        Duration::from_secs(15),
        || e.sink.delivered("orders").len() >= 2,
    )
    .await;
    slow.store(false, Ordering::SeqCst);
    eventually("audit gets both", Duration::from_secs(90), || {
        e.other.delivered("audit").len() >= 2
    })
    .await;
    relay.stop().await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
    assert_complete_and_ordered(&ids, &e.other.delivered("audit"));
}

#[tokio::test]
async fn a_hanging_destination_holds_the_other_routes_up_once_not_batch_after_batch() {
    // Each direct publish to a hanging destination costs every route the
    // publish timeout. Once one has timed out, the route's events must park
    // for its worker until a fetch that saw that failure settled says the
    // table is clear, not be tried directly again on the word of a fetch
    // made before it.
    let e = env().await;
    e.sink.delay_when(|_| Some(Duration::from_secs(20)));
    let audit = Route {
        sink: "other".into(),
        ..route("audit", "**")
    };
    let mut s = settings("a", 4);
    s.batch_size = 20;
    s.retry.max_attempts = u32::MAX;
    // The failed batch is not retried while the test looks.
    s.retry.base_delay = Duration::from_secs(120);
    s.retry.max_delay = Duration::from_secs(120);
    s.direct_publish_timeout = Duration::from_millis(300);
    // A key per event, so nothing is held back per key: only the route's
    // being down parks its events.
    let ids = produce(&e.pool, orders(400, 400)).await;
    let relay = start_with(&e, s, vec![route("orders", "order.**"), audit]);
    eventually("audit gets everything", Duration::from_secs(60), || {
        e.other.delivered("audit").len() >= 400
    })
    .await;
    // The worker's publish of what was parked hangs for longer than the
    // test: every attempt written by then is a direct publish's.
    let counts = async || -> (i64, i64) {
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE attempts > 0), count(*) FILTER (WHERE attempts = 0)
               FROM ferry.deliveries WHERE route = 'orders'",
        )
        .fetch_one(&e.pool)
        .await
        .unwrap()
    };
    eventually_async("every orders delivery written", Duration::from_secs(10), async || {
        let (tried, parked) = counts().await;
        tried + parked == 400
    })
    .await;
    let (tried, parked) = counts().await;
    relay.stop().await;
    assert_eq!(
        (tried, parked),
        (20, 380),
        "only the first batch is published directly to the hanging destination"
    );
    assert!(e.sink.delivered("orders").is_empty());
    assert_complete_and_ordered(&ids, &e.other.delivered("audit"));
}

#[tokio::test]
async fn events_matching_no_route_are_dead_never_dropped() {
    let e = env().await;
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    let ids = produce(&e.pool, vec![Event::new("user.account.created", json!({})).key("u")]).await;
    let pool = e.pool.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let row: Option<(String, String)> = sqlx::query_as(
            "SELECT d.state, d.last_error FROM ferry.deliveries d JOIN ferry.events e USING (seq)
              WHERE e.id = $1 AND d.route = $2",
        )
        .bind(ids[0].0)
        .bind(NO_ROUTE)
        .fetch_optional(&pool)
        .await
        .unwrap();
        if let Some((state, error)) = row {
            assert_eq!(state, "dead");
            assert!(error.contains("no route"), "{error}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the unroutable event was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.stop().await;
}

#[tokio::test]
async fn two_relays_share_the_work_without_loss_duplicates_or_reordering() {
    let e = env().await;
    let ids = produce(&e.pool, orders(3000, 50)).await;
    let routes = vec![route("orders", "order.**")];
    let a = start(&e, "a", routes.clone());
    let b = start(&e, "b", routes.clone());
    let more = produce(&e.pool, orders(2000, 50)).await;
    eventually("5000 delivered", Duration::from_secs(90), || {
        e.sink.delivered("orders").len() >= 5000
    })
    .await;
    let (ra, rb) = (a.stop().await, b.stop().await);
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 5000, "duplicates: {}", got.len() - 5000);
    let all: Vec<EventId> = ids.into_iter().chain(more).collect();
    assert_complete_and_ordered(&all, &got);
    assert_eq!(ra.published + rb.published, 5000);
    assert_eq!(ra.refused + rb.refused, 0);
}

/// A relay above its fair share hands partitions back only once the work in
/// flight on them is done. A publish that outlasts the lease (a slow
/// destination) must not let the leases run out meanwhile: the relay that
/// joined would take the partitions still being published, publish their
/// events again and have the first relay's outcomes refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_publish_while_handing_partitions_back_keeps_the_leases() {
    let e = env().await;
    let ids = produce(&e.pool, orders(200, 20)).await;
    // Twice the lease (3 s), once.
    let once = delay_first_publish(&e, ids[0], Duration::from_secs(6));
    let routes = vec![route("orders", "order.**")];
    let a = start(&e, "a", routes.clone());
    eventually("the slow publish under way", Duration::from_secs(20), || {
        once.load(Ordering::SeqCst)
    })
    .await;
    // Relay a now holds every partition, and must hand half back.
    let b = start(&e, "b", routes);
    eventually("200 delivered", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 200
    })
    .await;
    let (ra, rb) = (a.stop().await, b.stop().await);
    let got = e.sink.delivered("orders");
    assert_eq!(ra.refused + rb.refused, 0, "outcomes refused after a lease ran out");
    assert_eq!(got.len(), 200, "duplicates: {}", got.len() - 200);
    assert_complete_and_ordered(&ids, &got);
}

/// A relay told to stop keeps renewing its leases while it waits for the
/// publishes in flight: it stopped at the signal, so a publish that
/// outlasted the lease (here 4.5 s, inside an 8 s shutdown timeout, past
/// the 3 s lease) let another relay take the partitions and publish the
/// same events again, key by key beside it, and the stopping relay's
/// outcomes were refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_relay_keeps_its_leases_until_its_publishes_are_done() {
    let e = env().await;
    let ids = produce(&e.pool, orders(20, 1)).await;
    let once = delay_first_publish(&e, ids[0], Duration::from_millis(4500));
    let routes = vec![route("orders", "order.**")];
    // Room to drain on a loaded machine: the point is the lease, not the
    // shutdown timeout.
    let a_settings = RelaySettings {
        shutdown_timeout: Duration::from_secs(8),
        ..settings("a", 4)
    };
    let a = start_with(&e, a_settings, routes.clone());
    eventually("the slow publish under way", Duration::from_secs(20), || {
        once.load(Ordering::SeqCst)
    })
    .await;
    let a_stopped = tokio::spawn(a.stop());
    let b = start(&e, "b", routes);
    eventually("20 delivered", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 20
    })
    .await;
    let ra = a_stopped.await.unwrap();
    // What b would publish again, it would by now: a's lease ran out 3 s
    // after its last renewal.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rb = b.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(ra.refused + rb.refused, 0, "outcomes refused after a lease ran out");
    assert_eq!(got.len(), 20, "duplicates: {}", got.len() - 20);
    assert_complete_and_ordered(&ids, &got);
}

/// A stopping relay whose settle of a published batch keeps failing gives
/// up after a few tries (the events stay unrouted, and the next owner
/// publishes them again) rather than retry until the shutdown timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_relay_whose_settle_keeps_failing_gives_up_soon() {
    use ferry_testkit::hooked::Hook;
    let e = env().await;
    let ids = produce(&e.pool, orders(1, 1)).await;
    let once = delay_first_publish(&e, ids[0], Duration::from_millis(1500));
    let failing = Arc::new(AtomicBool::new(false));
    let fail = failing.clone();
    let hook: Hook = Arc::new(move |called| {
        let refuse = called == "settle" && fail.load(Ordering::SeqCst);
        Box::pin(async move {
            if refuse {
                Err(ferry_core::StoreError::transient(
                    "the settle cannot reach the database",
                ))
            } else {
                Ok(())
            }
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(
        &e,
        store,
        RelaySettings {
            shutdown_timeout: Duration::from_secs(30),
            ..settings("a", 4)
        },
        vec![route("orders", "order.**")],
    );
    eventually("the slow publish under way", Duration::from_secs(20), || {
        once.load(Ordering::SeqCst)
    })
    .await;
    failing.store(true, Ordering::SeqCst);
    let started = std::time::Instant::now();
    relay.stop().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "the relay retried the settle for {took:?}, towards its 30 s shutdown timeout"
    );
    let unrouted: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(unrouted, 1, "the event waits for the next owner");
}

/// A stopping relay that cannot listen for commits stops trying: its
/// backoff sleep returns at once once the relay is told to stop, and it
/// asked again and again, warning each time, for as long as the shutdown
/// lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_relay_does_not_spin_on_a_listen_that_fails() {
    use ferry_testkit::hooked::Hook;
    let e = env().await;
    let ids = produce(&e.pool, orders(1, 1)).await;
    let once = delay_first_publish(&e, ids[0], Duration::from_millis(1500));
    let listens = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = listens.clone();
    let hook: Hook = Arc::new(move |called| {
        let listen = called == "listen";
        if listen {
            count.fetch_add(1, Ordering::SeqCst);
        }
        Box::pin(async move {
            if listen {
                // A refused connection still goes through the reactor.
                tokio::task::yield_now().await;
                Err(ferry_core::StoreError::transient("LISTEN refused"))
            } else {
                Ok(())
            }
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(&e, store, settings("a", 4), vec![route("orders", "order.**")]);
    eventually("the slow publish under way", Duration::from_secs(20), || {
        once.load(Ordering::SeqCst)
    })
    .await;
    let before = listens.load(Ordering::SeqCst);
    relay.stop().await;
    let during = listens.load(Ordering::SeqCst) - before;
    assert!(during <= 2, "{during} listens tried while stopping");
}

/// A relay above its fair share hands partitions back in a tick. When that
/// tick commits but its answer is lost, the partitions are another relay's
/// to take at once: the relay must stop working them then. It kept them
/// until its next tick answered, and meanwhile both relays published them:
/// their events twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_back_whose_answer_was_lost_stops_work_on_those_partitions() {
    use ferry_testkit::hooked::{AfterTick, Hook};
    let e = env().await;
    let routes = vec![route("orders", "order.**")];
    let lost = Arc::new(AtomicBool::new(false));
    let losing = lost.clone();
    let after: AfterTick = Arc::new(move |release| {
        (!release.is_empty() && !losing.swap(true, Ordering::SeqCst))
            .then(|| ferry_core::StoreError::transient("connection reset after the commit"))
    });
    let pass: Hook = Arc::new(|_| Box::pin(async { Ok(()) }));
    let store_a = Hooked::new(PgStore::new(e.pool.clone()), pass).losing_tick_answers(after);
    // Relay a publishes to `e.sink`, relay b to `e.other`: who published
    // what is known.
    let a = start_on(&e, store_a, settings("a", 4), routes.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = start_on(
        &e,
        PgStore::new(e.pool.clone()),
        settings("b", 4),
        vec![route_to("orders", "order.**", "other")],
    );
    let mut ids = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut after_loss = None;
    while after_loss.is_none_or(|at: tokio::time::Instant| at.elapsed() < Duration::from_secs(3)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay a never handed partitions back"
        );
        ids.extend(produce(&e.pool, orders(32, 32)).await);
        if after_loss.is_none() && lost.load(Ordering::SeqCst) {
            after_loss = Some(tokio::time::Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually("every event delivered", Duration::from_secs(30), || {
        let got: std::collections::HashSet<EventId> = e
            .sink
            .delivered_ids("orders")
            .into_iter()
            .chain(e.other.delivered_ids("orders"))
            .collect();
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    a.stop().await;
    b.stop().await;
    let by_b: std::collections::HashSet<EventId> = e.other.delivered_ids("orders").into_iter().collect();
    assert!(!by_b.is_empty(), "relay b took over nothing: the test proves nothing");
    let twice = e
        .sink
        .delivered_ids("orders")
        .into_iter()
        .filter(|id| by_b.contains(id))
        .count();
    assert_eq!(twice, 0, "events published by both relays");
}

/// A destination's error text can hold a NUL byte (a webhook's binary
/// error body, a broker's description), which PostgreSQL refuses in text:
/// every write of that outcome failed, and the relay retried it for ever,
/// holding up the route and then the whole relay. The byte is stored as
/// U+FFFD.
#[tokio::test]
async fn an_error_text_with_a_nul_byte_is_recorded() {
    let e = env().await;
    let ids = produce(&e.pool, orders(10, 2)).await;
    let first = ids[0];
    let failed = Arc::new(AtomicBool::new(false));
    e.sink.fail_when(move |ev| {
        (ev.id == first && !failed.swap(true, Ordering::SeqCst)).then(|| SinkError::transient("bad\0gateway"))
    });
    let relay = start(&e, "nul", vec![route("orders", "order.**")]);
    eventually("all 10 events", Duration::from_secs(30), || {
        e.sink.delivered_ids("orders").len() >= 10
    })
    .await;
    relay.stop().await;
    let recorded: Vec<String> = sqlx::query_scalar("SELECT error FROM ferry.failures")
        .fetch_all(&e.pool)
        .await
        .unwrap();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert!(recorded[0].contains("bad\u{FFFD}gateway"), "{recorded:?}");
}

/// A relay told to stop starts nothing new: a batch whose fetch was under
/// way at the signal is left to the next relay, not published. It was
/// published, eating into the shutdown timeout, and a timeout cutting it
/// off half-confirmed left its events to be published twice.
#[tokio::test]
async fn a_batch_fetched_after_the_stop_signal_is_not_published() {
    let e = env().await;
    let ids = produce(&e.pool, orders(50, 5)).await;
    let routes = vec![route("orders", "order.**")];
    // Every fetch takes a second; the test hears when the first begins.
    let fetching = Arc::new(AtomicBool::new(false));
    let entered = fetching.clone();
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        let fetch = called == "fetch_direct";
        if fetch {
            entered.store(true, Ordering::SeqCst);
        }
        Box::pin(async move {
            if fetch {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(())
        })
    });
    let slow_fetch = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let a = start_on(&e, slow_fetch, settings("a", 4), routes.clone());
    eventually("inside the first fetch", Duration::from_secs(20), || {
        fetching.load(Ordering::SeqCst)
    })
    .await;
    let ra = a.stop().await;
    assert_eq!(e.sink.attempts(), 0, "published after the stop signal");
    assert_eq!(ra.published, 0);
    let b = start(&e, "b", routes);
    eventually("50 delivered", Duration::from_secs(30), || {
        e.sink.delivered("orders").len() >= 50
    })
    .await;
    b.stop().await;
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 50, "duplicates: {}", got.len() - 50);
    assert_complete_and_ordered(&ids, &got);
}

/// A relay that cannot renew its leases (the database out of its reach)
/// abandons a publish once its lease view runs out: past that point another
/// relay may hold the partitions and publish the same keys. It went on
/// publishing, beside the relay that took over, and its late confirms
/// came after that relay's: every event of the batch twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_cannot_renew_its_lease_abandons_the_publish_in_flight() {
    let e = env().await;
    let ids = produce(&e.pool, orders(20, 1)).await;
    // Twice the lease (3 s), once.
    let started = delay_first_publish(&e, ids[0], Duration::from_secs(6));
    // From the slow publish on, relay a cannot renew.
    let cut = started.clone();
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        let cut = cut.load(Ordering::SeqCst) && called == "tick";
        Box::pin(async move {
            if cut {
                Err(ferry_core::StoreError::transient("the database is unreachable"))
            } else {
                Ok(())
            }
        })
    });
    let routes = vec![route("orders", "order.**")];
    let a = start_on(
        &e,
        Hooked::new(PgStore::new(e.pool.clone()), hook),
        settings("a", 4),
        routes.clone(),
    );
    eventually("the slow publish under way", Duration::from_secs(20), || {
        started.load(Ordering::SeqCst)
    })
    .await;
    let b = start(&e, "b", routes);
    eventually("20 delivered", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= 20
    })
    .await;
    // Past the moment a's slow publish would have confirmed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (ra, rb) = (a.stop().await, b.stop().await);
    let got = e.sink.delivered("orders");
    assert_eq!(got.len(), 20, "duplicates: {}", got.len() - 20);
    assert_complete_and_ordered(&ids, &got);
    assert_eq!((ra.published, rb.published), (0, 20));
}

#[tokio::test]
async fn shutdown_hands_the_leases_back() {
    let e = env().await;
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    produce(&e.pool, orders(10, 2)).await;
    eventually("delivered", Duration::from_secs(20), || {
        e.sink.delivered("orders").len() >= 10
    })
    .await;
    relay.stop().await;
    let owned = leased(&e.pool, None).await;
    assert_eq!(owned, 0);
    // A new relay takes over at once, without waiting for a lease to expire.
    let b = start(&e, "b", vec![route("orders", "order.**")]);
    produce(&e.pool, orders(10, 2)).await;
    eventually("delivered by b", Duration::from_secs(20), || {
        e.sink.delivered("orders").len() >= 20
    })
    .await;
    b.stop().await;
}

/// A publish the shutdown timeout cut short may leave messages in a client's
/// queue, which the sink's close flushes: it must run while the leases are
/// still held, or those messages could reach the destination beside (or
/// after) the next relay's copies.
#[tokio::test]
async fn the_sinks_close_before_the_leases_are_handed_back() {
    let e = env().await;
    let sink = e.sink.clone();
    let closed_at_leave = Arc::new(std::sync::Mutex::new(None));
    let seen = closed_at_leave.clone();
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        if called == "leave" {
            *seen.lock().unwrap() = Some(sink.closed());
        }
        Box::pin(async { Ok(()) })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(&e, store, settings("a", 4), vec![route("orders", "order.**")]);
    produce(&e.pool, orders(10, 2)).await;
    eventually("delivered", Duration::from_secs(20), || {
        e.sink.delivered("orders").len() >= 10
    })
    .await;
    relay.stop().await;
    assert_eq!(
        *closed_at_leave.lock().unwrap(),
        Some(true),
        "the leases were handed back before the sinks closed"
    );
}

/// A task that panics (here in a sink's client: the router, which publishes
/// fresh events itself) stops the relay with an error naming it, so that a
/// supervisor restarts it, rather than leave events undelivered behind a
/// relay that runs on.
#[tokio::test]
async fn a_task_that_panics_stops_the_relay_with_an_error() {
    let e = env().await;
    e.sink.fail_when(|ev| {
        assert_ne!(ev.key.as_deref(), Some("k0"), "a bug in the sink");
        None
    });
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(
        PgStore::new(e.pool.clone()),
        SystemClock,
        settings("a", 4),
        vec![route("orders", "order.**")],
        sinks,
    )
    .unwrap();
    produce(&e.pool, orders(1, 1)).await;
    let result = tokio::time::timeout(Duration::from_secs(30), relay.run(std::future::pending()))
        .await
        .expect("the relay stops on its own");
    let error = result.expect_err("a relay whose worker died reports it");
    let text = error.to_string();
    assert!(matches!(error, ferry_relay::RelayError::TaskEnded { .. }), "{text}");
    assert!(
        text.contains("the relay's router stopped unexpectedly: panicked"),
        "{text}"
    );
    assert!(text.contains("a bug in the sink"), "{text}");
    // Stopped as on a signal: the leases are handed back.
    let owned = leased(&e.pool, None).await;
    assert_eq!(owned, 0);
}

/// A sink that cannot finish closing may still send what it holds: its
/// relay keeps the leases, to expire, rather than hand them to a relay that
/// would publish beside it.
#[tokio::test]
async fn a_sink_that_does_not_close_in_time_leaves_the_leases_to_expire() {
    let e = env().await;
    e.sink.delay_close(Duration::from_secs(60));
    let relay = start(&e, "a", vec![route("orders", "order.**")]);
    produce(&e.pool, orders(10, 2)).await;
    eventually("delivered", Duration::from_secs(20), || {
        e.sink.delivered("orders").len() >= 10
    })
    .await;
    tokio::time::timeout(Duration::from_secs(30), relay.stop())
        .await
        .expect("the close is bounded");
    let owned = leased(&e.pool, Some("a")).await;
    assert!(
        owned > 0,
        "the leases were handed back while the sink was still closing"
    );
}

/// A lease renewal in flight when the relay stops must not take the leases
/// again after the hand-back. A client that gives up on a statement already
/// sent leaves it running on the server; here the renewal's statement runs
/// in a task of its own, 300 ms late, so that giving up on it does not stop
/// it either.
#[tokio::test]
async fn a_renewal_in_flight_at_shutdown_does_not_keep_the_leases() {
    let e = env().await;
    let server = PgStore::new(e.pool.clone());
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        let (server, started_tx, ticks) = (server.clone(), started_tx.clone(), ticks.clone());
        Box::pin(async move {
            // The first tick takes the leases at start-up; later ones are slow.
            if called != "tick" || ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                return Ok(());
            }
            let _ = started_tx.send(());
            let statement = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                server
                    .tick(&ferry_core::RelayId("late".into()), Duration::from_secs(3), &[])
                    .await
                    .map(drop)
            });
            statement.await.expect("the late statement ran")
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(&e, store, settings("late", 4), vec![route("orders", "order.**")]);
    tokio::time::timeout(Duration::from_secs(20), started.recv())
        .await
        .expect("a renewal within 20 s")
        .unwrap();
    relay.stop().await;
    // Past the moment the late statement would have run.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let owned = leased(&e.pool, None).await;
    assert_eq!(owned, 0, "the renewal took leases after the relay handed them back");
}

/// The router settles batch n while it publishes batch n + 1, which it
/// planned behind batch n: a key that failed in n is held back in n + 1 only
/// in memory. If the database is gone until the lease runs out, the settle
/// of n gives up and its events stay unrouted; the settle of n + 1 must give
/// up with it. Written once the database is back, it would leave a later
/// event of that key pending with nothing before it in the table, and the
/// route worker would deliver it ahead of the earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_planned_behind_one_that_could_not_be_settled_is_not_settled_either() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    let e = env().await;
    let first = |key: &str, n: u32| Event::new("order.item.created", json!({ "n": n })).key(key);
    // Batches of two: [early, other], then [late, slow], fetched ahead.
    let ids = produce(
        &e.pool,
        vec![first("k", 0), first("other", 1), first("k", 2), first("slow", 3)],
    )
    .await;
    let (early, late, slow) = (ids[0], ids[2], ids[3]);
    let early_attempts = Arc::new(AtomicU32::new(0));
    let slow_attempts = Arc::new(AtomicU32::new(0));
    {
        let early_attempts = early_attempts.clone();
        e.sink.fail_when(move |ev| {
            (ev.id == early && early_attempts.fetch_add(1, Ordering::SeqCst) < 2)
                .then(|| SinkError::transient("refused"))
        });
        let slow_attempts = slow_attempts.clone();
        // Still publishing when the database is back.
        e.sink.delay_when(move |ev| {
            (ev.id == slow && slow_attempts.fetch_add(1, Ordering::SeqCst) == 0).then_some(Duration::from_secs(6))
        });
    }
    // The database goes away at the first settle (batch one's, beside batch
    // two's publish) for longer than the lease; afterwards the second
    // settle is slow, so that a route worker woken by the first has time to
    // claim what it wrote.
    let outage: Arc<Mutex<Option<Instant>>> = Arc::default();
    let settles_after = Arc::new(AtomicU32::new(0));
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        let (outage, settles_after) = (outage.clone(), settles_after.clone());
        Box::pin(async move {
            let began = {
                let mut outage = outage.lock().unwrap();
                if called == "settle" && outage.is_none() {
                    *outage = Some(Instant::now());
                }
                *outage
            };
            match began {
                Some(at) if at.elapsed() < Duration::from_millis(4_500) => {
                    Err(ferry_core::StoreError::transient("the database is unreachable"))
                }
                Some(_) if called == "settle" => {
                    if settles_after.fetch_add(1, Ordering::SeqCst) == 1 {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                    }
                    Ok(())
                }
                _ => Ok(()),
            }
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(
        &e,
        store,
        RelaySettings {
            batch_size: 2,
            ..settings("outage", 6)
        },
        vec![route("orders", "order.**")],
    );
    eventually("every event", Duration::from_secs(60), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    relay.stop().await;
    assert!(slow_attempts.load(Ordering::SeqCst) >= 1 && early_attempts.load(Ordering::SeqCst) >= 3);
    assert_arrived_first(&e, early, late);
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}

/// The same as above when the settle of batch n is refused rather than
/// failed: the relay lost its leases while it published n and took them
/// again, under new tokens, before it planned n + 1. The settle of n
/// (under the old tokens) puts its events back; the settle of n + 1 (under
/// the new ones) would be accepted, and with it a later event of a key
/// that failed in n, held back only by the plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_planned_behind_one_whose_settle_was_refused_is_not_settled_either() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    let e = env().await;
    let event = |key: &str, n: u32| Event::new("order.item.created", json!({ "n": n })).key(key);
    // Batches of two: [early, other], then [late, last].
    let ids = produce(
        &e.pool,
        vec![event("k", 0), event("other", 1), event("k", 2), event("last", 3)],
    )
    .await;
    let (early, other, late) = (ids[0], ids[1], ids[2]);
    let early_attempts = Arc::new(AtomicU32::new(0));
    let other_attempts = Arc::new(AtomicU32::new(0));
    // Set while batch one publishes: the next renewal finds the leases lost.
    let lose_leases = Arc::new(AtomicBool::new(false));
    let early_seen = Arc::new(AtomicU32::new(0));
    {
        let early_attempts = early_attempts.clone();
        e.sink.fail_when(move |ev| {
            (ev.id == early && early_attempts.fetch_add(1, Ordering::SeqCst) == 0)
                .then(|| SinkError::transient("refused"))
        });
        let (other_attempts, early_seen, lose_leases) =
            (other_attempts.clone(), early_seen.clone(), lose_leases.clone());
        e.sink.delay_when(move |ev| {
            if ev.id == other && other_attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                // Batch one stays in flight across a renewal (a third of
                // the 3 s lease).
                lose_leases.store(true, Ordering::SeqCst);
                return Some(Duration::from_millis(2_500));
            }
            // The early event's second attempt is slow, so that a route
            // worker given the later one has time to deliver it first.
            (ev.id == early && early_seen.fetch_add(1, Ordering::SeqCst) == 1).then_some(Duration::from_secs(2))
        });
    }
    let store = Hooked::new(
        PgStore::new(e.pool.clone()),
        lose_leases_at_next_tick(&e.pool, lose_leases),
    );
    let relay = start_on(
        &e,
        store,
        RelaySettings {
            batch_size: 2,
            ..settings("regained", 6)
        },
        vec![route("orders", "order.**")],
    );
    eventually("every event", Duration::from_secs(60), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    let report = relay.stop().await;
    assert!(
        report.refused > 0,
        "the settle of batch one was not refused: {report:?}"
    );
    assert_arrived_first(&e, early, late);
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}

/// A route worker records batch n while it claims batch n + 1. If the
/// relay lost its leases while it published n and took them again under
/// new tokens, the record of n is refused and n's deliveries stay pending;
/// n + 1, claimed past them, must not be published, or a key's later event
/// goes out before its earlier one is published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_publishes_nothing_claimed_behind_a_refused_record() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    let e = env().await;
    let event = |n: u32| Event::new("order.item.created", json!({ "n": n })).key("k");
    let ids = produce(&e.pool, vec![event(0), event(1)]).await;
    let (early, late) = (ids[0], ids[1]);
    // Both wait for the route worker, as parked events do.
    sqlx::raw_sql(
        "INSERT INTO ferry.deliveries (seq, route, partition, key)
         SELECT u.seq, 'orders', u.partition, ev.key FROM ferry.unrouted u JOIN ferry.events ev USING (seq);
         DELETE FROM ferry.unrouted",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let early_seen = Arc::new(AtomicU32::new(0));
    let lose_leases = Arc::new(AtomicBool::new(false));
    {
        let (early_seen, lose_leases) = (early_seen.clone(), lose_leases.clone());
        e.sink.delay_when(move |ev| {
            // In flight across a renewal (a third of the 3 s lease).
            (ev.id == early && early_seen.fetch_add(1, Ordering::SeqCst) == 0).then(|| {
                lose_leases.store(true, Ordering::SeqCst);
                Duration::from_millis(2_500)
            })
        });
    }
    let store = Hooked::new(
        PgStore::new(e.pool.clone()),
        lose_leases_at_next_tick(&e.pool, lose_leases),
    );
    let relay = start_on(
        &e,
        store,
        RelaySettings {
            batch_size: 1,
            ..settings("regained", 6)
        },
        vec![route("orders", "order.**")],
    );
    eventually("both events", Duration::from_secs(60), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    // Whatever else is published again, long enough to arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let report = relay.stop().await;
    assert!(
        report.refused > 0,
        "the record of batch one was not refused: {report:?}"
    );
    let got = e.sink.delivered_ids("orders");
    let first_late = got.iter().position(|g| *g == late).unwrap();
    assert!(
        !got[first_late..].contains(&early),
        "the earlier event of key k went out again after the later one: {got:?} (early {early}, late {late})"
    );
}

/// A database that stops answering (a partition, not a refusal) must not
/// hold the relay's exit: SIGTERM ends it within its shutdown timeout and
/// the farewell's bound, and no delivery is lost (what it could not record
/// stays pending for the next relay).
#[tokio::test]
async fn a_database_that_stops_answering_does_not_hold_up_shutdown() {
    let e = env().await;
    let upstream: std::net::SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let proxy = ferry_testkit::proxy::Proxy::start(upstream).unwrap();
    let url = e._db.url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let ids = produce(&e.pool, orders(300, 10)).await;
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(
        PgStore::new(pool),
        SystemClock,
        settings("silent-db", 4),
        vec![route("orders", "order.**")],
        sinks,
    )
    .unwrap();
    let (stop, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(relay.run(async {
        let _ = rx.await;
    }));
    eventually("the first events published", Duration::from_secs(20), || {
        !e.sink.delivered_ids("orders").is_empty()
    })
    .await;
    // Every byte either way is now held for an hour: queries hang.
    proxy.set_delay(Duration::from_secs(3600));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = tokio::time::Instant::now();
    let _ = stop.send(());
    let report = tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the relay exits within 30 s of being told to, database silent or not")
        .unwrap()
        .unwrap();
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(30), "{took:?}");
    // Nothing lost: each event was published, or is still pending in the
    // database for the next relay.
    let published: std::collections::HashSet<_> = e.sink.delivered_ids("orders").into_iter().collect();
    let pending: Vec<sqlx::types::Uuid> = sqlx::query_scalar(
        "SELECT e.id FROM ferry.events e JOIN ferry.deliveries d USING (seq) WHERE d.state = 'pending'
         UNION ALL SELECT e.id FROM ferry.events e JOIN ferry.unrouted u USING (seq)",
    )
    .fetch_all(&e.pool)
    .await
    .unwrap();
    let pending: std::collections::HashSet<_> = pending.into_iter().map(EventId).collect();
    for id in &ids {
        assert!(
            published.contains(id) || pending.contains(id),
            "{id} was neither published nor left pending; report {report:?}"
        );
    }
}

/// A relay whose `run` future is dropped (its task aborted) leaves nothing
/// behind: its leases stop being renewed, so another relay takes the work
/// over when they expire, and nothing is lost.
#[tokio::test]
async fn a_relay_dropped_mid_run_stops_renewing_and_another_takes_over() {
    let e = env().await;
    let ids = produce(&e.pool, orders(400, 8)).await;
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(
        PgStore::new(e.pool.clone()),
        SystemClock,
        settings("dropped", 4),
        vec![route("orders", "order.**")],
        sinks,
    )
    .unwrap();
    let task = tokio::spawn(relay.run(std::future::pending()));
    eventually("the first events published", Duration::from_secs(20), || {
        !e.sink.delivered_ids("orders").is_empty()
    })
    .await;
    task.abort();
    let _ = task.await;
    // Events committed after the drop can only go out through a successor,
    // which gets the partitions once the first relay's leases lapse (3 s):
    // never, if the dropped relay kept renewing them.
    let mut ids = ids;
    ids.extend(produce(&e.pool, orders(200, 8)).await);
    let b = start(&e, "successor", vec![route("orders", "order.**")]);
    eventually("every event published", Duration::from_secs(30), || {
        let got: std::collections::HashSet<_> = e.sink.delivered_ids("orders").into_iter().collect();
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    let report = b.stop().await;
    assert!(report.published > 0, "the successor took work over: {report:?}");
}

/// Batch n fails an event of key k; batch n + 1 has no k; batch n + 2,
/// fetched while batch n's settle has not committed yet, has k's next event.
/// That event must wait behind the failed one (in the table) rather than go
/// out directly ahead of its retry.
#[tokio::test]
async fn a_failure_holds_its_key_back_in_a_batch_fetched_before_the_failure_was_settled() {
    let e = env().await;
    let event = |n: usize, key: &str| Event::new("order.placed", json!({ "n": n })).key(key);
    // Batches of 10: k appears at 5 (fails once) and at 25; the rest are
    // keys of their own.
    let events: Vec<Event> = (0..40)
        .map(|n| {
            if n == 5 || n == 25 {
                event(n, "k")
            } else {
                event(n, &format!("other-{n}"))
            }
        })
        .collect();
    let ids = produce(&e.pool, events).await;
    let first_k = ids[5];
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    e.sink.fail_when(move |ev| {
        (ev.id == first_k && !failed.swap(true, std::sync::atomic::Ordering::SeqCst))
            .then(|| SinkError::transient("refused once"))
    });
    // A slow settle: the router's next-batch fetch, made while a batch is
    // published, then always runs before the batch before it is settled.
    let store = Hooked::delaying(PgStore::new(e.pool.clone()), "settle", Duration::from_millis(150));
    let settings = RelaySettings {
        batch_size: 10,
        ..settings("slow-settle", 6)
    };
    let relay = start_on(&e, store, settings, vec![route("orders", "order.**")]);
    eventually("all 40 events", Duration::from_secs(30), || {
        e.sink.delivered_ids("orders").len() >= 40
    })
    .await;
    let report = relay.stop().await;
    let k: Vec<EventId> = e
        .sink
        .delivered("orders")
        .iter()
        .filter(|ev| ev.key.as_deref() == Some("k"))
        .map(|ev| ev.id)
        .collect();
    assert_eq!(
        k,
        vec![ids[5], ids[25]],
        "k's later event went out before its retried one"
    );
    assert_eq!(report.order_breaks, 0);
}

/// `early` reached the route before `late` did.
fn assert_arrived_first(e: &Env, early: EventId, late: EventId) {
    let got = e.sink.delivered_ids("orders");
    let at = |id| got.iter().position(|g| *g == id).unwrap();
    assert!(
        at(early) < at(late),
        "the later event of key k arrived first: {got:?} (early {early}, late {late})"
    );
}

/// A store hook for which, once `armed` is set, the next renewal finds the
/// relay's partitions free, as if another relay had taken them and handed
/// them back: it takes them again, each under a new token.
fn lose_leases_at_next_tick(pool: &PgPool, armed: Arc<std::sync::atomic::AtomicBool>) -> ferry_testkit::hooked::Hook {
    let pool = pool.clone();
    Arc::new(move |called| {
        let (pool, armed) = (pool.clone(), armed.clone());
        Box::pin(async move {
            if called == "tick" && armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                sqlx::query("UPDATE ferry.partitions SET owner = NULL, expires_at = NULL")
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            Ok(())
        })
    })
}

/// A relay whose lease ran out (its renewals failing, as while the database
/// is unreachable) waits for a new one without spinning: the router and the
/// workers used to take every lease view ever sent for a new one and loop
/// at once, a core each, for as long as the outage lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_without_a_lease_waits_for_one_without_spinning() {
    let e = env().await;
    let unreachable = Arc::new(AtomicBool::new(false));
    let hook: ferry_testkit::hooked::Hook = {
        let unreachable = unreachable.clone();
        Arc::new(move |called| {
            let fail = called == "tick" && unreachable.load(Ordering::SeqCst);
            Box::pin(async move {
                if fail {
                    Err(ferry_core::StoreError::transient("the database is unreachable"))
                } else {
                    Ok(())
                }
            })
        })
    };
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(
        &e,
        store,
        settings("leaseless", 4),
        vec![route("orders", "order.**"), route("audit", "order.**")],
    );
    let first = produce(&e.pool, orders(5, 2)).await;
    eventually("the first events", Duration::from_secs(30), || {
        let got = e.sink.delivered_ids("orders");
        first.iter().all(|id| got.contains(id))
    })
    .await;
    unreachable.store(true, Ordering::SeqCst);
    // Past the 3 s lease: no valid lease from here on. A commit wakes the
    // relay, which finds no lease and must wait for one.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut ids = first;
    ids.extend(produce(&e.pool, orders(5, 2)).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = cpu_seconds();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_seconds() - before;
    assert!(
        used < 0.5,
        "the relay used {used:.2} s of CPU in 2 s while it waited for a lease"
    );
    unreachable.store(false, Ordering::SeqCst);
    ids.extend(produce(&e.pool, orders(5, 2)).await);
    eventually("every event after the outage", Duration::from_secs(30), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    relay.stop().await;
}

/// This process's CPU time, user and system, in seconds (Linux).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name: state (3) first, utime (14) and stime
    // (15) in clock ticks, 100 a second.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / 100.0
}

/// A worker that cannot read when its next retry is due looks again soon,
/// not at the slow poll (four poll intervals: four minutes here) while the
/// retry waits. Nothing else would wake it: no new event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_read_of_the_next_retry_time_does_not_leave_the_retry_to_the_slow_poll() {
    use std::sync::atomic::AtomicUsize;
    let e = env().await;
    let failed_reads = Arc::new(AtomicUsize::new(0));
    let hook: ferry_testkit::hooked::Hook = {
        let failed_reads = failed_reads.clone();
        Arc::new(move |called| {
            let fail = called == "next_due" && failed_reads.fetch_add(1, Ordering::SeqCst) < 3;
            Box::pin(async move {
                if fail {
                    Err(ferry_core::StoreError::transient("the database is unreachable"))
                } else {
                    Ok(())
                }
            })
        })
    };
    // Each event's first attempt fails.
    let tried = std::sync::Mutex::new(std::collections::HashSet::new());
    e.sink.fail_when(move |ev| {
        tried
            .lock()
            .unwrap()
            .insert(ev.id)
            .then(|| SinkError::transient("timed out"))
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(&e, store, settings("next-due", 4), vec![route("orders", "order.**")]);
    let ids = produce(&e.pool, orders(3, 1)).await;
    eventually("every event, on its retry", Duration::from_secs(30), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    assert!(
        failed_reads.load(Ordering::SeqCst) >= 1,
        "the next retry's time was never read: the test proves nothing"
    );
    relay.stop().await;
}

/// A router that keeps failing leaves new events unrouted while the route
/// workers, with nothing to claim, look idle: its progress handle says how
/// long it has failed (which the readiness probe reports), and stops saying
/// so once a step succeeds.
#[tokio::test]
async fn a_failing_router_shows_in_the_progress_handle_until_it_recovers() {
    // Reading what to route, and writing what it routed (the direct path
    // publishes first, then settles, retrying while its lease lasts).
    for which in ["fetch_direct", "settle"] {
        router_fails_at(which).await;
    }
}

async fn router_fails_at(which: &'static str) {
    let e = env().await;
    let failing = Arc::new(AtomicBool::new(true));
    let fail = failing.clone();
    let hook: ferry_testkit::hooked::Hook = Arc::new(move |called| {
        let refuse = fail.load(Ordering::SeqCst) && called == which;
        Box::pin(async move {
            if refuse {
                Err(ferry_core::StoreError::transient(
                    "permission denied for table deliveries",
                ))
            } else {
                Ok(())
            }
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(
        store,
        SystemClock,
        settings("a", 4),
        vec![route("orders", "order.**")],
        sinks,
    )
    .unwrap();
    let progress = relay.progress();
    let (stop, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        relay
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap()
    });
    produce(&e.pool, orders(5, 1)).await;
    eventually(
        &format!("the router's failure at {which} to show"),
        Duration::from_secs(20),
        || progress.router_failing_for().is_some(),
    )
    .await;
    failing.store(false, Ordering::SeqCst);
    eventually("delivered", Duration::from_secs(20), || {
        e.sink.delivered("orders").len() >= 5
    })
    .await;
    eventually("the router's failure to clear", Duration::from_secs(20), || {
        progress.router_failing_for().is_none()
    })
    .await;
    let _ = stop.send(());
    handle.await.unwrap();
}

#[path = "engine/counting.rs"]
mod counting;
#[path = "engine/lease.rs"]
mod lease;
#[path = "engine/lock_wait.rs"]
mod lock_wait;
#[path = "engine/partial.rs"]
mod partial;
#[path = "engine/silent.rs"]
mod silent;
