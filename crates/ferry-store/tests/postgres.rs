//! The PostgreSQL store against a real database: the shared conformance
//! suite, then the producer API and migrations. The admin and retention
//! suites run in `admin.rs` and `retention.rs`.

use ferry_core::Event;
use ferry_store::postgres::{EnqueueError, enqueue, enqueue_batch, migrate};
use ferry_testkit::pg::TestDb;
use ferry_testkit::pg_store::PgHarness;
use serde_json::json;
use sqlx::Connection;

async fn harness() -> PgHarness {
    PgHarness::create().await
}

mod conformance {
    use super::harness;
    ferry_testkit::store_conformance!(harness());
    ferry_testkit::producer_conformance!(harness());
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let db = TestDb::create().await;
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let every: Vec<i32> = ferry_store::postgres::MIGRATIONS.iter().map(|m| m.0).collect();
    assert_eq!(migrate(&mut conn).await.unwrap(), every);
    assert!(migrate(&mut conn).await.unwrap().is_empty());
}

/// Migrators run at once (every replica's start-up job) apply each
/// migration once between them, in order, and none fails.
#[tokio::test]
async fn migrators_at_once_apply_each_migration_once() {
    let db = TestDb::create().await;
    let runs = (0..4).map(|_| {
        let url = db.url().to_owned();
        tokio::spawn(async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            migrate(&mut conn).await.unwrap()
        })
    });
    let mut applied: Vec<i32> = Vec::new();
    for run in runs.collect::<Vec<_>>() {
        let done = run.await.unwrap();
        assert!(done.windows(2).all(|w| w[0] < w[1]), "{done:?}");
        applied.extend(done);
    }
    applied.sort_unstable();
    let every: Vec<i32> = ferry_store::postgres::MIGRATIONS.iter().map(|m| m.0).collect();
    assert_eq!(applied, every);
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let recorded: Vec<i32> = sqlx::query_scalar("SELECT version FROM ferry.schema_migrations ORDER BY version")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded, every);
}

