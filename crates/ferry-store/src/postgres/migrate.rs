use sqlx::{Connection, PgConnection};

/// Ferry's migrations, in order. Each runs once, in its own transaction.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "outbox", include_str!("migrations/0001_outbox.sql")),
    (2, "inbox", include_str!("migrations/0002_inbox.sql")),
    (3, "admin", include_str!("migrations/0003_admin.sql")),
    (4, "capture", include_str!("migrations/0004_capture.sql")),
    (5, "wal", include_str!("migrations/0005_wal.sql")),
    (6, "direct", include_str!("migrations/0006_direct.sql")),
    (7, "enqueue", include_str!("migrations/0007_enqueue.sql")),
    (8, "wal_settled", include_str!("migrations/0008_wal_settled.sql")),
    (9, "emit_fallback", include_str!("migrations/0009_emit_fallback.sql")),
    (10, "emit_seq", include_str!("migrations/0010_emit_seq.sql")),
    (
        11,
        "wal_slot_generation",
        include_str!("migrations/0011_wal_slot_generation.sql"),
    ),
    (
        12,
        "producer_limits",
        include_str!("migrations/0012_producer_limits.sql"),
    ),
    (13, "capture_guard", include_str!("migrations/0013_capture_guard.sql")),
    (14, "capture_key", include_str!("migrations/0014_capture_key.sql")),
    (
        15,
        "wal_slot_retired",
        include_str!("migrations/0015_wal_slot_retired.sql"),
    ),
    (16, "wal_part", include_str!("migrations/0016_wal_part.sql")),
    (
        17,
        "producer_fields",
        include_str!("migrations/0017_producer_fields.sql"),
    ),
    (18, "capture_specs", include_str!("migrations/0018_capture_specs.sql")),
    (19, "wal_slot_swept", include_str!("migrations/0019_wal_slot_swept.sql")),
    (
        20,
        "capture_partition_check",
        include_str!("migrations/0020_capture_partition_check.sql"),
    ),
    (
        21,
        "enqueue_outcome",
        include_str!("migrations/0021_enqueue_outcome.sql"),
    ),
    (22, "capture_gaps", include_str!("migrations/0022_capture_gaps.sql")),
    (23, "header_limit", include_str!("migrations/0023_header_limit.sql")),
    (
        24,
        "capture_replace",
        include_str!("migrations/0024_capture_replace.sql"),
    ),
    (
        25,
        "inbox_unfinished",
        include_str!("migrations/0025_inbox_unfinished.sql"),
    ),
    (
        26,
        "wal_slot_watermark",
        include_str!("migrations/0026_wal_slot_watermark.sql"),
    ),
    (
        27,
        "capture_warn_retryable",
        include_str!("migrations/0027_capture_warn_retryable.sql"),
    ),
    (28, "capture_rename", include_str!("migrations/0028_capture_rename.sql")),
    (
        29,
        "enqueue_repeats",
        include_str!("migrations/0029_enqueue_repeats.sql"),
    ),
    (
        30,
        "tick_release_tokens",
        include_str!("migrations/0030_tick_release_tokens.sql"),
    ),
    (31, "purged_order", include_str!("migrations/0031_purged_order.sql")),
    (
        32,
        "failed_key_index",
        include_str!("migrations/0032_failed_key_index.sql"),
    ),
    (33, "capture_types", include_str!("migrations/0033_capture_types.sql")),
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

/// Brings the `ferry` schema up to date; safe to run again and concurrently.
/// Returns the versions applied by this call.
///
/// Each migration commits on its own, under the migrators' lock: what one
/// locks (0012 locks `ferry.events` against producers) is held for that
/// migration only, not until the last one commits; a migration that fails
/// leaves the ones before it applied, and the next run goes on from there.
pub async fn migrate(conn: &mut PgConnection) -> Result<Vec<i32>, MigrateError> {
    let mut done = Vec::new();
    loop {
        let mut tx = conn.begin().await?;
        // One migrator at a time; the lock goes with the transaction. What
        // is applied is read under it, so two migrators never both apply one.
        sqlx::query("SELECT pg_advisory_xact_lock(1178948185, 0)")
            .execute(&mut *tx)
            .await?;
        if done.is_empty() {
            sqlx::query("CREATE SCHEMA IF NOT EXISTS ferry")
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS ferry.schema_migrations (
                     version int PRIMARY KEY,
                     name text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now())",
            )
            .execute(&mut *tx)
            .await?;
        }
        let applied: Vec<i32> = sqlx::query_scalar("SELECT version FROM ferry.schema_migrations ORDER BY version")
            .fetch_all(&mut *tx)
            .await?;
        let known = MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
        if let Some(&found) = applied.iter().max()
            && found > known
        {
            return Err(MigrateError::TooNew { found, known });
        }
        let Some(&(version, name, sql)) = MIGRATIONS.iter().find(|m| !applied.contains(&m.0)) else {
            tx.commit().await?;
            return Ok(done);
        };
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .map_err(|source| MigrateError::Failed { version, name, source })?;
        sqlx::query("INSERT INTO ferry.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        done.push(version);
    }
}
