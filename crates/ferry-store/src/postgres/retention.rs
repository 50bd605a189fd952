//! Retention for PostgreSQL.
//!
//! Candidates are found by walking the `events` primary key over a bounded
//! stretch (never a whole-table scan), from the first stored event after
//! the last batch: seqs may leave wide gaps (in WAL mode only failed
//! tableless events get rows), and the walk jumps over them.
//!
//! A batch is read without a lock, each event with a fingerprint of its
//! deliveries, failures and operators' actions: producers, the relay and
//! operators go on while it is archived, however slow the archive disk. The
//! delete then locks the batch's deliveries (only settled ones: the relay
//! claims and records pending ones, so it never waits on retention), reads
//! the fingerprints again, and deletes the batch only when every event is
//! still due and unchanged: an operator's requeue, a retry, or another run's
//! delete since the read keeps the whole batch, to be cut back out of the
//! archive; a later run takes what is still due. Several runs at once
//! (several relays) thus never wait long on each other: at most one batch's
//! delete.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::StoreError;
use sqlx::postgres::PgRow;
use sqlx::{Row, Transaction};

use super::PgStore;
use super::error::store_error;
use crate::retention::{
    ArchivedDelivery, ArchivedEvent, DeleteFailed, Deleted, ExpiredBatch, Retention, RetentionRules,
};

/// Stretches of the outbox scanned per batch, in batches: bounds the work of
/// one query when most old events must be kept (dead, or still pending).
const STRETCH: i64 = 10;
/// A delete's locks wait at most this long for an operator's command on
/// the same rows; the batch then stays, for a later run.
const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether event `e` is due: routed, and every delivery settled before its
/// window, that is published before $2, or dead or cancelled before $3
/// (NULL: kept until an operator acts).
macro_rules! due {
    () => {
        " NOT EXISTS (SELECT 1 FROM ferry.unrouted u WHERE u.seq = e.seq)
          AND EXISTS (SELECT 1 FROM ferry.deliveries d WHERE d.seq = e.seq)
          AND NOT EXISTS (
              SELECT 1 FROM ferry.deliveries d
               WHERE d.seq = e.seq
                 AND NOT coalesce((d.state = 'published' AND d.published_at < $2)
                               OR (d.state IN ('dead', 'cancelled') AND d.updated_at < $3), false)) "
    };
}

/// What any change to event `e` since it was read changes: its deliveries,
/// and how many failures and operators' actions it has.
macro_rules! version {
    () => {
        " (SELECT string_agg(d.route || '/' || d.state || '/' || d.attempts || '/'
                             || (extract(epoch FROM d.updated_at) * 1000000)::bigint || '/'
                             || coalesce((extract(epoch FROM d.published_at) * 1000000)::bigint::text, '-'),
                             ',' ORDER BY d.route)
             FROM ferry.deliveries d WHERE d.seq = e.seq)
          || '|' || (SELECT count(*) FROM ferry.failures f WHERE f.seq = e.seq)
          || '|' || (SELECT count(*) FROM ferry.admin_log a WHERE a.seq = e.seq) "
    };
}

/// The batch's events without their payloads, with their versions.
/// $1 seqs, $2 published cutoff, $3 settled cutoff.
const READ: &str = concat!(
    "SELECT e.seq, e.id, e.type, e.key, e.content_type, e.headers, e.dispatch_key, e.created_at,",
    version!(),
    "FROM ferry.events e WHERE e.seq = ANY($1::bigint[]) AND",
    due!(),
    "ORDER BY e.seq"
);

/// The batch's events whole, as the archive keeps them, with their
/// versions, in one statement (one snapshot). Same parameters.
const READ_WHOLE: &str = concat!(
    "SELECT e.seq, e.id, e.type, e.key, e.content_type, e.headers, e.dispatch_key, e.created_at,",
    version!(),
    ", e.payload,
       (SELECT jsonb_agg(jsonb_build_object(
                   'route', d.route, 'state', d.state, 'attempts', d.attempts,
                   'last_error', d.last_error, 'published_at', d.published_at, 'updated_at', d.updated_at,
                   'failures', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                           'attempt', f.attempt, 'at', f.at, 'dead', f.dead, 'error', f.error)
                                       ORDER BY f.id), '[]'::jsonb)
                                  FROM ferry.failures f WHERE f.seq = d.seq AND f.route = d.route),
                   'actions', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                          'at', a.at, 'actor', a.actor, 'action', a.action,
                                          'from_state', a.from_state, 'attempts', a.attempts, 'reason', a.reason)
                                      ORDER BY a.id), '[]'::jsonb)
                                 FROM ferry.admin_log a WHERE a.seq = d.seq AND a.route = d.route))
               ORDER BY d.route)
          FROM ferry.deliveries d WHERE d.seq = e.seq)
     FROM ferry.events e WHERE e.seq = ANY($1::bigint[]) AND",
    due!(),
    "ORDER BY e.seq"
);

