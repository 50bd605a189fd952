//! Table capture against a real database: the events each kind of change
//! writes, drift and refresh, the fail-closed and warn paths, bad input, a
//! relay delivering captured events in commit order per key, and the ways a
//! change could pass without its event (a trigger that does not fire, the
//! replica role, TRUNCATE, a spec changed), before and after an upgrade;
//! and partitioned tables, where a row that moves partitions reaches the
//! triggers as a delete and an insert.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Glob, Route, Sink, SystemClock};
use ferry_relay::{Relay, RelaySettings};
use ferry_store::postgres::capture::{self, CaptureError, CaptureSpec, OnError, Operation, Tables};
use ferry_store::postgres::{MIGRATIONS, PgStore, migrate};
use ferry_testkit::mock_sink::MockSink;
use ferry_testkit::pg::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgDatabaseError;

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

#[tokio::test]
async fn a_column_type_change_is_drift_until_refreshed() {
    let (_db, pool) = database("CREATE TABLE meters (id int PRIMARY KEY, v integer NOT NULL)").await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("meters", "plant.meter", "id"))
        .await
        .unwrap();
    // A session that wrote the table plans its reads of the columns for
    // their types then.
    let mut writer = pool.acquire().await.unwrap();
    sqlx::query("INSERT INTO meters VALUES (1, 10)")
        .execute(&mut *writer)
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE meters ALTER COLUMN v TYPE bigint").await;

    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.meters");
    assert!(
        drift[0].problem.contains("v (integer, now bigint)"),
        "{}",
        drift[0].problem
    );
    assert_eq!(drift[0].fix, "ferry capture refresh public.meters");
    // The stale plan fails that session's writes until the refresh.
    let stale = sqlx::query("INSERT INTO meters VALUES (2, 20)")
        .execute(&mut *writer)
        .await
        .unwrap_err();
    assert!(
        stale
            .to_string()
            .contains("does not match that when preparing the plan"),
        "{stale}"
    );

    capture::refresh(&mut conn, Tables::One("meters")).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    sqlx::query("INSERT INTO meters VALUES (2, 5000000000)")
        .execute(&mut *writer)
        .await
        .unwrap();
    let got = events(&pool).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1].payload["data"]["v"], json!(5000000000_i64));
}

/// A session's plans of the trigger's reads check the column's type OID,
/// not its modifier: a wider varchar or numeric breaks no session that
/// wrote the table before, and is no drift.
#[tokio::test]
async fn a_column_modifier_change_is_not_drift() {
    let (_db, pool) = database("CREATE TABLE labels (id int PRIMARY KEY, name varchar(20), price numeric(10,2))").await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("labels", "shop.label", "id"))
        .await
        .unwrap();
    let mut writer = pool.acquire().await.unwrap();
    sqlx::query("INSERT INTO labels VALUES (1, 'short', 1.50)")
        .execute(&mut *writer)
        .await
        .unwrap();
    exec(
        &pool,
        "ALTER TABLE labels ALTER COLUMN name TYPE varchar(40), ALTER COLUMN price TYPE numeric(12,2)",
    )
    .await;

    let drift = capture::check(&mut conn).await.unwrap();
    assert!(drift.is_empty(), "{drift:?}");
    // The session that wrote before keeps writing, with the wider values.
    sqlx::query("INSERT INTO labels VALUES (2, 'a name of thirty characters..', 1234567890.25)")
        .execute(&mut *writer)
        .await
        .unwrap();
    let got = events(&pool).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1].payload["data"]["name"], json!("a name of thirty characters.."));
    assert_eq!(got[1].payload["data"]["price"], json!(1234567890.25));
}

/// The types are recorded as OIDs: a refresh run under another
/// search_path (inside an application's migration) and a check under the
/// default one agree.
#[tokio::test]
async fn a_refresh_under_another_search_path_is_not_drift() {
    let (_db, pool) = database(
        "CREATE SCHEMA app;
         CREATE TYPE app.mood AS ENUM ('ok', 'meh');
         CREATE TABLE app.feelings (id int PRIMARY KEY, m app.mood)",
    )
    .await;
    add(&pool, CaptureSpec::new("app.feelings", "app.feeling", "id"))
        .await
        .unwrap();
    exec_in_session(
        &pool,
        "SET search_path = app",
        "SELECT ferry.capture_refresh('app.feelings')",
    )
    .await;

    let mut conn = pool.acquire().await.unwrap();
    let drift = capture::check(&mut conn).await.unwrap();
    assert!(drift.is_empty(), "{drift:?}");
}

/// Removing an enum value means replacing the type by a new one of the
/// same name: another type for the sessions that wrote the table before,
/// which fail until the refresh. Reported, the old type worded as gone.
#[tokio::test]
async fn a_type_replaced_by_one_of_the_same_name_is_drift() {
    let (_db, pool) = database(
        "CREATE SCHEMA app;
         CREATE TYPE app.mood AS ENUM ('ok', 'meh', 'bad');
         CREATE TABLE app.feelings (id int PRIMARY KEY, m app.mood)",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("app.feelings", "app.feeling", "id"))
        .await
        .unwrap();
    let mut writer = pool.acquire().await.unwrap();
    sqlx::query("INSERT INTO app.feelings VALUES (1, 'ok')")
        .execute(&mut *writer)
        .await
        .unwrap();
    exec(
        &pool,
        "ALTER TYPE app.mood RENAME TO mood_old;
         CREATE TYPE app.mood AS ENUM ('ok', 'meh');
         ALTER TABLE app.feelings ALTER COLUMN m TYPE app.mood USING m::text::app.mood;
         DROP TYPE app.mood_old",
    )
    .await;

    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "app.feelings");
    assert!(
        drift[0].problem.contains("m (a type since dropped, now app.mood)"),
        "{}",
        drift[0].problem
    );
    assert_eq!(drift[0].fix, "ferry capture refresh app.feelings");
    let stale = sqlx::query("INSERT INTO app.feelings VALUES (2, 'meh')")
        .execute(&mut *writer)
        .await
        .unwrap_err();
    assert!(stale.to_string().contains("cache lookup failed for type"), "{stale}");

    capture::refresh(&mut conn, Tables::One("app.feelings")).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    sqlx::query("INSERT INTO app.feelings VALUES (2, 'meh')")
        .execute(&mut *writer)
        .await
        .unwrap();
    let got = events(&pool).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[1].payload["data"]["m"], json!("meh"));
}

/// Schema 33 records the column types of the captures made before it as
/// their tables have them then: a type changed after the upgrade is
/// reported; a table renamed before it is read where its trigger is.
#[tokio::test]
async fn a_column_type_change_after_the_upgrade_is_reported() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 32).await;
    exec(
        &pool,
        "CREATE TABLE meters (id int PRIMARY KEY, v integer, note varchar(20));
         CREATE TABLE gauges (id int PRIMARY KEY, v integer)",
    )
    .await;
    add(&pool, CaptureSpec::new("meters", "plant.meter", "id"))
        .await
        .unwrap();
    add(&pool, CaptureSpec::new("gauges", "plant.gauge", "id"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE gauges RENAME TO dials").await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(migrate(&mut conn).await.unwrap().first(), Some(&33));
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.gauges");

    exec(
        &pool,
        "ALTER TABLE meters ALTER COLUMN note TYPE text; ALTER TABLE dials ALTER COLUMN v TYPE bigint",
    )
    .await;
    let recorded: Vec<Vec<String>> =
        sqlx::query_scalar("SELECT column_types::regtype[]::text[] FROM ferry.captures ORDER BY table_name")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    assert_eq!(
        recorded,
        [
            vec!["integer", "integer"],
            vec!["integer", "integer", "character varying"]
        ]
    );
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 2, "{drift:?}");
    assert_eq!(drift[0].table, "public.gauges");
    assert!(drift[0].problem.contains("renamed"), "{}", drift[0].problem);
    assert_eq!(drift[1].table, "public.meters");
    assert!(
        drift[1].problem.contains("note (character varying, now text)"),
        "{}",
        drift[1].problem
    );
    capture::refresh(&mut conn, Tables::All).await.unwrap();
    // The rename followed, the types recorded anew.
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// Writes `sql` in a session of its own with `settings` applied first.
async fn exec_in_session(pool: &PgPool, settings: &str, sql: &str) {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("{settings}; {sql}")))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{settings}; {sql}: {e}"));
    // Back to the defaults before the connection returns to the pool.
    sqlx::raw_sql("RESET ALL").execute(&mut *conn).await.unwrap();
}

/// Session settings that change how values print as text.
const LOCAL: &str = "SET TimeZone = 'Asia/Tokyo'; SET DateStyle = 'SQL, DMY'; \
                     SET IntervalStyle = 'iso_8601'; SET extra_float_digits = -3; SET bytea_output = 'escape'";
const UTC: &str = "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, MDY'";

