//! What an operator needs from a store: find deliveries, read an event's
//! whole history, requeue or cancel deliveries safely, and follow outcomes.
//!
//! Requeue and cancel are two steps, so that `--dry-run`, confirmation and
//! progress live in the caller: [`Admin::plan`] says what a selection would
//! change and what it refuses (and why), changing nothing; [`Admin::apply`]
//! changes a batch of planned targets, re-checking each one at write time,
//! so a delivery that moved on since the plan is refused, never overwritten.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, Glob, NO_ROUTE, StoreError};
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
/// for batch in plan.batches(&action, 500) {
///     store.apply(&action, "alice", &batch).await?;
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
    /// be in flight) is refused, not changed. A requeue's order checks
    /// leave out only `targets` themselves: a key's changes planned
    /// together are applied together ([`Plan::batches`]), or a key's
    /// published deliveries replayed in two calls refuse the first call's
    /// for the second's.
    async fn apply(&self, action: &Action, actor: &str, targets: &[Target]) -> Result<Applied, StoreError>;

    /// Delivery outcomes (published, failed attempts, dead, cancelled) whose
    /// last change is later than `since`, oldest first, in (change time,
    /// seq, route) order. With `after` (a delivery's seq and route), those
    /// changed at `since` itself that come after that delivery are included
    /// too: a follower paging on a full page passes its last change, since
    /// many changes can share one time (a batch's outcomes do). A row's
    /// change time is taken before its transaction commits (a relay's
    /// clock when it published, kept while it retries the write, for as
    /// long as its lease lasts), so followers should look back a little,
    /// now and then as far as a lease, and drop what they have seen.
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
///
/// Serialized as `{"action": "requeue", "include_published": .., "out_of_order": ..}`
/// or `{"action": "cancel", "reason": ..}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Dead or cancelled deliveries (and published ones, when asked) go back
    /// to pending with a fresh attempt count. Pending and retrying ones are
    /// refused: they are still being worked on, possibly right now. So is
    /// one that would reach its destination after a later event of its key
    /// on its route (published since, or possibly being published now):
    /// requeued, it would break the key's order. A `(no route)` delivery
    /// goes back to the router, which may give it any route: a later event
    /// of its key on any route counts, and so does one requeued with it.
    Requeue { include_published: bool },
    /// [`Action::Requeue`], taking also the deliveries that would reach their
    /// destination after later events of their key: the operator accepts
    /// breaking the key's order for them (`ferry requeue --out-of-order`).
    /// [`Plan::out_of_order`] names them.
    RequeueOutOfOrder { include_published: bool },
    /// Dead, pending and retrying deliveries become cancelled, which stops
    /// them holding back later events of their key. One a relay may be
    /// publishing right now is refused.
    Cancel { reason: String },
}

impl Action {
    /// A requeue; `out_of_order` takes deliveries that would break their
    /// key's order too.
    pub fn requeue(include_published: bool, out_of_order: bool) -> Self {
        if out_of_order {
            Action::RequeueOutOfOrder { include_published }
        } else {
            Action::Requeue { include_published }
        }
    }

    pub fn verb(&self) -> &'static str {
        match self {
            Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => "requeue",
            Action::Cancel { .. } => "cancel",
        }
    }

    pub fn is_requeue(&self) -> bool {
        matches!(self, Action::Requeue { .. } | Action::RequeueOutOfOrder { .. })
    }

    /// A requeue that may deliver published deliveries again.
    pub fn includes_published(&self) -> bool {
        match self {
            Action::Requeue { include_published } | Action::RequeueOutOfOrder { include_published } => {
                *include_published
            }
            Action::Cancel { .. } => false,
        }
    }

    /// A requeue that may break a key's order.
    pub fn allows_out_of_order(&self) -> bool {
        matches!(self, Action::RequeueOutOfOrder { .. })
    }
}

