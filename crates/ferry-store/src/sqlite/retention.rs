//! Retention for SQLite.
//!
//! Candidates are found by walking the `ferry_events` primary key over a
//! bounded stretch, from the first stored event after the last batch, and
//! read (whole only when archived, payloads within a byte budget) in one
//! read transaction, which takes no lock: producers and the relay write on while the batch is archived (a
//! slow or hung archive disk must not hold SQLite's one write lock, or every
//! producer's transaction would fail on its busy timeout). The delete then
//! takes the write lock briefly and asks again which of the batch's events
//! are still due: one an operator requeued, or a retry delivered, since the
//! read stays. The archive holds it then though the table keeps it, and a
//! later archive holds it again: twice, never missing.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::StoreError;
use sqlx::{Row, SqliteConnection};

use super::SqliteStore;
use super::error::store_error;
use super::store::{from_micros, micros};
use crate::retention::{
    ArchivedAction, ArchivedDelivery, ArchivedEvent, ArchivedFailure, DeleteFailed, Deleted, ExpiredBatch, Retention,
    RetentionRules,
};

/// Stretches of the outbox scanned per batch, in batches: bounds the work of
/// one query when most old events must be kept (dead, or still pending).
const STRETCH: i64 = 10;

#[async_trait]
impl Retention for SqliteStore {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, StoreError> {
        let (first, last): (Option<i64>, Option<i64>) =
            sqlx::query_as("SELECT (SELECT min(seq) FROM ferry_events), (SELECT max(seq) FROM ferry_events)")
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
        let published = micros(rules.published_cutoff(now));
        let settled = rules.settled_cutoff(now).map(micros);
        let newest_cutoff = settled.map_or(published, |s| s.max(published));
        // The next stored event: the stretch starts there, over any gap in
        // the seqs. Events are stored in creation order: once it is younger
        // than every window, nothing after it can be due yet.
        let next: Option<(i64, i64)> =
            sqlx::query_as("SELECT seq, created_at FROM ferry_events WHERE seq > ?1 ORDER BY seq LIMIT 1")
                .bind(after)
                .fetch_optional(self.pool())
                .await
                .map_err(store_error)?;
        let from = match next {
            Some((seq, created)) if seq <= upto && created < newest_cutoff => seq - 1,
            _ => return Ok(Box::new(SqliteExpired::empty(upto))),
        };
        let limit = rules.batch_size.max(1) as i64;
        let stretch_end = from.saturating_add(limit.saturating_mul(STRETCH)).min(upto);
        let sql = include_str!("sql/retention_expired.sql");
        let candidates: Vec<i64> = sqlx::query_scalar(sql)
            .bind(from)
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
            return Ok(Box::new(SqliteExpired::empty(scanned_to)));
        }
        // A read transaction: one snapshot for the events and their
        // deliveries, and no write lock.
        let mut tx = self.pool().begin().await.map_err(store_error)?;
        let events = read_events(&mut tx, &candidates, false).await?;
        tx.rollback().await.map_err(store_error)?;
        Ok(Box::new(SqliteExpired {
            store: Some(self.clone()),
            due: Due { published, settled },
            events,
            scanned_to,
        }))
    }
}

