//! What an operator needs from a store: find deliveries, read an event's
//! whole history, requeue or cancel deliveries safely, and follow outcomes.
//!
//! Requeue and cancel are two steps, so that `--dry-run`, confirmation and
//! progress live in the caller: [`Admin::plan`] says what a selection would
//! change and what it refuses (and why), changing nothing; [`Admin::apply`]
//! changes a batch of planned targets, re-checking each one at write time,
//! so a delivery that moved on since the plan is refused, never overwritten.

use std::fmt;
use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, Glob, StoreError};
use serde::{Deserialize, Serialize};

use crate::StatusReport;

/// The admin side of a store.
///
/// ```no_run
/// # async fn demo(store: &impl ferry_store::Admin) -> Result<(), ferry_core::StoreError> {
/// use ferry_store::{Action, AdminState, Filter};
/// let dead = Filter { states: vec![AdminState::Dead], ..Filter::default() };
/// let action = Action::Requeue { include_published: false };
/// let plan = store.plan(&action, &dead).await?;
/// for batch in plan.changes.chunks(500) {
///     store.apply(&action, "alice", batch).await?;
/// }
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Admin: Send + Sync {
    /// Counts per route and state, oldest waiting work, blocked keys, dead
    /// reasons and leases.
    async fn status(&self) -> Result<StatusReport, StoreError>;

    /// Deliveries matching `filter`, in outbox order, one page at a time.
    async fn list(&self, filter: &Filter, page: &Page) -> Result<ListPage, StoreError>;

    /// One event with its headers and, per route, every failed attempt and
    /// operator action; `None` when no event has this id.
    async fn show(&self, id: EventId) -> Result<Option<EventView>, StoreError>;

    /// What `action` would change among the deliveries `selection` matches,
    /// and what it refuses. Changes nothing.
    async fn plan(&self, action: &Action, selection: &Filter) -> Result<Plan, StoreError>;

    /// Applies `action` to `targets` (from [`plan`](Self::plan)) in one
    /// transaction, recording `actor`. Each target is checked again at write
    /// time: one that is no longer eligible (a relay moved it on, or it may
    /// be in flight) is refused, not changed.
    async fn apply(&self, action: &Action, actor: &str, targets: &[Target]) -> Result<Applied, StoreError>;

    /// Delivery outcomes (published, failed attempts, dead, cancelled) whose
    /// last change is later than `since`, oldest first, in (change time,
    /// seq, route) order. With `after` (a delivery's seq and route), those
    /// changed at `since` itself that come after that delivery are included
    /// too: a follower paging on a full page passes its last change, since
    /// many changes can share one time (a batch's outcomes do). A row's
    /// change time is taken before its transaction commits, so followers
    /// should look back a little and drop what they have seen.
    async fn changes_since(
        &self,
        since: DateTime<Utc>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Change>, StoreError>;
}

/// A delivery's state as an operator sees it: the store's `pending` is split
/// into waiting for a first attempt and retrying after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdminState {
    Pending,
    Retrying,
    Dead,
    Cancelled,
    Published,
}

impl AdminState {
    pub const ALL: [AdminState; 5] = [
        AdminState::Pending,
        AdminState::Retrying,
        AdminState::Dead,
        AdminState::Cancelled,
        AdminState::Published,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AdminState::Pending => "pending",
            AdminState::Retrying => "retrying",
            AdminState::Dead => "dead",
            AdminState::Cancelled => "cancelled",
            AdminState::Published => "published",
        }
    }

    /// From the store's state and attempt count.
    pub fn of(state: &str, attempts: i32) -> Result<Self, StoreError> {
        Ok(match state {
            "pending" if attempts > 0 => AdminState::Retrying,
            "pending" => AdminState::Pending,
            "dead" => AdminState::Dead,
            "cancelled" => AdminState::Cancelled,
            "published" => AdminState::Published,
            other => return Err(StoreError::permanent(format!("unknown delivery state {other:?}"))),
        })
    }
}

impl fmt::Display for AdminState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AdminState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        AdminState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| format!("unknown state {s:?}; use pending, retrying, dead, cancelled or published"))
    }
}

