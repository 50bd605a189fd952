//! The PostgreSQL store on a fresh, migrated database: the harness its
//! conformance, admin and retention suites run on, shared by each of its
//! test files.
//!
//! ```no_run
//! # async fn demo() {
//! use ferry_testkit::pg_store::PgHarness;
//! let h = PgHarness::create().await;
//! ferry_testkit::store_suite::no_lease_no_work(&h).await;
//! # }
//! ```

use std::collections::BTreeSet;

use async_trait::async_trait;
use ferry_core::{Event, EventId, RelayId};
use ferry_store::postgres::{PgStore, enqueue, enqueue_batch, migrate};
use ferry_store::{EnqueueError, Enqueued};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use crate::admin_suite::AdminHarness;
use crate::pg::TestDb;
use crate::producer_suite::ProducerHarness;
use crate::retention_suite::RetentionHarness;
use crate::store_suite::StoreHarness;

/// A [`PgStore`] on its own database, with the pool for raw checks.
pub struct PgHarness {
    pub store: PgStore,
    pub pool: PgPool,
    pub db: TestDb,
}

impl PgHarness {
    /// Creates and migrates a database of its own.
    pub async fn create() -> PgHarness {
        let db = TestDb::create().await;
        let pool = db.pool().await;
        migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
        PgHarness {
            store: PgStore::new(pool.clone()),
            pool,
            db,
        }
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
    async fn failure_history(&self, route: &str, id: EventId) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM ferry.failures f JOIN ferry.events e ON e.seq = f.seq
              WHERE f.route = $1 AND e.id = $2",
        )
        .bind(route)
        .bind(id.0)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

#[async_trait]
impl AdminHarness for PgHarness {
    async fn snapshot(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT concat_ws('|', seq, route, state, attempts, next_attempt_at, last_error, published_at, updated_at)
               FROM ferry.deliveries ORDER BY seq, route",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
    async fn release_partitions(&self) {
        sqlx::query("UPDATE ferry.partitions SET owner = NULL, expires_at = NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn expire_partitions(&self) {
        sqlx::query("UPDATE ferry.partitions SET expires_at = now() - interval '1 second' WHERE owner IS NOT NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn dead_failures(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.failures WHERE dead")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

#[async_trait]
impl RetentionHarness for PgHarness {
    async fn event_ids(&self) -> BTreeSet<EventId> {
        let all: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM ferry.events")
            .fetch_all(&self.pool)
            .await
            .unwrap();
        all.into_iter().map(EventId).collect()
    }
    async fn failures(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.failures")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
    async fn admin_actions(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.admin_log")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

#[async_trait]
impl ProducerHarness for PgHarness {
    type Db = Postgres;
    fn pool(&self) -> &PgPool {
        &self.pool
    }
    async fn begin(pool: &PgPool) -> Transaction<'static, Postgres> {
        pool.begin().await.unwrap()
    }
    async fn enqueue_on(conn: &mut PgConnection, event: Event) -> Result<Enqueued, EnqueueError> {
        enqueue(conn, event).await
    }
    async fn enqueue_batch_on(conn: &mut PgConnection, events: Vec<Event>) -> Result<Vec<Enqueued>, EnqueueError> {
        enqueue_batch(conn, events).await
    }
    async fn counts(&self) -> (i64, i64) {
        sqlx::query_as("SELECT (SELECT count(*) FROM ferry.events), (SELECT count(*) FROM ferry.unrouted)")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}