/// The SQL door and the Rust API share dispatch keys.
#[tokio::test]
async fn the_sql_door_agrees_on_dispatch_keys() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let first = enqueue(
        &mut tx,
        Event::new("order.created", json!({"n": 1})).dispatch_key("stripe:evt_1"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let sql_id: uuid::Uuid =
        sqlx::query_scalar("SELECT ferry.enqueue('order.created', 'k', '{}', '{}', 'stripe:evt_1')")
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!(sql_id, first.id.0);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// `ferry.enqueue_with_outcome` tells a new event from a repeat of its
/// dispatch key, whichever door stored the first, and checks the event as
/// `ferry.enqueue` does.
#[tokio::test]
async fn the_sql_door_reports_a_repeat() {
    let h = harness().await;
    let call = "SELECT id, duplicate FROM ferry.enqueue_with_outcome('order.created', 'k', '{\"n\": 1}', '{}', $1)";
    let (first, repeat): (uuid::Uuid, bool) = sqlx::query_as(call).bind("dk-1").fetch_one(&h.pool).await.unwrap();
    assert!(!repeat);
    let (again, repeat): (uuid::Uuid, bool) = sqlx::query_as(call).bind("dk-1").fetch_one(&h.pool).await.unwrap();
    assert_eq!((again, repeat), (first, true));
    // Without a dispatch key, every call stores an event.
    let (other, repeat): (uuid::Uuid, bool) = sqlx::query_as(call)
        .bind(None::<&str>)
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert!(other != first && !repeat);
    // A key the Rust door stored first.
    let mut tx = h.pool.begin().await.unwrap();
    let rust = enqueue(
        &mut tx,
        Event::new("order.created", json!({"n": 2})).dispatch_key("dk-2"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (id, repeat): (uuid::Uuid, bool) = sqlx::query_as(call).bind("dk-2").fetch_one(&h.pool).await.unwrap();
    assert_eq!((id, repeat), (rust.id.0, true));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
    // Checked as ferry.enqueue is.
    let err = sqlx::query("SELECT * FROM ferry.enqueue_with_outcome('Order', 'k', '{}')")
        .execute(&h.pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("invalid event type"), "{err}");
}

/// In one batch, an event is a repeat when another of the batch or an
/// earlier transaction wrote its dispatch key, also when it is the very
/// same event (same id).
#[tokio::test]
async fn a_batch_reports_each_repeat_whoever_wrote_it_first() {
    let h = harness().await;
    let stored = Event::new("order.created", json!({"n": 0})).dispatch_key("dk-0");
    let mut tx = h.pool.begin().await.unwrap();
    enqueue(&mut tx, stored.clone()).await.unwrap();
    tx.commit().await.unwrap();

    let new = Event::new("order.created", json!({"n": 1})).dispatch_key("dk-1");
    let same_key = Event::new("order.created", json!({"n": 2})).dispatch_key("dk-1");
    let unkeyed = Event::new("order.created", json!({"n": 3}));
    let batch = vec![stored.clone(), new.clone(), same_key, new.clone(), unkeyed.clone()];
    let mut tx = h.pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, batch).await.unwrap();
    tx.commit().await.unwrap();
    let got: Vec<_> = out.iter().map(|e| (e.id, e.duplicate)).collect();
    assert_eq!(
        got,
        [
            (stored.id(), true),
            (new.id(), false),
            (new.id(), true),
            (new.id(), true),
            (unkeyed.id(), false),
        ]
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
}

#[tokio::test]
async fn the_sql_door_validates_and_returns_v7_ids() {
    let h = harness().await;
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT ferry.enqueue('billing.invoice.paid', 'inv-1', '{\"total\": 12}', '{\"tenant\": \"acme\"}')",
    )
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert_eq!(id.get_version_num(), 7);
    let (payload, headers): (Vec<u8>, serde_json::Value) =
        sqlx::query_as("SELECT payload, headers FROM ferry.events WHERE id = $1")
            .bind(id)
            .fetch_one(&h.pool)
            .await
            .unwrap();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&payload).unwrap(),
        json!({"total": 12})
    );
    assert_eq!(headers, json!({"tenant": "acme"}));
    for (sql, field) in [
        ("SELECT ferry.enqueue('Order.Created', NULL, '{}')", "type"),
        ("SELECT ferry.enqueue('order', NULL, '{}')", "type"),
        ("SELECT ferry.enqueue('order.created', '', '{}')", "key"),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"n\": 1}')",
            "headers",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"a\": \"x\", \"b\": {\"c\": \"d\"}}')",
            "headers",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"a\": null}')",
            "headers",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"a\": \"x\", \"b\": [\"y\"]}')",
            "headers",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"a\": []}')",
            "headers",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '[\"x\"]')",
            "headers",
        ),
        ("SELECT ferry.enqueue('order.created', NULL, '{}', '\"x\"')", "headers"),
        (
            "SELECT ferry.enqueue('order.created', NULL, jsonb_build_object('x', repeat('x', 1100000)))",
            "payload",
        ),
        // Header names as the Rust door checks them: RabbitMQ refuses a
        // name over 255 bytes, and such an event went dead for good.
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"\": \"x\"}')",
            "headers: a header name of 0 bytes",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', jsonb_build_object(repeat('h', 300), 'x'))",
            "headers: a header name of 300 bytes",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', jsonb_build_object('ok', 'x', repeat('é', 128), 'x'))",
            "headers: a header name of 256 bytes",
        ),
        (
            "SELECT ferry.enqueue('order.created', 'k', NULL)",
            "payload: it is NULL",
        ),
        // What a destination would refuse for ever, and the event go dead
        // holding back its key: a line break in the key (a NATS or HTTP
        // header), a header name that is not an HTTP token, a control
        // character in a header value, a content type RabbitMQ cannot carry.
        (
            "SELECT ferry.enqueue('order.created', E'k\\r\\n', '{}')",
            "key: it has a line break",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"Tenant ID\": \"x\"}')",
            "headers: the header name 'Tenant ID' is not an HTTP token",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"ok\": \"x\", \"a:b\": \"x\"}')",
            "headers: the header name 'a:b'",
        ),
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', '{\"x\": \"a\\nb\"}')",
            "headers: the value of header 'x' has a control character",
        ),
        (
            "SELECT ferry._enqueue(ferry.uuid_v7(), 'order.created', NULL, '\\x00', repeat('x', 256), '{}', NULL)",
            "content type: 256 bytes",
        ),
        (
            "SELECT ferry._enqueue(ferry.uuid_v7(), 'order.created', NULL, '\\x00', E'text/plain\\r', '{}', NULL)",
            "content type: 11 bytes, with a control character",
        ),
        // The tableless door checks the same (without a slot it writes an
        // outbox row through ferry._enqueue; with one, it checks itself).
        (
            "SELECT ferry.emit('order.created', NULL, '{}', jsonb_build_object(repeat('h', 300), 'x'))",
            "headers: a header name of 300 bytes",
        ),
        ("SELECT ferry.emit('order.created', 'k', NULL)", "payload: it is NULL"),
        // Headers over 64 KiB in all: RabbitMQ refuses properties over its
        // frame size, Kafka counts them in a record's size.
        (
            "SELECT ferry.enqueue('order.created', NULL, '{}', jsonb_build_object('x', repeat('a', 65536)))",
            "headers: they take 65537 bytes",
        ),
        (
            "SELECT ferry.emit('order.created', NULL, '{}', jsonb_build_object('x', repeat('a', 40000), 'y', repeat('b', 40000)))",
            "headers: they take 80002 bytes",
        ),
    ] {
        let err = sqlx::query(sql).execute(&h.pool).await.unwrap_err();
        let db = err.as_database_error().expect("a database error");
        assert!(db.message().contains(&format!("invalid event {field}")), "{sql}: {db}");
        let hint = db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|e| e.hint());
        assert!(hint.is_some_and(|h| !h.is_empty()), "{sql}: no hint");
    }
    // Headers of 64 KiB in all pass.
    sqlx::query("SELECT ferry.enqueue('order.created', NULL, '{}', jsonb_build_object('x', repeat('a', 65535)))")
        .execute(&h.pool)
        .await
        .unwrap();
    // The longest accepted name: 255 bytes of token characters.
    let name = format!("{}h", "x-".repeat(127));
    sqlx::query("SELECT ferry.enqueue('order.created', NULL, '{}', jsonb_build_object($1::text, 'x'))")
        .bind(&name)
        .execute(&h.pool)
        .await
        .unwrap();
    // Tabs and UTF-8 in values, and every token character in names, pass.
    sqlx::query(
        "SELECT ferry.enqueue('order.created', 'k', '{}', jsonb_build_object('x-A.b_c~|`^*+#$%&!''', E'Müller\\tok'))",
    )
    .execute(&h.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn rust_validation_names_the_field_before_touching_the_database() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let nul = "a\0b";
    for (event, field) in [
        (Event::new("Order", json!({})), "type"),
        // PostgreSQL refuses a NUL in text with an encoding error that
        // names no field.
        (Event::new("order.created", json!({})).key(nul), "key"),
        (Event::new("order.created", json!({})).dispatch_key(nul), "dispatch_key"),
        (Event::new("order.created", json!({})).header(nul, "x"), "headers"),
        (Event::new("order.created", json!({})).header("tenant", nul), "headers"),
    ] {
        match enqueue(&mut tx, event).await.unwrap_err() {
            EnqueueError::Invalid(v) => assert_eq!(v.field, field, "{v}"),
            other => panic!("expected a validation error of {field}, got {other}"),
        }
    }
    // A tableless event has no row to deduplicate against: a dispatch key
    // would be ignored, and a producer's retry would send a duplicate.
    #[cfg(feature = "wal")]
    {
        let event = Event::new("order.created", json!({}))
            .key("k")
            .dispatch_key("stripe:evt_1");
        match ferry_store::postgres::wal::emit(&mut tx, event).await.unwrap_err() {
            EnqueueError::Invalid(v) => {
                assert_eq!(v.field, "dispatch_key", "{v}");
                assert!(v.fix.contains("enqueue"), "{v}");
            }
            other => panic!("expected a validation error of dispatch_key, got {other}"),
        }
    }
}