#[tokio::test]
async fn a_key_is_the_same_text_whatever_the_writers_session_settings() {
    // Key column types whose text form depends on a session setting, with
    // the text every session's events must carry.
    let cases = [
        ("timestamptz", "'2026-01-01 12:00:00+00'", "2026-01-01 12:00:00+00"),
        ("date", "'2026-03-04'", "2026-03-04"),
        ("interval", "'1 day 02:00:00'", "1 day 02:00:00"),
        ("float8", "0.1::float8 + 0.2", "0.30000000000000004"),
        ("bytea", "'\\x41ff'::bytea", "\\x41ff"),
        ("instant", "'2026-01-01 12:00:00+00'", "2026-01-01 12:00:00+00"),
        (
            "timestamptz[]",
            "ARRAY['2026-01-01 12:00:00+00'::timestamptz]",
            "{\"2026-01-01 12:00:00+00\"}",
        ),
    ];
    let (_db, pool) = database("CREATE DOMAIN instant AS timestamptz").await;
    for (i, (column_type, value, _)) in cases.into_iter().enumerate() {
        let table = format!("t{i}");
        exec(
            &pool,
            &format!("CREATE TABLE {table} (k {column_type} NOT NULL, v int)"),
        )
        .await;
        add(&pool, CaptureSpec::new(table.as_str(), format!("t.n{i}"), "k"))
            .await
            .unwrap();
        exec_in_session(&pool, LOCAL, &format!("INSERT INTO {table} VALUES ({value}, 1)")).await;
        exec_in_session(&pool, UTC, &format!("UPDATE {table} SET v = 2")).await;
        exec_in_session(&pool, LOCAL, &format!("DELETE FROM {table}")).await;
    }
    let got = events(&pool).await;
    assert_eq!(got.len(), 3 * cases.len());
    for (i, (column_type, _, key)) in cases.into_iter().enumerate() {
        let keys: Vec<_> = got
            .iter()
            .filter(|e| e.event_type.starts_with(&format!("t.n{i}.")))
            .map(|e| e.key.as_deref())
            .collect();
        assert_eq!(keys, [Some(key); 3], "{column_type}");
    }
    assert!(
        capture::check(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_key_written_per_session_before_the_upgrade_is_reported_until_refreshed() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 13).await;
    exec(
        &pool,
        "CREATE TABLE visits (at timestamptz PRIMARY KEY, n int); CREATE TABLE notes (id int PRIMARY KEY)",
    )
    .await;
    add(&pool, CaptureSpec::new("visits", "web.visit", "at")).await.unwrap();
    add(&pool, CaptureSpec::new("notes", "crm.note", "id")).await.unwrap();

    let mut conn = pool.acquire().await.unwrap();
    // 14 and whatever came after it.
    assert_eq!(migrate(&mut conn).await.unwrap().first(), Some(&14));
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.visits");
    assert!(
        drift[0]
            .problem
            .contains("its key column at (timestamp with time zone)"),
        "{}",
        drift[0].problem
    );
    assert_eq!(drift[0].fix, "ferry capture refresh public.visits");
    // Until refreshed, the key is each session's own text.
    exec_in_session(&pool, LOCAL, "INSERT INTO visits VALUES ('2026-01-01 12:00:00+00', 1)").await;

    capture::refresh(&mut conn, Tables::One("public.visits")).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec_in_session(&pool, LOCAL, "UPDATE visits SET n = 2").await;
    exec_in_session(&pool, UTC, "UPDATE visits SET n = 3").await;
    let keys: Vec<_> = events(&pool).await.into_iter().map(|e| e.key).collect();
    assert_eq!(
        keys,
        [
            Some("01/01/2026 21:00:00 JST".to_owned()),
            Some("2026-01-01 12:00:00+00".to_owned()),
            Some("2026-01-01 12:00:00+00".to_owned()),
        ]
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
    // A read of the counts that fails fails the gauges: taken as no drops,
    // it would set the exported count back to zero.
    // Roles are the server's: one named after the test's own database.
    let role = format!("{}_gauges", _db.name());
    exec(
        &pool,
        &format!(
            "CREATE ROLE \"{role}\" NOLOGIN;
             GRANT USAGE ON SCHEMA ferry TO \"{role}\";
             GRANT SELECT ON ALL TABLES IN SCHEMA ferry TO \"{role}\";
             REVOKE SELECT ON ferry.capture_dropped FROM \"{role}\";"
        ),
    )
    .await;
    let set_role = format!("SET ROLE \"{role}\"");
    let limited = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let set_role = set_role.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(set_role)).execute(conn).await?;
                Ok(())
            })
        })
        .connect(_db.url())
        .await
        .unwrap();
    let err = ferry_store::Gauges::gauges(&PgStore::new(limited.clone()))
        .await
        .unwrap_err();
    assert!(err.message.contains("capture_dropped"), "{err}");
    limited.close().await;
    exec(&pool, &format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"")).await;
}

/// Writes under a role with exactly the producer grants OPERATIONS.md lists
/// ("Least-privilege database roles"): a drop in warn mode is counted, and
/// the business write still commits.
#[tokio::test]
async fn warn_mode_counts_a_drop_under_the_documented_producer_grants() {
    let (db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    // Roles belong to the whole server: one per test database.
    let role = format!("{}_producer", db.name());
    exec(
        &pool,
        &format!(
            "CREATE ROLE {role} NOLOGIN;
             GRANT SELECT, INSERT, UPDATE ON orders TO {role};
             GRANT USAGE ON SCHEMA ferry TO {role};
             GRANT SELECT, INSERT ON ferry.events, ferry.unrouted TO {role};
             GRANT SELECT ON ferry.relays TO {role};
             GRANT SELECT ON ferry.wal_slots TO {role};
             GRANT SELECT, INSERT, UPDATE ON ferry.capture_dropped TO {role};"
        ),
    )
    .await;
    for write in [HUGE_INSERT, "INSERT INTO orders (id, status) VALUES (2, 'small')"] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET LOCAL ROLE {role}; {write}")))
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{write}: {e}"));
        tx.commit().await.unwrap();
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);
    assert_eq!(events(&pool).await.len(), 1, "only the small row's event");
    let listed = capture::list(&mut pool.acquire().await.unwrap()).await.unwrap();
    assert_eq!(listed[0].dropped, 1);
    exec(&pool, &format!("DROP OWNED BY {role}; DROP ROLE {role};")).await;
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

/// A column kept out of the events (`--exclude`) and later dropped has
/// nothing left to keep out: a refresh goes on without it. It refused
/// ("exclude column is not a column"), and a refresh of every table
/// stopped there, leaving the other tables' triggers stale.
#[tokio::test]
async fn refresh_goes_on_when_an_excluded_column_is_dropped() {
    let (_db, pool) = database(&format!(
        "{ORDERS}; CREATE TABLE visits (id bigint PRIMARY KEY, page text)"
    ))
    .await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").exclude(["card_token"]),
    )
    .await
    .unwrap();
    add(&pool, CaptureSpec::new("visits", "web.visit", "id")).await.unwrap();
    exec(&pool, "ALTER TABLE orders DROP COLUMN card_token").await;
    exec(&pool, "ALTER TABLE visits ADD COLUMN referrer text").await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        capture::refresh(&mut conn, Tables::All).await.unwrap(),
        ["public.orders", "public.visits"]
    );
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    exec(&pool, "INSERT INTO visits (id, page, referrer) VALUES (1, '/', 'ads')").await;
    let got = events(&pool).await;
    assert_eq!(got.len(), 2);
    assert_eq!(got[1].payload["data"]["referrer"], json!("ads"));
    assert!(got[0].payload["data"].get("card_token").is_none());
    // The spec keeps the exclusion: a column of that name added again
    // stays out of the events.
    exec(&pool, "ALTER TABLE orders ADD COLUMN card_token text").await;
    capture::refresh(&mut conn, Tables::One("orders")).await.unwrap();
    exec(
        &pool,
        "INSERT INTO orders (id, status, card_token) VALUES (2, 'new', 'tok_secret')",
    )
    .await;
    let got = events(&pool).await;
    assert_eq!(got.len(), 3);
    assert!(
        got[2].payload["data"].get("card_token").is_none(),
        "{:?}",
        got[2].payload
    );
    // A typo at add time is still refused: it would send the column meant.
    let typo = add(
        &pool,
        CaptureSpec::new("visits", "web.visit", "id").exclude(["refferer"]),
    )
    .await;
    assert!(
        matches!(&typo, Err(CaptureError::Invalid { message, .. }) if message.contains("'refferer' is not a column")),
        "{typo:?}"
    );
}

/// PostgreSQL runs an UPDATE that moves a row to another partition as a
/// DELETE and an INSERT: no update trigger fires. Captured for updates
/// alone, such an UPDATE committed with no event. Capturing a partitioned
/// table (or a partition) for updates asks for inserts and deletes too,
/// with which the move arrives as the row deleted and created.
#[tokio::test]
async fn a_partitioned_table_captured_for_updates_takes_inserts_and_deletes_too() {
    let (_db, pool) = database(
        "CREATE TABLE readings (device text NOT NULL, at date NOT NULL, value int) PARTITION BY RANGE (at);
         CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
         CREATE TABLE readings_2027 PARTITION OF readings FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');",
    )
    .await;
    for (table, ops) in [
        ("readings", vec![Operation::Update]),
        ("readings", vec![Operation::Update, Operation::Delete]),
        ("readings_2026", vec![Operation::Update, Operation::Insert]),
    ] {
        match add(&pool, CaptureSpec::new(table, "iot.reading", "device").on(ops.clone())).await {
            Err(CaptureError::Invalid { message, hint }) => {
                assert!(message.contains("moves a row to another partition"), "{message}");
                assert!(hint.contains("--on insert,update,delete"), "{hint}");
            }
            other => panic!("{table} {ops:?}: {other:?}"),
        }
    }
    add(
        &pool,
        CaptureSpec::new("readings", "iot.reading", "device").on([
            Operation::Insert,
            Operation::Update,
            Operation::Delete,
        ]),
    )
    .await
    .unwrap();
    exec(&pool, "INSERT INTO readings VALUES ('d1', '2026-03-01', 5)").await;
    exec(&pool, "UPDATE readings SET at = '2027-03-01'").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(
        types,
        ["iot.reading.created", "iot.reading.deleted", "iot.reading.created"]
    );
}

