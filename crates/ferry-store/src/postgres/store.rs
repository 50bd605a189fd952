use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectRecord, EventId, Ownership, Partition, Recorded, RelayId, RoutePlan, Store, StoreError,
    StoredEvent, Transition, UnroutedEvent, WakeSource,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::direct::{self, Conflicts, SettleMode};
use super::error::store_error;
use super::listen::PgWakeSource;

/// The PostgreSQL outbox store.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// The backlogs the direct fetch has met (see `fetch_direct`).
    backlog: Arc<Backlog>,
}

#[derive(Debug, Default)]
struct Backlog {
    /// The last direct fetch came back full.
    draining: AtomicBool,
    /// How many backlogs began: the number of the current one.
    begun: AtomicU64,
}

impl PgStore {
    /// A store over `pool`. A relay's pool is best built from
    /// [`PgStore::relay_pool_options`].
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            backlog: Arc::default(),
        }
    }

    /// Connects lazily: a database that is down at start is retried by the
    /// relay rather than failing the process.
    pub fn connect_lazy(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::connect_lazy_with(PgPoolOptions::new(), url, max_connections)
    }

    /// [`PgStore::connect_lazy`] for a relay: its connections come from
    /// [`PgStore::relay_pool_options`].
    pub fn connect_lazy_relay(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::connect_lazy_with(Self::relay_pool_options(), url, max_connections)
    }

    fn connect_lazy_with(pool: PgPoolOptions, url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(|e| {
            StoreError::config(format!("database.url: {e}; write it like postgres://user@host:5432/db"))
        })?;
        let pool = pool
            .max_connections(max_connections.max(2))
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options.application_name("ferry"));
        Ok(Self::new(pool))
    }

    /// Pool options for a relay: every connection prepares the statements
    /// an idle relay runs (the heartbeat and the fallback poll) as it opens.
    /// A statement's first run on a connection costs a round trip of its own
    /// (sqlx prepares it first), which PostgreSQL counts as a transaction;
    /// the pool lends its idle connections in turn, so without this an idle
    /// relay's heartbeat cost two transactions on each connection's first
    /// turn, for a minute or more after a burst.
    pub fn relay_pool_options() -> PgPoolOptions {
        PgPoolOptions::new().after_connect(|conn, _| {
            Box::pin(async move {
                use sqlx::{Executor, SqlSafeStr};
                for sql in [TICK, FETCH_DIRECT] {
                    if let Err(e) = conn.prepare(sql.into_sql_str()).await {
                        // Not migrated yet, say: the relay's first tick reports it.
                        tracing::debug!(error = %e, "a relay statement was not prepared");
                        break;
                    }
                }
                Ok(())
            })
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// The heartbeat: renews this relay's leases and reports the others. The
/// four-argument `ferry.relay_tick` (schema 30) releases a partition only
/// under the token it was held by; the relay needs schema 30, and on an
/// older one stops at start (an undefined function: run `ferry migrate`).
const TICK: &str = "SELECT partition, token, live_relays, total_partitions FROM ferry.relay_tick($1, $2, $3, $4)";
/// The router's fetch of new events, also its fallback poll.
const FETCH_DIRECT: &str = include_str!("sql/fetch_direct.sql");

fn interval(d: Duration) -> sqlx::postgres::types::PgInterval {
    sqlx::postgres::types::PgInterval {
        months: 0,
        days: 0,
        microseconds: d.as_micros().min(i64::MAX as u128) as i64,
    }
}

#[async_trait]
impl Store for PgStore {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        let (partitions, tokens): (Vec<Partition>, Vec<i64>) = release.iter().copied().unzip();
        let rows = sqlx::query(TICK)
            .bind(&relay.0)
            .bind(interval(lease))
            .bind(partitions)
            .bind(tokens)
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        let mut own = Ownership::default();
        for row in rows {
            own.leases.push((row.get(0), row.get(1)));
            own.live_relays = row.get::<i32, _>(2) as u32;
            own.total_partitions = row.get::<i32, _>(3) as u32;
        }
        if own.leases.is_empty() {
            let (live, total): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM ferry.relays WHERE heartbeat_at > now() - $1::interval),
                        (SELECT count(*) FROM ferry.partitions)",
            )
            .bind(interval(lease))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
            own.live_relays = live as u32;
            own.total_partitions = total as u32;
        }
        Ok(own)
    }

    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        // The relay's row first, then its partitions: the order
        // `ferry.relay_tick` locks them in. The other order deadlocks with a
        // renewal still running, and PostgreSQL may cancel the hand-back.
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        sqlx::query("DELETE FROM ferry.relays WHERE id = $1")
            .bind(&relay.0)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        // Released only under the token it was held by, as in a tick.
        let (partitions, tokens): (Vec<Partition>, Vec<i64>) = held.iter().copied().unzip();
        sqlx::query(
            "UPDATE ferry.partitions p SET owner = NULL, expires_at = NULL
              WHERE p.owner = $1
                AND (p.partition, p.token) IN (SELECT b.partition, b.token
                                                 FROM unnest($2::int[], $3::bigint[]) AS b(partition, token))",
        )
        .bind(&relay.0)
        .bind(partitions)
        .bind(tokens)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)
    }

    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError> {
        if owned.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(include_str!("sql/fetch_unrouted.sql"))
            .bind(owned.partitions())
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|r| UnroutedEvent {
                seq: r.get(0),
                partition: r.get(1),
                event_type: r.get(2),
                key: r.get(3),
            })
            .collect())
    }

    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError> {
        let seqs: Vec<i64> = plans.iter().map(|p| p.event.seq).collect();
        let records: Vec<DirectRecord> = plans.iter().flat_map(RoutePlan::records).collect();
        self.settle(owned, &seqs, &records, now).await
    }

    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        if owned.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(include_str!("sql/claim.sql"))
            // Unprepared: planned for the actual arrays on every run. A cached
            // generic plan guesses their sizes and can turn a batch's
            // primary-key lookups into repeated scans.
            .persistent(false)
            .bind(route)
            .bind(owned.partitions())
            .bind(now)
            .bind(limit as i64)
            .bind(exclude)
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        rows.iter().map(claimed_of).collect()
    }

    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        if outcomes.is_empty() {
            return Ok(0);
        }
        let n = outcomes.len();
        let mut seq = Vec::with_capacity(n);
        let mut expected = Vec::with_capacity(n);
        let mut state = Vec::with_capacity(n);
        let mut attempts = Vec::with_capacity(n);
        let mut next_at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
        let mut error: Vec<Option<String>> = Vec::with_capacity(n);
        let mut published_at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
        for o in outcomes {
            seq.push(o.seq);
            expected.push(o.expected_attempts as i32);
            attempts.push(o.transition.attempts() as i32);
            match &o.transition {
                Transition::Published { at, .. } => {
                    state.push("published");
                    next_at.push(None);
                    error.push(None);
                    published_at.push(Some(*at));
                }
                Transition::Retry {
                    next_at: at, error: e, ..
                } => {
                    state.push("pending");
                    next_at.push(Some(*at));
                    error.push(Some(e.clone()));
                    published_at.push(None);
                }
                Transition::Dead { reason, .. } => {
                    state.push("dead");
                    next_at.push(None);
                    error.push(Some(reason.clone()));
                    published_at.push(None);
                }
            }
        }
        let applied: i64 = sqlx::query_scalar(include_str!("sql/record.sql"))
            .bind(relay_of(owned))
            .bind(owned.partitions())
            .bind(owned.tokens())
            .bind(route)
            .bind(&seq)
            .bind(&expected)
            .bind(&state)
            .bind(&attempts)
            .bind(&next_at)
            .bind(&error)
            .bind(&published_at)
            .bind(now)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(applied as u64)
    }

    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        if owned.is_empty() {
            return Ok(None);
        }
        sqlx::query_scalar(include_str!("sql/next_due.sql"))
            .bind(route)
            .bind(owned.partitions())
            .bind(now)
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)
    }

    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        if owned.is_empty() {
            return Ok(Some(DirectBatch::default()));
        }
        // Each backlog gets a statement of its own. After five runs
        // PostgreSQL may keep a prepared statement's generic plan, made for
        // the tables' sizes of then, until the next ANALYZE: made while the
        // relay kept up with a trickle, over an `unrouted` of a row or two,
        // it read and sorted the whole table on every fetch of the next
        // burst (100,000 events after 30 seconds of trickle drained in 3.1
        // to 3.6 s instead of 1.8 to 1.9 s). Once a fetch comes back full,
        // the fetches of that backlog run a text of their own (the same
        // statement, numbered), planned for the backlog they meet; a trickle
        // keeps its cached plan, whose planning it would pay per event.
        let draining = self.backlog.draining.load(Ordering::Relaxed);
        let numbered;
        let sql = if draining {
            let number = self.backlog.begun.load(Ordering::Relaxed);
            numbered = format!("{FETCH_DIRECT}\n-- backlog {number}\n");
            numbered.as_str()
        } else {
            FETCH_DIRECT
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(owned.partitions())
            .bind(limit as i64)
            .bind(routes)
            .bind(down)
            .bind(exclude)
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        let full = rows.len() >= limit;
        if full && !draining {
            self.backlog.begun.fetch_add(1, Ordering::Relaxed);
        }
        self.backlog.draining.store(full, Ordering::Relaxed);
        let mut batch = DirectBatch::default();
        for (i, r) in rows.iter().enumerate() {
            batch.events.push(claimed_of(r)?);
            batch.held.push(r.get(10));
            if i == 0 {
                batch.busy = r.get(11);
            }
        }
        Ok(Some(batch))
    }

    async fn settle(
        &self,
        owned: &Ownership,
        seqs: &[i64],
        records: &[DirectRecord],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        if seqs.is_empty() || owned.is_empty() {
            return Ok(0);
        }
        let rows = records
            .iter()
            .map(|r| (r.seq, r.route.as_str(), r.key.as_deref(), &r.outcome));
        // Asynchronous commit: a write lost in a database crash leaves the
        // events unrouted and the relay publishes them again; a duplicate,
        // never a loss (ARCHITECTURE.md, "Durability of the relay's own
        // writes"). The relay wakes its own route workers for what it parked.
        let rows = direct::Deliveries::new(rows, now);
        let mode = |conflicts| SettleMode {
            fence: Some(owned),
            notify: false,
            durable: false,
            conflicts,
        };
        let written = match direct::settle(&self.pool, seqs, &rows, mode(Conflicts::Fail)).await {
            // Nothing was written; write each delivery once.
            Err(e) if direct::is_unique_violation(&e) => {
                tracing::warn!(error = %e, "a direct batch repeated a delivery; settling it again, keeping the first");
                direct::settle(&self.pool, seqs, &rows, mode(Conflicts::Skip)).await
            }
            written => written,
        };
        Ok(written.map_err(store_error)?.gone)
    }

    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        sqlx::query("UPDATE ferry.relays SET sleeping = $2 WHERE id = $1 AND sleeping <> $2")
            .bind(&relay.0)
            .bind(sleeping)
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn producers_open(&self) -> Result<bool, StoreError> {
        // Writing an event holds ROW EXCLUSIVE on ferry.events until the
        // transaction ends. pg_locks shows every session's locks (fast-path
        // ones too) to any role, unlike pg_stat_activity.
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks \
                             WHERE locktype = 'relation' AND relation = 'ferry.events'::regclass \
                               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                               AND mode = 'RowExclusiveLock' AND granted AND pid <> pg_backend_pid())",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)
    }

    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        Ok(Box::new(PgWakeSource::connect(&self.pool).await?))
    }
}

/// A row laid out as claim.sql's: seq, partition, attempts, then the event.
fn claimed_of(r: &PgRow) -> Result<Claimed, StoreError> {
    let headers: serde_json::Value = r.get(8);
    let headers: BTreeMap<String, String> = serde_json::from_value(headers)
        .map_err(|e| StoreError::permanent(format!("event headers are not a string map: {e}")))?;
    Ok(Claimed {
        partition: r.get(1),
        attempts: r.get::<i32, _>(2).max(0) as u32,
        event: StoredEvent {
            id: EventId(r.get::<Uuid, _>(3)),
            seq: r.get(0),
            event_type: r.get(4),
            key: r.get(5),
            payload: Bytes::from(r.get::<Vec<u8>, _>(6)),
            content_type: r.get(7),
            headers,
            created_at: r.get(9),
        },
    })
}

/// The relay a lease set belongs to travels with the ownership.
fn relay_of(owned: &Ownership) -> &str {
    &owned.relay.0
}
