//! Table capture against a real database: the events each kind of change
//! writes, drift and refresh, the fail-closed and warn paths, bad input, and
//! a relay delivering captured events in commit order per key.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Glob, Route, Sink, SystemClock};
use ferry_relay::{Relay, RelaySettings};
use ferry_store::postgres::capture::{self, CaptureError, CaptureSpec, OnError, Operation, Tables};
use ferry_store::postgres::{PgStore, migrate};
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::pg::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;

async fn database(schema: &str) -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(schema.to_owned()))
        .execute(&pool)
        .await
        .unwrap();
    (db, pool)
}

const ORDERS: &str = "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL, total numeric,
                                            card_token text, deleted_at timestamptz)";

/// One captured event: type, key, payload, headers.
#[derive(Debug)]
struct Captured {
    event_type: String,
    key: Option<String>,
    payload: Value,
    headers: Value,
}

async fn events(pool: &PgPool) -> Vec<Captured> {
    let rows: Vec<(String, Option<String>, Value, Value)> = sqlx::query_as(
        "SELECT type, key, convert_from(payload, 'UTF8')::jsonb, headers FROM ferry.events ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(event_type, key, payload, headers)| Captured {
            event_type,
            key,
            payload,
            headers,
        })
        .collect()
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn add(pool: &PgPool, spec: CaptureSpec) -> Result<String, CaptureError> {
    capture::add(&mut pool.acquire().await.unwrap(), &spec).await
}

#[tokio::test]
async fn insert_update_and_delete_write_events_with_the_changed_fields() {
    let (_db, pool) = database(ORDERS).await;
    let table = add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    assert_eq!(table, "public.orders");

    exec(&pool, "INSERT INTO orders (id, status, total) VALUES (7, 'new', 10.5)").await;
    exec(&pool, "UPDATE orders SET status = 'paid' WHERE id = 7").await;
    exec(&pool, "DELETE FROM orders WHERE id = 7").await;

    let got = events(&pool).await;
    let types: Vec<&str> = got.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        ["shop.order.created", "shop.order.updated", "shop.order.deleted"]
    );
    assert!(got.iter().all(|e| e.key.as_deref() == Some("7")));
    let row = |status: &str| json!({"id": 7, "status": status, "total": 10.5, "card_token": null, "deleted_at": null});
    assert_eq!(got[0].payload, json!({ "data": row("new") }));
    assert_eq!(
        got[1].payload,
        json!({ "data": row("paid"), "previous": { "status": "new" } })
    );
    assert_eq!(got[2].payload, json!({ "data": row("paid") }));
    assert_eq!(got[0].headers, json!({ "initiator": "user", "table": "public.orders" }));
}

#[tokio::test]
async fn an_update_that_changes_nothing_tracked_writes_nothing() {
    let (_db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").exclude(["card_token"]),
    )
    .await
    .unwrap();
    exec(
        &pool,
        "INSERT INTO orders (id, status, card_token) VALUES (1, 'new', 'tok_secret')",
    )
    .await;
    exec(&pool, "UPDATE orders SET status = 'new' WHERE id = 1").await;
    exec(&pool, "UPDATE orders SET card_token = 'tok_other' WHERE id = 1").await;
    exec(
        &pool,
        "UPDATE orders SET status = 'paid', card_token = 'tok_third' WHERE id = 1",
    )
    .await;

    let got = events(&pool).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        got[0].payload,
        json!({ "data": { "id": 1, "status": "new", "total": null, "deleted_at": null } })
    );
    assert_eq!(got[1].event_type, "shop.order.updated");
    assert_eq!(got[1].payload["previous"], json!({ "status": "new" }));
    for e in &got {
        assert!(!e.payload.to_string().contains("tok_"), "excluded column leaked: {e:?}");
    }
}