/// A plain table captured for updates alone, attached later as a
/// partition: capture_add could not refuse it, and a row moved out of it
/// commits with no event. `ferry check` says so, with the fix.
#[tokio::test]
async fn a_table_captured_for_updates_and_attached_as_a_partition_later_is_reported() {
    let (_db, pool) = database(
        "CREATE TABLE readings (device text NOT NULL, at date NOT NULL, value int) PARTITION BY RANGE (at);
         CREATE TABLE readings_2026 (device text NOT NULL, at date NOT NULL, value int);",
    )
    .await;
    add(
        &pool,
        CaptureSpec::new("readings_2026", "iot.reading", "device").on([Operation::Update]),
    )
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(
        &pool,
        "ALTER TABLE readings ATTACH PARTITION readings_2026 FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')",
    )
    .await;
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].table.contains("readings_2026"), "{found:?}");
    assert!(
        found[0].problem.contains("moves a row to another partition"),
        "{found:?}"
    );
    assert!(found[0].fix.contains("--on insert,update,delete"), "{found:?}");
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

/// The capture triggers on each table: `(table, trigger, pg_trigger.tgenabled)`.
async fn trigger_states(pool: &PgPool) -> Vec<(String, String, String)> {
    sqlx::query_as(
        "SELECT tgrelid::regclass::text, tgname::text, tgenabled::text FROM pg_trigger
          WHERE tgname LIKE 'ferry_capture%' ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The message and hint of a statement's error.
async fn refused(pool: &PgPool, sql: &str) -> (String, String) {
    let err = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .expect_err(sql);
    let db = err.as_database_error().unwrap_or_else(|| panic!("{sql}: {err}"));
    let hint = db.try_downcast_ref::<PgDatabaseError>().and_then(PgDatabaseError::hint);
    (db.message().to_owned(), hint.unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_trigger_that_does_not_always_fire_is_drift_with_the_statement_that_enables_it() {
    let (_db, pool) = database(ORDERS).await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE orders DISABLE TRIGGER ferry_capture").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.orders");
    assert!(drift[0].problem.contains("ferry_capture is disabled"), "{drift:?}");
    assert_eq!(
        drift[0].fix,
        "ALTER TABLE public.orders ENABLE ALWAYS TRIGGER ferry_capture"
    );
    exec(&pool, &drift[0].fix).await;
    assert!(capture::check(&mut conn).await.unwrap().is_empty());

    // What `pg_restore --disable-triggers` runs around its data, and the undo
    // it may not get to run: the undo makes the triggers ordinary ones again,
    // which writes under the replica role skip.
    exec(&pool, "ALTER TABLE orders DISABLE TRIGGER ALL").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 2, "the row trigger and the TRUNCATE guard: {drift:?}");
    assert!(drift.iter().all(|d| d.problem.contains("is disabled")), "{drift:?}");
    exec(&pool, "ALTER TABLE orders ENABLE TRIGGER ALL").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 2, "{drift:?}");
    for d in &drift {
        assert!(d.problem.contains("session_replication_role = replica"), "{d:?}");
        exec(&pool, &d.fix).await;
    }
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    assert_eq!(events(&pool).await.len(), 1);
}

#[tokio::test]
async fn changes_under_the_replica_role_are_captured() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    // As a logical replication apply worker, or a restore or ETL tool, runs.
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql(
        "SET LOCAL session_replication_role = replica;
         INSERT INTO orders (id, status) VALUES (1, 'new');
         UPDATE orders SET status = 'paid';
         DELETE FROM orders;",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(
        types,
        ["shop.order.created", "shop.order.updated", "shop.order.deleted"]
    );
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = sqlx::query("TRUNCATE orders").execute(&mut *tx).await.unwrap_err();
    assert!(err.to_string().contains("TRUNCATE of public.orders"), "{err}");
}

#[tokio::test]
async fn truncate_is_refused_while_the_table_captures_deletes() {
    let (_db, pool) = database(ORDERS).await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new'), (2, 'new')").await;
    let (message, hint) = refused(&pool, "TRUNCATE orders").await;
    assert_eq!(
        message,
        "ferry: TRUNCATE of public.orders would delete its rows without their shop.order.deleted events"
    );
    assert!(hint.contains("DELETE FROM public.orders"), "{hint}");
    assert!(hint.contains("ferry capture remove public.orders"), "{hint}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);

    // Without deletes captured, a TRUNCATE loses no event.
    capture::remove(&mut conn, "orders").await.unwrap();
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on([Operation::Insert, Operation::Update]),
    )
    .await
    .unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "TRUNCATE orders").await;
    capture::remove(&mut conn, "orders").await.unwrap();
    assert!(trigger_states(&pool).await.is_empty());
}

#[tokio::test]
async fn a_truncate_in_warn_mode_counts_each_row_as_a_dropped_event() {
    let (_db, pool) = database(ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    exec(
        &pool,
        "INSERT INTO orders (id, status) SELECT i, 'new' FROM generate_series(1, 3) i",
    )
    .await;
    exec(&pool, "TRUNCATE orders").await;
    exec(&pool, "TRUNCATE orders").await; // nothing left to lose
    let listed = capture::list(&mut pool.acquire().await.unwrap()).await.unwrap();
    assert_eq!(listed[0].dropped, 3);
    assert_eq!(
        listed[0].last_dropped_error.as_deref(),
        Some("TRUNCATE of public.orders deleted 3 rows without their shop.order.deleted events")
    );
    let gauges = ferry_store::Gauges::gauges(&PgStore::new(pool.clone())).await.unwrap();
    assert_eq!(gauges.capture_dropped, vec![("public.orders".to_owned(), 3)]);
}

#[tokio::test]
async fn every_partition_fires_always_and_is_guarded() {
    let (_db, pool) = database(
        "CREATE TABLE readings (device text NOT NULL, at date NOT NULL, value int) PARTITION BY RANGE (at);
         CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    add(&pool, CaptureSpec::new("readings", "iot.reading", "device"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE readings_2026 DISABLE TRIGGER ferry_capture").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.readings");
    assert!(
        drift[0].problem.contains("disabled on public.readings_2026"),
        "{drift:?}"
    );
    exec(&pool, &drift[0].fix).await;
    assert!(
        refused(&pool, "TRUNCATE readings_2026")
            .await
            .0
            .contains("readings_2026")
    );

    // Statement triggers are not cloned to a new partition: reported until
    // refreshed.
    exec(
        &pool,
        "CREATE TABLE readings_2027 PARTITION OF readings FOR VALUES FROM ('2027-01-01') TO ('2028-01-01')",
    )
    .await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert!(
        drift[0]
            .problem
            .contains("TRUNCATE guard is missing on public.readings_2027"),
        "{drift:?}"
    );
    assert_eq!(drift[0].fix, "ferry capture refresh public.readings");
    capture::refresh(&mut conn, Tables::All).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    refused(&pool, "TRUNCATE readings_2027").await;
    // Detached, a partition is no longer captured: nothing to guard.
    exec(&pool, "ALTER TABLE readings DETACH PARTITION readings_2027").await;
    exec(&pool, "TRUNCATE readings_2027").await;
}

#[tokio::test]
async fn tables_captured_before_the_upgrade_fire_always_and_are_guarded() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    // The schema as it was before the TRUNCATE guard.
    migrate_up_to(&pool, 12).await;
    exec(
        &pool,
        &format!("{ORDERS}; CREATE TABLE notes (id int PRIMARY KEY, body text)"),
    )
    .await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    add(&pool, CaptureSpec::new("notes", "crm.note", "id")).await.unwrap();
    // Disabled on purpose before the upgrade: the upgrade leaves it so.
    exec(&pool, "ALTER TABLE notes DISABLE TRIGGER ferry_capture").await;

    let mut conn = pool.acquire().await.unwrap();
    assert!(migrate(&mut conn).await.unwrap().contains(&13));
    let states = trigger_states(&pool).await;
    let state = |table: &str, trigger: &str| {
        states
            .iter()
            .find(|s| s.0 == table && s.1 == trigger)
            .map(|s| s.2.clone())
    };
    assert_eq!(state("orders", "ferry_capture").as_deref(), Some("A"), "{states:?}");
    assert_eq!(
        state("orders", "ferry_capture_truncate").as_deref(),
        Some("A"),
        "{states:?}"
    );
    assert_eq!(state("notes", "ferry_capture").as_deref(), Some("D"), "{states:?}");
    assert_eq!(
        state("notes", "ferry_capture_truncate").as_deref(),
        Some("A"),
        "{states:?}"
    );
    refused(&pool, "TRUNCATE orders").await;
    let drift = capture::check(&mut conn).await.unwrap();
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].table, "public.notes");
}

/// Upgrading from schema 11: 0012 locks `ferry.events` against producers
/// and 0013 alters each captured table. Applied in one transaction, the
/// events lock was held while 0013 waited for a transaction writing a
/// captured table, whose capture trigger then waited for the events lock: a
/// deadlock, in which PostgreSQL aborted the business write. Each migration
/// commits on its own, so the write waits only for 0012.
#[tokio::test]
async fn an_upgrade_does_not_deadlock_a_write_to_a_captured_table() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 11).await;
    exec(&pool, ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    let before = events(&pool).await.len();

    // A business transaction that has written to the table, but not yet a
    // captured row: it holds the table's lock, not the outbox's.
    let mut business = pool.begin().await.unwrap();
    sqlx::query("UPDATE orders SET status = status WHERE false")
        .execute(&mut *business)
        .await
        .unwrap();
    let upgrade = tokio::spawn({
        let pool = pool.clone();
        async move { migrate(&mut pool.acquire().await.unwrap()).await }
    });
    // The upgrade reaches 0013, waiting for the table.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'public.orders'::regclass",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upgrade never waited for the table"
        );
        assert!(!upgrade.is_finished(), "the upgrade finished: {:?}", upgrade.await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The business write now fires the capture trigger.
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 1")
        .execute(&mut *business)
        .await
        .expect("the captured write waits for no migration");
    business.commit().await.unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(30), upgrade)
        .await
        .expect("the upgrade finishes once the write commits")
        .unwrap()
        .unwrap();
    assert_eq!(applied.first(), Some(&12), "{applied:?}");
    let after = events(&pool).await;
    assert_eq!(after.len(), before + 1);
    assert_eq!(after.last().unwrap().event_type, "shop.order.updated");
}

