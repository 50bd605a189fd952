//! The PostgreSQL store against a real database: the shared conformance
//! suite, then the producer API and migrations.

use async_trait::async_trait;
use ferry_core::{Event, EventId, RelayId};
use ferry_store::postgres::{EnqueueError, PgStore, enqueue, enqueue_batch, migrate};
use ferry_testkit::pg::TestDb;
use ferry_testkit::store_suite::StoreHarness;
use serde_json::json;
use sqlx::{Connection, PgPool};

struct PgHarness {
    store: PgStore,
    pool: PgPool,
    _db: TestDb,
}

async fn harness() -> PgHarness {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    PgHarness {
        store: PgStore::new(pool.clone()),
        pool,
        _db: db,
    }
}

#[async_trait]
impl StoreHarness for PgHarness {
    type S = PgStore;
    fn store(&self) -> &PgStore {
        &self.store
    }
    async fn enqueue(&self, events: Vec<Event>) -> Vec<EventId> {
        let mut tx = self.pool.begin().await.unwrap();
        let out = enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        out.into_iter().map(|e| e.id).collect()
    }
    async fn expire_leases(&self, relay: &RelayId) {
        sqlx::query("UPDATE ferry.partitions SET expires_at = now() - interval '1 second' WHERE owner = $1")
            .bind(&relay.0)
            .execute(&self.pool)
            .await
            .unwrap();
        sqlx::query("UPDATE ferry.relays SET heartbeat_at = now() - interval '1 hour' WHERE id = $1")
            .bind(&relay.0)
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn delivery_state(&self, route: &str, id: EventId) -> Option<(String, u32)> {
        sqlx::query_as::<_, (String, i32)>(
            "SELECT d.state, d.attempts FROM ferry.deliveries d JOIN ferry.events e ON e.seq = d.seq
              WHERE d.route = $1 AND e.id = $2",
        )
        .bind(route)
        .bind(id.0)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .map(|(s, a)| (s, a as u32))
    }
}

mod conformance {
    use super::harness;
    ferry_testkit::store_conformance!(harness());
}

#[tokio::test]
async fn migrate_is_idempotent() {
    let db = TestDb::create().await;
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    assert_eq!(migrate(&mut conn).await.unwrap(), vec![1]);
    assert!(migrate(&mut conn).await.unwrap().is_empty());
}

#[tokio::test]
async fn enqueue_refuses_to_run_outside_a_transaction() {
    let h = harness().await;
    let mut conn = h.pool.acquire().await.unwrap();
    let err = enqueue(&mut conn, Event::new("order.created", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, EnqueueError::NotInTransaction), "{err}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_no_event() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    enqueue(&mut tx, Event::new("order.created", json!({}))).await.unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn dispatch_keys_make_repeats_a_reported_no_op() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let first = enqueue(
        &mut tx,
        Event::new("order.created", json!({"n": 1})).dispatch_key("stripe:evt_1"),
    )
    .await
    .unwrap();
    let again = enqueue(
        &mut tx,
        Event::new("order.created", json!({"n": 2})).dispatch_key("stripe:evt_1"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(again.id, first.id);
    // The SQL door agrees.
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
            "SELECT ferry.enqueue('order.created', NULL, jsonb_build_object('x', repeat('x', 1100000)))",
            "payload",
        ),
    ] {
        let err = sqlx::query(sql).execute(&h.pool).await.unwrap_err().to_string();
        assert!(err.contains(&format!("invalid event {field}")), "{sql}: {err}");
    }
}

#[tokio::test]
async fn rust_validation_names_the_field_before_touching_the_database() {
    let h = harness().await;
    let mut tx = h.pool.begin().await.unwrap();
    let err = enqueue(&mut tx, Event::new("Order", json!({}))).await.unwrap_err();
    match err {
        EnqueueError::Invalid(v) => assert_eq!(v.field, "type"),
        other => panic!("expected a validation error, got {other}"),
    }
}

/// Producers of one key are serialised at enqueue, so a later commit always
/// has a later seq: per key, outbox order is commit order.
#[tokio::test]
async fn per_key_seq_order_is_commit_order() {
    let h = harness().await;
    let mut t1 = h.pool.begin().await.unwrap();
    enqueue(&mut t1, Event::new("order.created", json!({"n": 1})).key("k"))
        .await
        .unwrap();
    let pool = h.pool.clone();
    let second = tokio::spawn(async move {
        let mut t2 = pool.begin().await.unwrap();
        let e = enqueue(&mut t2, Event::new("order.paid", json!({"n": 2})).key("k"))
            .await
            .unwrap();
        t2.commit().await.unwrap();
        e.id
    });
    // t2 waits on t1's key lock; let it queue up, then commit t1.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "the second producer of the key must wait for the first"
    );
    t1.commit().await.unwrap();
    second.await.unwrap();
    let types: Vec<String> = sqlx::query_scalar("SELECT type FROM ferry.events WHERE key = 'k' ORDER BY seq")
        .fetch_all(&h.pool)
        .await
        .unwrap();
    assert_eq!(types, vec!["order.created", "order.paid"]);
}

#[tokio::test]
async fn status_counts_states_and_blocked_keys() {
    use ferry_core::Store;
    let h = harness().await;
    h.enqueue(vec![
        Event::new("order.created", json!({})).key("a"),
        Event::new("order.created", json!({})).key("a"),
        Event::new("user.created", json!({})).key("u"),
    ])
    .await;
    let relay = RelayId("r".into());
    let mut owned = h
        .store
        .tick(&relay, std::time::Duration::from_secs(30), &[])
        .await
        .unwrap();
    owned.relay = relay;
    let events = h.store.fetch_unrouted(&owned, 10).await.unwrap();
    let plans = ferry_relay_free_plan(events);
    h.store.route(&owned, &plans, chrono::Utc::now()).await.unwrap();
    let c = h
        .store
        .claim(&owned, "orders", 10, chrono::Utc::now(), &[])
        .await
        .unwrap();
    let dead = ferry_core::Recorded {
        seq: c[0].event.seq,
        expected_attempts: 0,
        transition: ferry_core::Transition::Dead {
            attempts: 1,
            reason: "unroutable".into(),
        },
    };
    h.store
        .record(&owned, "orders", &[dead], chrono::Utc::now())
        .await
        .unwrap();
    let s = h.store.status().await.unwrap();
    let orders = s.routes.iter().find(|r| r.route == "orders").unwrap();
    assert_eq!((orders.pending, orders.dead, orders.published), (1, 1, 0));
    assert_eq!(orders.blocked.keys, 1);
    assert_eq!(orders.blocked.waiting, 1);
    let none = s.routes.iter().find(|r| r.route == ferry_core::NO_ROUTE).unwrap();
    assert_eq!(none.dead, 1);
    assert!(s.dead_reasons.iter().any(|d| d.reason.contains("no route")));
    assert_eq!(s.leases.len(), 1);
    assert_eq!(s.leases[0].partitions, 32);
}

fn ferry_relay_free_plan(events: Vec<ferry_core::UnroutedEvent>) -> Vec<ferry_core::RoutePlan> {
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