/// What a filter's states say about the stored state of deliveries `d`, to
/// add beside the filter's own test of each delivery's [`AdminState`]: that
/// test names no stored state a planner can see, so a page of dead
/// deliveries scanned every delivery of the outbox's history.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
#[derive(Debug)]
pub(crate) enum StoredStates {
    /// No states named: any.
    Any,
    /// Dead or cancelled only: the `deliveries_dead` partial index.
    Failed,
    /// Pending or retrying only: the `deliveries_pending` partial index.
    Pending,
    /// Several kinds, as stored state names.
    Listed(Vec<&'static str>),
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
impl StoredStates {
    pub(crate) fn of(states: &[AdminState]) -> Self {
        use AdminState::*;
        if states.is_empty() {
            StoredStates::Any
        } else if states.iter().all(|s| matches!(s, Dead | Cancelled)) {
            StoredStates::Failed
        } else if states.iter().all(|s| matches!(s, Pending | Retrying)) {
            StoredStates::Pending
        } else {
            let mut stored: Vec<&str> = states
                .iter()
                .map(|state| match state {
                    Retrying => Pending.as_str(),
                    other => other.as_str(),
                })
                .collect();
            stored.sort_unstable();
            stored.dedup();
            StoredStates::Listed(stored)
        }
    }

    /// The condition on `d.state`, or nothing. For a partial index it is
    /// the index's own predicate, which SQLite needs word for word.
    pub(crate) fn condition(&self) -> String {
        match self {
            StoredStates::Any => String::new(),
            StoredStates::Failed => "\n   AND d.state IN ('dead', 'cancelled')".to_string(),
            StoredStates::Pending => "\n   AND d.state = 'pending'".to_string(),
            StoredStates::Listed(states) => {
                let list: Vec<String> = states.iter().map(|s| format!("'{s}'")).collect();
                format!("\n   AND d.state IN ({})", list.join(", "))
            }
        }
    }

    /// The partial index holding exactly these deliveries, without the
    /// store's table prefix. SQLite names it (PostgreSQL picks it by cost).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn partial_index(&self) -> Option<&'static str> {
        match self {
            StoredStates::Failed => Some("deliveries_dead"),
            StoredStates::Pending => Some("deliveries_pending"),
            StoredStates::Any | StoredStates::Listed(_) => None,
        }
    }
}

/// Which deliveries to list, requeue or cancel. Every field narrows; the
/// default matches every delivery.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    /// Only these events.
    pub ids: Vec<EventId>,
    /// Any of these states.
    pub states: Vec<AdminState>,
    pub route: Option<String>,
    /// The event type matches this glob (`order.*`, `order.**`).
    pub type_glob: Option<Glob>,
    pub key: Option<String>,
    /// Events created at or after this.
    pub since: Option<DateTime<Utc>>,
    /// Events created before this.
    pub until: Option<DateTime<Utc>>,
    /// The delivery's last error contains this text (case-insensitive).
    pub error: Option<String>,
}

impl Filter {
    /// True when nothing narrows the selection: a requeue or cancel of
    /// everything is almost always a mistake, so callers ask for one.
    pub fn is_everything(&self) -> bool {
        *self == Filter::default()
    }
}

/// A position in outbox order: the last delivery of the previous page.
/// Serialized as its `SEQ:ROUTE` text, which `--after` takes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub seq: i64,
    pub route: String,
}

/// `SEQ:ROUTE`, as `ferry list` prints it and `--after` reads it.
impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.seq, self.route)
    }
}

impl Serialize for Cursor {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a cursor; pass the `next` value a previous page printed (SEQ:ROUTE)");
        let (seq, route) = s.split_once(':').ok_or_else(bad)?;
        Ok(Cursor {
            seq: seq.parse().map_err(|_| bad())?,
            route: route.to_owned(),
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// Start after this delivery; `None` starts at the oldest.
    pub after: Option<Cursor>,
    pub limit: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ListPage {
    pub deliveries: Vec<DeliverySummary>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<Cursor>,
}

/// One delivery (an event on one route), for tables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeliverySummary {
    pub event_id: EventId,
    pub seq: i64,
    pub event_type: String,
    pub key: Option<String>,
    pub route: String,
    pub state: AdminState,
    pub attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// When a pending or retrying delivery is due.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub published_at: Option<DateTime<Utc>>,
}

/// Everything known about one event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventView {
    pub id: EventId,
    pub seq: i64,
    pub event_type: String,
    pub key: Option<String>,
    pub content_type: String,
    pub headers: std::collections::BTreeMap<String, String>,
    /// The payload as text; `None` when it is not UTF-8.
    pub payload: Option<String>,
    pub payload_bytes: usize,
    pub dispatch_key: Option<String>,
    pub created_at: DateTime<Utc>,
    /// Committed but not yet routed by any relay.
    pub unrouted: bool,
    pub deliveries: Vec<DeliveryView>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeliveryView {
    pub route: String,
    pub state: AdminState,
    pub attempts: u32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub published_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
    /// Every failed attempt, oldest first (a requeue starts the count again).
    pub failures: Vec<Attempt>,
    /// Requeues and cancellations, oldest first.
    pub actions: Vec<ActionRecord>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    pub attempt: u32,
    pub at: DateTime<Utc>,
    /// This failure made the delivery dead.
    pub dead: bool,
    pub error: String,
}

/// An operator's requeue or cancel of one delivery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActionRecord {
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    pub from_state: AdminState,
    pub reason: Option<String>,
}

/// An operator's change to deliveries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Action {
    /// Dead or cancelled deliveries (and published ones, when asked) go back
    /// to pending with a fresh attempt count. Pending and retrying ones are
    /// refused: they are still being worked on, possibly right now.
    Requeue { include_published: bool },
    /// Dead, pending and retrying deliveries become cancelled, which stops
    /// them holding back later events of their key. One a relay may be
    /// publishing right now is refused.
    Cancel { reason: String },
}