impl Serialize for Action {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = serializer.serialize_struct("Action", 3)?;
        out.serialize_field("action", self.verb())?;
        match self {
            Action::Cancel { reason } => out.serialize_field("reason", reason)?,
            _ => {
                out.serialize_field("include_published", &self.includes_published())?;
                out.serialize_field("out_of_order", &self.allows_out_of_order())?;
            }
        }
        out.end()
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

/// A target and why it is refused (or, in [`Plan::out_of_order`], why it
/// is a concern).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Refusal {
    #[serde(flatten)]
    pub target: Target,
    pub reason: String,
}

/// Why a requeue refuses a delivery a later event of its key on its route
/// was published after: requeued, it would arrive after that event.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const LATER_PUBLISHED: &str = "out of order: a later event of its key was published on this route \
     since; requeued, it would arrive after that event. Pass --out-of-order to send it anyway";

/// Why a requeue refuses a delivery a later event of its key on its route
/// may be being published meanwhile: nothing holds that event back.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const LATER_IN_FLIGHT: &str = "out of order: a later event of its key may be in flight on this route \
     (nothing holds it back); requeued, this one could arrive after it. Pass --out-of-order to send it anyway";

/// Why a requeue refuses a `(no route)` delivery a later event of its key
/// was published after, on any route: back at the router it may be given
/// the route that event went to, and reach it after that event. Which
/// routes it is given is the relays' config, which the store does not see.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const LATER_PUBLISHED_ANY_ROUTE: &str = "out of order: a later event of its key was published since \
     (on some route); sent back to the router, it could reach that route after that event. Pass --out-of-order \
     to send it anyway";

/// Why a requeue refuses a delivery of a key that another requeue touched
/// after this one read the key's later events and before it locked them:
/// what it read may be out of date.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const REQUEUED_MEANWHILE: &str =
    "changed while this ran: another requeue touched its key; run the command again";

/// Why a requeue refuses a `(no route)` delivery a later event of its key
/// is requeued with: that one, dead until now, held nothing back and was
/// not in flight, but requeued it is due on its route at once, while this
/// one waits for the router.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const LATER_REQUEUED_ANY_ROUTE: &str = "out of order: a later event of its key is requeued with it; \
     sent back to the router, this one could reach that event's route after it, which goes out at once. Pass \
     --out-of-order to send it anyway";

/// Why a requeue refuses a `(no route)` delivery a later event of its key
/// may be being published meanwhile, on any route or straight from the
/// router.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) const LATER_IN_FLIGHT_ANY_ROUTE: &str = "out of order: a later event of its key may be in flight \
     (pending on some route with nothing holding it back, or not routed yet); sent back to the router, this one \
     could arrive after it. Pass --out-of-order to send it anyway";

// How a requeue keeps a key's order. While a delivery `d` is dead, a later
// delivery of its key and route is held back behind it (claim.sql): it
// waits pending, new or retrying, and a new event of the key queues behind
// it too (fetch_direct.sql). Those go after `d` once it is requeued, as
// they should. What goes wrong is a later delivery published already (after
// `d` was cancelled, or one a pipelined batch sent before `d` failed), and,
// once `d` is cancelled or published, a later delivery pending with no
// failed one before it to hold it back, or a new event that no pending or
// dead delivery of the key holds back, which the router may publish
// directly: `d` would reach the destination after them. A dead later
// delivery holds nothing back, so a dead head and a dead follower requeue
// together (the head first: plans are in outbox order). Keyless events
// have no order. A `(no route)` delivery goes back to the router, which may
// give it any route (a route added since is why it is requeued), and it
// holds back nothing on any route while it waits: a later event of its key
// published on any route, pending there with nothing holding it back, or
// not routed yet, may reach a destination before it.

