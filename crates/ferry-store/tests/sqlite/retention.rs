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