/// Ferry's schema as migration `last` left it.
async fn migrate_up_to(pool: &PgPool, last: i32) {
    exec(
        pool,
        "CREATE SCHEMA ferry;
         CREATE TABLE ferry.schema_migrations (version int PRIMARY KEY, name text NOT NULL,
                                               applied_at timestamptz NOT NULL DEFAULT now());",
    )
    .await;
    for &(version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 <= last) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
        sqlx::query("INSERT INTO ferry.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Row triggers fire for the table a row is in, and a plain inheritance
/// child has none of its parent's: capturing the parent alone would let
/// writes to the child's rows pass with no event. Refused until the child
/// is captured; a child added later is reported.
#[tokio::test]
async fn an_inheritance_child_must_be_captured_before_its_parent() {
    let (_db, pool) = database(
        "CREATE TABLE items (id bigint NOT NULL, name text);
         CREATE TABLE gadgets (watts int) INHERITS (items);",
    )
    .await;
    let err = add(&pool, CaptureSpec::new("items", "shop.item", "id"))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("public.gadgets") && text.contains("no event"), "{text}");
    assert!(text.contains("ferry capture add public.gadgets"), "{text}");
    add(&pool, CaptureSpec::new("gadgets", "shop.gadget", "id"))
        .await
        .unwrap();
    add(&pool, CaptureSpec::new("items", "shop.item", "id")).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    // A write through the parent to a child's row reaches the child's trigger.
    exec(&pool, "INSERT INTO gadgets (id, name, watts) VALUES (1, 'lamp', 40)").await;
    exec(&pool, "UPDATE items SET name = 'desk lamp' WHERE id = 1").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(types, ["shop.gadget.created", "shop.gadget.updated"]);

    exec(&pool, "CREATE TABLE cables (metres int) INHERITS (items)").await;
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].table, "public.items");
    assert!(found[0].problem.contains("public.cables"), "{found:?}");
    assert!(found[0].fix.contains("ferry capture add public.cables"), "{found:?}");
}

/// A row whose key is NULL writes keyless events, which keep no order:
/// `ferry check` says so, with the statement that fixes it.
#[tokio::test]
async fn a_nullable_key_column_is_reported() {
    let (_db, pool) = database("CREATE TABLE notes (id bigint NOT NULL, author text, body text)").await;
    add(&pool, CaptureSpec::new("notes", "app.note", "author"))
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].problem.contains("author") && found[0].problem.contains("NULL"),
        "{found:?}"
    );
    exec(&pool, found[0].fix.split(", or ").next().unwrap()).await;
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// A table dropped after it was captured: `ferry check` reports it gone
/// and suggests removing the capture, which works. (A table renamed is
/// another matter: see `a_renamed_table_is_followed_and_its_trigger_never_dropped`.)
#[tokio::test]
async fn a_capture_of_a_dropped_table_can_be_removed() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "DROP TABLE orders").await;
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].problem, "the table no longer exists");
    assert_eq!(found[0].fix, "ferry capture remove public.orders");
    capture::remove(&mut conn, "public.orders").await.unwrap();
    assert!(capture::list(&mut conn).await.unwrap().is_empty());
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// Rows in `orders` now.
async fn order_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Changing a capture's spec was a remove then an add, each committed on
/// its own: a row inserted between the two commits had no event, no error
/// and no drop count. A replace is one transaction under the table's lock,
/// so writers inserting all along get one event for every row.
#[tokio::test]
async fn a_spec_replaced_while_writers_insert_loses_no_event() {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let next_id = Arc::new(AtomicI64::new(1));
    let writers: Vec<_> = (0..2)
        .map(|_| {
            let (pool, stop, next_id) = (pool.clone(), stop.clone(), next_id.clone());
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                while !stop.load(Ordering::Relaxed) {
                    sqlx::query("INSERT INTO orders (id, status, card_token) VALUES ($1, 'new', 'tok_secret')")
                        .bind(next_id.fetch_add(1, Ordering::Relaxed))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();

    let old = CaptureSpec::new("orders", "shop.order", "id");
    let new = CaptureSpec::new("orders", "shop.v2.order", "id").exclude(["card_token"]);
    let mut conn = pool.acquire().await.unwrap();
    for spec in [&new, &old, &new, &old, &new, &old, &new] {
        // Some rows under each spec, and writers busy at each replace.
        let until = order_rows(&pool).await + 25;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while order_rows(&pool).await < until {
            assert!(tokio::time::Instant::now() < deadline, "the writers stalled");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(capture::replace(&mut conn, spec).await.unwrap().table, "public.orders");
    }
    let until = order_rows(&pool).await + 25;
    while order_rows(&pool).await < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    let rows: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut per_row: HashMap<i64, Vec<String>> = HashMap::new();
    for e in events(&pool).await {
        per_row
            .entry(e.key.unwrap().parse().unwrap())
            .or_default()
            .push(e.event_type);
    }
    let missing: Vec<i64> = rows.iter().copied().filter(|id| !per_row.contains_key(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} rows have no event: {missing:?}",
        missing.len(),
        rows.len()
    );
    assert_eq!(per_row.len(), rows.len(), "an event for a row that is not there");
    for (id, types) in &per_row {
        assert!(
            types.len() == 1 && types[0].ends_with(".created"),
            "row {id}: {types:?}"
        );
    }
    // Both specs wrote events, and the last one holds now.
    let prefixes: std::collections::HashSet<&str> = per_row.values().map(|t| t[0].as_str()).collect();
    assert_eq!(prefixes.len(), 2, "{prefixes:?}");
    let listed = capture::list(&mut conn).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].type_prefix, "shop.v2.order");
    assert_eq!(listed[0].exclude, ["card_token"]);
    exec(
        &pool,
        "INSERT INTO orders (id, status, card_token) VALUES (0, 'new', 'tok_secret')",
    )
    .await;
    let last = events(&pool).await.pop().unwrap();
    assert_eq!(last.event_type, "shop.v2.order.created");
    assert_eq!(last.key.as_deref(), Some("0"));
    assert!(last.payload["data"].get("card_token").is_none(), "{:?}", last.payload);
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// A replace checks the new spec as an add does and leaves the old one in
/// place when it refuses; it keeps the table's dropped-event count, and
/// needs a table already captured. An add of a captured table points at it.
#[tokio::test]
async fn a_replace_keeps_the_capture_when_refused_and_the_dropped_count() {
    let (_db, pool) = database(&format!(
        "{ORDERS}; CREATE TABLE visits (id bigint PRIMARY KEY, page text)"
    ))
    .await;
    let mut conn = pool.acquire().await.unwrap();
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    exec(&pool, HUGE_INSERT).await;

    let again = add(&pool, CaptureSpec::new("orders", "shop.v2.order", "id")).await;
    match &again {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("already captured"), "{message}");
            assert!(hint.contains("`ferry capture add public.orders --replace`"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    let bad = capture::replace(&mut conn, &CaptureSpec::new("orders", "Shop", "id")).await;
    assert!(
        matches!(&bad, Err(CaptureError::Invalid { message, .. }) if message.contains("type prefix 'Shop'")),
        "{bad:?}"
    );
    let listed = capture::list(&mut conn).await.unwrap();
    assert_eq!(
        (listed[0].type_prefix.as_str(), listed[0].on_error.as_str()),
        ("shop.order", "warn")
    );
    exec(&pool, "INSERT INTO orders (id, status) VALUES (2, 'new')").await;
    assert_eq!(events(&pool).await.last().unwrap().event_type, "shop.order.created");

    capture::replace(&mut conn, &CaptureSpec::new("orders", "shop.v2.order", "id"))
        .await
        .unwrap();
    let listed = capture::list(&mut conn).await.unwrap();
    assert_eq!(
        (listed[0].type_prefix.as_str(), listed[0].on_error.as_str()),
        ("shop.v2.order", "fail")
    );
    assert_eq!(listed[0].dropped, 1, "the drop warn mode made is still shown");

    match capture::replace(&mut conn, &CaptureSpec::new("visits", "web.visit", "id")).await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("public.visits: not captured"), "{message}");
            assert!(hint.contains("without --replace"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(capture::list(&mut conn).await.unwrap().len(), 1);
}

const READINGS: &str =
    "CREATE TABLE readings (device text NOT NULL, at date NOT NULL, value int) PARTITION BY RANGE (at);
     CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
     CREATE TABLE readings_2027 PARTITION OF readings FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');";

/// A row moved to another partition reaches triggers as a DELETE and an
/// INSERT. Captured for deletes alone, the move sent `.deleted` for a row
/// that still exists; for inserts alone, `.created` for one that already
/// existed; for both, deleted and created though updates were not asked
/// for. A partitioned table is captured for all three or not at all, and
/// one captured otherwise before the upgrade is reported, with the replace
/// that fixes it.
#[tokio::test]
async fn a_partitioned_table_is_captured_for_every_operation_or_reported() {
    let (_db, pool) = database(READINGS).await;
    for (table, ops, sends) in [
        (
            "readings",
            vec![Operation::Delete],
            "a deleted event for a row that still exists",
        ),
        (
            "readings_2026",
            vec![Operation::Insert],
            "a created event for a row that already existed",
        ),
        (
            "readings",
            vec![Operation::Insert, Operation::Delete],
            "a deleted and a created event",
        ),
    ] {
        match add(&pool, CaptureSpec::new(table, "iot.reading", "device").on(ops.clone())).await {
            Err(CaptureError::Invalid { message, hint }) => {
                assert!(message.contains("moves a row to another partition"), "{message}");
                assert!(message.contains(sends), "{message}");
                assert!(hint.contains("--on insert,update,delete"), "{hint}");
            }
            other => panic!("{table} {ops:?}: {other:?}"),
        }
    }
    assert!(
        capture::list(&mut pool.acquire().await.unwrap())
            .await
            .unwrap()
            .is_empty()
    );

    // Captured for deletes alone before the upgrade: a move is a `.deleted`
    // for a row that is still there.
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 23).await;
    exec(&pool, READINGS).await;
    add(
        &pool,
        CaptureSpec::new("readings", "iot.reading", "device")
            .exclude(["value"])
            .on([Operation::Delete]),
    )
    .await
    .unwrap();
    exec(&pool, "INSERT INTO readings VALUES ('d1', '2026-03-01', 5)").await;
    exec(&pool, "UPDATE readings SET at = '2027-03-01'").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(types, ["iot.reading.deleted"], "the row is still there");

    let mut conn = pool.acquire().await.unwrap();
    assert!(migrate(&mut conn).await.unwrap().contains(&24));
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].table, "public.readings");
    assert!(
        found[0].problem.contains("captured for delete only")
            && found[0].problem.contains("a deleted event for a row that still exists"),
        "{found:?}"
    );
    assert_eq!(
        found[0].fix,
        "ferry capture add public.readings --replace --type-prefix iot.reading --key device \
         --exclude value --on insert,update,delete"
    );
    capture::replace(
        &mut conn,
        &CaptureSpec::new("readings", "iot.reading", "device").exclude(["value"]),
    )
    .await
    .unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "UPDATE readings SET at = '2026-03-01'").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(
        types,
        ["iot.reading.deleted", "iot.reading.deleted", "iot.reading.created"]
    );
}

/// Partitioned so that a soft delete moves the row: the soft delete
/// reached the triggers as a DELETE and an INSERT and arrived as `.deleted`
/// then `.created`, the row alive again. A trigger cannot tell that move
/// from a delete and an insert, so a partitioned table takes no
/// soft-delete column, and one captured with it before the upgrade is
/// reported.
#[tokio::test]
async fn a_partitioned_table_takes_no_soft_delete_column() {
    const ACCOUNTS: &str = "CREATE TABLE accounts (id bigint NOT NULL, name text, deleted_at timestamptz)
                                PARTITION BY LIST ((deleted_at IS NULL));
                            CREATE TABLE accounts_live PARTITION OF accounts FOR VALUES IN (true);
                            CREATE TABLE accounts_gone PARTITION OF accounts FOR VALUES IN (false);";
    let (_db, pool) = database(ACCOUNTS).await;
    for table in ["accounts", "accounts_live"] {
        match add(
            &pool,
            CaptureSpec::new(table, "crm.account", "id").soft_delete("deleted_at"),
        )
        .await
        {
            Err(CaptureError::Invalid { message, hint }) => {
                assert!(message.contains("soft-delete column deleted_at"), "{message}");
                assert!(message.contains("alive again"), "{message}");
                assert!(hint.contains("leave out --soft-delete"), "{hint}");
            }
            other => panic!("{table}: {other:?}"),
        }
    }

    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 23).await;
    exec(&pool, ACCOUNTS).await;
    add(
        &pool,
        CaptureSpec::new("accounts", "crm.account", "id").soft_delete("deleted_at"),
    )
    .await
    .unwrap();
    exec(&pool, "INSERT INTO accounts (id, name) VALUES (1, 'ada')").await;
    exec(&pool, "UPDATE accounts SET deleted_at = now() WHERE id = 1").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(
        types,
        ["crm.account.created", "crm.account.deleted", "crm.account.created"],
        "the soft-deleted row arrived alive again"
    );

    let mut conn = pool.acquire().await.unwrap();
    assert!(migrate(&mut conn).await.unwrap().contains(&24));
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].problem.contains("soft-delete column deleted_at") && found[0].problem.contains("alive again"),
        "{found:?}"
    );
    assert_eq!(
        found[0].fix,
        "ferry capture add public.accounts --replace --type-prefix crm.account --key id \
         --on insert,update,delete"
    );
    capture::replace(&mut conn, &CaptureSpec::new("accounts", "crm.account", "id"))
        .await
        .unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// Two producers of one table, each holding one customer's key lock and