/// Why requeueing the delivery `d` could let a later event of its key
/// arrive first, because that one may be in flight now (see above), or
/// NULL; as SQL over the tables named with `prefix` (`ferry.` or
/// `ferry_`), reading a key's pending deliveries `by_key` (SQLite names its
/// index, or it read every pending delivery of the route after `d`), with
/// `later_unrouted` the condition that a later event of `d`'s key waits
/// unrouted ([`later_unrouted_sql`], or a value worked out beforehand).
/// A dead `d` on a route holds all of those on its route back itself.
/// Published later deliveries are [`LastPublished`]'s.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn in_flight_after_sql(prefix: &str, by_key: &str, later_unrouted: &str) -> String {
    // `state IN (...)` is the key's index's predicate, word for word, as
    // SQLite needs it.
    let unheld = |l: &str| {
        format!(
            "NOT EXISTS (SELECT 1 FROM {prefix}deliveries b
                          WHERE b.route = {l}.route AND b.key = {l}.key AND b.seq < {l}.seq
                            AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0)))"
        )
    };
    format!(
        "CASE
           WHEN d.key IS NULL THEN NULL
           WHEN d.route = '{NO_ROUTE}' THEN
             CASE WHEN EXISTS (SELECT 1 FROM {prefix}deliveries l{by_key}
                                WHERE l.key = d.key AND l.state IN ('pending', 'dead')
                                  AND l.state = 'pending' AND l.seq > d.seq AND {unheld_l})
                    OR {later_unrouted}
                  THEN '{LATER_IN_FLIGHT_ANY_ROUTE}'
             END
           WHEN d.state NOT IN ('cancelled', 'published') THEN NULL
           WHEN EXISTS (SELECT 1 FROM {prefix}deliveries l{by_key}
                         WHERE l.key = d.key AND l.route = d.route AND l.state IN ('pending', 'dead')
                           AND l.state = 'pending' AND l.seq > d.seq AND {unheld_l})
             OR ({later_unrouted}
                 AND NOT EXISTS (SELECT 1 FROM {prefix}deliveries h
                                  WHERE h.key = d.key AND h.route = d.route
                                    AND h.state IN ('pending', 'dead')))
             THEN '{LATER_IN_FLIGHT}'
         END",
        unheld_l = unheld("l"),
    )
}

/// Whether a later event of `d`'s key waits unrouted, as SQL for
/// [`in_flight_after_sql`]. The unrouted events are read first, through a
/// lookup per event: they are few, the events after `d` many.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn later_unrouted_sql(prefix: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM {prefix}unrouted u
                  WHERE u.seq > d.seq
                    AND (SELECT ue.key FROM {prefix}events ue WHERE ue.seq = u.seq) = d.key)"
    )
}

/// The last published delivery of each (route, key) of some targets, after
/// the earliest of them. Read once for all the targets, not per target: no
/// index leads to the published deliveries of a key, so the one read goes
/// through every delivery after the earliest target (200 ms for a million),
/// where a read per target went through them all for each (21 s for 100
/// dead heads in the middle of two million).
///
/// Retention deletes published events but keeps dead and cancelled ones, so
/// the later event a kept delivery would arrive after may be gone: the
/// order marks retention leaves in its place (`purged_order`, per key and
/// route, see `retention_kept.sql`) are read with the published deliveries,
/// as published deliveries, here and in each store's `catch_up`.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
#[derive(Debug, Default)]
pub(crate) struct LastPublished {
    by_route: std::collections::HashMap<(String, String), i64>,
    /// Over every route, for `(no route)` targets.
    by_key: std::collections::HashMap<String, i64>,
    /// The `(no route)` targets a later target of their key is requeued
    /// with (see [`LastPublished::with_targets`]).
    followed: std::collections::HashSet<i64>,
}