#[tokio::test]
async fn a_soft_delete_is_a_deleted_event() {
    let (_db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").soft_delete("deleted_at"),
    )
    .await
    .unwrap();
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    exec(
        &pool,
        "UPDATE orders SET deleted_at = '2026-01-02T03:04:05Z' WHERE id = 1",
    )
    .await;
    // Restored: an ordinary update.
    exec(&pool, "UPDATE orders SET deleted_at = NULL WHERE id = 1").await;

    let got = events(&pool).await;
    let types: Vec<&str> = got.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        ["shop.order.created", "shop.order.deleted", "shop.order.updated"]
    );
    assert_eq!(got[1].payload["data"]["deleted_at"], json!("2026-01-02T03:04:05+00:00"));
    assert_eq!(got[1].payload["previous"], json!({ "deleted_at": null }));
}

#[tokio::test]
async fn only_the_chosen_operations_write_events() {
    let (_db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on([Operation::Insert, Operation::Delete]),
    )
    .await
    .unwrap();
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    exec(&pool, "UPDATE orders SET status = 'paid'").await;
    exec(&pool, "DELETE FROM orders").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(types, ["shop.order.created", "shop.order.deleted"]);
}

#[tokio::test]
async fn odd_names_and_wide_tables_work() {
    let columns: Vec<String> = (0..120).map(|i| format!("\"c {i}\" int DEFAULT {i}")).collect();
    let schema = format!(
        "CREATE SCHEMA \"My App\";
         CREATE TABLE \"My App\".\"Work Item\" (\"Id\" text PRIMARY KEY, \"we\"\"ird.col\" text, {});",
        columns.join(", ")
    );
    let (_db, pool) = database(&schema).await;
    let table = add(
        &pool,
        CaptureSpec::new(r#""My App"."Work Item""#, "workitem", "Id").exclude(["c 3"]),
    )
    .await
    .unwrap();
    assert_eq!(table, r#""My App"."Work Item""#);
    exec(
        &pool,
        r#"INSERT INTO "My App"."Work Item" ("Id", "we""ird.col") VALUES ('a-1', 'x')"#,
    )
    .await;
    exec(&pool, r#"UPDATE "My App"."Work Item" SET "c 119" = 0"#).await;

    let got = events(&pool).await;
    assert_eq!(got.len(), 2);
    let data = got[0].payload["data"].as_object().unwrap();
    assert_eq!(data.len(), 2 + 120 - 1);
    assert_eq!(data["we\"ird.col"], json!("x"));
    assert_eq!(data["c 119"], json!(119));
    assert!(!data.contains_key("c 3"));
    assert_eq!(got[1].key.as_deref(), Some("a-1"));
    assert_eq!(got[1].payload["previous"], json!({ "c 119": 119 }));
    // Removed by the name `list` prints.
    capture::remove(&mut pool.acquire().await.unwrap(), &table)
        .await
        .unwrap();
    exec(&pool, r#"UPDATE "My App"."Work Item" SET "c 119" = 1"#).await;
    assert_eq!(events(&pool).await.len(), 2);
}

#[tokio::test]
async fn a_schema_change_is_drift_until_refreshed() {
    let (_db, pool) = database(ORDERS).await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());

    exec(&pool, "ALTER TABLE orders ADD COLUMN region text DEFAULT 'eu'").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.orders");
    assert!(drift[0].problem.contains("region"), "{}", drift[0].problem);
    assert_eq!(drift[0].fix, "ferry capture refresh public.orders");
    // Until refreshed, the trigger writes the columns it was generated with.
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;

    let done = capture::refresh(&mut conn, Tables::One("orders")).await.unwrap();
    assert_eq!(done, ["public.orders"]);
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "INSERT INTO orders (id, status) VALUES (2, 'new')").await;
    let got = events(&pool).await;
    assert!(got[0].payload["data"].get("region").is_none());
    assert_eq!(got[1].payload["data"]["region"], json!("eu"));

    // A dropped column breaks the trigger: reported, and fixed the same way.
    exec(&pool, "ALTER TABLE orders DROP COLUMN total").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert!(drift[0].problem.contains("total"), "{drift:?}");
    let stale = sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 2")
        .execute(&pool)
        .await;
    assert!(stale.is_err(), "a stale trigger fails closed");
    assert_eq!(
        capture::refresh(&mut conn, Tables::All).await.unwrap(),
        ["public.orders"]
    );
    exec(&pool, "UPDATE orders SET status = 'paid' WHERE id = 2").await;
    assert_eq!(events(&pool).await.len(), 3);

    let listed = capture::list(&mut conn).await.unwrap();
    assert_eq!(
        listed[0].columns,
        ["id", "status", "card_token", "deleted_at", "region"]
    );
}

/// An event over the outbox's 1 MiB payload limit cannot be written.
const HUGE_INSERT: &str = "INSERT INTO orders (id, status) VALUES (1, repeat('x', 1100000))";

#[tokio::test]
async fn fails_closed_when_the_event_cannot_be_written() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let err = sqlx::query(HUGE_INSERT).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("invalid event payload"), "{err}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the business write must fail with its event");
    assert!(events(&pool).await.is_empty());
}

