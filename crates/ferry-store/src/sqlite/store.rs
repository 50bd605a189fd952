use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectOutcome, DirectRecord, EventId, Ownership, Partition, Recorded, RelayId, RoutePlan,
    Store, StoreError, StoredEvent, Transition, UnroutedEvent, WakeSource,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row, SqliteConnection, SqlitePool};

use super::error::store_error;
use super::listen::SqliteWakeSource;
use super::lock::RelayLock;

/// The SQLite outbox store. Clones share the pool and the relay lock.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    lock: Arc<RelayLock>,
}

/// Connection options for a database given as `sqlite://path`, `sqlite:path`
/// (the scheme in any case) or a plain file path: created if missing, WAL
/// journal (readers never wait for the writer), a busy timeout so writers
/// queue instead of failing, and full sync so a committed event survives a
/// power cut. Use them for the producers' pool too.
///
/// A URL that names no file (`sqlite://`, say from `sqlite://${DB}` with
/// `DB` unset) is refused: SQLite would give each connection a temporary
/// database of its own, so `ferry migrate` would succeed on one that is
/// gone when it ends. An in-memory database is named explicitly, with
/// `sqlite::memory:` or `?mode=memory`.
pub fn connect_options(url_or_path: &str) -> Result<SqliteConnectOptions, StoreError> {
    let options = if let Some(rest) = strip_scheme(url_or_path) {
        let (file, query) = rest.split_once('?').unwrap_or((rest, ""));
        let in_memory = query.split('&').any(|p| p == "mode=memory");
        if file.trim().is_empty() && !in_memory {
            return Err(StoreError::config(format!(
                "database.url {url_or_path:?} names no database file (is a variable in it unset?); \
                 write it like sqlite://ferry.db or sqlite:///var/lib/ferry/ferry.db"
            )));
        }
        // Without its scheme: sqlx strips only a lowercase one, and would
        // take `SQLite:ferry.db` for a file of that name.
        SqliteConnectOptions::from_str(rest).map_err(|e| {
            StoreError::config(format!(
                "database.url: {e}; write it like sqlite://ferry.db or give a file path"
            ))
        })?
    } else if url_or_path.trim().is_empty() {
        return Err(StoreError::config(
            "database.url is empty; write it like sqlite://ferry.db or give a file path",
        ));
    } else {
        SqliteConnectOptions::new().filename(url_or_path)
    };
    Ok(options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true))
}

/// What follows `sqlite:` or `sqlite://`, the scheme in any case; `None`
/// for a plain path.
fn strip_scheme(url: &str) -> Option<&str> {
    let rest = url.get(7..).filter(|_| url[..7].eq_ignore_ascii_case("sqlite:"))?;
    Some(rest.strip_prefix("//").unwrap_or(rest))
}

impl SqliteStore {
    /// Uses `pool`; build it from [`connect_options`] to get WAL and a busy
    /// timeout.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            lock: Arc::new(RelayLock::default()),
        }
    }

    /// Opens (and creates if missing) the database at `url_or_path`. Run
    /// [`super::migrate`] before the relay's first tick.
    pub async fn open(url_or_path: &str) -> Result<Self, StoreError> {
        let options = connect_options(url_or_path)?;
        let file = options.get_filename().display().to_string();
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .map_err(|e| {
                StoreError::config(format!(
                    "cannot open the SQLite database {file}: {e}; check that its directory exists and is writable"
                ))
            })?;
        Ok(Self::new(pool))
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

pub(super) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(super) fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

/// SQLite takes arrays as JSON text, read back with `json_each`.
fn json_list<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    let body: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    format!("[{}]", body.join(","))
}

