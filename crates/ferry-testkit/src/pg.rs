//! A fresh PostgreSQL database per test.
//!
//! Tests never share mutable state: each one calls [`TestDb::create`] and gets
//! an empty database of its own, dropped again when the [`TestDb`] goes away.
//! The server is found through [`admin_url`]; `scripts/test` starts it when it
//! is down.
//!
//! ```no_run
//! # async fn demo() {
//! use ferry_testkit::pg::TestDb;
//! let db = TestDb::create().await;
//! let pool = db.pool().await;
//! sqlx::query("CREATE TABLE t (id int)").execute(&pool).await.unwrap();
//! db.drop_db().await;
//! # }
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};

/// Environment variable naming the admin URL, for running the tests against
/// a server other than the local default.
pub const ADMIN_URL_ENV: &str = "FERRY_TEST_PG_URL";
const DEFAULT_ADMIN_URL: &str = "postgres://root@127.0.0.1:5432/postgres";
const NAME_PREFIX: &str = "ferry_t_";
/// A database older than this whose test has not dropped it counts as left
/// behind by an earlier run. The margin keeps a concurrent run's live
/// databases safe: no single test holds its database this long.
const LEFTOVER_AGE_SECS: u32 = 10 * 60;
/// Bounds for the cleanup in `Drop`, which must not hang a test's teardown.
const DROP_TIMEOUT: Duration = Duration::from_secs(30);

/// The URL of a database that may create and drop databases: the value of
/// `FERRY_TEST_PG_URL`, or the local server's `postgres` database.
pub fn admin_url() -> String {
    std::env::var(ADMIN_URL_ENV).unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned())
}

/// A uniquely named database that lives as long as this value.
///
/// Drop it with [`drop_db`](Self::drop_db) where the test can await; the
/// `Drop` impl covers every other exit, including a panicking test.
#[derive(Debug)]
pub struct TestDb {
    name: String,
    url: String,
    admin_url: String,
    dropped: bool,
}

impl TestDb {
    /// Creates an empty database named `ferry_t_<hex>`.
    ///
    /// # Panics
    ///
    /// When the server is unreachable or refuses; a test cannot proceed
    /// without its database, and the message says how to fix it.
    pub async fn create() -> TestDb {
        Self::create_on(&admin_url()).await
    }

    /// Creates an empty database on the server of `admin_url`, such as a
    /// [`PgServer`](crate::pg_server::PgServer) of the test's own.
    ///
    /// # Panics
    ///
    /// As [`create`](Self::create).
    pub async fn create_on(admin_url: &str) -> TestDb {
        let admin_url = admin_url.to_owned();
        let mut admin = PgConnection::connect(&admin_url).await.unwrap_or_else(|e| {
            panic!(
                "cannot connect to PostgreSQL at {} ({e}); start it with scripts/test --services-only, \
                 or point {ADMIN_URL_ENV} at a server where this user may create databases",
                ferry_core::redact::url(&admin_url)
            )
        });
        let mut attempt: u64 = 0;
        let name = loop {
            attempt += 1;
            let name = unique_name();
            let created = sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&mut admin)
                .await;
            match created {
                Ok(_) => break name,
                // Two CREATE DATABASE at once can collide on the template
                // ("being accessed by other users"), and a name can repeat;
                // both are worth a retry, anything else is not.
                Err(e) if attempt < 5 && is_retryable_create_error(&e) => {
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => panic!("CREATE DATABASE {name} failed: {e}"),
            }
        };
        let _ = admin.close().await;
        TestDb {
            url: with_database(&admin_url, &name),
            name,
            admin_url,
            dropped: false,
        }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL to connect to this database, with the admin URL's credentials
    /// and parameters.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A new pool connected to this database.
    ///
    /// # Panics
    ///
    /// When the database cannot be reached.
    pub async fn pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(5)
            .connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to test database {}: {e}", self.name))
    }

    /// Drops the database now, terminating any connections still open to it.
    ///
    /// # Panics
    ///
    /// When the drop fails; the `Drop` impl then tries once more.
    pub async fn drop_db(mut self) {
        drop_database(&self.admin_url, &self.name)
            .await
            .unwrap_or_else(|e| panic!("DROP DATABASE {} failed: {e}", self.name));
        self.dropped = true;
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // A thread with its own runtime works whether or not the caller is
        // inside a runtime (block_on inside one would panic), and whatever
        // flavour that runtime is.
        // Builder::spawn, unlike thread::spawn, reports a failure to create
        // the thread instead of panicking.
        let cleanup = std::thread::Builder::new().spawn(move || -> Result<(), String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                match tokio::time::timeout(DROP_TIMEOUT, drop_database(&admin_url, &name)).await {
                    Ok(result) => result.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within {DROP_TIMEOUT:?}")),
                }
            })
        });
        // Never panic here: this may run while a failed test unwinds, and
        // `drop_leftovers` removes whatever is left.
        let outcome = match cleanup {
            Ok(thread) => thread
                .join()
                .unwrap_or_else(|_| Err("the cleanup thread panicked".to_owned())),
            Err(e) => Err(format!("cannot start a cleanup thread: {e}")),
        };
        if let Err(e) = outcome {
            eprintln!("warning: could not drop test database {}: {e}", self.name);
        }
    }
}

