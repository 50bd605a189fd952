use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{ErrorKind, StoredEvent, Transition};

/// A partition of the outbox. Every event belongs to one, chosen by a hash of
/// its key, so all events of a key share a partition. A relay works only the
/// partitions it holds a lease on; that is how several relays share the work
/// and keep per-key order.
pub type Partition = i32;

/// A relay instance's identity, unique among the relays sharing a database.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RelayId(pub String);

impl fmt::Display for RelayId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The partition leases a relay holds, each with the fencing token it was
/// granted. Every write the relay makes is refused unless the token still
/// matches, so an outcome reported under a lost lease cannot land.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ownership {
    /// The relay holding these leases.
    pub relay: RelayId,
    /// (partition, fencing token), sorted by partition.
    pub leases: Vec<(Partition, i64)>,
    /// Relays with a live heartbeat, this one included.
    pub live_relays: u32,
    /// Partitions in the outbox.
    pub total_partitions: u32,
}

impl Ownership {
    pub fn partitions(&self) -> Vec<Partition> {
        self.leases.iter().map(|(p, _)| *p).collect()
    }
    pub fn tokens(&self) -> Vec<i64> {
        self.leases.iter().map(|(_, t)| *t).collect()
    }
    pub fn owns(&self, p: Partition) -> bool {
        self.leases.binary_search_by_key(&p, |(q, _)| *q).is_ok()
    }
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
    /// The share of partitions this relay should hold.
    pub fn fair_share(&self) -> usize {
        let live = self.live_relays.max(1) as usize;
        (self.total_partitions as usize).div_ceil(live)
    }
}

/// An event that has not been routed yet: only what routing needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnroutedEvent {
    pub seq: i64,
    pub partition: Partition,
    pub event_type: String,
    pub key: Option<String>,
}

/// The routes an event matched. No routes means the event is dead with the
/// reason `no route`: it is never silently published to nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePlan {
    pub event: UnroutedEvent,
    pub routes: Vec<String>,
}

/// The route name under which events that matched no route are recorded dead.
pub const NO_ROUTE: &str = "(no route)";

/// A delivery handed to the relay to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    pub partition: Partition,
    /// Attempts made before this one.
    pub attempts: u32,
    pub event: StoredEvent,
}

/// An outcome to record for the delivery of event `seq` on a route: applied
/// only if the delivery is still pending with `expected_attempts` and its
/// partition lease is still this relay's.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub seq: i64,
    pub expected_attempts: u32,
    pub transition: Transition,
}

/// What happened to one event on one route when the relay delivered it
/// straight from the outbox (direct delivery, or WAL streaming), without a
/// delivery row to claim first.
#[derive(Debug, Clone, PartialEq)]
pub enum DirectOutcome {
    /// Confirmed by the destination on the first attempt.
    Published { at: DateTime<Utc> },
    /// Not attempted: queued in the delivery table behind earlier deliveries
    /// of its key (or of its route, while the destination is down).
    Parked,
    /// The first attempt failed; the table path retries at `next_at`.
    Retry { next_at: DateTime<Utc>, error: String },
    /// Failed for good, or matched no route.
    Dead { attempts: u32, reason: String },
}

impl DirectOutcome {
    /// The dead outcome of an event that matched no route.
    pub fn no_route(event_type: &str) -> Self {
        DirectOutcome::Dead {
            attempts: 0,
            reason: format!("no route: no [[routes]] entry matches type {event_type:?}; add a route and requeue"),
        }
    }
}

impl RoutePlan {
    /// The delivery rows that route this event into the table: one parked
    /// (pending, for the route worker) per route, or a dead `no route` one.
    pub fn records(&self) -> Vec<DirectRecord> {
        let record = |route: &str, outcome| DirectRecord {
            seq: self.event.seq,
            key: self.event.key.clone(),
            route: route.to_owned(),
            outcome,
        };
        if self.routes.is_empty() {
            return vec![record(NO_ROUTE, DirectOutcome::no_route(&self.event.event_type))];
        }
        self.routes.iter().map(|r| record(r, DirectOutcome::Parked)).collect()
    }
}

/// New events for direct delivery, with what the delivery table says about
/// them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DirectBatch {
    /// Unrouted events of the owned partitions, in seq order.
    pub events: Vec<Claimed>,
    /// Per event (same index): the routes on which an earlier delivery of its
    /// key is pending or dead. On those routes the event queues behind it.
    pub held: Vec<Vec<String>>,
    /// Of the routes asked about as down, those that still have pending
    /// deliveries in the owned partitions.
    pub busy: Vec<String>,
}

/// One row of a directly delivered batch's settlement.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectRecord {
    pub seq: i64,
    pub key: Option<String>,
    /// The route, or [`NO_ROUTE`] for an event that matched none.
    pub route: String,
    pub outcome: DirectOutcome,
}