#[tokio::test]
async fn warn_mode_keeps_the_write_and_counts_the_dropped_event() {
    let (_db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    exec(&pool, HUGE_INSERT).await;
    exec(&pool, "UPDATE orders SET status = repeat('y', 1100000)").await;
    exec(&pool, "INSERT INTO orders (id, status) VALUES (2, 'small')").await;

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);
    let got = events(&pool).await;
    assert_eq!(got.len(), 1, "only the small row's event: {got:?}");
    assert_eq!(got[0].key.as_deref(), Some("2"));
    let listed = capture::list(&mut pool.acquire().await.unwrap()).await.unwrap();
    assert_eq!(listed[0].on_error, "warn");
    assert_eq!(listed[0].dropped, 2);
    assert!(
        listed[0]
            .last_dropped_error
            .as_deref()
            .unwrap()
            .contains("invalid event payload"),
        "{listed:?}"
    );
    assert!(listed[0].last_dropped_at.is_some());
    // What the relay exports as `ferry_capture_dropped_events`.
    let gauges = ferry_store::Gauges::gauges(&PgStore::new(pool.clone())).await.unwrap();
    assert_eq!(gauges.capture_dropped, vec![("public.orders".to_owned(), 2)]);
}

#[tokio::test]
async fn the_initiator_comes_from_the_transaction() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL ferry.initiator = 'system.import'")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders (id, status) VALUES (1, 'new')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    exec(&pool, "INSERT INTO orders (id, status) VALUES (2, 'new')").await;
    let got = events(&pool).await;
    assert_eq!(got[0].headers["initiator"], json!("system.import"));
    assert_eq!(got[1].headers["initiator"], json!("user"));
}

#[tokio::test]
async fn a_rolled_back_change_leaves_no_event() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, status) VALUES (1, 'new')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(events(&pool).await.is_empty());
}