/// What [`LastPublished`] reads: every published delivery after `after`
/// whose (route, key) is among `routes` and `keys` (pairwise), or whose key
/// is among `any_route`.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
#[derive(Debug)]
pub(crate) struct Wanted<'t> {
    pub after: i64,
    pub routes: Vec<&'t str>,
    pub keys: Vec<&'t str>,
    /// The keys of `(no route)` targets: back at the router, such a target
    /// may be given any route.
    pub any_route: Vec<&'t str>,
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
impl LastPublished {
    /// What to read, when anything: keyless targets have no order to keep.
    pub(crate) fn wanted<'t>(targets: impl IntoIterator<Item = &'t Target>) -> Option<Wanted<'t>> {
        let keyed: Vec<(i64, &str, &str)> = targets
            .into_iter()
            .filter_map(|t| Some((t.seq, t.route.as_str(), t.key.as_deref()?)))
            .collect();
        let after = keyed.iter().map(|k| k.0).min()?;
        let (routed, unrouted): (Vec<&(i64, &str, &str)>, Vec<_>) = keyed.iter().partition(|k| k.1 != NO_ROUTE);
        let (routes, keys) = routed.iter().map(|k| (k.1, k.2)).unzip();
        Some(Wanted {
            after,
            routes,
            keys,
            any_route: unrouted.iter().map(|k| k.2).collect(),
        })
    }

    /// From (route, key, last published seq) rows.
    pub(crate) fn new(rows: impl IntoIterator<Item = (String, String, i64)>) -> Self {
        let mut out = LastPublished::default();
        for (route, key, seq) in rows {
            out.note(route, key, seq);
        }
        out
    }

    /// Notes the `(no route)` targets among `targets` that a later target
    /// of their key is requeued with. No check of theirs sees that one: it
    /// is dead, so neither in flight nor published, when they are checked.
    pub(crate) fn with_targets<'t>(mut self, targets: impl IntoIterator<Item = &'t Target>) -> Self {
        let keyed: Vec<(i64, &str, &str)> = targets
            .into_iter()
            .filter_map(|t| Some((t.seq, t.route.as_str(), t.key.as_deref()?)))
            .collect();
        let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
        for (seq, _, key) in &keyed {
            let l = last.entry(key).or_insert(*seq);
            *l = (*l).max(*seq);
        }
        self.followed = keyed
            .iter()
            .filter(|(seq, route, key)| *route == NO_ROUTE && last[key] > *seq)
            .map(|(seq, ..)| *seq)
            .collect();
        self
    }

    /// Whether `t` goes back to the router with a later event of its key
    /// requeued beside it.
    pub(crate) fn followed(&self, t: &Target) -> bool {
        t.route == NO_ROUTE && self.followed.contains(&t.seq)
    }

    /// Adds a published delivery.
    pub(crate) fn note(&mut self, route: String, key: String, seq: i64) {
        let by_key = self.by_key.entry(key.clone()).or_insert(seq);
        *by_key = (*by_key).max(seq);
        let by_route = self.by_route.entry((route, key)).or_insert(seq);
        *by_route = (*by_route).max(seq);
    }

    /// Whether a later delivery of `t`'s key on its route (any route, for a
    /// `(no route)` target) was published, or for a `(no route)` target is
    /// requeued with it.
    pub(crate) fn after(&self, t: &Target) -> bool {
        let Some(key) = &t.key else { return false };
        if self.followed(t) {
            return true;
        }
        let last = if t.route == NO_ROUTE {
            self.by_key.get(key)
        } else {
            self.by_route.get(&(t.route.clone(), key.clone()))
        };
        last.is_some_and(|last| *last > t.seq)
    }
}

