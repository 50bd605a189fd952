use async_trait::async_trait;
use ferry_core::{NO_ROUTE, StoreError};
use sqlx::Row;

use super::SqliteStore;
use super::error::store_error;
use crate::{GaugeReport, Gauges, RouteGauges};

/// How many events are unrouted, and the age of the earliest: one probe of
/// `ferry_events`, by the least unrouted seq.
pub(super) const UNROUTED: &str = concat!(
    "SELECT u.n, (",
    now_us!(),
    " - e.created_at) / 1e6
       FROM (SELECT count(*) AS n, min(seq) AS first FROM ferry_unrouted) u
       LEFT JOIN ferry_events e ON e.seq = u.first"
);

#[async_trait]
impl Gauges for SqliteStore {
    async fn gauges(&self) -> Result<GaugeReport, StoreError> {
        let pool = self.pool();
        let mut report = GaugeReport::default();
        let row = sqlx::query(UNROUTED).fetch_one(pool).await.map_err(store_error)?;
        report.unrouted = row.get::<i64, _>(0) as u64;
        report.oldest_unrouted_seconds = row.get(1);

        // Each subquery's filter matches one of the partial indexes of the
        // first migration, so each reads only the work left. A dead `(no
        // route)` delivery holds no key: no relay claims on that name.
        let rows = sqlx::query(concat!(
            "WITH pending AS (
                 SELECT route, count(*) AS n, count(*) FILTER (WHERE attempts > 0) AS retrying, min(seq) AS first
                   FROM ferry_deliveries WHERE state = 'pending' GROUP BY route),
             settled AS (
                 SELECT route, count(*) FILTER (WHERE state = 'dead') AS dead,
                        count(*) FILTER (WHERE state = 'cancelled') AS cancelled
                   FROM ferry_deliveries WHERE state IN ('dead', 'cancelled') GROUP BY route),
             blocked AS (
                 -- Since the head's first failure (of its attempts since
                 -- any requeue): each failure rewrites updated_at.
                 SELECT d.route, count(DISTINCT d.key) AS keys,
                        min(coalesce((SELECT max(f.at) FROM ferry_failures f
                                       WHERE f.seq = d.seq AND f.route = d.route AND f.attempt = 1),
                                     d.updated_at)) AS since
                   FROM ferry_deliveries d
                  WHERE d.key IS NOT NULL AND (d.state = 'dead' OR (d.state = 'pending' AND d.attempts > 0))
                    AND d.route <> ?1
                  GROUP BY d.route),
             routes AS (SELECT route FROM pending UNION SELECT route FROM settled UNION SELECT route FROM blocked)
             SELECT r.route, coalesce(p.n, 0), coalesce(p.retrying, 0), coalesce(s.dead, 0), coalesce(s.cancelled, 0),
                    (",
            now_us!(),
            " - e.created_at) / 1e6,
                    coalesce(b.keys, 0), (",
            now_us!(),
            " - b.since) / 1e6
               FROM routes r
               LEFT JOIN pending p ON p.route = r.route
               LEFT JOIN ferry_events e ON e.seq = p.first
               LEFT JOIN settled s ON s.route = r.route
               LEFT JOIN blocked b ON b.route = r.route
              ORDER BY r.route"
        ))
        .bind(NO_ROUTE)
        .fetch_all(pool)
        .await
        .map_err(store_error)?;
        report.routes = rows
            .into_iter()
            .map(|r| RouteGauges {
                route: r.get(0),
                pending: r.get::<i64, _>(1) as u64,
                retrying: r.get::<i64, _>(2) as u64,
                dead: r.get::<i64, _>(3) as u64,
                cancelled: r.get::<i64, _>(4) as u64,
                oldest_pending_seconds: r.get(5),
                blocked_keys: r.get::<i64, _>(6) as u64,
                oldest_blocked_seconds: r.get(7),
            })
            .collect();

        let row = sqlx::query(concat!(
            "SELECT count(*) FILTER (WHERE p.expires_at < ",
            now_us!(),
            "), (",
            now_us!(),
            " - min(r.heartbeat_at)) / 1e6
               FROM ferry_partitions p LEFT JOIN ferry_relays r ON r.id = p.owner
              WHERE p.owner IS NOT NULL"
        ))
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
        report.expired_leases = row.get::<i64, _>(0) as u64;
        report.oldest_lease_seconds = row.get(1);
        Ok(report)
    }

    /// A round trip only: the gauges' reads grow with the backlog, and a
    /// readiness probe that waited on them would take a slow read for a
    /// database that does not answer.
    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(self.pool())
            .await
            .map_err(store_error)?;
        Ok(())
    }
}