#[tokio::test]
async fn bad_input_names_the_argument_and_the_fix() {
    let (_db, pool) = database(&format!("{ORDERS}; CREATE VIEW order_view AS SELECT * FROM orders")).await;
    let cases = [
        (
            CaptureSpec::new("nosuch", "shop.order", "id"),
            "'nosuch': no such table",
            "schema-qualified",
        ),
        (
            CaptureSpec::new("order_view", "shop.order", "id"),
            "not a table",
            "ordinary",
        ),
        (
            CaptureSpec::new("ferry.events", "x.y", "seq"),
            "own tables",
            "application",
        ),
        (
            CaptureSpec::new("orders", "Shop Order", "id"),
            "type prefix 'Shop Order'",
            "--type-prefix",
        ),
        (
            CaptureSpec::new("orders", "shop.order", "uid"),
            "key column 'uid'",
            "--key one of: id, status",
        ),
        (
            CaptureSpec::new("orders", "shop.order", "id").exclude(["nope"]),
            "exclude column 'nope'",
            "--exclude",
        ),
        (
            CaptureSpec::new("orders", "shop.order", "id").exclude(["id"]),
            "key column 'id' is also excluded",
            "--exclude",
        ),
        (
            CaptureSpec::new("orders", "shop.order", "id").soft_delete("gone_at"),
            "soft-delete column 'gone_at'",
            "--soft-delete one of",
        ),
        (
            CaptureSpec::new("orders", "shop.order", "id").on([]),
            "operation",
            "--on",
        ),
    ];
    for (spec, message, hint) in cases {
        match add(&pool, spec.clone()).await {
            Err(CaptureError::Invalid { message: m, hint: h }) => {
                assert!(m.contains(message), "{spec:?}: {m}");
                assert!(h.contains(hint), "{spec:?}: {h}");
            }
            other => panic!("{spec:?}: {other:?}"),
        }
    }
    assert!(
        capture::list(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
            .is_empty()
    );

    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let again = add(&pool, CaptureSpec::new("public.orders", "shop.order", "id")).await;
    assert!(
        matches!(&again, Err(CaptureError::Invalid { message, .. }) if message.contains("already captured")),
        "{again:?}"
    );
    let mut conn = pool.acquire().await.unwrap();
    let unknown = capture::remove(&mut conn, "nosuch").await;
    assert!(matches!(unknown, Err(CaptureError::Invalid { .. })), "{unknown:?}");
}

#[tokio::test]
async fn the_relay_delivers_captured_events_in_commit_order_per_key() {
    let (_db, pool) = database("CREATE TABLE counters (name text PRIMARY KEY, n int NOT NULL)").await;
    add(&pool, CaptureSpec::new("counters", "stats.counter", "name"))
        .await
        .unwrap();
    const KEYS: usize = 4;
    const WRITERS: usize = 4;
    const UPDATES: usize = 25;
    for k in 0..KEYS {
        exec(&pool, &format!("INSERT INTO counters VALUES ('k{k}', 0)")).await;
    }
    // Writers race on the same rows: the row lock orders their commits,
    // and `n` records that order.
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let pool = pool.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..UPDATES {
                let key = format!("k{}", (w + i) % KEYS);
                sqlx::query("UPDATE counters SET n = n + 1 WHERE name = $1")
                    .bind(key)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let total = KEYS + WRITERS * UPDATES;

    let sink = Arc::new(MockSink::new());
    let route = Route {
        name: "stats".into(),
        matcher: Glob::new("stats.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    };
    let settings = RelaySettings {
        poll_interval: Duration::from_millis(100),
        ..RelaySettings::new("capture-test")
    };
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(PgStore::new(pool.clone()), SystemClock, settings, vec![route], sinks).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sink.delivered("stats").len() < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "delivered {} of {total}",
            sink.delivered("stats").len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for event in sink.delivered("stats") {
        let payload: Value = serde_json::from_slice(&event.payload).unwrap();
        per_key
            .entry(event.key.clone().unwrap())
            .or_default()
            .push(payload["data"]["n"].as_i64().unwrap());
    }
    assert_eq!(per_key.len(), KEYS);
    for (key, ns) in per_key {
        let want: Vec<i64> = (0..=(WRITERS * UPDATES / KEYS) as i64).collect();
        assert_eq!(ns, want, "key {key}: none lost, none reordered");
    }
}

#[tokio::test]
async fn a_partitioned_table_is_captured_through_its_partitions() {
    let (_db, pool) = database(
        "CREATE TABLE readings (device text NOT NULL, at date NOT NULL, value int) PARTITION BY RANGE (at);
         CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');",
    )
    .await;
    add(&pool, CaptureSpec::new("readings", "iot.reading", "device"))
        .await
        .unwrap();
    exec(&pool, "INSERT INTO readings VALUES ('d1', '2026-03-01', 5)").await;
    exec(&pool, "UPDATE readings_2026 SET value = 6").await;
    let got = events(&pool).await;
    let types: Vec<&str> = got.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, ["iot.reading.created", "iot.reading.updated"]);
    assert!(
        capture::check(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn installing_gives_up_on_a_table_a_long_transaction_holds() {
    let (_db, pool) = database(ORDERS).await;
    let mut writer = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, status) VALUES (1, 'new')")
        .execute(&mut *writer)
        .await
        .unwrap();
    let busy = add(&pool, CaptureSpec::new("orders", "shop.order", "id")).await;
    assert!(matches!(busy, Err(CaptureError::Busy)), "{busy:?}");
    writer.commit().await.unwrap();
    assert!(
        capture::list(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
            .is_empty()
    );
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
}