/// A transaction holds at most 1,024 key locks, one per bucket of keys,
/// however many keys it writes. With one lock per key, 20,000 keys filled
/// PostgreSQL's shared lock table on a default server (about 12,800
/// entries): the transaction failed with "out of shared memory", and while
/// it held most of the table no other connection could even open.
#[tokio::test]
async fn a_transaction_of_20000_keys_holds_at_most_1024_key_locks() {
    let h = harness().await;
    let mut bulk = h.pool.begin().await.unwrap();
    let events = (0..20_000)
        .map(|i| Event::new("order.imported", json!({"n": i})).key(format!("order-{i}")))
        .collect();
    enqueue_batch(&mut bulk, events).await.unwrap();
    let locks: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            .fetch_one(&mut *bulk)
            .await
            .unwrap();
    assert!(locks <= 1024, "the transaction holds {locks} key locks");

    // Meanwhile another connection opens and writes: a keyless event at
    // once, and an event of another key once the bulk commits (20,000 keys
    // cover every bucket, so it waits for that commit like any key of the
    // batch would).
    let mut other = sqlx::PgConnection::connect(h.db.url()).await.unwrap();
    let (keyless_tx, keyless) = tokio::sync::oneshot::channel();
    let producer = tokio::spawn(async move {
        let mut tx = other.begin().await.unwrap();
        enqueue(&mut tx, Event::new("customer.created", json!({})))
            .await
            .unwrap();
        keyless_tx.send(()).unwrap();
        enqueue(&mut tx, Event::new("customer.created", json!({})).key("customer-1"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    });
    keyless.await.unwrap();
    // The keyed event waits on its bucket, not on a full lock table.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
              WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()",
        )
        .fetch_one(&mut *bulk)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            !producer.is_finished(),
            "the other key's producer finished before the bulk commit"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other key's producer never waited on its bucket"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    bulk.commit().await.unwrap();
    producer.await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 20_002);
}