/// The events, `whole` with their payloads, deliveries, failures and
/// operators' actions, as the archive keeps them.
async fn read_events(conn: &mut SqliteConnection, seqs: &[i64], whole: bool) -> Result<Vec<ArchivedEvent>, StoreError> {
    let list = serde_json::to_string(seqs).expect("integers serialise");
    if !whole {
        return read_event_rows(conn, &list, false, HashMap::new()).await;
    }
    let mut actions: HashMap<(i64, String), Vec<ArchivedAction>> = HashMap::new();
    let rows = sqlx::query(
        "SELECT seq, route, at, actor, action, from_state, attempts, reason FROM ferry_admin_log
          WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY id",
    )
    .bind(&list)
    .fetch_all(&mut *conn)
    .await
    .map_err(store_error)?;
    for r in rows {
        actions.entry((r.get(0), r.get(1))).or_default().push(ArchivedAction {
            at: from_micros(r.get(2)),
            actor: r.get(3),
            action: r.get(4),
            from_state: r.get(5),
            attempts: r.get::<i64, _>(6) as i32,
            reason: r.get(7),
        });
    }
    let mut failures: HashMap<(i64, String), Vec<ArchivedFailure>> = HashMap::new();
    let rows = sqlx::query(
        "SELECT seq, route, attempt, at, dead, error FROM ferry_failures
          WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY id",
    )
    .bind(&list)
    .fetch_all(&mut *conn)
    .await
    .map_err(store_error)?;
    for r in rows {
        failures.entry((r.get(0), r.get(1))).or_default().push(ArchivedFailure {
            attempt: r.get::<i64, _>(2) as i32,
            at: from_micros(r.get(3)),
            dead: r.get(4),
            error: r.get(5),
        });
    }
    let mut deliveries: HashMap<i64, Vec<ArchivedDelivery>> = HashMap::new();
    let rows = sqlx::query(
        "SELECT seq, route, state, attempts, last_error, published_at, updated_at FROM ferry_deliveries
          WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY seq, route",
    )
    .bind(&list)
    .fetch_all(&mut *conn)
    .await
    .map_err(store_error)?;
    for r in rows {
        let seq: i64 = r.get(0);
        let route: String = r.get(1);
        deliveries.entry(seq).or_default().push(ArchivedDelivery {
            failures: failures.remove(&(seq, route.clone())).unwrap_or_default(),
            actions: actions.remove(&(seq, route.clone())).unwrap_or_default(),
            route,
            state: r.get(2),
            attempts: r.get::<i64, _>(3) as i32,
            last_error: r.get(4),
            published_at: r.get::<Option<i64>, _>(5).map(from_micros),
            updated_at: from_micros(r.get(6)),
        });
    }
    read_event_rows(conn, &list, true, deliveries).await
}

/// The events' rows, with their payloads when `whole`.
async fn read_event_rows(
    conn: &mut SqliteConnection,
    list: &str,
    whole: bool,
    mut deliveries: HashMap<i64, Vec<ArchivedDelivery>>,
) -> Result<Vec<ArchivedEvent>, StoreError> {
    let rows = sqlx::query(
        "SELECT seq, id, type, key, CASE WHEN ?2 THEN payload END, content_type, headers, dispatch_key, created_at
           FROM ferry_events WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY seq",
    )
    .bind(list)
    .bind(whole)
    .fetch_all(&mut *conn)
    .await
    .map_err(store_error)?;
    let mut events = Vec::with_capacity(rows.len());
    for r in rows {
        let seq: i64 = r.get(0);
        let id: &str = r.get(1);
        let headers: &str = r.get(6);
        let mut event = ArchivedEvent {
            seq,
            id: id
                .parse()
                .map_err(|e| StoreError::permanent(format!("retention: event id {id:?} is not a UUID: {e}")))?,
            event_type: r.get(2),
            key: r.get(3),
            content_type: r.get(5),
            headers: serde_json::from_str(headers)
                .map_err(|e| StoreError::permanent(format!("retention: unreadable headers of event {seq}: {e}")))?,
            payload: None,
            payload_base64: None,
            dispatch_key: r.get(7),
            created_at: from_micros(r.get(8)),
            deliveries: deliveries.remove(&seq).unwrap_or_default(),
        };
        if whole {
            event.set_payload(r.get::<Option<&[u8]>, _>(4).unwrap_or_default());
        }
        events.push(event);
    }
    Ok(events)
}

/// The cutoffs the batch was taken with, to ask again at the delete.
struct Due {
    published: i64,
    settled: Option<i64>,
}

struct SqliteExpired {
    /// `None` for an empty batch.
    store: Option<SqliteStore>,
    due: Due,
    events: Vec<ArchivedEvent>,
    scanned_to: i64,
}

impl SqliteExpired {
    fn empty(scanned_to: i64) -> Self {
        Self {
            store: None,
            due: Due {
                published: 0,
                settled: None,
            },
            events: Vec::new(),
            scanned_to,
        }
    }
}

#[async_trait]
impl ExpiredBatch for SqliteExpired {
    fn events(&self) -> &[ArchivedEvent] {
        &self.events
    }

