//! The outbox store named by `database.url`: PostgreSQL, or SQLite when the
//! binary is built with it. One type for every command, so each verb works
//! on both without knowing which it has.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectRecord, EventId, Ownership, Partition, Recorded, RelayId, RoutePlan, Store, StoreError,
    UnroutedEvent, WakeSource,
};
use ferry_store::postgres::PgStore;
#[cfg(feature = "sqlite")]
use ferry_store::sqlite::SqliteStore;
use ferry_store::{
    Action, Admin, Applied, Change, ExpiredBatch, Filter, GaugeReport, Gauges, ListPage, Page, Plan, Retention,
    RetentionRules, StatusReport, Target,
};

use crate::config::Config;

/// Whether `url` names an SQLite database.
pub fn is_sqlite(url: &str) -> bool {
    url.get(..7).is_some_and(|s| s.eq_ignore_ascii_case("sqlite:"))
}

#[derive(Clone)]
pub enum AnyStore {
    Postgres(PgStore),
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteStore),
}

impl AnyStore {
    /// Connects lazily: nothing is opened until the first query. An SQLite
    /// file is created if missing; `ferry migrate` creates its schema.
    pub fn open(cfg: &Config) -> Result<Self, StoreError> {
        Self::open_as(cfg, false)
    }

    /// [`AnyStore::open`] for `ferry run`: PostgreSQL connections prepare
    /// what an idle relay runs as they open ([`PgStore::relay_pool_options`]).
    pub fn open_for_relay(cfg: &Config) -> Result<Self, StoreError> {
        Self::open_as(cfg, true)
    }

    fn open_as(cfg: &Config, relay: bool) -> Result<Self, StoreError> {
        let url = &cfg.database.url;
        if is_sqlite(url) {
            #[cfg(feature = "sqlite")]
            {
                let options = ferry_store::sqlite::connect_options(url)?;
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(cfg.database.max_connections.max(2))
                    .acquire_timeout(Duration::from_secs(30))
                    .connect_lazy_with(options);
                return Ok(AnyStore::Sqlite(SqliteStore::new(pool)));
            }
            #[cfg(not(feature = "sqlite"))]
            return Err(StoreError::config(
                "database.url names SQLite, but this ferry was built without it; rebuild with `--features sqlite`",
            ));
        }
        let max = cfg.database.max_connections;
        let store = if relay {
            PgStore::connect_lazy_relay(url, max)
        } else {
            PgStore::connect_lazy(url, max)
        };
        store.map(AnyStore::Postgres)
    }

    /// Creates or upgrades the schema; returns the versions applied.
    pub async fn migrate(&self) -> anyhow::Result<Vec<i32>> {
        Ok(match self {
            AnyStore::Postgres(s) => ferry_store::postgres::migrate(&mut *s.pool().acquire().await?).await?,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => {
                // Classified, for the fix of a file that cannot be opened
                // (its directory missing or not writable).
                let mut conn = s.pool().acquire().await.map_err(ferry_store::sqlite::store_error)?;
                ferry_store::sqlite::migrate(&mut conn).await?
            }
        })
    }

    /// How long ago the relay named `id` last renewed its leases; `None`
    /// when no relay of that name is registered (it never ran, or handed
    /// its leases back when it stopped).
    pub async fn heartbeat_age(&self, id: &str) -> Result<Option<Duration>, sqlx::Error> {
        let micros: Option<i64> = match self {
            AnyStore::Postgres(s) => {
                sqlx::query_scalar(
                    "SELECT (extract(epoch FROM clock_timestamp() - heartbeat_at) * 1000000)::bigint
                       FROM ferry.relays WHERE id = $1",
                )
                .bind(id)
                .fetch_optional(s.pool())
                .await?
            }
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => {
                sqlx::query_scalar(
                    "SELECT CAST(unixepoch('subsec') * 1000000 AS INTEGER) - heartbeat_at
                       FROM ferry_relays WHERE id = ?1",
                )
                .bind(id)
                .fetch_optional(s.pool())
                .await?
            }
        };
        Ok(micros.map(|us| Duration::from_micros(us.max(0).unsigned_abs())))
    }