/// Two batches of many keys at once share buckets. Each takes its buckets
/// first, in ascending order, so one waits for the other's commit; taken in
/// the order of the events, each would hold a bucket the other waits for,
/// and PostgreSQL would abort one as a deadlock. Here batch A starts in
/// bucket x and ends in bucket y, and batch B the other way round, with
/// keys of buckets of their own in between.
#[tokio::test]
async fn two_bulk_batches_at_once_wait_for_each_other_instead_of_deadlocking() {
    let h = harness().await;
    let candidates: Vec<String> = (0..20_000).flat_map(|i| [format!("a-{i}"), format!("b-{i}")]).collect();
    let buckets: Vec<(String, i32)> = sqlx::query_as("SELECT k, 1 + (hashtext(k) & 1023) FROM unnest($1::text[]) k")
        .bind(&candidates)
        .fetch_all(&h.pool)
        .await
        .unwrap();
    let of = |side: &str, pick: &dyn Fn(i32) -> bool, n: usize| -> Vec<String> {
        let keys = buckets.iter().filter(|(k, b)| k.starts_with(side) && pick(*b));
        keys.take(n).map(|(k, _)| k.clone()).collect()
    };
    let (x, y) = (buckets[0].1, buckets[0].1 % 1024 + 1);
    let between = |lo: i32, hi: i32| move |b: i32| b != x && b != y && (lo..=hi).contains(&b);
    let order = |first: Vec<String>, middle: Vec<String>, last: Vec<String>| -> Vec<Event> {
        first
            .into_iter()
            .chain(middle)
            .chain(last)
            .map(|k| Event::new("order.imported", json!({})).key(k))
            .collect()
    };
    let batch_a = order(
        of("a", &|b| b == x, 1),
        of("a", &between(1, 512), 1_000),
        of("a", &|b| b == y, 1),
    );
    let batch_b = order(
        of("b", &|b| b == y, 1),
        of("b", &between(513, 1024), 1_000),
        of("b", &|b| b == x, 1),
    );
    // Both transactions open first, so the two batches overlap.
    let mut a = h.pool.begin().await.unwrap();
    let mut b = h.pool.begin().await.unwrap();
    let (wrote_a, wrote_b) = tokio::join!(
        async {
            enqueue_batch(&mut a, batch_a).await?;
            a.commit().await.map_err(EnqueueError::from)
        },
        async {
            enqueue_batch(&mut b, batch_b).await?;
            b.commit().await.map_err(EnqueueError::from)
        },
    );
    wrote_a.unwrap();
    wrote_b.unwrap();
}

/// Table capture in a bulk write: a 15,000-row INSERT into a captured table
/// (failing closed) writes its 15,000 events. With one lock per key it
/// failed with "out of shared memory" (and in warn mode dropped events).
#[tokio::test]
async fn a_bulk_insert_into_a_captured_table_writes_every_event() {
    use ferry_store::postgres::capture::{self, CaptureSpec};

    let h = harness().await;
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL)")
        .execute(&h.pool)
        .await
        .unwrap();
    capture::add(
        &mut h.pool.acquire().await.unwrap(),
        &CaptureSpec::new("orders", "shop.order", "id"),
    )
    .await
    .unwrap();
    sqlx::query("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 15000) g")
        .execute(&h.pool)
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(DISTINCT key) FROM ferry.events WHERE type = 'shop.order.created'")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 15_000);
}

/// A relay's connections open with the statements an idle relay runs
/// prepared, so a heartbeat or a poll on a connection that has not run it
/// yet needs no round trip of its own to prepare it (which PostgreSQL
/// would count as a transaction).
#[tokio::test]
async fn a_relays_connections_open_with_the_idle_statements_prepared() {
    use ferry_core::{Ownership, RelayId, Store};
    use ferry_store::postgres::PgStore;
    use std::time::Duration;

    let h = harness().await;
    let relay = PgStore::connect_lazy_relay(h.db.url(), 3).unwrap();
    let plain = PgStore::connect_lazy(h.db.url(), 3).unwrap();
    assert_eq!(plain.pool().acquire().await.unwrap().cached_statements_size(), 0);
    // Three at once: three connections opened.
    let cached = async |store: &PgStore| {
        let held = [
            store.pool().acquire().await.unwrap(),
            store.pool().acquire().await.unwrap(),
            store.pool().acquire().await.unwrap(),
        ];
        held.iter().map(|c| c.cached_statements_size()).collect::<Vec<_>>()
    };
    assert_eq!(cached(&relay).await, [2, 2, 2]);
    // The pool lends its idle connections in turn: each ticks and polls
    // once, and runs the statements it prepared, not new ones.
    let routes = ["orders".to_owned()];
    for _ in 0..3 {
        let owned: Ownership = relay
            .tick(&RelayId("a".into()), Duration::from_secs(30), &[])
            .await
            .unwrap();
        assert!(!owned.leases.is_empty());
        let polled = relay.fetch_direct(&owned, 500, &routes, &[], &[]).await.unwrap();
        assert!(polled.is_some_and(|b| b.events.is_empty()));
    }
    assert_eq!(cached(&relay).await, [2, 2, 2]);

    // Before `ferry migrate` there is nothing to prepare; the connection
    // still opens, so the relay can say what is missing.
    let empty = TestDb::create().await;
    let relay = PgStore::connect_lazy_relay(empty.url(), 2).unwrap();
    assert_eq!(relay.pool().acquire().await.unwrap().cached_statements_size(), 0);
}

