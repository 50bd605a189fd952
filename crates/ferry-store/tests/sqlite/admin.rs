//! The admin view of the SQLite store: the shared admin suite (listing,
//! history, status, and the guardrails of requeue and cancel, down to a
//! running relay delivering what was requeued).

use async_trait::async_trait;
use ferry_testkit::admin_suite::AdminHarness;

use super::{SqliteHarness, harness};

#[async_trait]
impl AdminHarness for SqliteHarness {
    async fn snapshot(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT concat_ws('|', seq, route, state, attempts, next_attempt_at, last_error, published_at, updated_at)
               FROM ferry_deliveries ORDER BY seq, route",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
    async fn release_partitions(&self) {
        sqlx::query("UPDATE ferry_partitions SET owner = NULL, expires_at = NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn expire_partitions(&self) {
        sqlx::query("UPDATE ferry_partitions SET expires_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 1000000 WHERE owner IS NOT NULL")
            .execute(&self.pool)
            .await
            .unwrap();
    }
    async fn dead_failures(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry_failures WHERE dead = 1")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

ferry_testkit::admin_conformance!(harness());
