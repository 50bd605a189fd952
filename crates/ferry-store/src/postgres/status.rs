use sqlx::{PgPool, Row};

use super::error::store_error;
use crate::{BlockedKeys, DeadReason, LeaseInfo, RouteStatus, StatusReport};
use ferry_core::{NO_ROUTE, StoreError};

impl super::PgStore {
    /// Counts per route and state, the oldest waiting work, blocked keys,
    /// dead reasons and who holds which leases. Reads `deliveries` whole
    /// (not `events`): fine for an operator's command, not for a hot loop.
    pub async fn status(&self) -> Result<StatusReport, StoreError> {
        status(self.pool()).await
    }
}

async fn status(pool: &PgPool) -> Result<StatusReport, StoreError> {
    let mut report = StatusReport::default();
    let row = sqlx::query(super::gauges::UNROUTED)
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
    report.unrouted = row.get::<i64, _>(0) as u64;
    report.oldest_unrouted_seconds = row.get(1);

    // The counts read `deliveries` whole, its narrow rows only; `events`,
    // which holds the payloads, is probed once per route for the age of
    // its earliest pending event (as the gauges do), so a status costs no
    // read of the outbox's history.
    let rows = sqlx::query(
        "WITH totals AS (
             SELECT route,
                    count(*) FILTER (WHERE state = 'pending' AND attempts = 0) AS pending,
                    count(*) FILTER (WHERE state = 'pending' AND attempts > 0) AS retrying,
                    count(*) FILTER (WHERE state = 'dead') AS dead,
                    count(*) FILTER (WHERE state = 'cancelled') AS cancelled,
                    count(*) FILTER (WHERE state = 'published') AS published,
                    count(*) FILTER (WHERE state = 'published' AND published_at > now() - interval '1 hour')
                        AS last_hour
               FROM ferry.deliveries GROUP BY route),
         waiting AS (
             SELECT d.route, min(d.seq) AS first,
                    count(*) FILTER (WHERE (d.attempts = 0 OR d.next_attempt_at <= now())
                                       AND p.owner IS NOT NULL AND p.expires_at > now()
                                       AND NOT EXISTS (
                                           SELECT 1 FROM ferry.deliveries b
                                            WHERE b.route = d.route AND b.key = d.key AND b.seq < d.seq
                                              AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))))
                        AS in_flight
               FROM ferry.deliveries d JOIN ferry.partitions p ON p.partition = d.partition
              WHERE d.state = 'pending'
              GROUP BY d.route)
         SELECT t.route, t.pending, t.retrying, t.dead, t.cancelled, t.published,
                extract(epoch FROM now() - e.created_at)::float8, t.last_hour, coalesce(w.in_flight, 0)
           FROM totals t
           LEFT JOIN waiting w ON w.route = t.route
           LEFT JOIN ferry.events e ON e.seq = w.first
          ORDER BY t.route",
    )
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
                    min(coalesce((SELECT max(f.at) FROM ferry.failures f
                                   WHERE f.seq = b.seq AND f.route = b.route AND f.attempt = 1),
                                 b.updated_at)) AS since
               FROM ferry.deliveries b
              WHERE b.key IS NOT NULL AND b.route <> $1
                AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))
              GROUP BY b.route, b.key)
         SELECT h.route, count(*), min(h.since),
                (SELECT count(*) FROM ferry.deliveries w JOIN heads h2
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
            oldest_since: r.get(2),
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
        "SELECT route, coalesce(last_error, ''), count(*) FROM ferry.deliveries
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

    let rows = sqlx::query(
        "SELECT r.id, count(p.partition),
                extract(epoch FROM now() - r.heartbeat_at)::float8,
                extract(epoch FROM min(p.expires_at) - now())::float8,
                r.sleeping,
                extract(epoch FROM now() - min(p.acquired_at))::float8
           FROM ferry.relays r LEFT JOIN ferry.partitions p ON p.owner = r.id
          GROUP BY r.id ORDER BY r.id",
    )
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
    report.partitions = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM ferry.partitions")
        .fetch_one(pool)
        .await
        .map_err(store_error)? as u32;
    Ok(report)
}