/// The direct fetch is planned for the backlog it meets. PostgreSQL may give
/// a prepared statement that ran five times a generic plan and keep it until
/// the next `ANALYZE`: made while the relay kept up with a trickle, over an
/// `unrouted` of a row or two, that plan read and sorted the whole table,
/// and probed `events` by scanning it, on every fetch of the next burst.
/// Once a fetch comes back full, the fetches of that backlog run a statement
/// of their own, planned for the backlog they meet (a plan that probes and
/// sorts nothing); a trickle keeps its prepared statement.
#[tokio::test]
async fn a_relays_fetch_is_planned_for_the_backlog_it_meets() {
    use ferry_core::{RelayId, Store};
    use ferry_store::postgres::PgStore;
    use std::time::Duration;

    let h = harness().await;
    // One connection, so the prepared statement's runs can be read back.
    let pool = PgStore::relay_pool_options()
        .max_connections(1)
        .connect_lazy(h.db.url())
        .unwrap();
    let relay = PgStore::new(pool);
    sqlx::raw_sql("ANALYZE ferry.events, ferry.unrouted, ferry.deliveries")
        .execute(&h.pool)
        .await
        .unwrap();
    let owned = relay
        .tick(&RelayId("a".into()), Duration::from_secs(30), &[])
        .await
        .unwrap();
    let routes = ["orders".to_owned()];
    let runs = async || -> i64 {
        sqlx::query_scalar(
            "SELECT generic_plans + custom_plans FROM pg_prepared_statements
              WHERE statement LIKE '-- Direct delivery:%' AND statement NOT LIKE '%-- backlog%'",
        )
        .fetch_one(relay.pool())
        .await
        .unwrap()
    };
    // The trickle: the outbox holds nothing each time the relay looks.
    for _ in 0..10 {
        let batch = relay
            .fetch_direct(&owned, 500, &routes, &[], &[])
            .await
            .unwrap()
            .unwrap();
        assert!(batch.events.is_empty());
    }
    let trickled = runs().await;
    assert!(trickled >= 10, "the trickle ran the prepared fetch: {trickled}");

    // The burst, committed before any ANALYZE sees it.
    let burst = async || {
        sqlx::query(
            "SELECT count(ferry.enqueue('order.item.created', 'k-' || (i % 100), jsonb_build_object('n', i)))
               FROM generate_series(1, 20000) i",
        )
        .execute(&h.pool)
        .await
        .unwrap();
    };
    burst().await;
    let mut fetched = Vec::new();
    for expected_runs in [trickled + 1, trickled + 1, trickled + 1] {
        let batch = relay
            .fetch_direct(&owned, 500, &routes, &[], &fetched)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(batch.events.len(), 500);
        fetched.extend(batch.events.iter().map(|c| c.event.seq));
        assert_eq!(
            runs().await,
            expected_runs,
            "after a full batch the backlog's own statement runs"
        );
    }
    assert!(fetched.windows(2).all(|w| w[0] < w[1]), "in seq order");
    let backlog_statements: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '-- Direct delivery:%-- backlog 1%'",
    )
    .fetch_one(relay.pool())
    .await
    .unwrap();
    assert_eq!(backlog_statements, 1);
    // A batch that is not full ends the backlog: the prepared fetch again.
    let rest = relay
        .fetch_direct(&owned, 50_000, &routes, &[], &fetched)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rest.events.len(), 20_000 - fetched.len());
    relay.fetch_direct(&owned, 500, &routes, &[], &[]).await.unwrap();
    assert_eq!(runs().await, trickled + 2);

    // What a statement new to the backlog is planned into, on the
    // statistics of the empty outbox: each event probed by its key, nothing
    // sorted.
    sqlx::raw_sql("DELETE FROM ferry.unrouted WHERE seq > 0; ANALYZE ferry.unrouted")
        .execute(&h.pool)
        .await
        .unwrap();
    burst().await;
    let fetch = include_str!("../src/postgres/sql/fetch_direct.sql");
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {fetch}")))
        .persistent(false)
        .bind(owned.partitions())
        .bind(500_i64)
        .bind(&routes[..])
        .bind(Vec::<String>::new())
        .bind(Vec::<i64>::new())
        .fetch_one(relay.pool())
        .await
        .unwrap();
    let nodes = plan_nodes(&plan);
    let wrong: Vec<_> = nodes
        .iter()
        .filter(|(n, in_subplan)| {
            (!in_subplan && n["Node Type"] == "Sort")
                || (matches!(n["Relation Name"].as_str(), Some("events" | "unrouted")) && n["Node Type"] == "Seq Scan")
        })
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?} in {plan:#}");
}

