use async_trait::async_trait;
use ferry_core::{NO_ROUTE, StoreError};
use sqlx::Row;

use super::PgStore;
use super::error::store_error;
use crate::{GaugeReport, Gauges, RouteGauges};

/// How many events are unrouted, and the age of the earliest: one probe of
/// `events`, by the least unrouted seq.
pub(super) const UNROUTED: &str = "SELECT u.n, extract(epoch FROM now() - e.created_at)::float8
       FROM (SELECT count(*) AS n, min(seq) AS first FROM ferry.unrouted) u
       LEFT JOIN ferry.events e ON e.seq = u.first";

#[async_trait]
impl Gauges for PgStore {
    async fn gauges(&self) -> Result<GaugeReport, StoreError> {
        let pool = self.pool();
        let mut report = GaugeReport::default();
        let row = sqlx::query(UNROUTED).fetch_one(pool).await.map_err(store_error)?;
        report.unrouted = row.get::<i64, _>(0) as u64;
        report.oldest_unrouted_seconds = row.get(1);

        // Each subquery's filter matches one of the partial indexes of the
        // first migration, so each reads only the work left. A dead `(no
        // route)` delivery holds no key: no relay claims on that name.
        let rows = sqlx::query(
            "WITH pending AS (
                 SELECT route, count(*) AS n, count(*) FILTER (WHERE attempts > 0) AS retrying, min(seq) AS first
                   FROM ferry.deliveries WHERE state = 'pending' GROUP BY route),
             settled AS (
                 SELECT route, count(*) FILTER (WHERE state = 'dead') AS dead,
                        count(*) FILTER (WHERE state = 'cancelled') AS cancelled
                   FROM ferry.deliveries WHERE state IN ('dead', 'cancelled') GROUP BY route),
             blocked AS (
                 -- Since the head's first failure (of its attempts since
                 -- any requeue): each failure rewrites updated_at.
                 SELECT d.route, count(DISTINCT d.key) AS keys,
                        min(coalesce((SELECT max(f.at) FROM ferry.failures f
                                       WHERE f.seq = d.seq AND f.route = d.route AND f.attempt = 1),
                                     d.updated_at)) AS since
                   FROM ferry.deliveries d
                  WHERE d.key IS NOT NULL AND (d.state = 'dead' OR (d.state = 'pending' AND d.attempts > 0))
                    AND d.route <> $1
                  GROUP BY d.route),
             routes AS (SELECT route FROM pending UNION SELECT route FROM settled UNION SELECT route FROM blocked)
             SELECT r.route, coalesce(p.n, 0), coalesce(p.retrying, 0), coalesce(s.dead, 0), coalesce(s.cancelled, 0),
                    extract(epoch FROM now() - e.created_at)::float8,
                    coalesce(b.keys, 0), extract(epoch FROM now() - b.since)::float8
               FROM routes r
               LEFT JOIN pending p ON p.route = r.route
               LEFT JOIN ferry.events e ON e.seq = p.first
               LEFT JOIN settled s ON s.route = r.route
               LEFT JOIN blocked b ON b.route = r.route
              ORDER BY r.route",
        )
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

        let row = sqlx::query(
            "SELECT count(*) FILTER (WHERE p.expires_at < now()),
                    extract(epoch FROM now() - min(r.heartbeat_at))::float8
               FROM ferry.partitions p LEFT JOIN ferry.relays r ON r.id = p.owner
              WHERE p.owner IS NOT NULL",
        )
        .fetch_one(pool)
        .await
        .map_err(store_error)?;
        report.expired_leases = row.get::<i64, _>(0) as u64;
        report.oldest_lease_seconds = row.get(1);

        // A database migrated before table capture existed has no such
        // table, and counts nothing. Any other error fails the read: taken
        // as no drops, it would set a table's count of dropped events back
        // to zero while events were being dropped.
        let dropped =
            sqlx::query("SELECT table_schema || '.' || table_name, count FROM ferry.capture_dropped ORDER BY 1")
                .fetch_all(pool)
                .await;
        match dropped {
            Ok(rows) => {
                report.capture_dropped = rows
                    .into_iter()
                    .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1) as u64))
                    .collect();
            }
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42P01") => {}
            Err(e) => return Err(store_error(e)),
        }
        Ok(report)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(self.pool())
            .await
            .map_err(store_error)?;
        Ok(())
    }
}