    fn scanned_to(&self) -> i64 {
        self.scanned_to
    }

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), StoreError> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let list =
            serde_json::to_string(&self.events.iter().map(|e| e.seq).collect::<Vec<_>>()).expect("integers serialise");
        let mut tx = store.pool().begin().await.map_err(store_error)?;
        // Payload sizes without reading the payloads.
        let sizes: Vec<(i64, Option<i64>)> = sqlx::query_as(
            "SELECT seq, length(payload) FROM ferry_events WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY seq",
        )
        .bind(&list)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        let (kept, cut) = crate::retention::within_budget(sizes, max_payload_bytes);
        if let Some(cut) = cut {
            self.scanned_to = cut;
        }
        self.events = read_events(&mut tx, &kept, true).await?;
        tx.rollback().await.map_err(store_error)?;
        Ok(())
    }

    async fn delete(self: Box<Self>) -> Result<Deleted, DeleteFailed> {
        let first = self.events.iter().map(|e| e.seq).min();
        let last = self.events.iter().map(|e| e.seq).max();
        let (Some(store), Some(first), Some(last)) = (&self.store, first, last) else {
            return Ok(Deleted::default());
        };
        let mut tx = match store.pool().begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            // The write lock stayed taken past the busy timeout (a long
            // transaction of a producer or of another process): like rows
            // locked in PostgreSQL, the batch stays for a later run rather
            // than failing the run.
            Err(e) if is_busy(&e) => {
                tracing::info!(
                    events = self.events.len(),
                    "retention: the database stayed locked; the batch stays, for a later run"
                );
                return Ok(Deleted {
                    changed: true,
                    ..Deleted::default()
                });
            }
            Err(e) => return Err(DeleteFailed::before_commit(store_error(e))),
        };
        // Under the write lock: which are still due. An event requeued, or a
        // delivery retried, since the read stays in the table.
        let due: Vec<i64> = sqlx::query_scalar(include_str!("sql/retention_expired.sql"))
            .bind(first - 1)
            .bind(last)
            .bind(self.due.published)
            .bind(self.due.settled)
            .bind(last - first + 1)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        let due: HashSet<i64> = due.into_iter().collect();
        let seqs: Vec<i64> = self.events.iter().map(|e| e.seq).filter(|s| due.contains(s)).collect();
        if seqs.len() < self.events.len() {
            // The read took no lock: delete nothing, so that the batch can
            // come out of the archive whole; a later run takes what is
            // still due.
            tracing::info!(
                changed = self.events.len() - seqs.len(),
                "retention: events changed since they were read; the batch stays, for a later run"
            );
            return Ok(Deleted {
                changed: true,
                ..Deleted::default()
            });
        }
        mark_order(&mut tx, &self.events)
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        let list = serde_json::to_string(&seqs).expect("integers serialise");
        let mut deleted = [0u64; 4];
        for (i, sql) in [
            "DELETE FROM ferry_admin_log WHERE seq IN (SELECT value FROM json_each(?1))",
            "DELETE FROM ferry_failures WHERE seq IN (SELECT value FROM json_each(?1))",
            "DELETE FROM ferry_deliveries WHERE seq IN (SELECT value FROM json_each(?1))",
            "DELETE FROM ferry_events WHERE seq IN (SELECT value FROM json_each(?1))",
        ]
        .into_iter()
        .enumerate()
        {
            deleted[i] = sqlx::query(sql)
                .bind(&list)
                .execute(&mut *tx)
                .await
                .map_err(|e| DeleteFailed::before_commit(store_error(e)))?
                .rows_affected();
        }
        let [_, _, deliveries, events] = deleted;
        if events as usize != seqs.len() {
            // Cannot happen while the write lock is held; if it does, delete
            // nothing rather than let the archive and the table disagree.
            return Err(DeleteFailed::before_commit(StoreError::permanent(format!(
                "retention: expected to delete {} events, found {events}; rolled back",
                seqs.len(),
            ))));
        }
        tx.commit().await.map_err(commit_failed)?;
        Ok(Deleted {
            events,
            deliveries,
            changed: false,
        })
    }
}