/// The relay's two reads of events with their payloads, the direct fetch
/// and the claim of due deliveries, look each event up by its primary key,
/// under the custom plans PostgreSQL makes at first and the generic plan it
/// may switch to: no merge join or scan of `events` (which grows with the
/// outbox's history) and no sort (which would copy every payload again).
/// The claim runs on statistics taken when the pending deliveries were the
/// outbox's first half, while the due ones are now its last rows: joined
/// plainly, that plan merge-joined from the first event.
#[tokio::test]
async fn the_relays_reads_probe_each_event_and_sort_nothing() {
    let h = harness().await;
    sqlx::raw_sql(
        "SELECT count(ferry.enqueue('order.item.created', 'k-' || (i % 100), jsonb_build_object('n', i)))
           FROM generate_series(1, 20000) i;
         ALTER TABLE ferry.deliveries SET (autovacuum_enabled = false);
         INSERT INTO ferry.deliveries (seq, route, partition, key, state)
         SELECT e.seq, 'retried', e.partition, e.key, CASE WHEN e.seq <= 10000 THEN 'pending' ELSE 'published' END
           FROM ferry.events e;
         ANALYZE ferry.events, ferry.unrouted, ferry.deliveries;
         UPDATE ferry.deliveries SET state = CASE WHEN seq > 19000 THEN 'pending' ELSE 'published' END",
    )
    .execute(&h.pool)
    .await
    .unwrap();
    let mut conn = h.pool.acquire().await.unwrap();
    let partitions = "'{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31}'";
    let reads = [
        (
            "fetch_direct(int[], int, text[], text[], bigint[])",
            include_str!("../src/postgres/sql/fetch_direct.sql"),
            format!("fetch_direct({partitions}, 500, '{{orders}}', '{{}}', '{{}}')"),
        ),
        (
            "claim(text, int[], timestamptz, int, bigint[])",
            include_str!("../src/postgres/sql/claim.sql"),
            format!("claim('retried', {partitions}, now(), 500, '{{}}')"),
        ),
    ];
    for (signature, sql, _) in &reads {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE {signature} AS {sql}")))
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET plan_cache_mode = {mode}")))
            .execute(&mut *conn)
            .await
            .unwrap();
        for (_, _, execute) in &reads {
            let plan: serde_json::Value =
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) EXECUTE {execute}")))
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
            let nodes = plan_nodes(&plan);
            // A sort inside a per-event subplan (the routes holding a key
            // back) sorts a few route names, not the fetched rows.
            let wrong: Vec<_> = nodes
                .iter()
                .filter(|(n, in_subplan)| {
                    (!in_subplan && matches!(n["Node Type"].as_str(), Some("Sort" | "Merge Join")))
                        || (n["Relation Name"] == "events" && n["Node Type"] != "Index Scan")
                })
                .collect();
            assert!(wrong.is_empty(), "{mode}, {execute}: {wrong:#?} in {plan:#}");
            assert!(
                nodes.iter().any(|(n, _)| n["Index Name"] == "events_pkey"),
                "{mode}, {execute}: {plan:#}"
            );
        }
    }
}

/// Retention's order-mark read (`retention_kept.sql`) looks up the kept
/// dead and cancelled deliveries of each key of the batch by that key,
/// under both the custom and the generic plan. Through the index by route
/// and seq it read every dead delivery kept before the batch and compared
/// each with every key of the batch: with `dead_window = "never"`, the
/// default, a read that grew with the outbox's history, under retention's
/// lock.
#[tokio::test]
async fn retentions_order_marks_read_kept_failures_by_key() {
    let h = harness().await;
    sqlx::raw_sql(
        "INSERT INTO ferry.deliveries (seq, route, partition, key, state)
         SELECT i, 'orders', 0, 'k-' || (i % 2000), CASE WHEN i % 2 = 0 THEN 'dead' ELSE 'cancelled' END
           FROM generate_series(1, 40000) i;
         INSERT INTO ferry.deliveries (seq, route, partition, key, state)
         SELECT i, 'orders', 0, 'k-' || (i % 2000), 'published'
           FROM generate_series(40001, 60000) i;
         ANALYZE ferry.deliveries, ferry.unrouted, ferry.events",
    )
    .execute(&h.pool)
    .await
    .unwrap();
    let mut conn = h.pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "PREPARE retention_kept(bigint[], text[], bigint) AS {}",
        include_str!("../src/postgres/sql/retention_kept.sql")
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    // The batch: the first 500 published events, each of a key with kept
    // failures before it.
    let seqs: Vec<String> = (40_001..=40_500).map(|i: i64| i.to_string()).collect();
    let keys: Vec<String> = (40_001..=40_500).map(|i: i64| format!("k-{}", i % 2000)).collect();
    let execute = format!(
        "EXECUTE retention_kept('{{{}}}', '{{{}}}', 40500)",
        seqs.join(","),
        keys.join(",")
    );
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET plan_cache_mode = {mode}")))
            .execute(&mut *conn)
            .await
            .unwrap();
        let plan: serde_json::Value =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {execute}")))
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        let nodes = plan_nodes(&plan);
        let wrong: Vec<_> = nodes
            .iter()
            .filter(|(n, _)| {
                n["Index Name"] == "deliveries_dead"
                    || (n["Relation Name"] == "deliveries" && n["Node Type"] == "Seq Scan")
            })
            .collect();
        assert!(wrong.is_empty(), "{mode}: {wrong:#?} in {plan:#}");
        assert!(
            nodes.iter().any(|(n, _)| n["Index Name"] == "deliveries_failed_key"),
            "{mode}: {plan:#}"
        );
    }
}