/// then writing the other's: PostgreSQL ends the deadlock by failing one
/// of the two writes. Returns the error code of the write that failed, or
/// `None` when both went through, after rolling the failed one back and
/// committing the other.
async fn two_writers_deadlock_on_their_keys(pool: &PgPool) -> Option<String> {
    let buckets: (i32, i32) = sqlx::query_as("SELECT hashtext('ada') & 1023, hashtext('bob') & 1023")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_ne!(buckets.0, buckets.1, "the two keys must take different locks");
    let mut first = pool.begin().await.unwrap();
    let mut second = pool.begin().await.unwrap();
    exec_in(&mut first, "INSERT INTO accounts (id, customer) VALUES (1, 'ada')").await;
    exec_in(&mut second, "INSERT INTO accounts (id, customer) VALUES (2, 'bob')").await;
    let waiting = tokio::spawn(async move {
        let r = sqlx::query("INSERT INTO accounts (id, customer) VALUES (3, 'bob')")
            .execute(&mut *first)
            .await;
        (first, r)
    });
    // The first writer waits for bob's lock before the second asks for ada's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second_result = sqlx::query("INSERT INTO accounts (id, customer) VALUES (4, 'ada')")
        .execute(&mut *second)
        .await;
    let code = |e: sqlx::Error| e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
    match second_result {
        Err(e) => {
            let code = code(e);
            second.rollback().await.unwrap();
            let (first, r) = waiting.await.unwrap();
            r.unwrap();
            first.commit().await.unwrap();
            code
        }
        Ok(_) => {
            let (first, r) = waiting.await.unwrap();
            match r {
                Err(e) => {
                    first.rollback().await.unwrap();
                    second.commit().await.unwrap();
                    code(e)
                }
                Ok(_) => {
                    first.commit().await.unwrap();
                    second.commit().await.unwrap();
                    None
                }
            }
        }
    }
}

async fn exec_in(tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, sql: &str) {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut **tx)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

const ACCOUNTS_BY_CUSTOMER: &str = "CREATE TABLE accounts (id bigint PRIMARY KEY, customer text NOT NULL)";

/// Every committed row has its event, and warn mode counted no drop.
async fn each_row_has_its_event(pool: &PgPool) {
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "one writer's transaction committed");
    let got = events(pool).await;
    assert_eq!(got.len(), 2, "a committed row without its event: {got:?}");
    let listed = capture::list(&mut pool.acquire().await.unwrap()).await.unwrap();
    let accounts = listed.iter().find(|c| c.table == "public.accounts").unwrap();
    assert_eq!(accounts.dropped, 0, "{listed:?}");
}

/// Warn mode drops an event that cannot be written, but a deadlock on the
/// key's lock says the transaction must be retried, not that the event is
/// bad: caught, the write committed without its event, which the
/// application's retry would have written. It fails the statement, as it
/// would without the capture.
#[tokio::test]
async fn warn_mode_fails_a_deadlocked_write_instead_of_dropping_its_event() {
    let (_db, pool) = database(ACCOUNTS_BY_CUSTOMER).await;
    add(
        &pool,
        CaptureSpec::new("accounts", "crm.account", "customer").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    let code = two_writers_deadlock_on_their_keys(&pool).await;
    assert_eq!(code.as_deref(), Some("40P01"), "the deadlock must fail one write");
    each_row_has_its_event(&pool).await;

    // An event that cannot be written is still dropped and counted.
    exec(
        &pool,
        "INSERT INTO accounts (id, customer) VALUES (9, repeat('x', 1100000))",
    )
    .await;
    let listed = capture::list(&mut pool.acquire().await.unwrap()).await.unwrap();
    assert_eq!(listed[0].dropped, 1, "{listed:?}");
}

/// Schema 27 mends the warn-mode triggers made before it in place: the
/// same handler a new install writes, nothing else changed; a fail-mode
/// trigger is left as it was.
#[tokio::test]
async fn the_upgrade_mends_existing_warn_mode_triggers() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 26).await;
    exec(&pool, ACCOUNTS_BY_CUSTOMER).await;
    exec(&pool, ORDERS).await;
    add(
        &pool,
        CaptureSpec::new("accounts", "crm.account", "customer").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let orders_before = trigger_source(&pool, "orders").await;
    assert!(!trigger_source(&pool, "accounts").await.contains("transaction_rollback"));

    let mut conn = pool.acquire().await.unwrap();
    assert!(migrate(&mut conn).await.unwrap().contains(&27));
    drop(conn);
    let mended = trigger_source(&pool, "accounts").await;
    assert!(mended.contains("transaction_rollback"), "{mended}");
    assert_eq!(
        trigger_source(&pool, "orders").await,
        orders_before,
        "a fail-mode trigger is left as it was"
    );
    let code = two_writers_deadlock_on_their_keys(&pool).await;
    assert_eq!(code.as_deref(), Some("40P01"), "the deadlock must fail one write");
    each_row_has_its_event(&pool).await;

    // What the migration wrote is what an install writes now.
    exec(
        &pool,
        "SELECT ferry.capture_install_rows(id) FROM ferry.captures WHERE table_name = 'accounts'",
    )
    .await;
    assert_eq!(trigger_source(&pool, "accounts").await, mended);
}