/// Under the delete's locks: the versions of the batch's events still due.
/// Same parameters.
const RECHECK: &str = concat!(
    "SELECT e.seq,",
    version!(),
    "FROM ferry.events e WHERE e.seq = ANY($1::bigint[]) AND",
    due!(),
    "ORDER BY e.seq"
);

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
        // The next stored event: the stretch starts there, over any gap in
        // the seqs. Events are stored roughly in creation order: once it is
        // younger than every window, nothing after it can be due yet.
        let next: Option<(i64, DateTime<Utc>)> =
            sqlx::query_as("SELECT seq, created_at FROM ferry.events WHERE seq > $1 ORDER BY seq LIMIT 1")
                .bind(after)
                .fetch_optional(self.pool())
                .await
                .map_err(store_error)?;
        let from = match next {
            Some((seq, created)) if seq <= upto && created < newest_cutoff => seq - 1,
            _ => return Ok(Box::new(PgExpired::empty(self, upto))),
        };
        let limit = rules.batch_size.max(1) as i64;
        let stretch_end = from.saturating_add(limit.saturating_mul(STRETCH)).min(upto);
        let candidates: Vec<i64> = sqlx::query_scalar(include_str!("sql/retention_expired.sql"))
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
        let mut batch = PgExpired::empty(self, scanned_to);
        if candidates.is_empty() {
            return Ok(Box::new(batch));
        }
        batch.published = published;
        batch.settled = settled;
        let rows = sqlx::query(READ)
            .bind(&candidates)
            .bind(published)
            .bind(settled)
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        for row in rows {
            let (event, version) = event_of(&row);
            batch.events.push(event);
            batch.versions.push(version);
        }
        Ok(Box::new(batch))
    }
}

/// An event without its payload and deliveries, and its version.
fn event_of(row: &PgRow) -> (ArchivedEvent, Option<String>) {
    let event = ArchivedEvent {
        seq: row.get(0),
        id: row.get(1),
        event_type: row.get(2),
        key: row.get(3),
        content_type: row.get(4),
        headers: row.get(5),
        payload: None,
        payload_base64: None,
        dispatch_key: row.get(6),
        created_at: row.get(7),
        deliveries: Vec::new(),
    };
    (event, row.get(8))
}