/// What a requeue's order checks read beyond each target's own row: the
/// later events of the targets' keys that were published or wait unrouted.
/// Finding them reads every delivery after the earliest target and every
/// unrouted event after it (in SQLite, 9 s for 100 targets behind 200,000
/// unrouted events, when read per target): too long to hold the lock that
/// keeps relays from recording outcomes while the requeue checks and
/// writes. So they are read before the lock, in one snapshot, and under
/// the lock only what can have changed since is read again, through
/// primary keys and the keys' index (`deliveries_held`): an event of those
/// keys published since was pending or dead then (`watched`), or unrouted
/// then (`unrouted`), or is newer than the read (`events_upto`), or was
/// requeued by someone else meanwhile, which the admin log says
/// (`log_upto`); such a key is refused, not guessed at. Whether a later
/// event is pending on its route with nothing holding it back is read
/// under the lock, through `deliveries_held`.
///
/// In PostgreSQL the lock is the targets' partition rows, which every
/// relay's lease renewal of those partitions waits for (past its lease, a
/// relay stops and its events are published twice), and `events_upto` is
/// the events' sequence's last value, read under the keys' advisory locks
/// that their producers draw seqs under, so every event of those keys
/// committed by then is in the snapshot and every later one draws a
/// greater seq. In SQLite the lock is its one write lock, which producers
/// would fail on their busy timeout waiting for and behind which the
/// relay's lease would lapse, the snapshot is a read transaction (which
/// takes no lock), and `events_upto` is `max(seq)` in it.
///
/// Each store reads the facts with its own SQL; what they mean is worked
/// out here, once.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
#[derive(Debug, Default)]
pub(crate) struct OrderFacts {
    /// What the targets' keys published after them, the targets themselves
    /// left out (see each store's `last_published`).
    pub published: LastPublished,
    /// The newest event's seq at the read.
    pub events_upto: i64,
    /// The newest admin log entry at the read.
    pub log_upto: i64,
    /// Per key of the targets, its events after its earliest target that
    /// wait unrouted.
    unrouted: HashMap<String, Vec<i64>>,
    /// Deliveries of the targets' keys, after their earliest target, that
    /// were pending or dead at the read: a relay may publish them before
    /// the lock.
    watched: Vec<(i64, String)>,
    /// The earliest target of each key.
    first: HashMap<String, i64>,
    /// The targets, which are left out of what their keys published.
    targets: HashSet<(i64, String)>,
    /// Keys another requeue touched between the read and the lock.
    touched: HashSet<String>,
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
impl OrderFacts {
    /// Nothing read yet about `targets`.
    pub(crate) fn new(targets: &[Target]) -> Self {
        let mut first: HashMap<String, i64> = HashMap::new();
        for t in targets {
            if let Some(key) = &t.key {
                let seq = first.entry(key.clone()).or_insert(t.seq);
                *seq = (*seq).min(t.seq);
            }
        }
        OrderFacts {
            first,
            targets: targets.iter().map(|t| (t.seq, t.route.clone())).collect(),
            ..OrderFacts::default()
        }
    }

    /// The targets' keys; empty when no target has one, and there is
    /// nothing to read.
    pub(crate) fn keys(&self) -> Vec<String> {
        self.first.keys().cloned().collect()
    }

    /// The earliest target with a key (`i64::MAX` when none has one): what
    /// the read looks after.
    pub(crate) fn after(&self) -> i64 {
        self.first.values().min().copied().unwrap_or(i64::MAX)
    }

    /// Notes an event of `key` that waits unrouted, when it is after the
    /// key's earliest target.
    pub(crate) fn note_unrouted(&mut self, key: String, seq: i64) {
        if self.first.get(&key).is_some_and(|first| seq > *first) {
            self.unrouted.entry(key).or_default().push(seq);
        }
    }

    /// `t`, a `(no route)` delivery, went back to the router.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn unrouted_again(&mut self, t: &Target) {
        if let Some(key) = &t.key {
            self.note_unrouted(key.clone(), t.seq);
        }
    }

    /// Every event noted waiting unrouted: any may have been routed and
    /// published since.
    pub(crate) fn unrouted_seqs(&self) -> Vec<i64> {
        self.unrouted.values().flatten().copied().collect()
    }