/// Under the write lock, before the batch goes: keeps in
/// `ferry_purged_order` what a requeue's order check needs of its published
/// deliveries, and drops the marks of its keys that no kept delivery sits
/// before any more. As in PostgreSQL (`retention_kept.sql`, migration 31),
/// read through indexes by the batch's keys: pending and dead deliveries,
/// dead and cancelled ones (`ferry_deliveries_failed_key`, schema 8),
/// unrouted events before the batch's end (or its keys' latest mark).
async fn mark_order(conn: &mut SqliteConnection, events: &[ArchivedEvent]) -> Result<(), sqlx::Error> {
    let mut keys: Vec<&str> = events.iter().filter_map(|e| e.key.as_deref()).collect();
    keys.sort_unstable();
    keys.dedup();
    let Some(last) = events.iter().map(|e| e.seq).max().filter(|_| !keys.is_empty()) else {
        return Ok(());
    };
    let seqs = serde_json::to_string(&events.iter().map(|e| e.seq).collect::<Vec<_>>()).expect("integers serialise");
    let keys = serde_json::to_string(&keys).expect("strings serialise");
    let marked: Option<i64> =
        sqlx::query_scalar("SELECT max(seq) FROM ferry_purged_order WHERE key IN (SELECT value FROM json_each(?1))")
            .bind(&keys)
            .fetch_one(&mut *conn)
            .await?;
    let kept: Vec<(String, i64)> = sqlx::query_as(
        "SELECT k.key, min(k.seq)
           FROM (SELECT r.key, r.seq FROM ferry_deliveries r INDEXED BY ferry_deliveries_held
                  WHERE r.key IN (SELECT value FROM json_each(?2)) AND r.key IS NOT NULL
                    AND r.state IN ('pending', 'dead') AND r.seq < ?3
                 UNION ALL
                 SELECT r.key, r.seq FROM ferry_deliveries r INDEXED BY ferry_deliveries_failed_key
                  WHERE r.key IN (SELECT value FROM json_each(?2)) AND r.key IS NOT NULL
                    AND r.state IN ('dead', 'cancelled') AND r.seq < ?3
                 UNION ALL
                 SELECT e.key, e.seq FROM ferry_unrouted u CROSS JOIN ferry_events e ON e.seq = u.seq
                  WHERE u.seq < ?3 AND e.key IN (SELECT value FROM json_each(?2))) k
          WHERE k.seq NOT IN (SELECT value FROM json_each(?1))
          GROUP BY k.key",
    )
    .bind(&seqs)
    .bind(&keys)
    .bind(marked.map_or(last, |m| m.max(last)))
    .fetch_all(&mut *conn)
    .await?;
    let kept = serde_json::to_string(&kept).expect("strings and integers serialise");
    sqlx::query(
        "DELETE FROM ferry_purged_order
          WHERE key IN (SELECT value FROM json_each(?1))
            AND NOT EXISTS (SELECT 1 FROM json_each(?2) k
                             WHERE json_extract(k.value, '$[0]') = ferry_purged_order.key
                               AND json_extract(k.value, '$[1]') < ferry_purged_order.seq)",
    )
    .bind(&keys)
    .bind(&kept)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO ferry_purged_order (key, route, seq)
         SELECT d.key, d.route, max(d.seq)
           FROM json_each(?2) k CROSS JOIN ferry_deliveries d
          WHERE d.seq IN (SELECT value FROM json_each(?1)) AND d.key = json_extract(k.value, '$[0]')
            AND d.state = 'published' AND d.seq > json_extract(k.value, '$[1]')
          GROUP BY d.key, d.route
         ON CONFLICT (key, route) DO UPDATE SET seq = max(seq, excluded.seq)",
    )
    .bind(&seqs)
    .bind(&kept)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// SQLITE_BUSY (5) or SQLITE_LOCKED (6), with their extended codes.
fn is_busy(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .and_then(|c| c.parse::<i64>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

/// A failed COMMIT of a retention delete. SQLite answering with an I/O
/// error (or a full disk) may have written the commit to its WAL file
/// before the error: recovery can replay it, and the rows be gone all the
/// same. So the batch stays in the archive, the only copy then left.
fn commit_failed(e: sqlx::Error) -> DeleteFailed {
    let uncertain = commit_may_have_landed(e.as_database_error().and_then(|d| d.code()).as_deref());
    let mut failed = DeleteFailed::at_commit(e, store_error);
    failed.maybe_deleted |= uncertain;
    failed
}

/// Whether a COMMIT that failed with this (extended) result code may have
/// been written all the same: SQLITE_IOERR (10) and SQLITE_FULL (13), with
/// their extended codes (`IOERR_FSYNC` is 1034).
fn commit_may_have_landed(code: Option<&str>) -> bool {
    code.and_then(|c| c.parse::<i64>().ok())
        .is_some_and(|code| matches!(code & 0xff, 10 | 13))
}

#[cfg(test)]
mod tests {
    use super::commit_may_have_landed;

    #[test]
    fn an_io_error_at_commit_leaves_the_delete_in_doubt() {
        assert!(commit_may_have_landed(Some("10")));
        assert!(commit_may_have_landed(Some("1034")), "SQLITE_IOERR_FSYNC");
        assert!(commit_may_have_landed(Some("13")), "SQLITE_FULL");
        assert!(!commit_may_have_landed(Some("5")), "SQLITE_BUSY: nothing was written");
        assert!(!commit_may_have_landed(Some("19")), "a constraint");
        assert!(!commit_may_have_landed(None));
    }
}
