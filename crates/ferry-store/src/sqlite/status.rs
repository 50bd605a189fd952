use ferry_core::{NO_ROUTE, StoreError};
use sqlx::{Row, SqlitePool};

use super::error::store_error;
use super::store::from_micros;
use crate::{BlockedKeys, DeadReason, LeaseInfo, RouteStatus, StatusReport};

impl super::SqliteStore {
    /// Counts per route and state, the oldest waiting work, blocked keys,
    /// dead reasons and who holds which leases: the same report as
    /// PostgreSQL's. Counts every delivery row: fine for an operator's
    /// command, not for a hot loop.
    pub async fn status(&self) -> Result<StatusReport, StoreError> {
        status(self.pool()).await
    }
}

async fn status(pool: &SqlitePool) -> Result<StatusReport, StoreError> {
    let mut report = StatusReport::default();
    let row = sqlx::query(super::gauges::UNROUTED)
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    report.unrouted = row.get::<i64, _>(0) as u64;
    report.oldest_unrouted_seconds = row.get(1);

    // The counts read `ferry_deliveries` alone; the oldest pending age
    // probes one event per route, by its least pending seq (as the gauges
    // do), instead of joining every delivery with its event.
    let rows = sqlx::query(concat!(
        "SELECT c.route, c.pending, c.retrying, c.dead, c.cancelled, c.published, (",
        now_us!(),
        " - e.created_at) / 1e6, c.published_last_hour, c.in_flight
           FROM (SELECT d.route,
                        count(*) FILTER (WHERE d.state = 'pending' AND d.attempts = 0) AS pending,
                        count(*) FILTER (WHERE d.state = 'pending' AND d.attempts > 0) AS retrying,
                        count(*) FILTER (WHERE d.state = 'dead') AS dead,
                        count(*) FILTER (WHERE d.state = 'cancelled') AS cancelled,
                        count(*) FILTER (WHERE d.state = 'published') AS published,
                        min(d.seq) FILTER (WHERE d.state = 'pending') AS first,
                        count(*) FILTER (WHERE d.state = 'published' AND d.published_at > ",
        now_us!(),
        " - 3600000000) AS published_last_hour,
                        count(*) FILTER (WHERE d.state = 'pending' AND (d.attempts = 0 OR d.next_attempt_at <= ",
        now_us!(),
        ") AND p.owner IS NOT NULL AND p.expires_at > ",
        now_us!(),
        " AND NOT EXISTS (
                                       SELECT 1 FROM ferry_deliveries b
                                        WHERE b.route = d.route AND b.key = d.key AND b.seq < d.seq
                                          AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))))
                                   AS in_flight
                   FROM ferry_deliveries d
                   JOIN ferry_partitions p ON p.partition = d.partition
                  GROUP BY d.route) c
           LEFT JOIN ferry_events e ON e.seq = c.first
          ORDER BY c.route"
    ))
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    for r in rows {
        report.routes.push(RouteStatus {
            route: r.get(0),
            pending: r.get::<i64, _>(1) as u64,
            retrying: r.get::<i64, _>(2) as u64,
            dead: r.get::<i64, _>(3) as u64,
            cancelled: r.get::<i64, _>(4) as u64,
            published: r.get::<i64, _>(5) as u64,
            oldest_pending_seconds: r.get(6),
            published_last_hour: r.get::<i64, _>(7) as u64,
            in_flight: r.get::<i64, _>(8) as u64,
            blocked: BlockedKeys::default(),
        });
    }

    // A key is blocked on a route while a delivery of it failed and waits, or
    // is dead; `waiting` counts the later deliveries of those keys. A dead
    // `(no route)` delivery holds no key: no relay claims on that name, and
    // a requeue sends the event back to the router.
    let rows = sqlx::query(
        "WITH heads AS (
             SELECT b.route, b.key, min(b.seq) AS seq,
                    -- Since the first failure of the head's attempts (since
                    -- any requeue): each failure rewrites updated_at.
                    min(coalesce((SELECT max(f.at) FROM ferry_failures f
                                   WHERE f.seq = b.seq AND f.route = b.route AND f.attempt = 1),
                                 b.updated_at)) AS since
               FROM ferry_deliveries b
              WHERE b.key IS NOT NULL AND b.route <> ?1
                AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))
              GROUP BY b.route, b.key)
         SELECT h.route, count(*), min(h.since),
                (SELECT count(*) FROM ferry_deliveries w JOIN heads h2
                     ON w.route = h2.route AND w.key = h2.key AND w.seq > h2.seq
                  WHERE w.state = 'pending' AND w.route = h.route)
           FROM heads h GROUP BY h.route",
    )
    .bind(NO_ROUTE)
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    for r in rows {
        let route: String = r.get(0);
        let blocked = BlockedKeys {
            keys: r.get::<i64, _>(1) as u64,
            oldest_since: r.get::<Option<i64>, _>(2).map(from_micros),
            waiting: r.get::<i64, _>(3) as u64,
        };
        match report.routes.iter_mut().find(|s| s.route == route) {
            Some(s) => s.blocked = blocked,
            None => report.routes.push(RouteStatus {
                route,
                blocked,
                ..Default::default()
            }),
        }
    }

    let rows = sqlx::query(
        "SELECT route, coalesce(last_error, ''), count(*) FROM ferry_deliveries
          WHERE state = 'dead' GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 20",
    )
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    report.dead_reasons = rows
        .into_iter()
        .map(|r| DeadReason {
            route: r.get(0),
            reason: r.get(1),
            count: r.get::<i64, _>(2) as u64,
        })
        .collect();

    let rows = sqlx::query(concat!(
        "SELECT r.id, count(p.partition),
                (",
        now_us!(),
        " - r.heartbeat_at) / 1e6,
                (min(p.expires_at) - ",
        now_us!(),
        ") / 1e6,
                r.sleeping,
                (",
        now_us!(),
        " - min(p.acquired_at)) / 1e6
           FROM ferry_relays r LEFT JOIN ferry_partitions p ON p.owner = r.id
          GROUP BY r.id ORDER BY r.id"
    ))
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    report.leases = rows
        .into_iter()
        .map(|r| LeaseInfo {
            relay: r.get(0),
            partitions: r.get::<i64, _>(1) as u32,
            heartbeat_age_seconds: r.get(2),
            expires_in_seconds: r.get(3),
            sleeping: r.get(4),
            oldest_lease_seconds: r.get(5),
        })
        .collect();
    report.partitions = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ferry_partitions")
        .fetch_one(pool)
        .await
        .map_err(store_error)? as u32;
    Ok(report)
}