/// Every node of an `EXPLAIN (FORMAT JSON)` result, with whether it runs
/// inside a subplan.
fn plan_nodes(plan: &serde_json::Value) -> Vec<(&serde_json::Value, bool)> {
    let mut nodes = Vec::new();
    collect_nodes(&plan[0]["Plan"], false, &mut nodes);
    nodes
}

/// Every node of a JSON plan, with whether it runs inside a subplan.
fn collect_nodes<'a>(node: &'a serde_json::Value, in_subplan: bool, out: &mut Vec<(&'a serde_json::Value, bool)>) {
    let in_subplan = in_subplan || matches!(node["Parent Relationship"].as_str(), Some("SubPlan" | "InitPlan"));
    out.push((node, in_subplan));
    for child in node["Plans"].as_array().into_iter().flatten() {
        collect_nodes(child, in_subplan, out);
    }
}

/// A cancel waits for the partition locks a relay's settle or record holds,
/// then judges what a relay may be publishing. It judged by the time its
/// transaction began (`now()`): a retry that fell due while it waited
/// looked not due yet, and was cancelled while a relay could be publishing
/// it (the event then published, but recorded cancelled). It is judged by
/// the time the cancel has its locks.
#[tokio::test]
async fn a_cancel_that_waited_for_its_locks_judges_what_is_in_flight_once_it_has_them() {
    use ferry_core::{RelayId, Store};
    use ferry_store::{Action, Admin, AdminState, Target};
    use ferry_testkit::store_suite::StoreHarness;
    use std::time::Duration;

    let h = harness().await;
    let ids = h.enqueue(vec![Event::new("order.created", json!({})).key("k")]).await;
    h.store()
        .tick(&RelayId("relay-a".into()), Duration::from_secs(120), &[])
        .await
        .unwrap();
    let (seq, partition): (i64, i32) = sqlx::query_as("SELECT seq, partition FROM ferry.events WHERE id = $1")
        .bind(ids[0].0)
        .fetch_one(&h.pool)
        .await
        .unwrap();
    let leased: bool = sqlx::query_scalar(
        "SELECT owner IS NOT NULL AND expires_at > now() + interval '60 seconds' FROM ferry.partitions WHERE partition = $1",
    )
    .bind(partition)
    .fetch_one(&h.pool)
    .await
    .unwrap();
    assert!(leased, "the relay holds the event's partition");
    // Retrying, due 5.5 s from now: just outside the 5 s margin for a
    // relay's clock running ahead.
    sqlx::query("DELETE FROM ferry.unrouted WHERE seq = $1")
        .bind(seq)
        .execute(&h.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO ferry.deliveries (seq, route, partition, key, state, attempts, next_attempt_at, last_error)
         VALUES ($1, 'orders', $2, 'k', 'pending', 1, now() + interval '5.5 seconds', 'boom')",
    )
    .bind(seq)
    .bind(partition)
    .execute(&h.pool)
    .await
    .unwrap();
    // The partition held for 6 s, as a relay's write holds it.
    let mut holder = h.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM ferry.partitions WHERE partition = $1 FOR SHARE")
        .bind(partition)
        .execute(&mut *holder)
        .await
        .unwrap();
    let target = Target {
        event_id: ids[0],
        seq,
        route: "orders".into(),
        event_type: "order.created".into(),
        key: Some("k".into()),
        state: AdminState::Retrying,
    };
    let cancel = Action::Cancel {
        reason: "obsolete".into(),
    };
    let (applied, ()) = tokio::join!(h.store().apply(&cancel, "ops", std::slice::from_ref(&target)), async {
        tokio::time::sleep(Duration::from_secs(6)).await;
        holder.commit().await.unwrap();
    });
    let applied = applied.unwrap();
    assert!(applied.changed.is_empty(), "cancelled though due: {applied:?}");
    assert!(applied.refused[0].reason.contains("in flight"), "{applied:?}");
}