    /// The schema version the database is at (`None`: no Ferry schema) and
    /// the newest this binary knows. An unreachable database is an error.
    pub async fn schema_version(&self) -> Result<(Option<i32>, i32), sqlx::Error> {
        match self {
            AnyStore::Postgres(s) => {
                let known = ferry_store::postgres::MIGRATIONS.last().map_or(0, |m| m.0);
                let mut conn = s.pool().acquire().await?;
                let found = sqlx::query_scalar("SELECT max(version) FROM ferry.schema_migrations")
                    .fetch_one(&mut *conn)
                    .await;
                Ok((no_table_is_none(found, "42P01")?, known))
            }
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => {
                let known = ferry_store::sqlite::MIGRATIONS.last().map_or(0, |m| m.0);
                let mut conn = s.pool().acquire().await?;
                let found = sqlx::query_scalar("SELECT max(version) FROM ferry_schema_migrations")
                    .fetch_one(&mut *conn)
                    .await;
                // SQLite has no SQLSTATE: "no such table" is its generic error.
                Ok((no_table_is_none(found, "1")?, known))
            }
        }
    }
}

/// The version read, `None` when the table is missing (SQLSTATE or SQLite
/// code `missing`). Any other failure (a permission, a timeout) is an error,
/// not a missing schema.
fn no_table_is_none(found: Result<Option<i32>, sqlx::Error>, missing: &str) -> Result<Option<i32>, sqlx::Error> {
    match found {
        Ok(version) => Ok(version),
        Err(sqlx::Error::Database(e))
            if e.code().as_deref() == Some(missing) && (missing != "1" || e.message().contains("no such table")) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Calls the same method on whichever store this is.
macro_rules! each {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyStore::Postgres($s) => $call,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite($s) => $call,
        }
    };
}

#[async_trait]
impl Store for AnyStore {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        each!(self, s => s.tick(relay, lease, release).await)
    }
    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        each!(self, s => s.leave(relay, held).await)
    }
    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError> {
        each!(self, s => s.fetch_unrouted(owned, limit).await)
    }
    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError> {
        each!(self, s => s.route(owned, plans, now).await)
    }
    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        each!(self, s => s.fetch_direct(owned, limit, routes, down, exclude).await)
    }
    async fn settle(
        &self,
        owned: &Ownership,
        seqs: &[i64],
        records: &[DirectRecord],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        each!(self, s => s.settle(owned, seqs, records, now).await)
    }
    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        each!(self, s => s.claim(owned, route, limit, now, exclude).await)
    }
    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        each!(self, s => s.record(owned, route, outcomes, now).await)
    }
    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        each!(self, s => s.next_due(owned, route, now).await)
    }
    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        each!(self, s => s.set_sleeping(relay, sleeping).await)
    }
    async fn producers_open(&self) -> Result<bool, StoreError> {
        each!(self, s => s.producers_open().await)
    }
    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        each!(self, s => s.listen().await)
    }
}

#[async_trait]
impl Admin for AnyStore {
    async fn status(&self) -> Result<StatusReport, StoreError> {
        each!(self, s => Admin::status(s).await)
    }
    async fn list(&self, filter: &Filter, page: &Page) -> Result<ListPage, StoreError> {
        each!(self, s => s.list(filter, page).await)
    }
    async fn show(&self, id: EventId) -> Result<Option<ferry_store::EventView>, StoreError> {
        each!(self, s => s.show(id).await)
    }
    async fn plan(&self, action: &Action, selection: &Filter) -> Result<Plan, StoreError> {
        each!(self, s => s.plan(action, selection).await)
    }
    async fn apply(&self, action: &Action, actor: &str, targets: &[Target]) -> Result<Applied, StoreError> {
        each!(self, s => s.apply(action, actor, targets).await)
    }
    async fn changes_since(
        &self,
        since: DateTime<Utc>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Change>, StoreError> {
        each!(self, s => s.changes_since(since, after, limit).await)
    }
}

#[async_trait]
impl Retention for AnyStore {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, StoreError> {
        each!(self, s => s.retention_range().await)
    }
    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, StoreError> {
        each!(self, s => s.take_expired(rules, after, upto, now).await)
    }
}

#[async_trait]
impl Gauges for AnyStore {
    async fn gauges(&self) -> Result<GaugeReport, StoreError> {
        each!(self, s => s.gauges().await)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        each!(self, s => s.ping().await)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sqlite_urls_are_told_apart() {
        assert!(super::is_sqlite("sqlite://ferry.db"));
        assert!(super::is_sqlite("SQLite:ferry.db"));
        assert!(!super::is_sqlite("postgres://h/db"));
        assert!(!super::is_sqlite("sqlit"));
    }
}