    /// Takes the pending or dead deliveries read, as (seq, route, key),
    /// keeping those after their key's earliest target.
    pub(crate) fn watch(&mut self, rows: impl IntoIterator<Item = (i64, String, String)>) {
        self.watched = rows
            .into_iter()
            .filter(|(seq, _, key)| self.first.get(key).is_some_and(|first| seq > first))
            .map(|(seq, route, _)| (seq, route))
            .collect();
    }

    /// The watched deliveries, as (seq, route).
    pub(crate) fn watched(&self) -> &[(i64, String)] {
        &self.watched
    }

    /// Notes published deliveries, as (route, key, seq), but the targets.
    pub(crate) fn note_published(&mut self, rows: impl IntoIterator<Item = (String, String, i64)>) {
        for (route, key, seq) in rows {
            if !self.targets.contains(&(seq, route.clone())) {
                self.published.note(route, key, seq);
            }
        }
    }

    /// The keys another requeue touched since the read.
    pub(crate) fn set_touched(&mut self, keys: impl IntoIterator<Item = String>) {
        self.touched = keys.into_iter().collect();
    }

    /// Whether a later event of `t`'s key waits unrouted.
    pub(crate) fn later_unrouted(&self, t: &Target) -> bool {
        let Some(key) = &t.key else { return false };
        self.unrouted
            .get(key)
            .is_some_and(|seqs| seqs.iter().any(|seq| *seq > t.seq))
    }

    /// Whether another requeue touched `t`'s key since the read.
    pub(crate) fn touched(&self, t: &Target) -> bool {
        t.key.as_ref().is_some_and(|key| self.touched.contains(key))
    }
}

/// Why requeueing `t` would break its key's order: a later event of its
/// key was published (`published`), or may be in flight (`in_flight`, from
/// [`in_flight_after_sql`]).
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn out_of_order(t: &Target, published: &LastPublished, in_flight: Option<String>) -> Option<String> {
    match published.after(t) {
        true if published.followed(t) => Some(LATER_REQUEUED_ANY_ROUTE.to_owned()),
        true if t.route == NO_ROUTE => Some(LATER_PUBLISHED_ANY_ROUTE.to_owned()),
        true => Some(LATER_PUBLISHED.to_owned()),
        false => in_flight,
    }
}

/// Sorts a planned target: refused with `refusal`; else, when it would
/// break its key's order (`out_of_order`), refused for that unless `action`
/// allows it, then changed and named in [`Plan::out_of_order`].
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn sort_target(
    plan: &mut Plan,
    action: &Action,
    target: Target,
    refusal: Option<String>,
    out_of_order: Option<String>,
) {
    match (refusal, out_of_order) {
        (Some(reason), _) => plan.refused.push(Refusal { target, reason }),
        (None, Some(reason)) if action.allows_out_of_order() => {
            plan.out_of_order.push(Refusal {
                target: target.clone(),
                reason,
            });
            plan.changes.push(target);
        }
        (None, Some(reason)) => plan.refused.push(Refusal { target, reason }),
        (None, None) => plan.changes.push(target),
    }
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
    /// Those of `changes` that will reach their destination after later
    /// events of their key, and why: only an
    /// [`Action::RequeueOutOfOrder`] takes them.
    pub out_of_order: Vec<Refusal>,
}