/// Frees the partitions of `leases` that `relay` still holds under the
/// token named with each: one taken again since (a new token) stays held,
/// so a hand-back or a leave arriving late frees nothing it should not.
async fn release_held(
    tx: &mut SqliteConnection,
    relay: &RelayId,
    leases: &[(Partition, i64)],
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE ferry_partitions SET owner = NULL, expires_at = NULL
          WHERE owner = ?1
            AND EXISTS (SELECT 1 FROM json_each(?2) r
                         WHERE json_extract(r.value, '$[0]') = ferry_partitions.partition
                           AND json_extract(r.value, '$[1]') = ferry_partitions.token)",
    )
    .bind(&relay.0)
    .bind(json_list(leases.iter().map(|(p, t)| format!("[{p},{t}]"))))
    .execute(tx)
    .await
    .map_err(store_error)?;
    Ok(())
}

fn lease_micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// The partitions whose leases this relay still holds under the tokens it
/// was granted. Read inside the caller's write transaction, so no takeover
/// can slip in before its writes commit.
async fn fenced(conn: &mut SqliteConnection, owned: &Ownership) -> Result<Vec<Partition>, StoreError> {
    let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT partition, token FROM ferry_partitions WHERE owner = ?1")
        .bind(&owned.relay.0)
        .fetch_all(&mut *conn)
        .await
        .map_err(store_error)?;
    let current: HashSet<(i64, i64)> = rows.into_iter().collect();
    Ok(owned
        .leases
        .iter()
        .filter(|(p, t)| current.contains(&(i64::from(*p), *t)))
        .map(|(p, _)| *p)
        .collect())
}

/// A row laid out as claim.sql's: seq, partition, attempts, then the event.
fn claimed_of(r: &SqliteRow) -> Result<Claimed, StoreError> {
    let headers: String = r.get(8);
    let headers: BTreeMap<String, String> = serde_json::from_str(&headers)
        .map_err(|e| StoreError::permanent(format!("event headers are not a string map: {e}")))?;
    let id: String = r.get(3);
    let id =
        EventId::from_str(&id).map_err(|e| StoreError::permanent(format!("event id {id:?} is not a UUID: {e}")))?;
    Ok(Claimed {
        partition: r.get(1),
        attempts: r.get::<i64, _>(2).max(0) as u32,
        event: StoredEvent {
            id,
            seq: r.get(0),
            event_type: r.get(4),
            key: r.get(5),
            payload: Bytes::from(r.get::<Vec<u8>, _>(6)),
            content_type: r.get(7),
            headers,
            created_at: from_micros(r.get(9)),
        },
    })
}

fn json_strings(text: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::permanent(format!("route list {text:?} is not JSON: {e}")))
}

