//! WAL streaming mode against a real PostgreSQL slot (wal_level=logical,
//! set by scripts/test) and scripted sinks: commit order, a relay killed
//! mid-stream, a destination down, tableless events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{Event, EventId, Glob, Route, Sink, StoredEvent, SystemClock};
use ferry_relay::{Relay, Wal, WalOptions};
use ferry_store::postgres::wal::{WalConfig, WalSource, emit};
use ferry_store::postgres::{PgStore, enqueue, enqueue_batch, migrate};
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::pg::TestDb;
use ferry_testkit::pg_server::PgServer;
use rand::Rng;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::oneshot;

mod support;
use support::{Running, eventually, eventually_async, settings};

struct Env {
    pool: PgPool,
    sink: Arc<MockSink>,
    other: Arc<MockSink>,
    slot: String,
    db: TestDb,
}

async fn env() -> Env {
    env_on(TestDb::create().await).await
}

/// An environment on `db`, whatever server that is.
async fn env_on(db: TestDb) -> Env {
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    Env {
        pool,
        sink: Arc::new(MockSink::new()),
        other: Arc::new(MockSink::new()),
        // Slots are named across the whole server: one per test database.
        slot: db.name().to_owned(),
        db,
    }
}

fn route(name: &str, sink: &str) -> Route {
    Route {
        name: name.into(),
        matcher: Glob::new("**").unwrap(),
        sink: sink.into(),
        destination: "d".into(),
        routing_key: None,
    }
}

fn start(e: &Env, id: &str, routes: Vec<Route>) -> Running {
    start_in(e, id, routes, true)
}

/// A relay streaming from the WAL (`stream`), or polling the table.
fn start_in(e: &Env, id: &str, routes: Vec<Route>, stream: bool) -> Running {
    let options = WalOptions {
        publish_timeout: Duration::from_secs(2),
        ..WalOptions::default()
    };
    start_with(e, id, routes, stream.then_some(options)).0
}

/// A relay streaming from the WAL with `options`, or polling the table.
/// Also returns the relay's progress handle.
fn start_with(e: &Env, id: &str, routes: Vec<Route>, options: Option<WalOptions>) -> (Running, ferry_relay::Progress) {
    start_on(e, e.pool.clone(), id, routes, options)
}

/// [`start_with`], the relay's queries going through `pool` (the stream
/// connects straight to the database).
fn start_on(
    e: &Env,
    pool: PgPool,
    id: &str,
    routes: Vec<Route>,
    options: Option<WalOptions>,
) -> (Running, ferry_relay::Progress) {
    let sinks: HashMap<String, Arc<dyn Sink>> = [
        ("mock".to_string(), e.sink.clone() as Arc<dyn Sink>),
        ("other".to_string(), e.other.clone() as Arc<dyn Sink>),
    ]
    .into();
    let source = WalSource::new(
        pool.clone(),
        WalConfig {
            url: e.db.url().to_owned(),
            slot: e.slot.clone(),
            publication: "ferry".into(),
        },
    )
    .unwrap();

    let relay = Relay::new(PgStore::new(pool), SystemClock, settings(id, 100), routes, sinks).unwrap();
    let relay = match options {
        Some(options) => relay.with_wal(Wal { source, options }),
        None => relay,
    };
    let progress = relay.progress();
    let (stop, rx) = oneshot::channel();
    let handle = tokio::spawn(async move {
        relay
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap()
    });
    (Running { stop, handle }, progress)
}

/// Waits until a relay streams from the slot.
async fn streaming(e: &Env) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        // Streaming, and past the start-up sweep (tableless events allowed).
        if ferry_store::postgres::wal::streaming(&e.pool, &e.slot).await.unwrap() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no relay streams from the slot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn unique(got: &[StoredEvent]) -> Vec<EventId> {
    let mut seen = std::collections::HashSet::new();
    got.iter().map(|e| e.id).filter(|id| seen.insert(*id)).collect()
}