/// Waits until backend `pid` waits for a lock.
async fn until_it_waits(pool: &sqlx::PgPool, pid: i32) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
        if waiting {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the retry never waited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A retried `Event` whose first attempt commits while the retry runs (the
/// retry's insert waits for it, then writes nothing) is a repeat: its id is
/// its own and no snapshot of the retry's statement shows the first one.
/// It was reported as written, and a caller skipping its business write
/// for repeats applied it twice.
#[tokio::test]
async fn a_retry_that_waited_for_its_first_attempt_is_a_repeat() {
    let h = harness().await;
    let event = Event::new("order.paid", json!({"n": 1})).dispatch_key("pay-1");
    let mut first = h.pool.begin().await.unwrap();
    let sent = enqueue(&mut first, event.clone()).await.unwrap();
    assert!(!sent.duplicate);
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let retry = tokio::spawn({
        let pool = h.pool.clone();
        let event = event.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            pid_tx.send(pid).unwrap();
            let out = enqueue(&mut tx, event).await.unwrap();
            tx.commit().await.unwrap();
            out
        }
    });
    until_it_waits(&h.pool, pid_rx.await.unwrap()).await;
    first.commit().await.unwrap();
    let again = retry.await.unwrap();
    assert_eq!(again.id, event.id());
    assert!(again.duplicate, "a retry that wrote nothing was reported as written");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// A repeat marked inside a savepoint that is rolled back leaves no mark:
/// the event written again after it is reported as written.
#[tokio::test]
async fn a_repeat_rolled_back_with_its_savepoint_leaves_no_mark() {
    let h = harness().await;
    let event = Event::new("order.paid", json!({"n": 1})).dispatch_key("pay-1");
    let mut tx = h.pool.begin().await.unwrap();
    let mut inner = tx.begin().await.unwrap();
    assert!(!enqueue(&mut inner, event.clone()).await.unwrap().duplicate);
    assert!(enqueue(&mut inner, event.clone()).await.unwrap().duplicate);
    inner.rollback().await.unwrap();
    let written = enqueue(&mut tx, event.clone()).await.unwrap();
    assert_eq!((written.id, written.duplicate), (event.id(), false));
    let other = Event::new("order.paid", json!({"n": 2})).dispatch_key("pay-2");
    let written = enqueue_batch(&mut tx, vec![other.clone(), event.clone()])
        .await
        .unwrap();
    assert_eq!(
        written.iter().map(|e| (e.id, e.duplicate)).collect::<Vec<_>>(),
        [(other.id(), false), (event.id(), true)]
    );
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 2);
}

/// A producer upgraded before `ferry migrate` runs: on schema 28, without
/// the repeats' marks, a plain repeat (same event, in a later transaction or
/// the same one) is still reported.
#[tokio::test]
async fn a_producer_ahead_of_schema_29_still_reports_a_repeat() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    sqlx::raw_sql(
        "CREATE SCHEMA ferry;
         CREATE TABLE ferry.schema_migrations (version int PRIMARY KEY, name text NOT NULL,
                                               applied_at timestamptz NOT NULL DEFAULT now());",
    )
    .execute(&pool)
    .await
    .unwrap();
    for &(version, name, sql) in ferry_store::postgres::MIGRATIONS.iter().filter(|m| m.0 <= 28) {
        let mut tx = pool.begin().await.unwrap();
        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
        sqlx::query("INSERT INTO ferry.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let event = Event::new("order.paid", json!({"n": 1})).dispatch_key("pay-1");
    let mut tx = pool.begin().await.unwrap();
    assert!(!enqueue(&mut tx, event.clone()).await.unwrap().duplicate);
    assert!(enqueue(&mut tx, event.clone()).await.unwrap().duplicate);
    tx.commit().await.unwrap();
    let other = Event::new("order.paid", json!({"n": 2})).dispatch_key("pay-2");
    let mut tx = pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, vec![event.clone(), other.clone()])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        out.iter().map(|e| (e.id, e.duplicate)).collect::<Vec<_>>(),
        [(event.id(), true), (other.id(), false)]
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 2);
}

/// Before `ferry migrate` has run, the producer says to run it rather than
/// that the database refused the event.
#[tokio::test]
async fn a_producer_before_migrate_says_to_run_it() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let mut tx = pool.begin().await.unwrap();
    let err = enqueue(&mut tx, Event::new("order.paid", json!({}))).await.unwrap_err();
    assert!(matches!(err, EnqueueError::NotMigrated(_)), "{err}");
    assert!(err.to_string().contains("run `ferry migrate`"), "{err}");
}
