//! Retention and gauges of the SQLite store: the shared retention suite.

use std::collections::BTreeSet;

use async_trait::async_trait;
use ferry_core::EventId;
use ferry_testkit::retention_suite::RetentionHarness;

use super::{SqliteHarness, harness};

#[async_trait]
impl RetentionHarness for SqliteHarness {
    async fn event_ids(&self) -> BTreeSet<EventId> {
        let all: Vec<String> = sqlx::query_scalar("SELECT id FROM ferry_events")
            .fetch_all(&self.pool)
            .await
            .unwrap();
        all.iter().map(|id| EventId(id.parse().unwrap())).collect()
    }
    async fn failures(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry_failures")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

ferry_testkit::retention_conformance!(harness());

#[tokio::test]
async fn a_batch_being_archived_holds_no_lock_and_what_changed_meanwhile_stays() {
    use std::str::FromStr;
    use std::time::Duration;

    use chrono::Utc;
    use ferry_core::{Event, Recorded, RelayId, RoutePlan, Store, Transition};
    use ferry_store::{Retention, RetentionRules};
    use ferry_testkit::store_suite::StoreHarness;
    use serde_json::json;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

    let h = harness().await;
    let ids = h
        .enqueue(
            (0..3)
                .map(|i| Event::new("order.created", json!({ "n": i })).key(format!("k{i}")))
                .collect(),
        )
        .await;
    let relay = RelayId("r".into());
    let mut o = h.store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    o.relay = relay;
    let plans: Vec<RoutePlan> = h
        .store
        .fetch_unrouted(&o, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|event| RoutePlan {
            event,
            routes: vec!["orders".into()],
        })
        .collect();
    h.store.route(&o, &plans, Utc::now()).await.unwrap();
    let claimed = h
        .store
        .claim(&o, "orders", 100, Utc::now() + chrono::Duration::days(1), &[])
        .await
        .unwrap();
    let published: Vec<Recorded> = claimed
        .iter()
        .map(|c| Recorded {
            seq: c.event.seq,
            expected_attempts: c.attempts,
            transition: Transition::Published {
                attempts: 1,
                at: Utc::now(),
            },
        })
        .collect();
    assert_eq!(h.store.record(&o, "orders", &published, Utc::now()).await.unwrap(), 3);

    let rules = RetentionRules {
        published: Duration::from_secs(3600),
        settled: None,
        batch_size: 100,
        pause: Duration::ZERO,
    };
    let batch = h
        .store
        .take_expired(&rules, 0, i64::MAX, Utc::now() + chrono::Duration::days(1))
        .await
        .unwrap();
    assert_eq!(batch.events().len(), 3);

    // While the batch is archived (a slow disk, say), a producer commits:
    // the batch holds no lock for it to wait on.
    let impatient = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::from_str(&format!("sqlite://{}", h.path))
                .unwrap()
                .busy_timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    let mut tx = impatient
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("the write lock is free");
    ferry_store::sqlite::enqueue(&mut tx, Event::new("order.created", json!({})).key("later"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // And an operator requeues one of the batch's events meanwhile.
    let requeued = batch.events()[1].seq;
    sqlx::query("UPDATE ferry_deliveries SET state = 'pending', attempts = 0 WHERE seq = ?1")
        .bind(requeued)
        .execute(&impatient)
        .await
        .unwrap();

    assert_eq!(
        batch.delete().await.unwrap(),
        ferry_store::Deleted {
            events: 2,
            deliveries: 2
        },
        "the requeued event and its delivery stay, and are not counted as deleted"
    );
    let left = h.event_ids().await;
    assert!(left.contains(&ids[1]), "the requeued event stays in the table");
    assert!(!left.contains(&ids[0]) && !left.contains(&ids[2]));
}
