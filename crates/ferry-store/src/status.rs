use chrono::{DateTime, Utc};
use serde::Serialize;

/// What `ferry status` shows: per route and state, how much work is where and
/// how old the oldest of it is.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StatusReport {
    /// Committed events no relay has routed yet.
    pub unrouted: u64,
    pub oldest_unrouted_seconds: Option<f64>,
    pub routes: Vec<RouteStatus>,
    pub dead_reasons: Vec<DeadReason>,
    pub leases: Vec<LeaseInfo>,
    pub partitions: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouteStatus {
    pub route: String,
    /// Pending and never tried: waiting for their turn, or being published.
    pub pending: u64,
    /// Failed at least once and waiting for the next attempt.
    pub retrying: u64,
    pub dead: u64,
    pub cancelled: u64,
    pub published: u64,
    /// Published in the last hour: the route's recent throughput.
    pub published_last_hour: u64,
    /// Of `pending` and `retrying`, those due now in a partition a live
    /// relay holds: being published now or next.
    pub in_flight: u64,
    pub oldest_pending_seconds: Option<f64>,
    pub blocked: BlockedKeys,
}

/// Keys held back on a route by a failed or dead delivery.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BlockedKeys {
    pub keys: u64,
    /// Pending deliveries waiting behind those keys' failures.
    pub waiting: u64,
    pub oldest_since: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadReason {
    pub route: String,
    pub reason: String,
    pub count: u64,
}

/// One relay's partition leases.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeaseInfo {
    pub relay: String,
    pub partitions: u32,
    pub heartbeat_age_seconds: f64,
    pub expires_in_seconds: Option<f64>,
    /// How long this relay has held its oldest lease.
    pub oldest_lease_seconds: Option<f64>,
    pub sleeping: bool,
}

impl StatusReport {
    /// Dead deliveries, each holding its key back: what an operator must
    /// act on. A key held back by a retrying delivery clears by itself once
    /// the destination takes it, so it alone needs no one.
    pub fn needs_attention(&self) -> bool {
        self.routes.iter().any(|r| r.dead > 0)
    }
}
