//! The bench's own database: created fresh and migrated at the start, dropped
//! at the end (also after an error), and read for its transaction counters.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

const NAME_PREFIX: &str = "ferry_bench_";

/// A database named `ferry_bench_<hex>` with the Ferry schema.
pub(crate) struct BenchDb {
    name: String,
    /// The database's URL, for the WAL stream's replication connection.
    url: String,
    admin: PgConnectOptions,
    options: PgConnectOptions,
    pool: PgPool,
}

impl BenchDb {
    /// Creates and migrates the database. `admin_url` must let its user
    /// create databases.
    pub(crate) async fn create(admin_url: &str) -> anyhow::Result<Self> {
        let admin = PgConnectOptions::from_str(admin_url)
            .map_err(|e| crate::commands::UsageError(format!("--database-url: {e}")))?
            .application_name("ferry-bench");
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .with_context(|| format!("cannot connect to PostgreSQL at {}", ferry_core::redact::url(admin_url)))?;
        let name = format!("{NAME_PREFIX}{:016x}", rand::random::<u64>());
        // The name is ours (prefix and hex digits): nothing to quote.
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .with_context(|| format!("CREATE DATABASE {name} (the --database-url user must be allowed to)"))?;
        let _ = conn.close().await;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options.clone());
        let mut url =
            url::Url::parse(admin_url).map_err(|e| crate::commands::UsageError(format!("--database-url: {e}")))?;
        url.set_path(&name);
        let db = Self {
            url: url.to_string(),
            name,
            admin,
            options,
            pool,
        };
        if let Err(e) = db.migrate().await {
            db.drop_db().await?;
            return Err(e);
        }
        Ok(db)
    }

    async fn migrate(&self) -> anyhow::Result<()> {
        let mut conn = self.pool.acquire().await.context("connecting to the bench database")?;
        ferry_store::postgres::migrate(&mut conn)
            .await
            .context("migrating the bench database")?;
        Ok(())
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Options for a connection to the bench database.
    pub(crate) fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// A small pool for the bench's own set-up queries.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A connection to the admin database, so that reading statistics adds
    /// no transaction to the bench database's own counters.
    pub(crate) async fn admin(&self) -> anyhow::Result<PgConnection> {
        PgConnection::connect_with(&self.admin)
            .await
            .context("connecting to the admin database")
    }

    /// Empties the outbox and forgets relays, so each scenario starts alike.
    pub(crate) async fn reset_outbox(&self) -> anyhow::Result<()> {
        sqlx::raw_sql(
            "TRUNCATE ferry.events, ferry.unrouted, ferry.deliveries, ferry.failures;
             DELETE FROM ferry.relays;
             UPDATE ferry.partitions SET owner = NULL, expires_at = NULL;",
        )
        .execute(&self.pool)
        .await
        .context("resetting the outbox")?;
        Ok(())
    }

    /// Drops the database, ending any connection still open to it.
    pub(crate) async fn drop_db(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut conn = PgConnection::connect_with(&self.admin).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut conn)
        .await
        .with_context(|| format!("DROP DATABASE {}", self.name))?;
        let _ = conn.close().await;
        Ok(())
    }
}

/// Committed plus rolled-back transactions of database `name` so far, as the
/// statistics system has them (PostgreSQL 15 flushes a backend's counters at
/// most once a second, so read with a margin).
pub(crate) async fn transactions(admin: &mut PgConnection, name: &str) -> anyhow::Result<i64> {
    let n: i64 =
        sqlx::query_scalar("SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = $1")
            .bind(name)
            .fetch_one(admin)
            .await
            .context("reading pg_stat_database")?;
    Ok(n)
}

/// `SHOW server_version`.
pub(crate) async fn server_version(pool: &PgPool) -> anyhow::Result<String> {
    let v: String = sqlx::query_scalar("SHOW server_version").fetch_one(pool).await?;
    Ok(v)
}