/// Before the batch goes, under its locks: keeps in `ferry.purged_order`
/// what a requeue's order check needs of its published deliveries, and
/// drops the marks of its keys that no kept delivery sits before any more
/// (see migration 31). A mark is written in the delete's transaction, so a
/// reader sees either the published delivery or its mark, never neither.
/// Runs take turns at this (an advisory lock, which no producer takes: its
/// buckets are 1 to 1024), so two batches sharing keys never deadlock on
/// the marks.
async fn mark_order(tx: &mut sqlx::PgConnection, events: &[ArchivedEvent]) -> Result<(), sqlx::Error> {
    let mut keys: Vec<&str> = events.iter().filter_map(|e| e.key.as_deref()).collect();
    keys.sort_unstable();
    keys.dedup();
    let Some(last) = events.iter().map(|e| e.seq).max().filter(|_| !keys.is_empty()) else {
        return Ok(());
    };
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    sqlx::query("SELECT pg_advisory_xact_lock(1178948185, 1025)")
        .execute(&mut *tx)
        .await?;
    // A mark of an earlier run may lie past the batch: what is kept before
    // it counts too.
    let marked: Option<i64> = sqlx::query_scalar("SELECT max(seq) FROM ferry.purged_order WHERE key = ANY($1::text[])")
        .bind(&keys)
        .fetch_one(&mut *tx)
        .await?;
    let kept: Vec<(String, i64)> = sqlx::query_as(include_str!("sql/retention_kept.sql"))
        .persistent(false)
        .bind(&seqs)
        .bind(&keys)
        .bind(marked.map_or(last, |m| m.max(last)))
        .fetch_all(&mut *tx)
        .await?;
    let (kept_keys, kept_seqs): (Vec<String>, Vec<i64>) = kept.into_iter().unzip();
    sqlx::query(
        "DELETE FROM ferry.purged_order m
          WHERE m.key = ANY($1::text[])
            AND NOT EXISTS (SELECT 1 FROM unnest($2::text[], $3::bigint[]) AS k(key, seq)
                             WHERE k.key = m.key AND k.seq < m.seq)",
    )
    .bind(&keys)
    .bind(&kept_keys)
    .bind(&kept_seqs)
    .execute(&mut *tx)
    .await?;
    if !kept_keys.is_empty() {
        sqlx::query(include_str!("sql/retention_marks.sql"))
            .bind(&seqs)
            .bind(&kept_keys)
            .bind(&kept_seqs)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// A lock that waited too long: someone else's rows for now.
fn lock_timed_out(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

struct PgExpired {
    store: PgStore,
    published: DateTime<Utc>,
    settled: Option<DateTime<Utc>>,
    events: Vec<ArchivedEvent>,
    /// Each event's version as read, to find it unchanged at the delete.
    versions: Vec<Option<String>>,
    scanned_to: i64,
}

impl PgExpired {
    fn empty(store: &PgStore, scanned_to: i64) -> Self {
        Self {
            store: store.clone(),
            published: DateTime::<Utc>::MIN_UTC,
            settled: None,
            events: Vec::new(),
            versions: Vec::new(),
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

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), StoreError> {
        let seqs: Vec<i64> = self.events.iter().map(|e| e.seq).collect();
        // Payload sizes without reading the payloads.
        let sizes: Vec<(i64, Option<i32>)> =
            sqlx::query_as("SELECT seq, octet_length(payload) FROM ferry.events WHERE seq = ANY($1) ORDER BY seq")
                .bind(&seqs)
                .fetch_all(self.store.pool())
                .await
                .map_err(store_error)?;
        let (kept, cut) = crate::retention::within_budget(sizes, max_payload_bytes);
        if let Some(cut) = cut {
            self.scanned_to = cut;
        }
        let rows = sqlx::query(READ_WHOLE)
            .bind(&kept)
            .bind(self.published)
            .bind(self.settled)
            .fetch_all(self.store.pool())
            .await
            .map_err(store_error)?;
        self.events.clear();
        self.versions.clear();
        for row in rows {
            let (mut event, version) = event_of(&row);
            let deliveries: serde_json::Value = row.get(10);
            event.deliveries = serde_json::from_value::<Option<Vec<ArchivedDelivery>>>(deliveries)
                .map_err(|e| StoreError::permanent(format!("retention: unreadable deliveries: {e}")))?
                .unwrap_or_default();
            event.set_payload(row.get::<&[u8], _>(9));
            self.events.push(event);
            self.versions.push(version);
        }
        Ok(())
    }

    async fn delete(self: Box<Self>) -> Result<Deleted, DeleteFailed> {
        if self.events.is_empty() {
            return Ok(Deleted::default());
        }
        let seqs: Vec<i64> = self.events.iter().map(|e| e.seq).collect();
        let mut tx: Transaction<'static, sqlx::Postgres> = self
            .store
            .pool()
            .begin()
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", LOCK_TIMEOUT.as_millis()))
            .execute(&mut *tx)
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        let locked =
            sqlx::query("SELECT 1 FROM ferry.deliveries WHERE seq = ANY($1::bigint[]) ORDER BY seq, route FOR UPDATE")
                .bind(&seqs)
                .execute(&mut *tx)
                .await;
        match locked {
            Ok(_) => {}
            Err(e) if lock_timed_out(&e) => {
                tracing::info!(
                    events = seqs.len(),
                    "retention: a batch's deliveries stayed locked (an operator's command?); it stays, for a later run"
                );
                return Ok(Deleted {
                    changed: true,
                    ..Deleted::default()
                });
            }
            Err(e) => return Err(DeleteFailed::before_commit(store_error(e))),
        }
        let now: Vec<(i64, Option<String>)> = sqlx::query_as(RECHECK)
            .bind(&seqs)
            .bind(self.published)
            .bind(self.settled)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| DeleteFailed::before_commit(store_error(e)))?;
        let unchanged = now.len() == seqs.len()
            && now
                .iter()
                .zip(seqs.iter().zip(&self.versions))
                .all(|((seq, version), (read_seq, read_version))| seq == read_seq && version == read_version);
        if !unchanged {
            tracing::info!(
                events = seqs.len(),
                "retention: events changed since they were read; the batch stays, for a later run"
            );
            return Ok(Deleted {
                changed: true,
                ..Deleted::default()
            });
        }
        match mark_order(&mut tx, &self.events).await {
            Ok(()) => {}
            Err(e) if lock_timed_out(&e) => {
                tracing::info!(
                    events = seqs.len(),
                    "retention: another run's order marks stayed locked; the batch stays, for a later run"
                );
                return Ok(Deleted {
                    changed: true,
                    ..Deleted::default()
                });
            }
            Err(e) => return Err(DeleteFailed::before_commit(store_error(e))),
        }
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