#[async_trait]
impl Store for SqliteStore {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        self.lock.acquire(&self.pool).await?;
        let lease = lease_micros(lease);
        // IMMEDIATE: take the write lock first, so the reads below cannot go
        // stale before the writes.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        let now: i64 = sqlx::query_scalar(concat!("SELECT ", now_us!()))
            .fetch_one(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query(
            "INSERT INTO ferry_relays (id, started_at, heartbeat_at) VALUES (?1, ?2, ?2)
             ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
        )
        .bind(&relay.0)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        sqlx::query("DELETE FROM ferry_relays WHERE heartbeat_at < ?1")
            .bind(now - (lease.saturating_mul(10)).max(600_000_000))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        release_held(&mut tx, relay, release).await?;
        // A lease that had expired is renewed under a new token, as if taken
        // again: a hand-back sent under the old one (by an earlier run of
        // this relay id, given up on) must not free it when it arrives.
        sqlx::query(
            "UPDATE ferry_partitions
                SET expires_at = ?2, token = token + CASE WHEN expires_at < ?3 THEN 1 ELSE 0 END
              WHERE owner = ?1",
        )
        .bind(&relay.0)
        .bind(now + lease)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        let (live, total, owned): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM ferry_relays WHERE heartbeat_at > ?1),
                    (SELECT count(*) FROM ferry_partitions),
                    (SELECT count(*) FROM ferry_partitions WHERE owner = ?2)",
        )
        .bind(now - lease)
        .bind(&relay.0)
        .fetch_one(&mut *tx)
        .await
        .map_err(store_error)?;
        let fair = (total.max(0) as u64).div_ceil(live.max(1) as u64) as i64;
        if owned < fair {
            sqlx::query(include_str!("sql/take_partitions.sql"))
                .bind(&relay.0)
                .bind(now + lease)
                .bind(now)
                .bind(fair - owned)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
        }
        let leases: Vec<(i32, i64)> =
            sqlx::query_as("SELECT partition, token FROM ferry_partitions WHERE owner = ?1 ORDER BY partition")
                .bind(&relay.0)
                .fetch_all(&mut *tx)
                .await
                .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(Ownership {
            relay: relay.clone(),
            leases,
            live_relays: live.max(0) as u32,
            total_partitions: total.max(0) as u32,
        })
    }

    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        release_held(&mut tx, relay, held).await?;
        sqlx::query("DELETE FROM ferry_relays WHERE id = ?1")
            .bind(&relay.0)
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
            .bind(json_list(owned.partitions()))
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
        let json = |v: &[String]| serde_json::to_string(v).expect("strings serialise");
        let rows = sqlx::query(include_str!("sql/fetch_direct.sql"))
            .bind(json_list(owned.partitions()))
            .bind(limit as i64)
            .bind(json(routes))
            .bind(json(down))
            .bind(json_list(exclude))
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
        let mut batch = DirectBatch::default();
        for (i, r) in rows.iter().enumerate() {
            batch.events.push(claimed_of(r)?);
            batch.held.push(json_strings(r.get(10))?);
            if i == 0 {
                batch.busy = json_strings(r.get(11))?;
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
        if seqs.is_empty() {
            return Ok(0);
        }
        let now = micros(now);
        let mut by_seq: HashMap<i64, Vec<&DirectRecord>> = HashMap::new();
        for r in records {
            by_seq.entry(r.seq).or_default().push(r);
        }
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        let fence = fenced(&mut tx, owned).await?;
        if fence.is_empty() {
            return Ok(0);
        }
        let fence = json_list(fence);
        let mut taken = 0;
        for seq in seqs {
            let partition: Option<i64> = sqlx::query_scalar(
                "DELETE FROM ferry_unrouted WHERE seq = ?1 AND partition IN (SELECT value FROM json_each(?2))
                 RETURNING partition",
            )
            .bind(seq)
            .bind(&fence)
            .fetch_optional(&mut *tx)
            .await
            .map_err(store_error)?;
            let Some(partition) = partition else { continue };
            taken += 1;
            for r in by_seq.get(seq).map(Vec::as_slice).unwrap_or_default() {
                let (state, attempts, next, error, published) = match &r.outcome {
                    DirectOutcome::Published { at } => ("published", 1, now, None, Some(micros(*at))),
                    DirectOutcome::Parked => ("pending", 0, now, None, None),
                    DirectOutcome::Retry { next_at, error } => ("pending", 1, micros(*next_at), Some(error), None),
                    DirectOutcome::Dead { attempts, reason } => ("dead", i64::from(*attempts), now, Some(reason), None),
                };
                let inserted = sqlx::query(
                    "INSERT INTO ferry_deliveries
                         (seq, route, partition, key, state, attempts, next_attempt_at, last_error, published_at,
                          updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
                     ON CONFLICT (seq, route) DO NOTHING",
                )
                .bind(seq)
                .bind(&r.route)
                .bind(partition)
                .bind(&r.key)
                .bind(state)
                .bind(attempts)
                .bind(next)
                .bind(error)
                .bind(published)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?
                .rows_affected();
                // A repeat of a (seq, route) this call already wrote leaves
                // no failure in the history, as it leaves no delivery.
                if inserted == 1 && attempts > 0 && state != "published" {
                    sqlx::query(
                        "INSERT INTO ferry_failures (seq, route, attempt, at, dead, error) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    )
                    .bind(seq)
                    .bind(&r.route)
                    .bind(attempts)
                    .bind(now)
                    .bind(state == "dead")
                    .bind(error)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                }
            }
        }
        tx.commit().await.map_err(store_error)?;
        Ok(taken)
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
            .bind(route)
            .bind(json_list(owned.partitions()))
            .bind(micros(now))
            .bind(limit as i64)
            .bind(json_list(exclude))
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
        let now = micros(now);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        let fence = fenced(&mut tx, owned).await?;
        if fence.is_empty() {
            return Ok(0);
        }
        let fence = json_list(fence);
        let mut applied = 0;
        for o in outcomes {
            let (state, next_at, error, published_at) = match &o.transition {
                Transition::Published { at, .. } => ("published", None, None, Some(micros(*at))),
                Transition::Retry { next_at, error, .. } => {
                    ("pending", Some(micros(*next_at)), Some(error.as_str()), None)
                }
                Transition::Dead { reason, .. } => ("dead", None, Some(reason.as_str()), None),
            };
            let attempts = i64::from(o.transition.attempts());
            let done = sqlx::query(include_str!("sql/record.sql"))
                .bind(o.seq)
                .bind(route)
                .bind(i64::from(o.expected_attempts))
                .bind(state)
                .bind(attempts)
                .bind(next_at)
                .bind(error)
                .bind(published_at)
                .bind(now)
                .bind(&fence)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?
                .rows_affected();
            if done == 0 {
                continue;
            }
            applied += 1;
            if state != "published" {
                sqlx::query(
                    "INSERT INTO ferry_failures (seq, route, attempt, at, dead, error)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .bind(o.seq)
                .bind(route)
                .bind(attempts)
                .bind(now)
                .bind(state == "dead")
                .bind(error.unwrap_or_default())
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
            }
        }
        tx.commit().await.map_err(store_error)?;
        Ok(applied)
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
        let due: Option<i64> = sqlx::query_scalar(include_str!("sql/next_due.sql"))
            .bind(route)
            .bind(json_list(owned.partitions()))
            .bind(micros(now))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(due.map(from_micros))
    }

    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        sqlx::query("UPDATE ferry_relays SET sleeping = ?2 WHERE id = ?1 AND sleeping <> ?2")
            .bind(&relay.0)
            .bind(sleeping)
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        Ok(Box::new(SqliteWakeSource::connect(&self.pool).await?))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use ferry_core::ErrorKind;

    use super::connect_options;

    fn file(url: &str) -> String {
        let options = connect_options(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        options.get_filename().display().to_string()
    }

    /// The scheme in any case names the same file: `SQLite:ferry.db` used to
    /// open a file literally named `SQLite:ferry.db`, beside producers
    /// writing to `ferry.db`.
    #[test]
    fn the_scheme_is_read_in_any_case() {
        for url in [
            "sqlite:ferry.db",
            "sqlite://ferry.db",
            "SQLite:ferry.db",
            "SQLITE://ferry.db",
            "ferry.db",
        ] {
            assert_eq!(file(url), "ferry.db", "{url}");
        }
        assert_eq!(file("SQLite:///var/lib/ferry/ferry.db"), "/var/lib/ferry/ferry.db");
        assert_eq!(
            connect_options("Sqlite://a%3Fb.db?mode=rwc").unwrap().get_filename(),
            Path::new("a?b.db")
        );
    }

    /// A URL with no file after its scheme (`sqlite://${DB}` with `DB`
    /// unset) would give every connection a throwaway database of its own.
    #[test]
    fn a_url_that_names_no_file_is_refused() {
        for url in ["sqlite://", "sqlite:", "SQLite://", "sqlite://  ", "sqlite://?mode=rwc"] {
            let err = connect_options(url).expect_err(url);
            assert_eq!(err.kind, ErrorKind::Config, "{url}: {err}");
            assert!(err.message.starts_with("database.url"), "{url}: {err}");
            assert!(err.message.contains("names no database file"), "{url}: {err}");
        }
        // An in-memory database, asked for by name, is not a mistake.
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://?mode=memory",
            "SQLite::memory:",
        ] {
            connect_options(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }
}
