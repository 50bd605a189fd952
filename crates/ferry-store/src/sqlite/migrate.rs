use sqlx::{Connection, SqliteConnection};

/// Ferry's SQLite migrations, in order. All pending ones run in one
/// transaction.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "outbox", include_str!("migrations/0001_outbox.sql")),
    (2, "inbox", include_str!("migrations/0002_inbox.sql")),
    (3, "direct", include_str!("migrations/0003_direct.sql")),
    (
        4,
        "unrouted_trigger",
        include_str!("migrations/0004_unrouted_trigger.sql"),
    ),
    (5, "inbox_claim", include_str!("migrations/0005_inbox_claim.sql")),
    (
        6,
        "inbox_unfinished",
        include_str!("migrations/0006_inbox_unfinished.sql"),
    ),
    (7, "purged_order", include_str!("migrations/0007_purged_order.sql")),
    (
        8,
        "failed_key_index",
        include_str!("migrations/0008_failed_key_index.sql"),
    ),
];

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    #[error("migration {version} ({name}) failed: {source}")]
    Failed {
        version: i32,
        name: &'static str,
        source: sqlx::Error,
    },
    #[error("the database is at schema version {found}, newer than this ferry ({known}); upgrade ferry")]
    TooNew { found: i32, known: i32 },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Brings the `ferry_` tables up to date and puts the file in WAL mode; safe
/// to run again and concurrently. Returns the versions applied by this call.
pub async fn migrate(conn: &mut SqliteConnection) -> Result<Vec<i32>, MigrateError> {
    // WAL is a property of the file, and cannot be set inside a transaction.
    sqlx::query("PRAGMA journal_mode = WAL").execute(&mut *conn).await?;
    // IMMEDIATE: one migrator at a time, the others wait on the busy timeout.
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS ferry_schema_migrations (
             version    INTEGER PRIMARY KEY,
             name       TEXT    NOT NULL,
             applied_at INTEGER NOT NULL) STRICT",
    )
    .execute(&mut *tx)
    .await?;
    let applied: Vec<i32> = sqlx::query_scalar("SELECT version FROM ferry_schema_migrations ORDER BY version")
        .fetch_all(&mut *tx)
        .await?;
    let known = MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
    if let Some(&found) = applied.iter().max()
        && found > known
    {
        return Err(MigrateError::TooNew { found, known });
    }
    let mut done = Vec::new();
    for &(version, name, sql) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .map_err(|source| MigrateError::Failed { version, name, source })?;
        sqlx::query(concat!(
            "INSERT INTO ferry_schema_migrations (version, name, applied_at) VALUES (?1, ?2, ",
            now_us!(),
            ")"
        ))
        .bind(version)
        .bind(name)
        .execute(&mut *tx)
        .await?;
        done.push(version);
    }
    tx.commit().await?;
    Ok(done)
}