/// Drops the test databases earlier runs left behind (crashed or killed
/// tests skip their cleanup), and returns their names.
///
/// Only databases older than ten minutes go, so a test suite running at the
/// same time against the same server keeps its databases.
pub async fn drop_leftovers() -> Result<Vec<String>, sqlx::Error> {
    let admin_url = admin_url();
    let mut admin = PgConnection::connect(&admin_url).await?;
    // The creation time is part of the name (see `unique_name`): PostgreSQL
    // does not record when a database was created.
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT datname::text FROM pg_database \
         WHERE datname ~ '^ferry_t_[0-9a-f]{16}$' \
           AND ('x' || substr(datname, 9, 8))::bit(32)::bigint < extract(epoch FROM now()) - $1 \
         ORDER BY datname",
    )
    .bind(i64::from(LEFTOVER_AGE_SECS))
    .fetch_all(&mut admin)
    .await?;
    let _ = admin.close().await;
    for name in &names {
        drop_database(&admin_url, name).await?;
    }
    Ok(names)
}

/// `ferry_t_` followed by the creation time in Unix seconds (8 hex digits)
/// and 32 random bits (8 hex digits).
fn unique_name() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // Truncation is fine: 32 bits of seconds last until 2106.
    let secs = secs as u32;
    format!("{NAME_PREFIX}{secs:08x}{:08x}", rand::random::<u32>())
}

fn is_retryable_create_error(error: &sqlx::Error) -> bool {
    let code = error.as_database_error().and_then(|e| e.code());
    // 55006 object_in_use (the template is busy), 42P04 duplicate_database.
    matches!(code.as_deref(), Some("55006" | "42P04"))
}

async fn drop_database(admin_url: &str, name: &str) -> Result<(), sqlx::Error> {
    let mut admin = PgConnection::connect(admin_url).await?;
    // A replication slot in use keeps its database from being dropped: end
    // the walsenders reading them (WAL streaming tests) and wait until every
    // slot is released. Released slots are dropped with the database.
    for _ in 0..50 {
        let active: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots \
             WHERE database = $1 AND active_pid IS NOT NULL",
        )
        .bind(name)
        .fetch_one(&mut admin)
        .await?;
        if active == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `name` comes from `unique_name` or from pg_database filtered to that
    // shape, so it never needs quoting. FORCE ends connections a test's pool
    // still holds, which would otherwise block the drop.
    sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
        .execute(&mut admin)
        .await?;
    let _ = admin.close().await;
    Ok(())
}

/// Replaces the database in a PostgreSQL URL, keeping credentials, host and
/// query parameters.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{database}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn database_exists(name: &str) -> bool {
        let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut admin)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn create_connect_drop() {
        let db = TestDb::create().await;
        let name = db.name().to_owned();
        assert!(name.starts_with(NAME_PREFIX), "{name}");
        assert!(database_exists(&name).await);

        let pool = db.pool().await;
        let current: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(current, name);
        sqlx::raw_sql("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
            .execute(&pool)
            .await
            .unwrap();

        // The pool still holds connections: the drop must not wait on them.
        db.drop_db().await;
        assert!(!database_exists(&name).await);
        pool.close().await;
    }

    #[tokio::test]
    async fn databases_are_isolated() {
        let (a, b) = tokio::join!(TestDb::create(), TestDb::create());
        assert_ne!(a.name(), b.name());
        let pa = a.pool().await;
        sqlx::query("CREATE TABLE only_in_a (id int)")
            .execute(&pa)
            .await
            .unwrap();
        let pb = b.pool().await;
        let visible: bool = sqlx::query_scalar("SELECT to_regclass('only_in_a') IS NOT NULL")
            .fetch_one(&pb)
            .await
            .unwrap();
        assert!(!visible);
        a.drop_db().await;
        b.drop_db().await;
    }

    #[tokio::test]
    async fn drop_without_drop_db_removes_the_database() {
        let db = TestDb::create().await;
        let name = db.name().to_owned();
        let pool = db.pool().await;
        drop(db);
        assert!(!database_exists(&name).await);
        pool.close().await;
    }

    #[test]
    fn drop_works_outside_a_runtime() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let db = runtime.block_on(TestDb::create());
        let name = db.name().to_owned();
        drop(db);
        assert!(!runtime.block_on(database_exists(&name)));
    }

    #[tokio::test]
    async fn drop_leftovers_removes_only_old_test_databases() {
        let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
        let old_secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as u32 - LEFTOVER_AGE_SECS - 60;
        let old = format!("{NAME_PREFIX}{old_secs:08x}{:08x}", rand::random::<u32>());
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {old}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let fresh = TestDb::create().await;

        let dropped = drop_leftovers().await.unwrap();
        assert!(dropped.contains(&old), "{dropped:?}");
        assert!(!dropped.iter().any(|n| n == fresh.name()), "{dropped:?}");
        assert!(!database_exists(&old).await);
        assert!(database_exists(fresh.name()).await);
        fresh.drop_db().await;
    }

    #[test]
    fn url_for_another_database() {
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/postgres", "x"),
            "postgres://root@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgresql://u:p@h/postgres?sslmode=disable", "x"),
            "postgresql://u:p@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h:5432", "x"), "postgres://h:5432/x");
        assert_eq!(
            with_database("postgres://h?application_name=t", "x"),
            "postgres://h/x?application_name=t"
        );
    }

    #[test]
    fn names_are_unique_and_carry_their_age() {
        let (a, b) = (unique_name(), unique_name());
        assert_ne!(a, b);
        assert_eq!(a.len(), NAME_PREFIX.len() + 16);
        let secs = u32::from_str_radix(&a[NAME_PREFIX.len()..NAME_PREFIX.len() + 8], 16).unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as u32;
        assert!(now - secs < 5, "{a}");
    }
}
