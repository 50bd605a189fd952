use std::collections::VecDeque;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{Partition, StoreError, Wake, WakeSource};
use sqlx::{Connection, SqliteConnection, SqlitePool};
use tokio::time::{Interval, MissedTickBehavior};

use super::error::store_error;

/// How often the listener looks for commits. `PRAGMA data_version` reads
/// only the WAL index in shared memory, so this costs the database nothing
/// that grows with its tables, and keeps commit-to-wake latency at a few
/// tens of milliseconds.
const POLL: Duration = Duration::from_millis(20);

/// Commit notifications for SQLite, which has no LISTEN/NOTIFY: a dedicated
/// connection polls `PRAGMA data_version`, which changes when any other
/// connection (in this process or another) commits. On a change it reports
/// the partitions that have unrouted events: new commits, and events an
/// operator sent back to the router. 32 index probes, whatever the backlog.
pub(super) struct SqliteWakeSource {
    conn: SqliteConnection,
    version: i64,
    /// The newest operator action seen: a requeue or cancel makes
    /// deliveries due without any new event, so it wakes every worker.
    admin_action: i64,
    ready: VecDeque<Partition>,
    interval: Interval,
}

impl SqliteWakeSource {
    pub(super) async fn connect(pool: &SqlitePool) -> Result<Self, StoreError> {
        let mut conn = SqliteConnection::connect_with(&pool.connect_options())
            .await
            .map_err(store_error)?;
        let version = data_version(&mut conn).await?;
        let admin_action = last_admin_action(&mut conn).await?;
        let mut interval = tokio::time::interval(POLL);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ok(Self {
            conn,
            version,
            admin_action,
            ready: VecDeque::new(),
            interval,
        })
    }
}

async fn last_admin_action(conn: &mut SqliteConnection) -> Result<i64, StoreError> {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM ferry_admin_log")
        .fetch_one(conn)
        .await
        .map_err(store_error)
}

async fn data_version(conn: &mut SqliteConnection) -> Result<i64, StoreError> {
    sqlx::query_scalar("PRAGMA data_version")
        .fetch_one(conn)
        .await
        .map_err(store_error)
}

#[async_trait]
impl WakeSource for SqliteWakeSource {
    async fn wait(&mut self) -> Result<Option<Wake>, StoreError> {
        loop {
            if let Some(p) = self.ready.pop_front() {
                return Ok(Some(Wake::Events(p)));
            }
            self.interval.tick().await;
            let version = data_version(&mut self.conn).await?;
            if version == self.version {
                continue;
            }
            self.version = version;
            let admin_action = last_admin_action(&mut self.conn).await?;
            if admin_action != self.admin_action {
                self.admin_action = admin_action;
                return Ok(None);
            }
            // The relay's own writes change data_version too; once it has
            // routed everything, they find nothing here and wake nobody.
            let partitions: Vec<Partition> = sqlx::query_scalar(
                "SELECT p.partition FROM ferry_partitions p
                  WHERE EXISTS (SELECT 1 FROM ferry_unrouted u WHERE u.partition = p.partition)
                  ORDER BY p.partition",
            )
            .fetch_all(&mut self.conn)
            .await
            .map_err(store_error)?;
            self.ready.extend(partitions);
        }
    }
}