/// Whether a trigger named `ferry_capture` is on `table`.
async fn has_capture_trigger(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = 'ferry_capture')",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The `table` header of the last event.
async fn last_table_header(pool: &PgPool) -> Value {
    events(pool).await.pop().unwrap().headers["table"].clone()
}

/// A table renamed after it was captured keeps its trigger, whose events
/// still named the old table. `ferry check` said the table was gone and
/// gave a remove as the fix, and that remove dropped the trigger on the
/// renamed table with a NOTICE only: its later changes sent no event. Now
/// check reports the rename with a refresh, which follows it, and a remove
/// by the old name refuses, naming where the trigger is and what to run.
#[tokio::test]
async fn a_renamed_table_is_followed_and_its_trigger_never_dropped() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE orders RENAME TO orders_v2").await;
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].table, "public.orders");
    assert!(
        found[0].problem.contains("renamed") && found[0].problem.contains("public.orders_v2"),
        "{found:?}"
    );
    assert_eq!(found[0].fix, "ferry capture refresh public.orders");

    match capture::remove(&mut conn, "public.orders").await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("public.orders_v2"), "{message}");
            assert!(
                hint.contains("`ferry capture refresh public.orders`")
                    && hint.contains("`ferry capture remove public.orders_v2`"),
                "{hint}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        has_capture_trigger(&pool, "orders_v2").await,
        "the remove dropped the trigger"
    );
    exec(&pool, "INSERT INTO orders_v2 (id, status) VALUES (1, 'new')").await;
    assert_eq!(events(&pool).await.len(), 1);

    // The fix, as check gave it: the capture follows the rename.
    let done = capture::refresh(&mut conn, Tables::One("public.orders")).await.unwrap();
    assert_eq!(done, ["public.orders_v2"]);
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    assert_eq!(capture::list(&mut conn).await.unwrap()[0].table, "public.orders_v2");
    exec(&pool, "UPDATE orders_v2 SET status = 'paid' WHERE id = 1").await;
    let last = events(&pool).await.pop().unwrap();
    assert_eq!(last.event_type, "shop.order.updated");
    assert_eq!(last.headers["table"], "public.orders_v2");

    // By its new name it is removed, triggers and all.
    capture::remove(&mut conn, "orders_v2").await.unwrap();
    assert!(!has_capture_trigger(&pool, "orders_v2").await);
}

/// `ALTER TABLE ... SET SCHEMA` is a rename too. Refreshing every table
/// follows it, with the table's dropped-event count, and goes on past a
/// table that is gone instead of stopping there.
#[tokio::test]
async fn a_table_moved_to_another_schema_is_followed_by_a_refresh_of_all() {
    let (_db, pool) = database(&format!(
        "{ORDERS}; CREATE TABLE visits (id bigint PRIMARY KEY, page text);
         CREATE TABLE notes (id bigint PRIMARY KEY, body text); CREATE SCHEMA archive;"
    ))
    .await;
    add(
        &pool,
        CaptureSpec::new("orders", "shop.order", "id").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    add(&pool, CaptureSpec::new("visits", "web.visit", "id")).await.unwrap();
    add(&pool, CaptureSpec::new("notes", "app.note", "id")).await.unwrap();
    exec(&pool, HUGE_INSERT).await; // a drop, counted for public.orders
    exec(&pool, "ALTER TABLE orders SET SCHEMA archive").await;
    exec(&pool, "DROP TABLE notes").await;
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    let moved = found.iter().find(|d| d.table == "public.orders").unwrap();
    assert!(moved.problem.contains("archive.orders"), "{found:?}");
    assert_eq!(moved.fix, "ferry capture refresh public.orders");

    let done = capture::refresh(&mut conn, Tables::All).await.unwrap();
    assert_eq!(done, ["archive.orders", "public.visits"]);
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].table.as_str(), found[0].fix.as_str()),
        ("public.notes", "ferry capture remove public.notes")
    );
    let listed = capture::list(&mut conn).await.unwrap();
    let orders = listed.iter().find(|c| c.table == "archive.orders").unwrap();
    assert_eq!(orders.dropped, 1, "the drop count went with the table");

    exec(&pool, "INSERT INTO archive.orders (id, status) VALUES (2, 'new')").await;
    assert_eq!(last_table_header(&pool).await, "archive.orders");
    capture::remove(&mut conn, "public.notes").await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
}

/// A table renamed, then a new one made under the old name: the capture's
/// trigger is missing on the new table and still fires on the old one.
/// Both are reported; a remove by the name refuses to drop the trigger on
/// the other table, until that table is decided for.
#[tokio::test]
async fn a_trigger_left_on_a_table_renamed_away_is_reported_and_kept() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE orders RENAME TO orders_old").await;
    exec(&pool, ORDERS).await;
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].problem.contains("also fires on public.orders_old"),
        "{found:?}"
    );
    assert!(
        found[0]
            .fix
            .starts_with("DROP TRIGGER ferry_capture ON public.orders_old"),
        "{found:?}"
    );
    assert_eq!(found[1].problem, "its trigger is missing");

    match capture::remove(&mut conn, "orders").await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("public.orders_old"), "{message}");
            assert!(
                hint.contains("DROP TRIGGER ferry_capture ON public.orders_old"),
                "{hint}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        has_capture_trigger(&pool, "orders_old").await,
        "the remove dropped the trigger"
    );

    exec(&pool, "DROP TRIGGER ferry_capture ON public.orders_old").await;
    capture::refresh(&mut conn, Tables::One("orders")).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    assert_eq!(last_table_header(&pool).await, "public.orders");
    capture::remove(&mut conn, "orders").await.unwrap();
}

/// With the soft-delete column excluded, setting it back to NULL (an
/// undelete) changed no tracked column and sent nothing: consumers kept
/// the row deleted. Refused now, by an add and a replace; a capture so
/// made before the upgrade is reported, with the replace that fixes it.
#[tokio::test]
async fn a_soft_delete_column_cannot_be_excluded() {
    let (_db, pool) = database(ORDERS).await;
    let spec = CaptureSpec::new("orders", "shop.order", "id")
        .exclude(["deleted_at"])
        .soft_delete("deleted_at");
    match add(&pool, spec.clone()).await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(
                message.contains("soft-delete column 'deleted_at' is also excluded"),
                "{message}"
            );
            assert!(hint.contains("--exclude") && hint.contains("--soft-delete"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let refused = capture::replace(&mut conn, &spec).await;
    assert!(
        matches!(&refused, Err(CaptureError::Invalid { message, .. }) if message.contains("also excluded")),
        "{refused:?}"
    );
    assert!(capture::list(&mut conn).await.unwrap()[0].soft_delete.is_none());
}

#[tokio::test]
async fn a_soft_delete_column_excluded_before_the_upgrade_is_reported() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 27).await;
    exec(&pool, ORDERS).await;
    exec(
        &pool,
        "SELECT ferry.capture_add('orders', 'shop.order', 'id', '{card_token,deleted_at}', 'deleted_at',
                                  '{insert,update,delete}', 'fail')",
    )
    .await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].problem.contains("undelete"), "{found:?}");
    assert_eq!(
        found[0].fix,
        "ferry capture add public.orders --replace --type-prefix shop.order --key id --exclude card_token \
         --soft-delete deleted_at --on insert,update,delete"
    );

    let fixed = CaptureSpec::new("orders", "shop.order", "id")
        .exclude(["card_token"])
        .soft_delete("deleted_at");
    capture::replace(&mut conn, &fixed).await.unwrap();
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "INSERT INTO orders (id, status) VALUES (1, 'new')").await;
    exec(&pool, "UPDATE orders SET deleted_at = now() WHERE id = 1").await;
    exec(&pool, "UPDATE orders SET deleted_at = NULL WHERE id = 1").await;
    let types: Vec<String> = events(&pool).await.into_iter().map(|e| e.event_type).collect();
    assert_eq!(
        types,
        ["shop.order.created", "shop.order.deleted", "shop.order.updated"]
    );
}