impl Plan {
    /// [`Plan::changes`] of `action` (the one planned) cut into batches for
    /// [`Admin::apply`], each its own transaction, of at most `size`
    /// changes. A requeue's batch may hold more, for one key's: every
    /// change of a key goes in one batch, however many there are. A
    /// requeue batch's order checks leave out its own targets only, so a
    /// key split in two would have its earlier changes refused for its
    /// later ones, published and replayed with them, and a `(no route)`
    /// change would miss the later one requeued with it. Such a batch
    /// holds its partition's rows for as long as it runs. A cancel checks
    /// no order, and its batches hold at most `size`, whatever the keys.
    /// Changes without a key keep no order and fill batches up. Each
    /// batch keeps the plan's order.
    pub fn batches(&self, action: &Action, size: usize) -> Vec<Vec<Target>> {
        let size = size.max(1);
        if !action.is_requeue() {
            return self.changes.chunks(size).map(<[Target]>::to_vec).collect();
        }
        // The plan's indexes of each key's changes, or of one keyless
        // change, in order of first appearance.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut of_key: HashMap<&str, usize> = HashMap::new();
        for (i, t) in self.changes.iter().enumerate() {
            match t.key.as_deref() {
                Some(key) => {
                    let group = *of_key.entry(key).or_insert_with(|| {
                        groups.push(Vec::new());
                        groups.len() - 1
                    });
                    groups[group].push(i);
                }
                None => groups.push(vec![i]),
            }
        }
        let mut batches: Vec<Vec<usize>> = Vec::new();
        let mut current: Vec<usize> = Vec::new();
        for group in groups {
            if !current.is_empty() && current.len() + group.len() > size {
                batches.push(std::mem::take(&mut current));
            }
            current.extend(group);
        }
        if !current.is_empty() {
            batches.push(current);
        }
        batches
            .into_iter()
            .map(|mut batch| {
                batch.sort_unstable();
                batch.into_iter().map(|i| self.changes[i].clone()).collect()
            })
            .collect()
    }
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

    fn target(seq: i64, key: Option<&str>) -> Target {
        Target {
            event_id: EventId::new(),
            seq,
            route: "orders".into(),
            event_type: "order.updated".into(),
            key: key.map(str::to_owned),
            state: AdminState::Published,
        }
    }

    /// A key's changes never straddle two batches (whose order checks
    /// would refuse the first's for the second's), even past the size;
    /// other keys and keyless changes are packed around it, in plan order.
    #[test]
    fn batches_keep_each_keys_changes_together() {
        let mut changes: Vec<Target> = (1..=7).map(|seq| target(seq, Some("a"))).collect();
        changes.insert(2, target(100, Some("b")));
        changes.push(target(200, None));
        changes.push(target(201, Some("b")));
        changes.push(target(202, Some("c")));
        let plan = Plan {
            changes,
            ..Plan::default()
        };
        let requeue = Action::Requeue {
            include_published: true,
        };
        let seqs = |size| -> Vec<Vec<i64>> {
            plan.batches(&requeue, size)
                .iter()
                .map(|b| b.iter().map(|t| t.seq).collect())
                .collect()
        };
        assert_eq!(seqs(3), [vec![1, 2, 3, 4, 5, 6, 7], vec![100, 200, 201], vec![202]]);
        assert_eq!(seqs(9), [vec![1, 2, 100, 3, 4, 5, 6, 7, 201], vec![200, 202]]);
        assert_eq!(seqs(100).concat().len(), plan.changes.len());
        assert!(Plan::default().batches(&requeue, 500).is_empty());
    }

    /// A cancel checks no order: one key's whole backlog in a single
    /// transaction held its partition's rows for seconds, stalling the
    /// relays' lease renewals and outcome writes. Its batches hold at most
    /// the size, cut across a key.
    #[test]
    fn cancel_batches_cut_across_a_key() {
        let plan = Plan {
            changes: (1..=1201).map(|seq| target(seq, Some("hot"))).collect(),
            ..Plan::default()
        };
        let cancel = Action::Cancel {
            reason: "backlog".into(),
        };
        let batches = plan.batches(&cancel, 500);
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(sizes, [500, 500, 201]);
        let seqs: Vec<i64> = batches.concat().iter().map(|t| t.seq).collect();
        assert_eq!(seqs, (1..=1201).collect::<Vec<i64>>(), "in the plan's order");
        assert!(Plan::default().batches(&cancel, 500).is_empty());
        let requeue = Action::requeue(true, false);
        assert_eq!(plan.batches(&requeue, 500).len(), 1, "a requeue keeps the key whole");
    }

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
