//! Direct delivery's write: the delivery rows of a batch the relay published
//! straight from the outbox. Shared by the table path ([`PgStore`]'s
//! `settle`) and WAL streaming.
//!
//! [`PgStore`]: super::PgStore

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use ferry_core::{DirectOutcome, NO_ROUTE, Ownership};
use sqlx::{PgExecutor, Row};

const SETTLE: &str = include_str!("sql/settle.sql");
/// The clause of [`SETTLE`] that [`Conflicts::Fail`] leaves out.
const SKIP_CONFLICTS: &str = "    ON CONFLICT (seq, route) DO NOTHING\n";
static SETTLE_UNGUARDED: LazyLock<String> = LazyLock::new(|| SETTLE.replacen(SKIP_CONFLICTS, "", 1));

/// What a settlement does with a delivery row that already exists.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Conflicts {
    /// Fails the statement with a unique violation; nothing is written.
    /// Spares every row PostgreSQL's speculative insertion, for callers
    /// that can settle again with [`Conflicts::Skip`] (see settle.sql).
    Fail,
    /// Keeps the existing row (`ON CONFLICT DO NOTHING`).
    Skip,
}

/// How a settlement is written.
pub(crate) struct SettleMode<'a> {
    /// Take only events of partitions still leased to this relay under
    /// these tokens; `None` takes any (WAL streaming holds the slot).
    pub fence: Option<&'a Ownership>,
    /// Notify the partitions that received pending deliveries, so the
    /// relays leasing them claim at once.
    pub notify: bool,
    /// Commit durably (WAL streaming confirms the slot position right after).
    pub durable: bool,
    /// What to do with a delivery row that exists.
    pub conflicts: Conflicts,
}

/// What one settlement wrote.
pub(crate) struct Written {
    /// Events taken out of `unrouted`.
    pub gone: u64,
    /// Delivery rows created (reported by WAL streaming).
    #[cfg_attr(not(feature = "wal"), allow(dead_code))]
    pub made: u64,
}

/// The delivery rows of a settlement, as the statement's arrays, and the
/// time they are written at.
#[derive(Default)]
pub(crate) struct Deliveries<'r> {
    now: DateTime<Utc>,
    seq: Vec<i64>,
    route: Vec<&'r str>,
    key: Vec<Option<&'r str>>,
    state: Vec<&'static str>,
    attempts: Vec<i32>,
    next: Vec<DateTime<Utc>>,
    error: Vec<Option<&'r str>>,
    published: Vec<Option<DateTime<Utc>>>,
}

impl<'r> Deliveries<'r> {
    /// One row per (seq, route, key, outcome), written at `now`.
    pub(crate) fn new(
        rows: impl Iterator<Item = (i64, &'r str, Option<&'r str>, &'r DirectOutcome)>,
        now: DateTime<Utc>,
    ) -> Self {
        let mut d = Self { now, ..Self::default() };
        for (seq, route, key, outcome) in rows {
            let (state, attempts, next, error, published) = match outcome {
                DirectOutcome::Published { at } => ("published", 1, now, None, Some(*at)),
                DirectOutcome::Parked => ("pending", 0, now, None, None),
                DirectOutcome::Retry { next_at, error } => ("pending", 1, *next_at, Some(error.as_str()), None),
                DirectOutcome::Dead { attempts, reason } => {
                    ("dead", *attempts as i32, now, Some(reason.as_str()), None)
                }
            };
            debug_assert!(route != NO_ROUTE || state == "dead");
            d.seq.push(seq);
            d.route.push(route);
            d.key.push(key);
            d.state.push(state);
            d.attempts.push(attempts);
            d.next.push(next);
            d.error.push(error);
            d.published.push(published);
        }
        d
    }
}

/// Whether `err` is a unique violation: a settlement under
/// [`Conflicts::Fail`] met a delivery row that exists.
pub(crate) fn is_unique_violation(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// Takes `seqs` out of `unrouted` and writes the delivery rows whose event
/// it took, in one statement.
pub(crate) async fn settle<'e>(
    exec: impl PgExecutor<'e>,
    seqs: &[i64],
    rows: &Deliveries<'_>,
    mode: SettleMode<'_>,
) -> Result<Written, sqlx::Error> {
    let (relay, partitions, tokens) = match mode.fence {
        Some(owned) => (Some(owned.relay.0.as_str()), owned.partitions(), owned.tokens()),
        None => (None, Vec::new(), Vec::new()),
    };
    let sql = match mode.conflicts {
        Conflicts::Fail => SETTLE_UNGUARDED.as_str(),
        Conflicts::Skip => SETTLE,
    };
    let row = sqlx::query(sql)
        // Unprepared: planned on every run for the actual arrays and the
        // table sizes of the moment. A cached generic plan saves about
        // 0.3 ms of planning per 500 events, but one made while `unrouted`
        // was small deletes by a sequential scan of it, and keeps doing so
        // through a backlog until the next ANALYZE.
        .persistent(false)
        .bind(seqs)
        .bind(&rows.seq)
        .bind(&rows.route)
        .bind(&rows.key)
        .bind(&rows.state)
        .bind(&rows.attempts)
        .bind(&rows.next)
        .bind(&rows.error)
        .bind(&rows.published)
        .bind(rows.now)
        .bind(relay)
        .bind(&partitions)
        .bind(&tokens)
        .bind(mode.notify)
        .bind(mode.durable)
        .fetch_one(exec)
        .await?;
    Ok(Written {
        gone: row.get::<i64, _>(0) as u64,
        made: row.get::<i64, _>(1) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A role or database may default to `synchronous_commit = off`; a
    /// durable settle (WAL streaming's, whose slot position is confirmed
    /// right after it) must still reach the disk, and a relaxed one keeps
    /// its relaxation.
    #[tokio::test]
    async fn a_durable_settle_flushes_even_where_commits_default_to_asynchronous() {
        let db = ferry_testkit::pg::TestDb::create().await;
        let admin = db.pool().await;
        crate::postgres::migrate(&mut admin.acquire().await.unwrap())
            .await
            .unwrap();
        // A test database's own generated name.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET synchronous_commit = off",
            db.name()
        )))
        .execute(&admin)
        .await
        .unwrap();
        admin.close().await;
        let pool = db.pool().await;
        for (durable, expected) in [(true, "local"), (false, "off")] {
            let mut tx = pool.begin().await.unwrap();
            let default: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            assert_eq!(default, "off", "the database's default");
            let mode = SettleMode {
                fence: None,
                notify: false,
                durable,
                conflicts: Conflicts::Skip,
            };
            settle(&mut *tx, &[], &Deliveries::default(), mode).await.unwrap();
            let at_commit: String = sqlx::query_scalar("SHOW synchronous_commit")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            assert_eq!(at_commit, expected, "durable: {durable}");
            tx.commit().await.unwrap();
        }
    }

    #[test]
    fn the_unguarded_settle_differs_only_by_its_conflict_clause() {
        assert_eq!(SETTLE.matches(SKIP_CONFLICTS).count(), 1);
        assert!(!SETTLE_UNGUARDED.contains("ON CONFLICT (seq, route)"));
        assert_eq!(SETTLE_UNGUARDED.len(), SETTLE.len() - SKIP_CONFLICTS.len());
    }
}