/// A delivery's state in the store. "In flight" is not stored per row: a due
/// pending delivery in a partition under a live lease is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryState {
    Pending,
    Published,
    Dead,
    Cancelled,
}

impl DeliveryState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Published => "published",
            DeliveryState::Dead => "dead",
            DeliveryState::Cancelled => "cancelled",
        }
    }
}

/// A failed store operation, classified like sink errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} ({kind})")]
pub struct StoreError {
    pub kind: ErrorKind,
    pub message: String,
}

impl StoreError {
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            message: message.into(),
        }
    }
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            message: message.into(),
        }
    }
    pub fn config(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Config,
            message: message.into(),
        }
    }
}

/// What a commit notification says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// New events were committed in the partition: the router has work.
    Events(Partition),
    /// Deliveries in the partition became due without new events (an
    /// operator's requeue, events parked for the table path): every part
    /// of the relay should look.
    Due(Partition),
}

impl Wake {
    pub fn partition(self) -> Partition {
        match self {
            Wake::Events(p) | Wake::Due(p) => p,
        }
    }
}

/// Notifications that new events were committed.
#[async_trait]
pub trait WakeSource: Send {
    /// Waits for the next notification; `None` when notifications may have
    /// been missed (a reconnect) and the caller should look at everything.
    async fn wait(&mut self) -> Result<Option<Wake>, StoreError>;
}

/// The queries the relay runs against an outbox database. Each store runs the
/// conformance suite in `ferry-testkit`.
///
/// Time-dependent calls take `now` from the relay's [`crate::Clock`]; lease
/// deadlines use the database's own clock so that relays on different hosts
/// agree on them.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Heartbeat; renew this relay's leases; release `release`; take free or
    /// expired partitions up to the fair share. Returns the leases now held.
    ///
    /// `release` pairs each partition with the fencing token it was held
    /// under (as in [`Ownership::leases`]). A partition is released only if
    /// this relay still holds it under that token: one taken again since,
    /// by this relay or another, under a new token is left as it is. So a
    /// release that reaches the database late (a tick the caller gave up
    /// on, delivered when a silent connection recovers) cannot free a lease
    /// granted after it.
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError>;

    /// Gives up the heartbeat and the leases of `held` (clean shutdown):
    /// each partition with the token it was held under, released, as in
    /// [`tick`](Store::tick), only if this relay still holds it under that
    /// token. A leave that reaches the database late (given up on at
    /// shutdown, delivered when a silent connection recovers) cannot free a
    /// lease a later run under the same relay id was granted since. A lease
    /// not named stays held until it expires.
    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError>;

    /// Up to `limit` unrouted events of the owned partitions, in seq order.
    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError>;

    /// Creates the deliveries in `plans` and marks those events routed, fenced
    /// by the leases. Returns how many events were routed.
    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError>;

    /// Up to `limit` due deliveries of `route` in seq order, skipping any key
    /// held back by an earlier delivery of the same key and route that failed
    /// and waits for its retry, or is dead, and skipping the seqs in `exclude`
    /// (deliveries published whose outcomes are still being recorded).
    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError>;

    /// Applies outcomes, fenced by leases and by each delivery's attempt count.
    /// Returns how many were applied; the rest were refused.
    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError>;

    /// The earliest future time a failed delivery of `route` in the owned
    /// partitions is due again (when the keys it holds back move on).
    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// Direct delivery: up to `limit` unrouted events of the owned
    /// partitions with everything needed to publish them, in seq order, and
    /// which of `routes` hold each one's key back; `down` are routes whose
    /// destination failed, asked about for pending deliveries; `exclude` are
    /// events published but not settled yet. `None` when this store has no
    /// direct path: the relay then routes events into the delivery table and
    /// claims them from there.
    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        let _ = (owned, limit, routes, down, exclude);
        Ok(None)
    }

    /// Writes what happened to a directly delivered batch, fenced by the
    /// leases: takes `seqs` out of the unrouted events and writes the
    /// delivery rows of `records`. Returns how many events it took; 0 when
    /// the leases moved on (the next owner delivers them again).
    async fn settle(
        &self,
        owned: &Ownership,
        seqs: &[i64],
        records: &[DirectRecord],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        let _ = (owned, seqs, records, now);
        Err(StoreError::permanent("this store has no direct delivery"))
    }

    /// Tells producers whether this relay sleeps and wants a notification.
    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError>;

    /// Whether a transaction that has written events is still open. A
    /// producer decides whether to notify when it writes, not when it
    /// commits, so one that found every relay awake and commits after they
    /// all went to sleep wakes nobody: the relay keeps looking while such a
    /// transaction is open. Stores whose wake-up does not rest on the
    /// producer's decision say `false`.
    async fn producers_open(&self) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Subscribes to commit notifications.
    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError>;
}
