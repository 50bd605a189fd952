use serde::Serialize;

use ferry_core::StoreError;

/// The outbox's depth and age at a glance: cheap enough to read every few
/// seconds for metrics, unlike the full [`StatusReport`](crate::StatusReport),
/// because every count reads a partial index that holds only the work left.
///
/// ```no_run
/// # async fn demo(store: &ferry_store::postgres::PgStore) -> Result<(), ferry_core::StoreError> {
/// use ferry_store::Gauges;
/// let g = store.gauges().await?;
/// for r in &g.routes {
///     println!("{}: {} pending, oldest {:?}s", r.route, r.pending, r.oldest_pending_seconds);
/// }
/// # Ok(()) }
/// ```
#[async_trait::async_trait]
pub trait Gauges: Send + Sync {
    async fn gauges(&self) -> Result<GaugeReport, StoreError>;

    /// The cheapest round trip to the database, for a readiness probe. The
    /// default reads the gauges; a store with a cheaper query overrides it.
    async fn ping(&self) -> Result<(), StoreError> {
        self.gauges().await.map(|_| ())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GaugeReport {
    /// Committed events no relay has routed yet.
    pub unrouted: u64,
    pub oldest_unrouted_seconds: Option<f64>,
    /// Routes with any pending, dead, cancelled or blocked delivery.
    pub routes: Vec<RouteGauges>,
    /// Partitions still owned by a relay whose lease ran out: a relay died
    /// and no other has taken over yet.
    pub expired_leases: u64,
    /// Since the least recently renewed lease was renewed; grows when a
    /// relay stops heartbeating.
    pub oldest_lease_seconds: Option<f64>,
    /// Events that table triggers in `warn` mode failed to write, per
    /// captured table (`schema.table`), since the table was captured. Lossy
    /// by choice; any count above zero is an incident.
    pub capture_dropped: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouteGauges {
    pub route: String,
    /// Pending deliveries, retrying ones included.
    pub pending: u64,
    /// Pending deliveries that failed at least once.
    pub retrying: u64,
    pub dead: u64,
    pub cancelled: u64,
    /// Age of the oldest pending delivery's event.
    pub oldest_pending_seconds: Option<f64>,
    /// Keys held back by a failed or dead delivery.
    pub blocked_keys: u64,
    pub oldest_blocked_seconds: Option<f64>,
}
