//! Retention for PostgreSQL.
//!
//! Candidates are found by walking the `events` primary key over a bounded
//! stretch (never a whole-table scan), then their deliveries are locked and
//! the candidates read again under the lock, so an operator's requeue that
//! commits in between keeps its event. Only settled deliveries are locked:
//! the relay claims and records pending ones, so it never waits on retention.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::StoreError;
use sqlx::{Postgres, Row, Transaction};

use super::PgStore;
use super::error::store_error;
use crate::retention::{
    ArchivedDelivery, ArchivedEvent, DeleteFailed, Deleted, ExpiredBatch, Retention, RetentionRules,
};

/// Stretches of the outbox scanned per batch, in batches: bounds the work of
/// one query when most old events must be kept (dead, or still pending).
const STRETCH: i64 = 10;
/// A batch's locks wait at most this long for an operator's command on the
/// same rows; the run then stops with a transient error and the next run
/// tries again.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

#[async_trait]
impl Retention for PgStore {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, StoreError> {
        let (first, last): (Option<i64>, Option<i64>) =
            sqlx::query_as("SELECT (SELECT min(seq) FROM ferry.events), (SELECT max(seq) FROM ferry.events)")
                .fetch_one(self.pool())
                .await
                .map_err(store_error)?;
        Ok(first.zip(last))
    }

    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, StoreError> {
        let published = rules.published_cutoff(now);
        let settled = rules.settled_cutoff(now);
        let newest_cutoff = settled.map_or(published, |s| s.max(published));
        // Events are stored roughly in creation order: once the next one is
        // younger than every window, nothing after it can be due yet.
        let next: Option<DateTime<Utc>> =
            sqlx::query_scalar("SELECT created_at FROM ferry.events WHERE seq > $1 ORDER BY seq LIMIT 1")
                .bind(after)
                .fetch_optional(self.pool())
                .await
                .map_err(store_error)?;
        if next.is_none_or(|created| created >= newest_cutoff) {
            return Ok(Box::new(PgExpired::empty(upto)));
        }
        let limit = rules.batch_size.max(1) as i64;
        let stretch_end = after.saturating_add(limit.saturating_mul(STRETCH)).min(upto);
        let candidates: Vec<i64> = sqlx::query_scalar(include_str!("sql/retention_expired.sql"))
            .bind(after)
            .bind(stretch_end)
            .bind(published)
            .bind(settled)
            .bind(limit)
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        let scanned_to = match candidates.last() {
            Some(&last) if candidates.len() as i64 == limit => last,
            _ => stretch_end,
        };
        if candidates.is_empty() {
            return Ok(Box::new(PgExpired::empty(scanned_to)));
        }
        let mut tx = self.pool().begin().await.map_err(store_error)?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", LOCK_TIMEOUT.as_millis()))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query("SELECT 1 FROM ferry.deliveries WHERE seq = ANY($1::bigint[]) ORDER BY seq, route FOR UPDATE")
            .bind(&candidates)
            .execute(&mut *tx)
            .await
            .map_err(lock_error)?;
        let rows = sqlx::query(include_str!("sql/retention_read.sql"))
            .bind(&candidates)
            .bind(published)
            .bind(settled)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let deliveries: serde_json::Value = row.get(9);
            let deliveries: Vec<ArchivedDelivery> = serde_json::from_value(deliveries)
                .map_err(|e| StoreError::permanent(format!("retention: unreadable deliveries: {e}")))?;
            let mut event = ArchivedEvent {
                seq: row.get(0),
                id: row.get(1),
                event_type: row.get(2),
                key: row.get(3),
                content_type: row.get(5),
                headers: row.get(6),
                payload: None,
                payload_base64: None,
                dispatch_key: row.get(7),
                created_at: row.get(8),
                deliveries,
            };
            event.set_payload(row.get::<&[u8], _>(4));
            events.push(event);
        }
        Ok(Box::new(PgExpired {
            tx: Some(tx),
            events,
            scanned_to,
        }))
    }
}

/// A lock that waited too long is a busy moment, not a broken store.
fn lock_error(err: sqlx::Error) -> StoreError {
    match &err {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => StoreError::transient(format!(
            "retention: deliveries stayed locked for over {}s (an operator command?); the next run retries",
            LOCK_TIMEOUT.as_secs()
        )),
        _ => store_error(err),
    }
}

struct PgExpired {
    tx: Option<Transaction<'static, Postgres>>,
    events: Vec<ArchivedEvent>,
    scanned_to: i64,
}

impl PgExpired {
    fn empty(scanned_to: i64) -> Self {
        Self {
            tx: None,
            events: Vec::new(),
            scanned_to,
        }
    }
}

#[async_trait]
impl ExpiredBatch for PgExpired {
    fn events(&self) -> &[ArchivedEvent] {
        &self.events
    }

    fn scanned_to(&self) -> i64 {
        self.scanned_to
    }

    async fn delete(mut self: Box<Self>) -> Result<Deleted, DeleteFailed> {
        let Some(mut tx) = self.tx.take() else {
            return Ok(Deleted::default());
        };
        let seqs: Vec<i64> = self.events.iter().map(|e| e.seq).collect();
        let (deliveries, events): (i64, i64) = sqlx::query_as(include_str!("sql/retention_delete.sql"))
            .bind(&seqs)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        if events as usize != seqs.len() {
            // Cannot happen while the rows are locked; if it does, delete
            // nothing rather than let the archive and the table disagree.
            return Err(DeleteFailed::before_commit(StoreError::permanent(format!(
                "retention: expected to delete {} events, found {events}; rolled back",
                seqs.len()
            ))));
        }
        tx.commit().await.map_err(|e| DeleteFailed::at_commit(e, store_error))?;
        Ok(Deleted {
            events: events as u64,
            deliveries: deliveries as u64,
            changed: false,
        })
    }
}
