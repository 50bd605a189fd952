//! The safety net under the stream: outbox rows it has provably passed
//! without handing them over ([`WalSource::mark`], [`WalSource::missed`]).
//!
//! PostgreSQL streams an insert only if the publication carried the table
//! when it was committed. A publication altered without `ferry.events` and
//! mended while no relay checked it (a relay stopped for a deploy, say, or a
//! window shorter than the check's interval) leaves the rows committed
//! meanwhile out of the stream for good, and nothing else would ever take
//! them out of `ferry.unrouted`. Whatever the cause, such a row is found
//! here once the stream has gone past it.
//!
//! A [`Mark`] is a snapshot's `xmin` with the WAL insert position read
//! after the snapshot. A transaction whose id is below that `xmin` had
//! ended when the snapshot was taken, so its commit record lies before the
//! position. Once the relay has settled the stream past the position, every
//! such transaction the stream carried is settled, its rows routed: a row it
//! wrote that is still unrouted was never streamed. Subtransactions are
//! covered too: a subtransaction's id is above its parent's, so one below
//! the `xmin` belongs to a transaction that had ended.

use ferry_core::StoreError;

use super::{WalEvent, WalSource};
use crate::postgres::store_error;

/// A point the stream must pass before [`WalSource::missed`] may look for
/// rows it did not hand over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The snapshot's `xmin`, with its epoch (`xid8`).
    xmin: i64,
    /// The WAL insert position, read after the snapshot was taken.
    lsn: u64,
    /// The highest outbox seq the snapshot saw: no row it saw committed
    /// has a higher one. Keeps the look to the few rows below it.
    seq: i64,
}

impl Mark {
    /// The position the relay must have settled the stream through before
    /// the mark is looked at.
    pub fn lsn(&self) -> u64 {
        self.lsn
    }
}

impl WalSource {
    /// Takes a [`Mark`]: one statement, one snapshot, no write.
    ///
    /// The insert position rather than the write position: a transaction
    /// committed with `synchronous_commit` off may have its commit record
    /// inserted but not written yet.
    pub async fn mark(&self) -> Result<Mark, StoreError> {
        let (xmin, lsn, seq): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint, \
                    (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, \
                    coalesce((SELECT max(seq) FROM ferry.events), 0)",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(Mark {
            xmin,
            lsn: lsn.max(0) as u64,
            seq,
        })
    }

    /// Up to `limit` outbox rows, oldest first, still unrouted though the
    /// transaction that wrote them had ended before `mark` was taken: call
    /// it once the relay has settled the stream through
    /// [`Mark::lsn`], when the stream has handed over every such row it
    /// carries. What is left was never streamed: it is for the table path.
    ///
    /// Rows an operator requeued after they were dead with no route are
    /// left out: they are back in `unrouted` by design, and
    /// [`requeued`](Self::requeued) takes them.
    ///
    /// A row's `xmin` is a 32-bit id: it is placed in the epoch that puts
    /// it just below the current snapshot's `xmax`, as every committed
    /// row's id is (see look.sql). An index range scan of `unrouted` up to
    /// the mark's seq finds the candidates; once the stream is past the
    /// mark, those are only the rows of transactions still open at the
    /// mark, if any, and the ones missed.
    pub async fn missed(&self, mark: &Mark, limit: i64) -> Result<Vec<WalEvent>, StoreError> {
        self.events_of(
            sqlx::query(
                "SELECT e.seq, e.id, e.type, e.key, e.partition, e.payload, e.content_type, e.headers, e.created_at \
                   FROM (SELECT u.seq \
                           FROM ferry.unrouted u, \
                                (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax) snap \
                          WHERE u.seq <= $2 \
                            AND snap.xmax - 1 - ((snap.xmax - 1 - u.xmin::text::bigint) & 4294967295) < $1 \
                            AND NOT EXISTS (SELECT 1 FROM ferry.admin_log a \
                                             WHERE a.seq = u.seq AND a.route = $4 AND a.action = 'requeue') \
                          ORDER BY u.seq LIMIT $3) u \
                  CROSS JOIN LATERAL (SELECT * FROM ferry.events e WHERE e.seq = u.seq LIMIT 1) e \
                  ORDER BY u.seq",
            )
            .bind(mark.xmin)
            .bind(mark.seq)
            .bind(limit)
            .bind(ferry_core::NO_ROUTE),
        )
        .await
    }
}
