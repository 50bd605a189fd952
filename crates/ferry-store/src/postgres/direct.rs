//! Direct delivery's write: the delivery rows of a batch the relay published
//! straight from the outbox. Shared by the table path ([`PgStore`]'s
//! `settle`) and WAL streaming.
//!
//! [`PgStore`]: super::PgStore

use chrono::{DateTime, Utc};
use ferry_core::{DirectOutcome, NO_ROUTE, Ownership, StoreError};
use sqlx::{PgExecutor, Row};

use super::error::store_error;

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
}

/// What one settlement wrote.
pub(crate) struct Written {
    /// Events taken out of `unrouted`.
    pub gone: u64,
    /// Delivery rows created (reported by WAL streaming).
    #[cfg_attr(not(feature = "wal"), allow(dead_code))]
    pub made: u64,
}

/// Takes `seqs` out of `unrouted` and writes a delivery row per
/// (seq, route, key, outcome) whose event it took, in one statement.
pub(crate) async fn settle<'e, 'r>(
    exec: impl PgExecutor<'e>,
    seqs: &[i64],
    rows: impl Iterator<Item = (i64, &'r str, Option<&'r str>, &'r DirectOutcome)>,
    now: DateTime<Utc>,
    mode: SettleMode<'_>,
) -> Result<Written, StoreError> {
    let (mut d_seq, mut d_route, mut d_key, mut d_state, mut d_attempts, mut d_next, mut d_err, mut d_pub) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (seq, route, key, outcome) in rows {
        let (state, attempts, next, err, published) = match outcome {
            DirectOutcome::Published { at } => ("published", 1, now, None, Some(*at)),
            DirectOutcome::Parked => ("pending", 0, now, None, None),
            DirectOutcome::Retry { next_at, error } => ("pending", 1, *next_at, Some(error.as_str()), None),
            DirectOutcome::Dead { attempts, reason } => ("dead", *attempts as i32, now, Some(reason.as_str()), None),
        };
        debug_assert!(route != NO_ROUTE || state == "dead");
        d_seq.push(seq);
        d_route.push(route);
        d_key.push(key);
        d_state.push(state);
        d_attempts.push(attempts);
        d_next.push(next);
        d_err.push(err);
        d_pub.push(published);
    }
    let (relay, partitions, tokens) = match mode.fence {
        Some(owned) => (Some(owned.relay.0.as_str()), owned.partitions(), owned.tokens()),
        None => (None, Vec::new(), Vec::new()),
    };
    let row = sqlx::query(include_str!("sql/settle.sql"))
        // Unprepared: planned for the actual arrays on every run (see claim).
        .persistent(false)
        .bind(seqs)
        .bind(&d_seq)
        .bind(&d_route)
        .bind(&d_key)
        .bind(&d_state)
        .bind(&d_attempts)
        .bind(&d_next)
        .bind(&d_err)
        .bind(&d_pub)
        .bind(now)
        .bind(relay)
        .bind(&partitions)
        .bind(&tokens)
        .bind(mode.notify)
        .bind(mode.durable)
        .fetch_one(exec)
        .await
        .map_err(store_error)?;
    Ok(Written {
        gone: row.get::<i64, _>(0) as u64,
        made: row.get::<i64, _>(1) as u64,
    })
}