/// A replace that changes the key column puts a row's unpublished events
/// and its later ones under two keys, which keep no order between them:
/// the replace counts the events still waiting, so that the command can
/// say so. The same key, or nothing waiting, counts nothing.
#[tokio::test]
async fn a_replace_that_changes_the_key_counts_the_events_still_unpublished() {
    let (_db, pool) = database(ORDERS).await;
    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(
        &pool,
        "INSERT INTO orders (id, status) VALUES (1, 'new'), (2, 'new');
         SELECT ferry.enqueue('shop.order.note', '1', '{}')",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let same_key = capture::replace(&mut conn, &CaptureSpec::new("orders", "shop.v2.order", "id"))
        .await
        .unwrap();
    assert_eq!(same_key.key_change, None);

    let replaced = capture::replace(&mut conn, &CaptureSpec::new("orders", "shop.order", "status"))
        .await
        .unwrap();
    let change = replaced.key_change.unwrap();
    assert_eq!(
        (change.from.as_str(), change.type_prefix.as_str()),
        ("id", "shop.v2.order")
    );
    assert_eq!(change.unpublished, 0, "no shop.v2.order event was written");
    let replaced = capture::replace(&mut conn, &CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    let change = replaced.key_change.unwrap();
    assert_eq!(
        (change.from.as_str(), change.type_prefix.as_str()),
        ("status", "shop.order")
    );
    assert_eq!(change.unpublished, 2, "the two created events, not the other type");

    // Published, an event no longer counts; dead, it does.
    let seqs: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM ferry.events WHERE type = 'shop.order.created' ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    exec(
        &pool,
        &format!(
            "DELETE FROM ferry.unrouted WHERE seq IN ({0}, {1});
             INSERT INTO ferry.deliveries (seq, route, partition, key, state)
             VALUES ({0}, 'orders', 0, '1', 'published'), ({1}, 'orders', 0, '2', 'dead')",
            seqs[0], seqs[1]
        ),
    )
    .await;
    let replaced = capture::replace(&mut conn, &CaptureSpec::new("orders", "shop.order", "status"))
        .await
        .unwrap();
    assert_eq!(replaced.key_change.unwrap().unpublished, 1);
}

/// Each event's payload as the bytes the outbox stores, as text.
async fn payload_texts(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT convert_from(payload, 'UTF8') FROM ferry.events ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

const MEASURES: &str = "CREATE TABLE measures (id bigint PRIMARY KEY, f float8)";

/// jsonb takes a float as the session prints it: under extra_float_digits
/// <= 0 the trigger saw 0.1 and 0.10000000000000003 as one value, and the
/// update wrote no event, in fail mode too.
#[tokio::test]
async fn an_update_of_a_float_writes_its_event_whatever_the_writers_float_digits() {
    let (_db, pool) = database(MEASURES).await;
    add(&pool, CaptureSpec::new("measures", "lab.measure", "id"))
        .await
        .unwrap();
    exec(&pool, "INSERT INTO measures VALUES (1, 0.1)").await;
    exec_in_session(
        &pool,
        "SET extra_float_digits = 0",
        "UPDATE measures SET f = 0.10000000000000003 WHERE id = 1;
         INSERT INTO measures VALUES (2, 0.1::float8 + 0.2)",
    )
    .await;
    assert_eq!(
        payload_texts(&pool).await,
        [
            r#"{"data": {"f": 0.1, "id": 1}}"#,
            r#"{"data": {"f": 0.10000000000000003, "id": 1}, "previous": {"f": 0.1}}"#,
            r#"{"data": {"f": 0.30000000000000004, "id": 2}}"#,
        ]
    );
}

const SAMPLES: &str = "CREATE TABLE samples (id bigint PRIMARY KEY, at timestamptz, span interval, body bytea,
                                              f8 float8, f4 real, price money, during tstzrange, days daterange,
                                              pos point, ats timestamptz[], day date, n numeric)";

const SAMPLE_ROW: &str = "INSERT INTO samples VALUES (1, '2026-01-01 12:00:00+00', '1 day 02:00:00', 'x',
    0.1::float8 + 0.2, 0.1, 1.5, tstzrange('2026-01-01 12:00+00', '2026-01-02 12:00+00'),
    daterange('2026-03-04', '2026-03-05'), point(0.1, 0.1::float8 + 0.2),
    ARRAY['2026-01-01 12:00:00+00'::timestamptz], '2026-03-04', 1.50)";

/// A row's payload is the same bytes whatever the settings of the session
/// that writes it, in the form the key has (schema 14): UTC, hex bytea,
/// exact floats, postgres intervals, ISO dates in ranges.
#[tokio::test]
async fn a_payload_is_the_same_bytes_whatever_the_writers_session_settings() {
    let (_db, pool) = database(SAMPLES).await;
    add(&pool, CaptureSpec::new("samples", "lab.sample", "id"))
        .await
        .unwrap();
    let india = "SET TimeZone = 'Asia/Kolkata'; SET extra_float_digits = 0; SET bytea_output = 'escape';
                 SET IntervalStyle = 'sql_standard'; SET DateStyle = 'German, DMY'";
    for settings in [LOCAL, UTC, india] {
        exec_in_session(&pool, settings, SAMPLE_ROW).await;
        exec_in_session(&pool, settings, "DELETE FROM samples").await;
    }
    let texts = payload_texts(&pool).await;
    assert_eq!(texts.len(), 6);
    for text in &texts[1..] {
        assert_eq!(text, &texts[0]);
    }
    let data = &serde_json::from_str::<Value>(&texts[0]).unwrap()["data"];
    assert_eq!(
        data,
        &json!({
            "id": 1, "at": "2026-01-01T12:00:00+00:00", "span": "1 day 02:00:00", "body": "\\x78",
            "f8": 0.30000000000000004, "f4": 0.1, "price": "$1.50",
            "during": "[\"2026-01-01 12:00:00+00\",\"2026-01-02 12:00:00+00\")",
            "days": "[2026-03-04,2026-03-05)", "pos": "(0.1,0.30000000000000004)",
            "ats": ["2026-01-01T12:00:00+00:00"], "day": "2026-03-04", "n": 1.50
        })
    );
    assert!(texts[0].contains("0.30000000000000004"), "{}", texts[0]);
}

/// The source text of a table's capture trigger function.
async fn trigger_source(pool: &PgPool, table: &str) -> String {
    sqlx::query_scalar(
        "SELECT p.prosrc FROM ferry.captures k
           JOIN pg_proc p ON p.pronamespace = 'ferry'::regnamespace AND p.proname = 'capture_' || k.id
          WHERE k.table_name = $1",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The settings of a trigger function: what `ALTER FUNCTION ... SET` gave it.
async fn trigger_settings(pool: &PgPool, table: &str) -> Option<Vec<String>> {
    sqlx::query_scalar(
        "SELECT p.proconfig::text[] FROM ferry.captures k
           JOIN pg_proc p ON p.pronamespace = 'ferry'::regnamespace AND p.proname = 'capture_' || k.id
          WHERE k.table_name = $1",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Applies the migrations after `after` up to `last`, as `migrate` would.
async fn migrate_from_to(pool: &PgPool, after: i32, last: i32) {
    for &(version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 > after && m.0 <= last) {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
        sqlx::query("INSERT INTO ferry.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Schema 27 gives the triggers made before it the settings, their text
/// untouched, but for a trigger that still writes its key as each session
/// prints it (made before schema 14): its keys would change text in the
/// upgrade, which is left to the operator's refresh. The settings are what
/// an install gives.
#[tokio::test]
async fn the_upgrade_renders_existing_triggers_under_the_fixed_settings() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate_up_to(&pool, 13).await;
    exec(&pool, "CREATE TABLE visits (at timestamptz PRIMARY KEY, n int)").await;
    add(&pool, CaptureSpec::new("visits", "web.visit", "at")).await.unwrap();
    migrate_from_to(&pool, 13, 26).await;
    exec(&pool, MEASURES).await;
    exec(&pool, ACCOUNTS_BY_CUSTOMER).await;
    add(&pool, CaptureSpec::new("measures", "lab.measure", "id"))
        .await
        .unwrap();
    add(
        &pool,
        CaptureSpec::new("accounts", "crm.account", "customer").on_error(OnError::Warn),
    )
    .await
    .unwrap();
    let measures_before = trigger_source(&pool, "measures").await;
    assert_eq!(trigger_settings(&pool, "measures").await, None);
    exec(&pool, "INSERT INTO measures VALUES (1, 0.1)").await;

    let mut conn = pool.acquire().await.unwrap();
    assert!(migrate(&mut conn).await.unwrap().contains(&27));
    drop(conn);
    let fixed: Vec<String> = sqlx::query_scalar("SELECT unnest(ferry.capture_settings())")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(fixed.contains(&"TimeZone=UTC".to_owned()), "{fixed:?}");
    for table in ["measures", "accounts"] {
        assert_eq!(trigger_settings(&pool, table).await.as_ref(), Some(&fixed), "{table}");
    }
    assert_eq!(
        trigger_source(&pool, "measures").await,
        measures_before,
        "the text is left as it was"
    );
    assert_eq!(
        trigger_settings(&pool, "visits").await,
        None,
        "a key written per session keeps its text until refreshed"
    );
    exec_in_session(
        &pool,
        "SET extra_float_digits = 0",
        "UPDATE measures SET f = 0.10000000000000003",
    )
    .await;
    assert_eq!(
        payload_texts(&pool).await.last().unwrap(),
        r#"{"data": {"f": 0.10000000000000003, "id": 1}, "previous": {"f": 0.1}}"#
    );

    // What the migration set is what an install sets now; the refresh
    // ferry check asks for gives the old trigger its settings too.
    exec(
        &pool,
        "SELECT ferry.capture_install_rows(id) FROM ferry.captures WHERE table_name IN ('measures', 'accounts')",
    )
    .await;
    for table in ["measures", "accounts"] {
        assert_eq!(trigger_settings(&pool, table).await.as_ref(), Some(&fixed), "{table}");
    }
    let mut conn = pool.acquire().await.unwrap();
    capture::refresh(&mut conn, Tables::One("public.visits")).await.unwrap();
    assert_eq!(trigger_settings(&pool, "visits").await.as_ref(), Some(&fixed));
}

/// The message and hint of a statement's error, written as `role` when
/// given.
async fn refused_as(pool: &PgPool, role: Option<&str>, sql: &str) -> (String, String) {
    let mut tx = pool.begin().await.unwrap();
    if let Some(role) = role {
        exec_in(&mut tx, &format!("SET LOCAL ROLE {role}")).await;
    }
    let err = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut *tx)
        .await
        .expect_err(sql);
    tx.rollback().await.unwrap();
    let db = err.as_database_error().unwrap_or_else(|| panic!("{sql}: {err}"));
    let hint = db.try_downcast_ref::<PgDatabaseError>().and_then(PgDatabaseError::hint);
    (db.message().to_owned(), hint.unwrap_or_default().to_owned())
}

const DOCS: &str = "CREATE TABLE docs (id bigint PRIMARY KEY, title text, body text, notes text)";

/// An update carries a changed column twice, in data and in previous: a
/// row with a 600 KB column goes in, but its update is over the 1 MiB
/// payload limit. The error names the table and the column, and gives the
/// replace that keeps the column out of the events, also for a writer with
/// the producer grants alone, who may not read the capture's spec.
#[tokio::test]
async fn an_event_over_the_payload_limit_names_the_column_to_exclude() {
    let (db, pool) = database(DOCS).await;
    add(&pool, CaptureSpec::new("docs", "cms.doc", "id").exclude(["notes"]))
        .await
        .unwrap();
    exec(&pool, "INSERT INTO docs VALUES (1, 'a', repeat('x', 600000), 'n')").await;
    let role = format!("{}_writer", db.name());
    exec(
        &pool,
        &format!(
            "CREATE ROLE {role} NOLOGIN;
             GRANT SELECT, INSERT, UPDATE ON docs TO {role};
             GRANT USAGE ON SCHEMA ferry TO {role};
             GRANT SELECT, INSERT ON ferry.events, ferry.unrouted TO {role};
             GRANT SELECT ON ferry.relays TO {role};
             GRANT SELECT ON ferry.wal_slots TO {role};
             GRANT SELECT, INSERT, UPDATE ON ferry.capture_dropped TO {role};"
        ),
    )
    .await;
    let update = "UPDATE docs SET body = repeat('y', 600000) WHERE id = 1";
    let fix = concat!(
        "ferry capture add public.docs --replace --type-prefix cms.doc --key id ",
        "--exclude notes --exclude body --on insert,update,delete"
    );
    for writer in [None, Some(role.as_str())] {
        let (message, hint) = refused_as(&pool, writer, update).await;
        assert!(
            message.starts_with("ferry: capture of public.docs: invalid event payload: 1200"),
            "{message}"
        );
        assert!(message.contains("the column body takes 1200"), "{message}");
        assert!(message.contains("in data and in previous"), "{message}");
        assert!(hint.contains(&format!("`{fix}`")), "{hint}");
    }

    // No column enough alone: as many as it takes are named, larger first.
    exec(
        &pool,
        "CREATE TABLE pages (id bigint PRIMARY KEY, a text, b text, c text, d text)",
    )
    .await;
    add(&pool, CaptureSpec::new("pages", "cms.page", "id")).await.unwrap();
    let (message, hint) = refused(
        &pool,
        "INSERT INTO pages VALUES (1, repeat('a', 350000), repeat('b', 350000), repeat('c', 350000), repeat('d', 350000))",
    )
    .await;
    assert!(message.contains("the columns a, b take 700018 bytes"), "{message}");
    assert!(!message.contains("in previous"), "{message}");
    assert!(hint.contains("--key id --exclude a --exclude b --on"), "{hint}");

    // Nothing a capture may leave out brings it under: the soft-delete
    // column (the key is refused first, over 512 bytes).
    exec(&pool, "CREATE TABLE tags (id bigint PRIMARY KEY, gone text)").await;
    add(&pool, CaptureSpec::new("tags", "cms.tag", "id").soft_delete("gone"))
        .await
        .unwrap();
    let (message, hint) = refused(&pool, "INSERT INTO tags VALUES (1, repeat('g', 1100000))").await;
    assert!(
        message.contains("capture of public.tags: invalid event payload"),
        "{message}"
    );
    assert!(
        message.contains("(all but the key column and the soft-delete column)"),
        "{message}"
    );
    assert!(hint.contains("another table"), "{hint}");

    // The replace the hint gives lets such an update through, its event
    // without the column.
    let mut conn = pool.acquire().await.unwrap();
    capture::replace(
        &mut conn,
        &CaptureSpec::new("docs", "cms.doc", "id").exclude(["notes", "body"]),
    )
    .await
    .unwrap();
    exec(
        &pool,
        "UPDATE docs SET body = repeat('y', 600000), title = 'b' WHERE id = 1",
    )
    .await;
    assert_eq!(
        payload_texts(&pool).await.pop().unwrap(),
        r#"{"data": {"id": 1, "title": "b"}, "previous": {"title": "a"}}"#
    );
    drop(conn);
    exec(&pool, &format!("DROP OWNED BY {role}; DROP ROLE {role};")).await;
}

/// A table renamed away and a new one made under the old name: the
/// refresh of that name regenerated the capture's one function from the
/// new table's columns, and the trigger left on the renamed table, which
/// calls it, then failed that table's writes. The refresh refuses now,
/// naming the table and what to run; a refresh of every table reports it
/// and goes on.
#[tokio::test]
async fn a_refresh_refuses_while_the_trigger_sits_on_a_table_renamed_away() {
    let (_db, pool) = database(&format!(
        "{ORDERS}; CREATE TABLE visits (id bigint PRIMARY KEY, page text)"
    ))
    .await;
    add(&pool, CaptureSpec::new("visits", "web.visit", "id")).await.unwrap();
    exec(
        &pool,
        &format!(
            "ALTER TABLE visits RENAME TO visits_old; {}",
            ORDERS.replace("orders", "visits")
        ),
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    match capture::refresh(&mut conn, Tables::One("visits")).await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("also fires on public.visits_old"), "{message}");
            assert!(
                hint.contains("DROP TRIGGER ferry_capture ON public.visits_old")
                    && hint.contains("ferry capture add public.visits_old"),
                "{hint}"
            );
        }
        other => panic!("{other:?}"),
    }
    exec(&pool, "INSERT INTO visits_old (id, page) VALUES (1, '/')").await;
    assert_eq!(last_table_header(&pool).await, "public.visits");

    add(&pool, CaptureSpec::new("orders", "shop.order", "id"))
        .await
        .unwrap();
    exec(&pool, "ALTER TABLE orders ADD COLUMN note text").await;
    let done = capture::refresh(&mut conn, Tables::All).await.unwrap();
    assert_eq!(done, ["public.orders"]);
    exec(&pool, "INSERT INTO visits_old (id, page) VALUES (2, '/')").await;
    let found = capture::check(&mut conn).await.unwrap();
    assert!(
        found.iter().all(|d| d.table == "public.visits") && found.len() == 2,
        "{found:?}"
    );
    assert!(
        found[1]
            .fix
            .contains("once public.visits_old no longer has its trigger"),
        "{found:?}"
    );
}

/// Captures of `o` and `o_v2`; `o_v2` dropped and `o` renamed to `o_v2`.
/// The refresh of every table stopped on a raw unique-constraint error,
/// and `ferry check` said nothing of the capture whose table is gone. Now
/// both are reported, the refresh names the remove to run first and goes
/// past them, the remove leaves the renamed table's trigger alone, and the
/// refresh then follows the rename.
#[tokio::test]
async fn a_rename_onto_a_captured_name_whose_table_is_gone_is_reported_and_followed() {
    let (_db, pool) = database(
        "CREATE TABLE o (id bigint PRIMARY KEY, state text); CREATE TABLE o_v2 (id bigint PRIMARY KEY, state text);
         CREATE TABLE notes (id bigint PRIMARY KEY, body text)",
    )
    .await;
    add(&pool, CaptureSpec::new("o", "shop.o", "id")).await.unwrap();
    add(&pool, CaptureSpec::new("o_v2", "shop.o2", "id")).await.unwrap();
    add(&pool, CaptureSpec::new("notes", "app.note", "id")).await.unwrap();
    exec(&pool, "DROP TABLE o_v2; ALTER TABLE o RENAME TO o_v2").await;
    let mut conn = pool.acquire().await.unwrap();
    let found = capture::check(&mut conn).await.unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].table, "public.o");
    assert_eq!(
        found[0].fix,
        "ferry capture remove public.o_v2, then ferry capture refresh public.o"
    );
    assert_eq!(found[1].table, "public.o_v2");
    assert!(found[1].problem.starts_with("the table no longer exists"), "{found:?}");
    assert_eq!(found[1].fix, "ferry capture remove public.o_v2");

    match capture::refresh(&mut conn, Tables::One("public.o")).await {
        Err(CaptureError::Invalid { message, hint }) => {
            assert!(message.contains("public.o_v2"), "{message}");
            assert!(hint.contains("`ferry capture remove public.o_v2`"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(
            capture::refresh(&mut conn, Tables::One("o_v2")).await,
            Err(CaptureError::Invalid { .. })
        ),
        "a refresh of the capture whose table is gone took the trigger over"
    );
    let done = capture::refresh(&mut conn, Tables::All).await.unwrap();
    assert_eq!(done, ["public.notes"]);
    exec(&pool, "INSERT INTO o_v2 (id, state) VALUES (1, 'new')").await;
    assert_eq!(events(&pool).await.pop().unwrap().event_type, "shop.o.created");

    // The fix, as check gave it.
    capture::remove(&mut conn, "public.o_v2").await.unwrap();
    assert!(
        has_capture_trigger(&pool, "o_v2").await,
        "the remove dropped the renamed table's trigger"
    );
    let done = capture::refresh(&mut conn, Tables::One("public.o")).await.unwrap();
    assert_eq!(done, ["public.o_v2"]);
    assert!(capture::check(&mut conn).await.unwrap().is_empty());
    exec(&pool, "UPDATE o_v2 SET state = 'paid' WHERE id = 1").await;
    let last = events(&pool).await.pop().unwrap();
    assert_eq!(last.event_type, "shop.o.updated");
    assert_eq!(last.headers["table"], "public.o_v2");
}