impl Action {
    pub fn verb(&self) -> &'static str {
        match self {
            Action::Requeue { .. } => "requeue",
            Action::Cancel { .. } => "cancel",
        }
    }
}

/// A delivery an action is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    pub event_id: EventId,
    pub seq: i64,
    pub route: String,
    pub event_type: String,
    pub key: Option<String>,
    /// The state when planned (or, in [`Applied::changed`], before the change).
    pub state: AdminState,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Refusal {
    #[serde(flatten)]
    pub target: Target,
    pub reason: String,
}

/// Why a target that was `planned` when planned and is `now` now is
/// refused: someone (a relay, another operator) moved it on meanwhile, and
/// the action must not overwrite that.
pub(crate) fn changed_since(planned: AdminState, now: AdminState) -> String {
    format!(
        "changed since it was selected: {} then, {} now; select it again to act on it as it is",
        planned.as_str(),
        now.as_str()
    )
}

/// What an action would do: change `changes`, refuse `refused`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// In the order they should be applied.
    pub changes: Vec<Target>,
    pub refused: Vec<Refusal>,
}

/// What an [`Admin::apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Applied {
    pub changed: Vec<Target>,
    /// Targets that were no longer eligible at write time.
    pub refused: Vec<Refusal>,
}

/// A delivery's latest outcome, for `ferry tail`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub event_id: EventId,
    pub seq: i64,
    pub route: String,
    pub event_type: String,
    pub key: Option<String>,
    pub state: AdminState,
    pub attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub published_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

impl Change {
    /// From commit to the destination's confirmation, for published deliveries.
    pub fn latency_seconds(&self) -> Option<f64> {
        self.published_at
            .map(|p| (p - self.created_at).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6)
    }
}

/// The selections a partial index holds, for each store's test of its
/// plans: every filter of failed or of pending states, with and without a
/// route, each with the partial index (without the store's prefix) that
/// should answer it, and the actions whose selections are planned.
#[cfg(all(test, any(feature = "postgres", feature = "sqlite")))]
pub(crate) fn partial_index_cases(route: &str) -> (Vec<(Filter, &'static str)>, [Action; 2]) {
    use AdminState::*;
    let states: [(&[AdminState], &str); 5] = [
        (&[Dead], "deliveries_dead"),
        (&[Dead, Cancelled], "deliveries_dead"),
        (&[Cancelled], "deliveries_dead"),
        (&[Retrying], "deliveries_pending"),
        (&[Pending, Retrying], "deliveries_pending"),
    ];
    let filters = states
        .iter()
        .flat_map(|&(states, index)| {
            [None, Some(route.to_string())].into_iter().map(move |route| {
                let filter = Filter {
                    states: states.to_vec(),
                    route,
                    ..Filter::default()
                };
                (filter, index)
            })
        })
        .collect();
    let actions = [
        Action::Requeue {
            include_published: false,
        },
        Action::Cancel { reason: "test".into() },
    ];
    (filters, actions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_name_the_fix() {
        let c = Cursor {
            seq: 42,
            route: "orders:eu".into(),
        };
        assert_eq!(c.to_string().parse::<Cursor>().unwrap(), c);
        assert!("orders".parse::<Cursor>().unwrap_err().contains("SEQ:ROUTE"));
    }

    #[test]
    fn a_filters_stored_states_are_its_partial_indexes_predicates() {
        use AdminState::*;
        let of = |states: &[AdminState]| {
            let stored = StoredStates::of(states);
            (stored.condition(), stored.partial_index())
        };
        assert_eq!(of(&[]), (String::new(), None));
        let failed = (
            "\n   AND d.state IN ('dead', 'cancelled')".to_string(),
            Some("deliveries_dead"),
        );
        assert_eq!(of(&[Cancelled]), failed);
        assert_eq!(of(&[Dead, Cancelled]), failed);
        let pending = ("\n   AND d.state = 'pending'".to_string(), Some("deliveries_pending"));
        assert_eq!(of(&[Retrying]), pending);
        assert_eq!(of(&[Pending, Retrying]), pending);
        assert_eq!(
            of(&[Published, Dead, Retrying, Pending]),
            ("\n   AND d.state IN ('dead', 'pending', 'published')".to_string(), None)
        );
    }

    #[test]
    fn states_parse_and_split_pending() {
        assert_eq!("retrying".parse::<AdminState>().unwrap(), AdminState::Retrying);
        assert!("stuck".parse::<AdminState>().unwrap_err().contains("pending, retrying"));
        assert_eq!(AdminState::of("pending", 0).unwrap(), AdminState::Pending);
        assert_eq!(AdminState::of("pending", 2).unwrap(), AdminState::Retrying);
        assert!(AdminState::of("lost", 0).is_err());
    }
}