/// Every id arrived; per key, first arrivals keep the order of `ids`.
fn assert_complete_and_ordered(ids: &[(EventId, String)], got: &[StoredEvent]) {
    let arrived = unique(got);
    let missing: Vec<_> = ids.iter().filter(|(id, _)| !arrived.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} events lost, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    let key_of: HashMap<EventId, &str> = ids.iter().map(|(id, k)| (*id, k.as_str())).collect();
    let mut per_key_want: HashMap<&str, Vec<EventId>> = HashMap::new();
    for (id, k) in ids {
        per_key_want.entry(k).or_default().push(*id);
    }
    let mut per_key_got: HashMap<&str, Vec<EventId>> = HashMap::new();
    for id in arrived {
        if let Some(k) = key_of.get(&id) {
            per_key_got.entry(k).or_default().push(id);
        }
    }
    assert_eq!(per_key_got, per_key_want, "a key's events arrived out of commit order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_arrive_in_commit_order_across_concurrent_transactions() {
    let e = env().await;
    // Committed before the slot existed: the start-up sweep delivers them.
    let mut tx = e.pool.begin().await.unwrap();
    let early = enqueue_batch(
        &mut tx,
        (0..5).map(|i| Event::new("early.event", json!({ "i": i }))).collect(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    eventually("the early events", Duration::from_secs(20), || {
        e.sink.delivered_ids("all").len() >= early.len()
    })
    .await;
    // Delivered is not yet recorded: until the table path has recorded the
    // swept events, the route counts as busy and new events would be parked
    // behind them, and the table path delivers in outbox order, not commit
    // order. Streamed events are what this test is about.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'pending'")
            .fetch_one(&e.pool)
            .await
            .unwrap();
        if pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the swept events were never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Producers draw their seq early and commit late, in an order only the
    // commit decides. A lock taken just before each commit (and held through
    // it) records the commit order.
    let commits: Arc<Mutex<Vec<(EventId, i64)>>> = Arc::default();
    let mut producers = Vec::new();
    for p in 0..8 {
        let pool = e.pool.clone();
        let commits = commits.clone();
        producers.push(tokio::spawn(async move {
            for n in 0..25 {
                let mut tx = pool.begin().await.unwrap();
                let sent = enqueue(
                    &mut tx,
                    Event::new("order.placed", json!({ "p": p, "n": n })).key(format!("p{p}")),
                )
                .await
                .unwrap();
                let seq: i64 = sqlx::query_scalar("SELECT seq FROM ferry.events WHERE id = $1")
                    .bind(sent.id.0)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                let pause = rand::rng().random_range(0..4);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                sqlx::query("SELECT pg_advisory_xact_lock(4242)")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                commits.lock().unwrap().push((sent.id, seq));
                tx.commit().await.unwrap();
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let commits = commits.lock().unwrap().clone();
    eventually("every event", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= early.len() + commits.len()
    })
    .await;
    let got: Vec<EventId> = unique(&e.sink.delivered("all"))
        .into_iter()
        .filter(|id| !early.iter().any(|x| x.id == *id))
        .collect();
    let want: Vec<EventId> = commits.iter().map(|c| c.0).collect();
    assert_eq!(got, want, "delivery order differs from commit order");
    let mut by_seq = commits.clone();
    by_seq.sort_by_key(|c| c.1);
    assert_ne!(
        by_seq.iter().map(|c| c.0).collect::<Vec<_>>(),
        want,
        "commits happened in seq order, so this run proves nothing about commit order"
    );
    let report = relay.stop().await;
    assert_eq!(report.published as usize, early.len() + commits.len());
    let unsettled: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(unsettled, 0);
    e.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_mid_stream_loses_nothing() {
    let e = env().await;
    let first = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let producer = {
        let pool = e.pool.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for t in 0..100 {
                let mut tx = pool.begin().await.unwrap();
                let events = (0..10)
                    .map(|i| {
                        Event::new("order.placed", json!({ "t": t, "i": i })).key(format!("k{}", (t * 10 + i) % 7))
                    })
                    .collect::<Vec<_>>();
                let keys: Vec<String> = events.iter().map(|ev| ev.get_key().unwrap().to_owned()).collect();
                // Outbox rows survive in the table whatever the slot says;
                // tableless events live only in the WAL, so they are what
                // a position confirmed too early would lose.
                let sent = write(&mut tx, t % 2 == 0, events).await;
                tx.commit().await.unwrap();
                ids.extend(sent.into_iter().zip(keys));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            ids
        })
    };
    eventually("a part of the stream", Duration::from_secs(30), || {
        e.sink.delivered("all").len() >= 200
    })
    .await;
    // A crash: the relay's tasks die where they stand, nothing settled or
    // confirmed after this point.
    first.handle.abort();
    let _ = first.handle.await;
    let before = e.sink.delivered("all").len();
    let ids = producer.await.unwrap();
    let second = start(&e, "wal-b", vec![route("all", "mock")]);
    eventually("every event after the restart", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert!(
        before < ids.len(),
        "the crash came after everything was delivered; it proves nothing"
    );
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    second.stop().await;
    let (published, other): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'published'), count(*) FILTER (WHERE state <> 'published') \
           FROM ferry.deliveries",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    // Tableless events delivered straight from the stream leave no row.
    assert!(published <= ids.len() as i64);
    assert_eq!(other, 0);
    e.db.drop_db().await;
}

/// The replication connection drops (a walsender terminated, a proxy cut)
/// while a published batch waits to be settled. The relay settles that batch
/// before it reconnects, so the next session skips its events rather than
/// publish them again: nothing is lost and nothing arrives twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_cut_after_a_publish_loses_nothing_and_sends_nothing_twice() {
    let e = env().await;
    // Each publish takes a while, so that a cut lands while a batch is out.
    e.sink.delay_when(|_| Some(Duration::from_millis(100)));
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let pool = e.pool.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut t = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let mut tx = pool.begin().await.unwrap();
                let events: Vec<Event> = (0..5)
                    .map(|i| Event::new("order.placed", json!({ "t": t, "i": i })).key(format!("k{}", (t + i) % 7)))
                    .collect();
                let keys: Vec<String> = events.iter().map(|ev| ev.get_key().unwrap().to_owned()).collect();
                // Outbox rows are skipped on replay once settled; tableless
                // events by the settled position: both must be recorded.
                let sent = write(&mut tx, t % 2 == 0, events).await;
                tx.commit().await.unwrap();
                ids.extend(sent.into_iter().zip(keys));
                t += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            ids
        })
    };
    let mut cuts = 0;
    while cuts < 4 {
        // Streaming again and publishing: cut somewhere inside a publish.
        let before = e.sink.delivered("all").len();
        eventually("the stream publishing", Duration::from_secs(30), || {
            e.sink.delivered("all").len() > before + 10
        })
        .await;
        let pause = rand::rng().random_range(0..100);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let cut = sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
              WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(&e.slot)
        .execute(&e.pool)
        .await
        .unwrap();
        cuts += cut.rows_affected();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let ids = producer.await.unwrap();
    eventually("every event after the cuts", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    let got = e.sink.delivered("all");
    assert_complete_and_ordered(&ids, &got);
    assert_eq!(
        got.len() - unique(&got).len(),
        0,
        "events published before a cut were published again after it"
    );
    relay.stop().await;
    e.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_destination_down_does_not_hold_up_the_others_and_loses_nothing() {
    let e = env().await;
    e.other.set_down(true);
    let relay = start(&e, "wal-a", vec![route("up", "mock"), route("down", "other")]);
    streaming(&e).await;
    let mut ids = Vec::new();
    for t in 0..60 {
        let mut tx = e.pool.begin().await.unwrap();
        let events: Vec<Event> = (0..5)
            .map(|i| Event::new("order.placed", json!({ "t": t, "i": i })).key(format!("k{}", i % 3)))
            .collect();
        let keys: Vec<String> = events.iter().map(|ev| ev.get_key().unwrap().to_owned()).collect();
        let sent = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        ids.extend(sent.into_iter().map(|s| s.id).zip(keys));
    }
    eventually("the healthy route's events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("up")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("up"));
    assert!(e.other.delivered("down").is_empty());
    // The slot moves on: the failing route's events wait in the table (the
    // last batch's are written once the healthy route has them).
    eventually_async(
        "the failing route's events parked",
        Duration::from_secs(10),
        async || {
            let parked: i64 =
                sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE route = 'down' AND state = 'pending'")
                    .fetch_one(&e.pool)
                    .await
                    .unwrap();
            parked as usize == ids.len()
        },
    )
    .await;
    e.other.set_down(false);
    eventually(
        "the failed route's events after the outage",
        Duration::from_secs(60),
        || unique(&e.other.delivered("down")).len() >= ids.len(),
    )
    .await;
    assert_complete_and_ordered(&ids, &e.other.delivered("down"));
    // Back to direct publishing once the table is drained.
    let mut tx = e.pool.begin().await.unwrap();
    let after = enqueue(&mut tx, Event::new("order.placed", json!({})).key("k0"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    eventually("an event after recovery", Duration::from_secs(30), || {
        e.other.delivered_ids("down").contains(&after.id)
    })
    .await;
    relay.stop().await;
    e.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_route_slower_than_the_bound_is_served_from_the_table_and_loses_nothing() {
    let e = env().await;
    // Slower than the stream's 2 s bound, as a webhook near its timeout is:
    // every batch holding a "slow" event takes 3 s.
    e.other
        .delay_when(|ev| (ev.key.as_deref() == Some("slow")).then_some(Duration::from_secs(3)));
    let relay = start(&e, "wal-a", vec![route("up", "mock"), route("late", "other")]);
    streaming(&e).await;
    let mut ids = Vec::new();
    for t in 0..30 {
        let mut tx = e.pool.begin().await.unwrap();
        let keys = ["slow".to_owned(), format!("k{}", t % 3)];
        let events: Vec<Event> = keys
            .iter()
            .map(|k| Event::new("order.placed", json!({ "t": t })).key(k.clone()))
            .collect();
        let sent = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        ids.extend(sent.into_iter().map(|s| s.id).zip(keys));
    }
    eventually("every event on both routes", Duration::from_secs(60), || {
        unique(&e.sink.delivered("up")).len() >= ids.len() && unique(&e.other.delivered("late")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("up"));
    assert_complete_and_ordered(&ids, &e.other.delivered("late"));
    // The slow route's publish was cut off at the bound and its events went
    // to the table path; the other route's never failed.
    let attempts = |route: &'static str| {
        let pool = e.pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<i32>>("SELECT max(attempts) FROM ferry.deliveries WHERE route = $1")
                .bind(route)
                .fetch_one(&pool)
                .await
                .unwrap()
                .unwrap_or(0)
        }
    };
    assert!(
        attempts("late").await >= 2,
        "the slow route's first batch was not cut off"
    );
    assert_eq!(attempts("up").await, 1);
    relay.stop().await;
    e.db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tableless_events_are_delivered_and_written_to_the_outbox_only_when_they_fail() {
    let e = env().await;
    // Without a slot nobody would read a tableless event: it becomes an
    // outbox row, which the relay's start-up sweep delivers.
    let mut tx = e.pool.begin().await.unwrap();
    let early = emit(&mut tx, Event::new("order.placed", json!({ "early": true })).key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    // The sweep hands the early event to the table path. Until that has
    // delivered it, later events of its route are parked behind it, which
    // writes them to the outbox: wait, so that only their own failure could.
    eventually("the early event", Duration::from_secs(30), || {
        e.sink.delivered_ids("all").contains(&early)
    })
    .await;
    let mut ids = vec![(early, "k".to_owned())];
    for i in 0..20 {
        let mut tx = e.pool.begin().await.unwrap();
        let id = emit(&mut tx, Event::new("order.placed", json!({ "i": i })).key("k"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids.push((id, "k".to_owned()));
    }
    eventually("tableless events", Duration::from_secs(20), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(
        rows, 1,
        "a delivered tableless event left a row (the one row is the early event's)"
    );

    e.sink.set_down(true);
    let mut failed = Vec::new();
    for i in 0..10 {
        let mut tx = e.pool.begin().await.unwrap();
        let id = emit(&mut tx, Event::new("order.placed", json!({ "i": i })).key("k"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        failed.push((id, "k".to_owned()));
    }
    eventually_async(
        "the failed tableless events in the outbox",
        Duration::from_secs(20),
        async || {
            let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
                .fetch_one(&e.pool)
                .await
                .unwrap();
            rows == 1 + failed.len() as i64
        },
    )
    .await;
    e.sink.set_down(false);
    eventually("tableless events after the outage", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= ids.len() + failed.len()
    })
    .await;
    ids.extend(failed);
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    relay.stop().await;
    e.db.drop_db().await;
}

/// Writes `events` in `tx`, as outbox rows when `rows`, else as tableless
/// events; their ids in order.
async fn write(tx: &mut sqlx::PgConnection, rows: bool, events: Vec<Event>) -> Vec<EventId> {
    if rows {
        let sent = enqueue_batch(tx, events).await.unwrap();
        return sent.into_iter().map(|s| s.id).collect();
    }
    let mut sent = Vec::new();
    for ev in events {
        sent.push(emit(tx, ev).await.unwrap());
    }
    sent
}

/// Commits `n` outbox rows over seven keys, 10 per transaction.
async fn enqueue_rows(pool: &PgPool, tag: &str, n: usize) -> Vec<(EventId, String)> {
    let mut ids = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(10) {
        let mut tx = pool.begin().await.unwrap();
        let events: Vec<Event> = chunk
            .iter()
            .map(|i| Event::new("order.placed", json!({ "tag": tag, "i": i })).key(format!("k{}", i % 7)))
            .collect();
        let keys: Vec<String> = events.iter().map(|ev| ev.get_key().unwrap().to_owned()).collect();
        let sent = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        ids.extend(sent.into_iter().map(|s| s.id).zip(keys));
    }
    ids
}

/// Emits `n` events over seven keys, one per transaction.
async fn emit_events(pool: &PgPool, tag: &str, n: usize) -> Vec<(EventId, String)> {
    let mut ids = Vec::new();
    for i in 0..n {
        let key = format!("k{}", i % 7);
        let mut tx = pool.begin().await.unwrap();
        let id = emit(
            &mut tx,
            Event::new("order.placed", json!({ "tag": tag, "i": i })).key(key.clone()),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        ids.push((id, key));
    }
    ids
}

/// PostgreSQL invalidates a slot that holds back more WAL than
/// `max_slot_wal_keep_size` (here: while no relay ran). Such a slot never
/// streams again; a relay that only retried it would leave every outbox row
/// undelivered for good. The relay replaces it and sweeps: every outbox row
/// committed before and after the loss arrives, in order per key, and
/// streaming works again. Events emitted while the slot is lost become
/// outbox rows and arrive too; tableless events of the lost WAL are gone,
/// as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_slot_is_replaced_and_no_outbox_row_is_lost() {
    let server = PgServer::start().await;
    let e = env_on(TestDb::create_on(&server.admin_url()).await).await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "streamed", 50).await;
    expected.extend(emit_events(&e.pool, "streamed", 20).await);
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    relay.stop().await;

    expected.extend(enqueue_rows(&e.pool, "before the loss", 200).await);
    // These live only in the WAL the server is about to give up.
    emit_events(&e.pool, "lost", 10).await;
    server.invalidate_slot(&e.slot).await;
    expected.extend(emit_events(&e.pool, "emitted as rows", 20).await);
    expected.extend(enqueue_rows(&e.pool, "after the loss", 200).await);

    let relay = start(&e, "wal-b", vec![route("all", "mock")]);
    streaming(&e).await;
    expected.extend(emit_events(&e.pool, "new slot", 20).await);
    expected.extend(enqueue_rows(&e.pool, "new slot", 50).await);
    eventually("every outbox row and every new event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    let status: Option<String> = sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&e.slot)
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_ne!(status.as_deref(), Some("lost"), "the lost slot is still there");
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// A walsender told to stop waits until its client confirms everything
/// sent, the shutdown checkpoint included, and the relay confirms only what
/// it has recorded as the slot's watermark, which a shutting-down server
/// lets it write no more. The relay must end its stream then, or a clean
/// stop of the server (`pg_ctl stop`, a switchover, a pod stopped) waits
/// for ever on a relay that answers every keepalive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streaming_relay_lets_the_server_stop_cleanly() {
    let mut server = PgServer::start().await;
    let e = env_on(TestDb::create_on(&server.admin_url()).await).await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let expected = enqueue_rows(&e.pool, "before the stop", 20).await;
    eventually("the events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    // The relay raises the watermark at most every 10 s and gives a raise
    // 5 s: well inside this, unless the stream holds the server.
    let stopped = tokio::task::spawn_blocking(move || {
        let stopped = server.stop_within(Duration::from_secs(60));
        (server, stopped)
    });
    let (_server, stopped) = stopped.await.unwrap();
    assert!(stopped, "the server did not stop while the relay streamed");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_event_holds_back_later_events_of_its_route_until_it_is_delivered() {
    let e = env().await;
    // The tenth event fails once; every later one not already in flight
    // beside it must wait for its retry, including those streamed while the
    // failure is not written yet.
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let failed_once = failed_once.clone();
        e.sink.fail_when(move |ev| {
            let tenth = ev.payload.as_ref() == br#"{"n":9}"#;
            (tenth && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst))
                .then(|| ferry_core::SinkError::transient("refused once"))
        });
    }
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut ids = Vec::new();
    for n in 0..60 {
        let mut tx = e.pool.begin().await.unwrap();
        let sent = enqueue(&mut tx, Event::new("order.placed", json!({ "n": n })).key("k"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids.push((sent.id, "k".to_owned()));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    eventually("every event", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    let report = relay.stop().await;
    assert!(
        failed_once.load(std::sync::atomic::Ordering::SeqCst),
        "the failure never happened"
    );
    // Events streamed in the same batch as the failed one were already in
    // flight when it failed (a pipelined publish): they may arrive ahead of
    // its retry, and each is counted as an order break. Every other event
    // waits for the retry.
    let got = e.sink.delivered("all");
    let arrived = unique(&got);
    let failed = ids[9].0;
    let retried_at = arrived
        .iter()
        .position(|id| *id == failed)
        .expect("the failed event arrived");
    let later: Vec<EventId> = ids[10..].iter().map(|(id, _)| *id).collect();
    let ahead: Vec<EventId> = arrived[..retried_at]
        .iter()
        .filter(|id| later.contains(id))
        .copied()
        .collect();
    assert_eq!(
        ahead.len() as u64,
        report.order_breaks,
        "events ahead of the retry that were not in flight with the failure: {ahead:?}"
    );
    let in_order: Vec<StoredEvent> = got.into_iter().filter(|ev| !ahead.contains(&ev.id)).collect();
    let expected: Vec<(EventId, String)> = ids.iter().filter(|(id, _)| !ahead.contains(id)).cloned().collect();
    assert_complete_and_ordered(&expected, &in_order);
    e.db.drop_db().await;
}

/// Commits one event of `key` in a transaction of its own, tableless
/// (`ferry.emit`) or as an outbox row (`enqueue`).
async fn commit_one(pool: &PgPool, tableless: bool, key: &str, n: usize) -> (EventId, String) {
    let mut tx = pool.begin().await.unwrap();
    let event = Event::new("order.placed", json!({ "n": n, "tableless": tableless })).key(key);
    let id = if tableless {
        emit(&mut tx, event).await.unwrap()
    } else {
        enqueue(&mut tx, event).await.unwrap().id
    };
    tx.commit().await.unwrap();
    (id, key.to_owned())
}

/// Waits until `n` events are written to the outbox (tableless ones once
/// their delivery failed).
async fn written(pool: &PgPool, n: usize) {
    eventually_async("the failed events in the outbox", Duration::from_secs(20), async || {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries")
            .fetch_one(pool)
            .await
            .unwrap();
        rows as usize >= n
    })
    .await;
}

/// With the destination down, tableless events and outbox rows of a key
/// all go to the table path, which delivers a key in seq order. A tableless
/// event takes the seq `ferry.emit` reserved under the key's lock, so a row
/// committed after it (or written after it in its own transaction) comes
/// after it; a seq drawn only when its failure was written came after theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn emitted_and_enqueued_events_of_a_key_arrive_in_commit_order_after_an_outage() {
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    e.sink.set_down(true);
    let mut ids = Vec::new();
    for n in 0..15 {
        // In turn, one door then the other, on two keys out of step.
        ids.push(commit_one(&e.pool, n % 2 == 0, "a", n).await);
        ids.push(commit_one(&e.pool, n % 2 == 1, "b", n).await);
        // Both doors in one transaction: the order they were called in.
        let mut tx = e.pool.begin().await.unwrap();
        let first = emit(
            &mut tx,
            Event::new("order.placed", json!({ "n": n, "first": true })).key("a"),
        )
        .await
        .unwrap();
        let second = enqueue(
            &mut tx,
            Event::new("order.placed", json!({ "n": n, "first": false })).key("a"),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        ids.push((first, "a".to_owned()));
        ids.push((second.id, "a".to_owned()));
    }
    written(&e.pool, ids.len()).await;
    e.sink.set_down(false);
    eventually("every event after the outage", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    relay.stop().await;
    e.db.drop_db().await;
}

/// Tableless events that fail together are written in one settle, whose
/// outcomes come route by route: `shipping` lists the shipped event before
/// `audit` lists the paid one emitted ahead of it. Their seqs, reserved at
/// emit, keep the order they were emitted in on every route.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tableless_events_failing_on_several_routes_keep_their_order_per_key() {
    let e = env().await;
    let shipping = Route {
        matcher: Glob::new("order.shipped").unwrap(),
        ..route("shipping", "mock")
    };
    let relay = start(&e, "wal-a", vec![shipping, route("audit", "other")]);
    streaming(&e).await;
    e.sink.set_down(true);
    e.other.set_down(true);
    let (mut audit, mut shipped) = (Vec::new(), Vec::new());
    for n in 0..10 {
        let key = format!("o-{}", n % 3);
        let mut tx = e.pool.begin().await.unwrap();
        let paid = emit(&mut tx, Event::new("order.paid", json!({ "n": n })).key(key.clone()))
            .await
            .unwrap();
        let ship = emit(&mut tx, Event::new("order.shipped", json!({ "n": n })).key(key.clone()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        audit.extend([(paid, key.clone()), (ship, key.clone())]);
        shipped.push((ship, key));
    }
    written(&e.pool, audit.len() + shipped.len()).await;
    e.sink.set_down(false);
    e.other.set_down(false);
    eventually("every event after the outage", Duration::from_secs(60), || {
        unique(&e.other.delivered("audit")).len() >= audit.len()
            && unique(&e.sink.delivered("shipping")).len() >= shipped.len()
    })
    .await;
    assert_complete_and_ordered(&audit, &e.other.delivered("audit"));
    assert_complete_and_ordered(&shipped, &e.sink.delivered("shipping"));
    relay.stop().await;
    e.db.drop_db().await;
}

/// `ferry.emit` reserves the event's seq with the rights of the function's
/// owner (the role that ran `ferry migrate`): a producer role with only the
/// grants docs/OPERATIONS.md lists emits tableless events, though it may not
/// draw from the outbox's sequence itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_with_the_documented_grants_emits_tableless_events() {
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    // Roles belong to the whole server: one per test database.
    let role = format!("{}_producer", e.db.name());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} NOLOGIN;
         GRANT USAGE ON SCHEMA ferry TO {role};
         GRANT SELECT, INSERT ON ferry.events, ferry.unrouted TO {role};
         GRANT SELECT ON ferry.relays, ferry.wal_slots TO {role};"
    )))
    .execute(&e.pool)
    .await
    .unwrap();
    let set_role = format!("SET LOCAL ROLE {role}");

    let mut tx = e.pool.begin().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(set_role.clone()))
        .execute(&mut *tx)
        .await
        .unwrap();
    let denied = sqlx::query("SELECT nextval('ferry.events_seq_seq')")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert_eq!(
        denied.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("42501"),
        "the producer role may draw from the sequence, so this test proves nothing: {denied}"
    );
    tx.rollback().await.unwrap();

    let mut ids = Vec::new();
    for n in 0..3 {
        let mut tx = e.pool.begin().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(set_role.clone()))
            .execute(&mut *tx)
            .await
            .unwrap();
        let id = emit(&mut tx, Event::new("order.placed", json!({ "n": n })).key("k"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids.push((id, "k".to_owned()));
    }
    eventually("the producer role's events", Duration::from_secs(20), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the events were not tableless");
    relay.stop().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP OWNED BY {role}; DROP ROLE {role};")))
        .execute(&e.pool)
        .await
        .unwrap();
    e.db.drop_db().await;
}

/// A failed tableless event is written with the seq `ferry.emit` reserved
/// for it, once: the settle replayed after a crash writes nothing again. A
/// message from before migration 0010 carries no seq and draws one then.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_tableless_event_is_written_once_with_its_reserved_seq() {
    let e = env().await;
    let source = WalSource::new(
        e.pool.clone(),
        WalConfig {
            url: e.db.url().to_owned(),
            slot: e.slot.clone(),
            publication: "ferry".into(),
        },
    )
    .unwrap();
    let reserved: i64 = sqlx::query_scalar("SELECT ferry._reserve_seq()")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    let tableless = |seq: i64| ferry_store::postgres::wal::WalEvent {
        event: StoredEvent {
            id: EventId::new(),
            seq,
            event_type: "order.paid".into(),
            key: Some("k".into()),
            payload: b"{}".to_vec().into(),
            content_type: "application/json".into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
        },
        partition: None,
        undecodable: None,
    };
    // Its seq reserved, then one from before the migration (drawn now, so
    // after the reserved one).
    let (with_seq, without) = (tableless(reserved), tableless(0));
    let now = chrono::Utc::now();
    let failed = ferry_store::postgres::wal::Outcome::Retry {
        next_at: now,
        error: "down".into(),
    };
    let settlement = ferry_store::postgres::wal::Settlement {
        outcomes: vec![
            (&without, "all".to_owned(), failed.clone()),
            (&with_seq, "all".to_owned(), failed),
        ],
        through: 0,
        generation: 0,
        part: None,
    };
    let first = source.settle(&settlement, now).await.unwrap();
    assert_eq!((first.written, first.deliveries), (2, 2));
    let again = source.settle(&settlement, now).await.unwrap();
    assert_eq!((again.written, again.deliveries), (0, 0), "a replay wrote again");
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT id::text, seq FROM ferry.events ORDER BY seq")
        .fetch_all(&e.pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[0],
        (with_seq.event.id.0.to_string(), reserved),
        "the reserved seq was not kept"
    );
    assert_eq!(rows[1].0, without.event.id.0.to_string());
    assert!(rows[1].1 > reserved);
    e.db.drop_db().await;
}

/// An event no route matched is dead with reason `no route`, whose advice
/// is "add a route and requeue". The requeue puts it back into `unrouted`
/// for a router, which a relay in WAL mode does not run, and the stream
/// never brings the event again: the streaming relay must take it itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_requeued_event_that_had_no_route_is_delivered_in_wal_mode() {
    use ferry_store::{Action, Admin, Filter};
    let e = env().await;
    let only = |name: &str, glob: &str, sink: &str| Route {
        name: name.into(),
        matcher: Glob::new(glob).unwrap(),
        sink: sink.into(),
        destination: "d".into(),
        routing_key: None,
    };
    let relay = start(&e, "wal-a", vec![only("orders", "order.**", "mock")]);
    streaming(&e).await;
    let mut tx = e.pool.begin().await.unwrap();
    let sent = enqueue(&mut tx, Event::new("invoice.item.sent", json!({ "n": 1 })).key("i-1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    eventually_async("dead with no route", Duration::from_secs(20), async || {
        let dead: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM ferry.deliveries d JOIN ferry.events e ON e.seq = d.seq \
              WHERE e.id = $1 AND d.route = $2 AND d.state = 'dead'",
        )
        .bind(sent.id.0)
        .bind(ferry_core::NO_ROUTE)
        .fetch_one(&e.pool)
        .await
        .unwrap();
        dead == 1
    })
    .await;
    relay.stop().await;

    let relay = start(
        &e,
        "wal-b",
        vec![
            only("orders", "order.**", "mock"),
            only("invoices", "invoice.**", "other"),
        ],
    );
    streaming(&e).await;
    let store = PgStore::new(e.pool.clone());
    let action = Action::Requeue {
        include_published: false,
    };
    let selection = Filter {
        ids: vec![sent.id],
        ..Filter::default()
    };
    let plan = store.plan(&action, &selection).await.unwrap();
    assert_eq!(plan.changes.len(), 1, "{plan:?}");
    store.apply(&action, "test", &plan.changes).await.unwrap();
    eventually("the requeued event", Duration::from_secs(30), || {
        e.other.delivered_ids("invoices").contains(&sent.id)
    })
    .await;
    assert!(e.sink.delivered("orders").is_empty());
    relay.stop().await;
    e.db.drop_db().await;
}

/// Leaving WAL mode: `retire` stops `ferry.emit` writing tableless events
/// for the slot and returns only once the streaming relay has delivered
/// every one written before, including one whose transaction was open when
/// the slot was marked. After that the slot can be dropped and the relays
/// can poll: every event, tableless or row, arrives, in order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retired_slot_has_delivered_every_tableless_event_and_polling_delivers_the_rest() {
    use ferry_store::postgres::wal::retire;
    use std::sync::atomic::{AtomicBool, Ordering};
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    // Open when the slot is marked: it read the slot as ready and emitted
    // for it.
    let mut open = e.pool.begin().await.unwrap();
    let early = emit(
        &mut open,
        Event::new("order.placed", json!({ "early": true })).key("early"),
    )
    .await
    .unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let producer = {
        let (pool, done) = (e.pool.clone(), done.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut i = 0;
            while !done.load(Ordering::SeqCst) {
                ids.extend(emit_events(&pool, &format!("p{i}"), 1).await);
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ids
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retiring = {
        let (pool, slot) = (e.pool.clone(), e.slot.clone());
        tokio::spawn(async move { retire(&pool, &slot, |_| {}).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !retiring.is_finished(),
        "retire returned while a transaction that emitted for the slot was open"
    );
    open.commit().await.unwrap();
    retiring.await.unwrap().expect("retire");
    // Everything written as a tableless event has been delivered by now;
    // what the producer writes from here on are rows.
    let delivered: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
    done.store(true, Ordering::SeqCst);
    let mut ids = vec![(early, "early".to_owned())];
    ids.extend(producer.await.unwrap());
    let rows: std::collections::HashSet<String> = sqlx::query_scalar("SELECT id::text FROM ferry.events")
        .fetch_all(&e.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert!(
        !rows.is_empty(),
        "ferry.emit still wrote tableless events after the slot was retired"
    );
    let tableless: Vec<_> = ids.iter().filter(|(id, _)| !rows.contains(&id.0.to_string())).collect();
    assert!(tableless.len() > 1, "no event was tableless: the test proves nothing");
    assert!(
        delivered.contains(&early),
        "the event of the open transaction was not delivered"
    );
    assert!(
        tableless.iter().all(|(id, _)| delivered.contains(id)),
        "a tableless event was still undelivered when retire returned"
    );
    // The stream drops and the relay reconnects (as a standby would take
    // over): it streams on, but the slot stays retired.
    sqlx::query("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&e.slot)
        .execute(&e.pool)
        .await
        .unwrap();
    let reconnected = enqueue_rows(&e.pool, "reconnected", 10).await;
    eventually("the rows after the reconnect", Duration::from_secs(30), || {
        let got = e.sink.delivered_ids("all");
        reconnected.iter().all(|(id, _)| got.contains(id))
    })
    .await;
    ids.extend(reconnected);
    // The sweep that delivered them comes just before the slot is marked.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        ferry_store::postgres::wal::emit_slots(&e.pool, None)
            .await
            .unwrap()
            .is_empty(),
        "a relay that reconnected marked the retired slot ready again"
    );
    // Leave WAL mode: stop, drop the slot, poll.
    relay.stop().await;
    // The walsender may take a moment to let the slot go.
    eventually_async("the slot dropped", Duration::from_secs(20), async || {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&e.slot)
            .execute(&e.pool)
            .await
            .is_ok()
    })
    .await;
    let more = emit_events(&e.pool, "polled", 20).await;
    ids.extend(more);
    let polling = start_in(&e, "poll-a", vec![route("all", "mock")], false);
    eventually("every event", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    polling.stop().await;
    e.db.drop_db().await;
}

/// A slot retired while no relay streams from it still holds tableless
/// events; what `ferry.emit` writes from then on are outbox rows, which the
/// slot streams after them. The relay that comes back must not sweep those
/// rows into the table path (the slot's first sweep is long done), or a row
/// would be delivered ahead of an older tableless event of the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_returning_to_a_retired_slot_keeps_the_order_per_key() {
    use ferry_store::postgres::wal::retire;
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    relay.stop().await;
    // Held in the slot: no relay reads it.
    let mut ids = emit_events(&e.pool, "tableless", 14).await;
    let retiring = {
        let (pool, slot) = (e.pool.clone(), e.slot.clone());
        tokio::spawn(async move { retire(&pool, &slot, |_| {}).await })
    };
    eventually_async("the slot marked retired", Duration::from_secs(10), async || {
        ferry_store::postgres::wal::emit_slots(&e.pool, None)
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    let rows = emit_events(&e.pool, "row", 14).await;
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(
        written, 14,
        "ferry.emit wrote tableless events after the slot was retired"
    );
    ids.extend(rows);
    let relay = start(&e, "wal-b", vec![route("all", "mock")]);
    retiring.await.unwrap().expect("retire");
    eventually("every event", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("all"));
    relay.stop().await;
    e.db.drop_db().await;
}

/// Commits one transaction of `n` events over seven keys, written ten at a
/// time as outbox rows where `rows(t)` holds for the `t`-th ten, else as
/// tableless events; their ids and keys in order.
async fn large_transaction(pool: &PgPool, n: usize, rows: impl Fn(usize) -> bool) -> Vec<(EventId, String)> {
    let mut ids: Vec<(EventId, String)> = Vec::new();
    let mut tx = pool.begin().await.unwrap();
    for t in 0..n / 10 {
        let events: Vec<Event> = (0..10)
            .map(|i| Event::new("order.placed", json!({ "t": t, "i": i })).key(format!("k{}", (t + i) % 7)))
            .collect();
        let keys: Vec<String> = events.iter().map(|ev| ev.get_key().unwrap().to_owned()).collect();
        let sent = write(&mut tx, rows(t), events).await;
        ids.extend(sent.into_iter().zip(keys));
    }
    tx.commit().await.unwrap();
    ids
}

/// A transaction larger than a part of the stream ([`PART_EVENTS`]) is
/// published part by part, and each part settled as it goes. The relay
/// crashes inside it; its successor streams the transaction again from the
/// start, skips the events settled before the crash and delivers the rest:
/// none lost, per-key order held, and no settled event, tableless ones
/// included, published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_inside_a_large_transaction_resumes_after_its_settled_part() {
    use ferry_store::postgres::wal::PART_EVENTS;
    let e = env().await;
    e.sink.delay_when(|_| Some(Duration::from_millis(20)));
    let first = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let ids = large_transaction(&e.pool, 3 * PART_EVENTS + 500, |t| t % 2 == 0).await;
    let part = async || -> Option<i64> {
        sqlx::query_scalar("SELECT part_events FROM ferry.wal_slots WHERE slot = $1")
            .bind(&e.slot)
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    eventually_async(
        "a part of the transaction settled",
        Duration::from_secs(60),
        async || part().await.is_some(),
    )
    .await;
    first.handle.abort();
    let _ = first.handle.await;
    let settled = part().await.unwrap() as usize;
    let before = e.sink.delivered("all").len();
    assert!(
        before < ids.len(),
        "the crash came after the whole transaction was delivered; it proves nothing"
    );
    let second = start(&e, "wal-b", vec![route("all", "mock")]);
    eventually("every event after the restart", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    let got = e.sink.delivered("all");
    assert_complete_and_ordered(&ids, &got);
    let times = arrivals(&got);
    let again = ids[..settled].iter().filter(|(id, _)| times[id] > 1).count();
    assert_eq!(
        again, 0,
        "{again} of the {settled} events settled before the crash were published again"
    );
    second.stop().await;
    e.db.drop_db().await;
}

/// How many times each event arrived.
fn arrivals(got: &[StoredEvent]) -> HashMap<EventId, usize> {
    let mut times: HashMap<EventId, usize> = HashMap::new();
    for event in got {
        *times.entry(event.id).or_default() += 1;
    }
    times
}

/// A crash of the server can take a slot's confirmed position back to its
/// last checkpoint, so the relay starts from the position its settles
/// recorded. Two large transactions whose tableless events all lie in their
/// first part, the rest outbox rows: the last part of each records nothing,
/// and the second's first part takes over the one record of a partly
/// settled transaction. The slot is then set back to where it stood before
/// the first (a copy made then replaces it, as the crash would). The next
/// relay must start past the first transaction and skip the second's
/// settled part: none lost, none published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_set_back_by_a_server_crash_replays_no_settled_large_transaction() {
    use ferry_store::postgres::wal::PART_EVENTS;
    let e = env().await;
    let first = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let backup = format!("{}_set_back", e.slot);
    sqlx::query("SELECT pg_copy_logical_replication_slot($1, $2)")
        .bind(&e.slot)
        .bind(&backup)
        .execute(&e.pool)
        .await
        .unwrap();
    // Tableless events fill the first part exactly; outbox rows follow.
    let tableless_then_rows = |t: usize| t >= PART_EVENTS / 10;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let txn = large_transaction(&e.pool, PART_EVENTS + 500, tableless_then_rows).await;
        ids.extend(txn);
        eventually("the transaction delivered", Duration::from_secs(60), || {
            unique(&e.sink.delivered("all")).len() >= ids.len()
        })
        .await;
    }
    first.stop().await;
    // The crash: the slot as it stood before both transactions.
    let inactive = async || -> bool {
        sqlx::query_scalar("SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&e.slot)
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    eventually_async("the slot released", Duration::from_secs(30), inactive).await;
    for statement in [
        "SELECT pg_drop_replication_slot($1)",
        "SELECT pg_copy_logical_replication_slot($2, $1)",
        "SELECT pg_drop_replication_slot($2)",
    ] {
        sqlx::query(statement)
            .bind(&e.slot)
            .bind(&backup)
            .execute(&e.pool)
            .await
            .unwrap();
    }
    let second = start(&e, "wal-b", vec![route("all", "mock")]);
    streaming(&e).await;
    // Whatever the replay publishes comes before this event in the stream.
    ids.extend(emit_events(&e.pool, "last", 1).await);
    eventually("the last event", Duration::from_secs(60), || {
        unique(&e.sink.delivered("all")).len() >= ids.len()
    })
    .await;
    second.stop().await;
    let got = e.sink.delivered("all");
    assert_complete_and_ordered(&ids, &got);
    let again = arrivals(&got).values().filter(|n| **n > 1).count();
    assert_eq!(again, 0, "{again} events settled before the crash were published again");
    e.db.drop_db().await;
}

/// A publication that stops carrying the outbox's inserts (an administrator
/// dropped the table from it, or made one without it) streams the
/// tableless events and none of the rows: the slot would pass the rows
/// committed meanwhile and leave them unrouted for good. The relay stops
/// streaming instead, and once the publication is mended takes them into
/// the table path: none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publication_that_stops_carrying_the_outbox_loses_no_event() {
    let e = env().await;
    let options = WalOptions {
        publish_timeout: Duration::from_secs(2),
        lag_every: Duration::from_millis(200),
        ..WalOptions::default()
    };
    let (relay, progress) = start_with(&e, "wal-a", vec![route("all", "mock")], Some(options.clone()));
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "before", 30).await;
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    let alter = async |sql: &str| sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&e.pool).await.unwrap();
    alter("ALTER PUBLICATION ferry DROP TABLE ferry.events").await;
    expected.extend(enqueue_rows(&e.pool, "unpublished", 40).await);
    // Past a few checks; the stream stops at the first.
    eventually_async("the stream to stop", Duration::from_secs(30), async || {
        !ferry_store::postgres::wal::streaming(&e.pool, &e.slot).await.unwrap()
    })
    .await;
    // The streamer is WAL mode's router: readiness sees it fail.
    eventually("the streamer's failure to show", Duration::from_secs(30), || {
        progress.router_failing_for().is_some()
    })
    .await;
    alter("ALTER PUBLICATION ferry ADD TABLE ferry.events").await;
    expected.extend(enqueue_rows(&e.pool, "mended", 30).await);
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    assert_eq!(progress.router_failing_for(), None, "streaming again");
    relay.stop().await;

    // A relay that starts on a publication without the table streams
    // nothing until it is mended, and loses nothing either.
    alter("ALTER PUBLICATION ferry SET (publish = 'update')").await;
    let (relay, _) = start_with(&e, "wal-b", vec![route("all", "mock")], Some(options));
    let more = enqueue_rows(&e.pool, "at start", 30).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!ferry_store::postgres::wal::streaming(&e.pool, &e.slot).await.unwrap());
    alter("ALTER PUBLICATION ferry SET (publish = 'insert')").await;
    expected.extend(more);
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// A slot dropped and made anew by hand while no relay ran (as an
/// administrator makes the first one) streams only what commits after it
/// was made. Rows committed in between must still arrive, in order per key
/// with what the new slot streams: the relay takes the slot for a new one
/// and sweeps them first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_committed_before_a_slot_made_anew_by_hand_are_delivered() {
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "streamed", 20).await;
    expected.extend(emit_events(&e.pool, "streamed", 7).await);
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    relay.stop().await;
    // The walsender may take a moment to let the slot go.
    eventually_async("the slot dropped", Duration::from_secs(20), async || {
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&e.slot)
            .execute(&e.pool)
            .await
            .is_ok()
    })
    .await;
    expected.extend(enqueue_rows(&e.pool, "between", 20).await);
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&e.slot)
        .execute(&e.pool)
        .await
        .unwrap();
    let relay = start(&e, "wal-b", vec![route("all", "mock")]);
    streaming(&e).await;
    expected.extend(enqueue_rows(&e.pool, "after", 20).await);
    expected.extend(emit_events(&e.pool, "after", 7).await);
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// Runs `statements` on the server as its administrator.
async fn on_server(server: &PgServer, statements: &[&'static str]) {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(&server.admin_url()).await.unwrap();
    for &statement in statements {
        sqlx::query(statement).execute(&mut admin).await.expect(statement);
    }
    let _ = admin.close().await;
}

/// Under synchronous replication the slot hands a transaction over once
/// its commit is flushed locally, while the committing session still waits
/// for a standby and nobody sees it commit yet: a failover now would lose
/// it. A transaction of tableless events only must not be published before
/// it is visible either, or the event would be a phantom. (On a server of
/// the test's own: `synchronous_standby_names` is the whole server's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tableless_event_waits_for_its_commit_to_be_acknowledged() {
    let server = PgServer::start().await;
    // Only the producer below waits for a standby; the relay and the
    // test's other sessions commit locally.
    on_server(
        &server,
        &[
            "ALTER SYSTEM SET synchronous_commit = 'local'",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    let e = env_on(TestDb::create_on(&server.admin_url()).await).await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    on_server(
        &server,
        &[
            "ALTER SYSTEM SET synchronous_standby_names = 'nosuch'",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    // The server's processes take the setting in a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let producer = {
        let pool = e.pool.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SET LOCAL synchronous_commit = on")
                .execute(&mut *tx)
                .await
                .unwrap();
            let id = emit(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            id
        })
    };
    eventually_async(
        "the producer's commit to wait for the standby",
        Duration::from_secs(20),
        async || {
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep')")
                .fetch_one(&e.pool)
                .await
                .unwrap()
        },
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline {
        assert!(
            e.sink.delivered("all").is_empty(),
            "a tableless event was published while its commit still waited for the standby"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!producer.is_finished(), "the commit did not wait for the standby");
    on_server(
        &server,
        &[
            "ALTER SYSTEM RESET synchronous_standby_names",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    let id = producer.await.unwrap();
    eventually(
        "the event, once its commit is acknowledged",
        Duration::from_secs(30),
        || e.sink.delivered_ids("all").contains(&id),
    )
    .await;
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// A `ferry` logical message that `ferry.emit` did not write (anything may
/// call `pg_logical_emit_message('ferry', ...)`) would fail every session
/// that reads it, holding the slot and every later event back for good.
/// The relay settles it as a dead event instead, with the message's bytes
/// and the reason, and streams on: the events of its transaction and after
/// it arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreign_ferry_message_is_kept_as_a_dead_event_and_the_stream_goes_on() {
    use ferry_store::postgres::wal::UNDECODABLE_TYPE;
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut tx = e.pool.begin().await.unwrap();
    let at: String = sqlx::query_scalar("SELECT pg_logical_emit_message(true, 'ferry', 'not an event')::text")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let beside = emit(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut expected = vec![(beside, "k".to_owned())];
    expected.extend(emit_events(&e.pool, "after", 7).await);
    expected.extend(enqueue_rows(&e.pool, "after", 14).await);
    eventually("the events beside and after it", Duration::from_secs(30), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    assert!(
        e.sink
            .delivered("all")
            .iter()
            .all(|ev| ev.event_type != UNDECODABLE_TYPE),
        "the undecodable message was published"
    );
    let kept: Vec<(Vec<u8>, String, String)> = sqlx::query_as(
        "SELECT e.payload, d.state, d.last_error FROM ferry.events e JOIN ferry.deliveries d ON d.seq = e.seq \
          WHERE e.type = $1 AND d.route = $2",
    )
    .bind(UNDECODABLE_TYPE)
    .bind(ferry_core::NO_ROUTE)
    .fetch_all(&e.pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let (payload, state, why) = &kept[0];
    assert_eq!(&payload[..], b"not an event");
    assert_eq!(state, "dead");
    assert!(why.contains(&format!("WAL position {at}")), "{why}");
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// An operator drops the publication while a relay streams (meaning to
/// make it again, say) and an outbox row commits before it exists again.
/// PostgreSQL before 18 decodes each change against the publications of
/// its time: the slot can never stream past that row, however often the
/// publication is made again. The relay sees why, replaces the slot and
/// sweeps what is undelivered into the table path: every outbox row
/// arrives, and the replacement is counted.
#[tokio::test]
async fn a_slot_stopped_by_a_dropped_publication_is_replaced_and_no_outbox_row_is_lost() {
    use ferry_relay::metrics::WAL_SLOT_REPLACED;
    use ferry_testkit::metrics::Counts;
    let counts = Counts::by_label("reason");
    // The relay's tasks run on this thread (a current-thread runtime).
    let _recording = metrics::set_default_local_recorder(&counts);
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "streamed", 20).await;
    expected.extend(emit_events(&e.pool, "streamed", 7).await);
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;

    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&e.pool).await.unwrap();
    expected.extend(enqueue_rows(&e.pool, "unpublished", 10).await);
    // The relay may have made it again already.
    let _ = sqlx::raw_sql("CREATE PUBLICATION ferry FOR TABLE ferry.events WITH (publish = 'insert')")
        .execute(&e.pool)
        .await;
    expected.extend(enqueue_rows(&e.pool, "made again", 20).await);
    eventually("the slot replaced", Duration::from_secs(60), || {
        counts.get(WAL_SLOT_REPLACED, "unpublished") > 0
    })
    .await;
    streaming(&e).await;
    expected.extend(emit_events(&e.pool, "new slot", 7).await);
    expected.extend(enqueue_rows(&e.pool, "new slot", 20).await);
    eventually("every outbox row and every new event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    assert_eq!(
        counts.get(WAL_SLOT_REPLACED, "unpublished"),
        1,
        "replaced more than once"
    );
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// Tableless events read in the same batch as the change a dropped
/// publication stops the slot at are published and settled before the
/// stream ends: the next session is on a new slot, which would not replay
/// them. Each arrives once.
#[tokio::test]
async fn events_read_with_the_change_that_stops_the_slot_arrive_once() {
    let e = env().await;
    // The relay is held publishing the gate while what follows, up to the
    // change it cannot stream past, arrives: its next batch reads it all.
    e.sink.delay_when(|ev| {
        (serde_json::from_slice::<serde_json::Value>(&ev.payload).is_ok_and(|p| p["tag"] == "gate"))
            .then_some(Duration::from_secs(3))
    });
    let options = WalOptions {
        publish_timeout: Duration::from_secs(30),
        ..WalOptions::default()
    };
    let (relay, _) = start_with(&e, "wal-a", vec![route("all", "mock")], Some(options));
    streaming(&e).await;
    let gate = emit_events(&e.pool, "gate", 1).await;
    eventually("the gate being published", Duration::from_secs(30), || {
        e.sink.attempts() > 0
    })
    .await;
    let held = emit_events(&e.pool, "held", 5).await;
    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&e.pool).await.unwrap();
    let unpublished = enqueue_rows(&e.pool, "unpublished", 1).await;
    let mut expected: Vec<(EventId, String)> = gate.into_iter().chain(held.clone()).collect();
    expected.extend(unpublished);
    eventually("every event", Duration::from_secs(60), || {
        let arrived = unique(&e.sink.delivered("all"));
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    let delivered = e.sink.delivered("all");
    for (id, _) in &held {
        assert_eq!(delivered.iter().filter(|ev| ev.id == *id).count(), 1, "{id:?}");
    }
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// PostgreSQL streams an insert only if the publication carried the table
/// when it was committed. A publication altered without the outbox and
/// mended while no relay was checking it (stopped for a deploy, say) leaves
/// the rows committed meanwhile out of the stream for good, though every
/// check passes afterwards. The relay finds them once the stream has passed
/// them and takes them into the table path: none waits in `unrouted` for
/// ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_committed_while_an_unwatched_publication_lacked_the_outbox_are_delivered() {
    let e = env().await;
    let options = WalOptions {
        publish_timeout: Duration::from_secs(2),
        lag_every: Duration::from_millis(200),
        ..WalOptions::default()
    };
    let (relay, _) = start_with(&e, "wal-a", vec![route("all", "mock")], Some(options.clone()));
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "before", 10).await;
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    relay.stop().await;
    let alter = async |sql: &str| sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&e.pool).await.unwrap();
    alter("ALTER PUBLICATION ferry DROP TABLE ferry.events").await;
    expected.extend(enqueue_rows(&e.pool, "unpublished", 3).await);
    alter("ALTER PUBLICATION ferry ADD TABLE ferry.events").await;
    let (relay, _) = start_with(&e, "wal-b", vec![route("all", "mock")], Some(options));
    streaming(&e).await;
    expected.extend(enqueue_rows(&e.pool, "after", 10).await);
    // Not in order per key: the rows the stream passed by arrive after
    // later events of their keys, as the relay warns.
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    let unrouted: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(unrouted, 0);
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// A relay that cannot reach its database while it streams (its
/// connections ended by a server shutting down, say, and no new one
/// accepted) must let its replication connection go: a walsender told to
/// stop waits for its client to confirm everything sent, and a relay
/// retrying its writes for ever would confirm nothing more while answering
/// every keepalive, holding a clean stop of the server for good. It streams
/// again once the database answers, and loses nothing. Here the relay's
/// queries go through a proxy that resets every connection; its stream
/// does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_cannot_reach_its_database_lets_its_replication_connection_go() {
    let e = env().await;
    let proxy = ferry_testkit::proxy::Proxy::start("127.0.0.1:5432".parse().unwrap()).unwrap();
    let url = e.db.url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();
    let options = WalOptions {
        publish_timeout: Duration::from_secs(2),
        ..WalOptions::default()
    };
    let (relay, _) = start_on(&e, pool.clone(), "wal-a", vec![route("all", "mock")], Some(options));
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "before", 5).await;
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    let walsender: i32 = sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&e.slot)
        .fetch_one(&e.pool)
        .await
        .unwrap();
    proxy.set_refuse(true);
    proxy.cut();
    expected.extend(enqueue_rows(&e.pool, "held", 1).await);
    eventually_async("the walsender to end", Duration::from_secs(40), async || {
        let alive: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
            .bind(walsender)
            .fetch_one(&e.pool)
            .await
            .unwrap();
        !alive
    })
    .await;
    proxy.set_refuse(false);
    expected.extend(enqueue_rows(&e.pool, "after", 5).await);
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    assert_complete_and_ordered(&expected, &e.sink.delivered("all"));
    relay.stop().await;
    pool.close().await;
    e.pool.close().await;
    e.db.drop_db().await;
}

/// A relay whose writes the database refuses for a while (a trigger that
/// raises, a constraint, a full disk), while it answers, keeps its stream
/// and retries: ending the session would replay, and publish again, what
/// was published but not settled, over and over while the fault lasts. An
/// event goes out at most twice however long the fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_whose_writes_are_refused_for_a_while_publishes_each_event_at_most_twice() {
    let e = env().await;
    let relay = start(&e, "wal-a", vec![route("all", "mock")]);
    streaming(&e).await;
    let mut expected = enqueue_rows(&e.pool, "before", 5).await;
    eventually("the first events", Duration::from_secs(30), || {
        unique(&e.sink.delivered("all")).len() >= expected.len()
    })
    .await;
    let walsender = || async {
        sqlx::query_scalar::<_, Option<i32>>("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&e.slot)
            .fetch_one(&e.pool)
            .await
            .unwrap()
    };
    let first = walsender().await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN RAISE EXCEPTION 'deliveries refused for now'; END$$; \
         CREATE TRIGGER refuse BEFORE INSERT ON ferry.deliveries FOR EACH ROW EXECUTE FUNCTION public.refuse()",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let held = enqueue_rows(&e.pool, "held", 3).await;
    expected.extend(held.iter().cloned());
    eventually("the held events published", Duration::from_secs(30), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        held.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    // Long enough for a relay that ended its session after 10 s of failed
    // settles to replay the batch twice.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(walsender().await, first, "the stream was ended");
    sqlx::raw_sql("DROP TRIGGER refuse ON ferry.deliveries")
        .execute(&e.pool)
        .await
        .unwrap();
    expected.extend(enqueue_rows(&e.pool, "after", 5).await);
    eventually("every event", Duration::from_secs(60), || {
        let arrived: std::collections::HashSet<EventId> = unique(&e.sink.delivered("all")).into_iter().collect();
        expected.iter().all(|(id, _)| arrived.contains(id))
    })
    .await;
    let got = e.sink.delivered("all");
    for (id, _) in &expected {
        let times = got.iter().filter(|g| g.id == *id).count();
        assert!(times <= 2, "{id:?} published {times} times");
    }
    assert_complete_and_ordered(&expected, &got);
    relay.stop().await;
    e.pool.close().await;
    e.db.drop_db().await;
}
