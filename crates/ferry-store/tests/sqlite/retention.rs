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
    async fn admin_actions(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry_admin_log")
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

    // The batch was read without a lock, and its archive written before
    // the delete: it deletes nothing, so that the archive can be cut back.
    assert_eq!(
        batch.delete().await.unwrap(),
        ferry_store::Deleted {
            events: 0,
            deliveries: 0,
            changed: true,
        },
    );
    let left = h.event_ids().await;
    assert!(ids.iter().all(|id| left.contains(id)), "a changed batch stays whole");

    // In a run: the archive holds nothing the run did not delete, and the
    // next run deletes (and archives) what is still due.
    let dir = tempfile::tempdir().unwrap();
    let options = ferry_store::PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..ferry_store::PurgeOptions::default()
    };
    let later = Utc::now() + chrono::Duration::days(1);
    sqlx::query("UPDATE ferry_deliveries SET state = 'published' WHERE seq = ?1")
        .bind(requeued)
        .execute(&impatient)
        .await
        .unwrap();
    let racing = RequeueBeforeDelete {
        store: h.store.clone(),
        pool: impatient.clone(),
    };
    let report = ferry_store::purge(&racing, &rules, &options, later).await.unwrap();
    assert_eq!((report.events, report.archived), (0, 0), "{report:?}");
    let archived = |dir: &std::path::Path| -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|f| ferry_store::read_archive(&f.unwrap().path()).unwrap().len())
            .sum()
    };
    assert_eq!(archived(dir.path()), 0, "the archive holds events still in the table");
    let report = ferry_store::purge(&h.store, &rules, &options, later).await.unwrap();
    assert_eq!((report.events, report.archived), (2, 2), "{report:?}");
    assert_eq!(archived(dir.path()), 2);
    let left = h.event_ids().await;
    assert!(left.contains(&ids[1]), "the requeued event stays in the table");
    assert!(!left.contains(&ids[0]) && !left.contains(&ids[2]));
}

/// The SQLite store, but each batch's second event is requeued just before
/// the batch is deleted: the race the delete's re-check is for.
struct RequeueBeforeDelete {
    store: ferry_store::sqlite::SqliteStore,
    pool: sqlx::SqlitePool,
}

struct RequeuedBatch {
    inner: Box<dyn ferry_store::ExpiredBatch>,
    pool: sqlx::SqlitePool,
}

#[async_trait]
impl ferry_store::Retention for RequeueBeforeDelete {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, ferry_core::StoreError> {
        self.store.retention_range().await
    }

    async fn take_expired(
        &self,
        rules: &ferry_store::RetentionRules,
        after: i64,
        upto: i64,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Box<dyn ferry_store::ExpiredBatch>, ferry_core::StoreError> {
        Ok(Box::new(RequeuedBatch {
            inner: self.store.take_expired(rules, after, upto, now).await?,
            pool: self.pool.clone(),
        }))
    }
}

#[async_trait]
impl ferry_store::ExpiredBatch for RequeuedBatch {
    fn events(&self) -> &[ferry_store::ArchivedEvent] {
        self.inner.events()
    }

    fn scanned_to(&self) -> i64 {
        self.inner.scanned_to()
    }

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), ferry_core::StoreError> {
        self.inner.read_whole(max_payload_bytes).await
    }

    async fn delete(self: Box<Self>) -> Result<ferry_store::Deleted, ferry_store::DeleteFailed> {
        if let Some(e) = self.inner.events().get(1) {
            sqlx::query("UPDATE ferry_deliveries SET state = 'pending', attempts = 0 WHERE seq = ?1")
                .bind(e.seq)
                .execute(&self.pool)
                .await
                .unwrap();
        }
        self.inner.delete().await
    }
}
