use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, Clock, DirectBatch, DirectOutcome, DirectRecord, NO_ROUTE, Ownership, Partition, Route, RoutePlan, Store,
    UnroutedEvent,
};
use tokio::sync::RwLockReadGuard;
use tokio::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::direct::Tally;
use crate::engine::Shared;
use crate::{direct, metrics};

/// Which routes each event goes to. An event that matches none gets an empty
/// plan, which the store records as dead with reason `no route`.
pub fn plan_routes(routes: &[Route], events: Vec<UnroutedEvent>) -> Vec<RoutePlan> {
    events
        .into_iter()
        .map(|event| {
            let routes = routes
                .iter()
                .filter(|r| r.matcher.matches(&event.event_type))
                .map(|r| r.name.clone())
                .collect();
            RoutePlan { event, routes }
        })
        .collect()
}

/// Re-checks after this relay tells producers it sleeps: a producer that read
/// the flag just before it flipped commits without notifying, and one of
/// these polls finds its event; one still open after them is watched for
/// ([`Stragglers`]).
const RECHECKS: [Duration; 3] = [
    Duration::from_millis(5),
    Duration::from_millis(50),
    Duration::from_millis(500),
];

pub(crate) async fn run<S: Store, C: Clock>(shared: Arc<Shared<S, C>>) {
    let shared = &*shared;
    let mut idle = Idle::default();
    let mut direct = Direct::new(&shared.routes);
    // Until the store says it has no direct path.
    let mut direct_path = true;
    let mut backoff = Duration::from_millis(50);
    loop {
        if shared.cancel.is_cancelled() {
            direct.finish(shared).await;
            return;
        }
        let gate = match direct.gate.take() {
            Some(gate) => gate,
            None => shared.gate.read().await,
        };
        let Some(owned) = shared.valid_ownership() else {
            direct.finish(shared).await;
            drop(gate);
            // Nothing to route without partitions: not failing (a relay
            // whose renewals fail is reported as such).
            shared.progress.router_step(true);
            shared.wait_for_lease().await;
            continue;
        };
        // Producers notify while any relay sleeps, so each judges the rate
        // of the whole outbox from its share of the partitions.
        let share = owned.leases.len() as f64 / f64::from(owned.total_partitions.max(1));
        let step = if direct_path {
            direct.step(shared, owned, gate).await
        } else {
            let step = route_step(shared, &owned).await;
            drop(gate);
            step
        };
        let (fetched, full) = match step {
            Step::Done { fetched, full } => (fetched, full),
            Step::Unsupported => {
                direct_path = false;
                continue;
            }
            Step::Failed => {
                shared.progress.router_step(false);
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        shared.progress.router_step(true);
        // Caught up: settle the last batch while waiting for the next
        // commit, and let the gate go before the wait can outlast it.
        let settling = async {
            if !full {
                direct.finish(shared).await;
            }
        };
        let (_, go_on) = tokio::join!(settling, idle.after(shared, fetched, share, full));
        if !go_on {
            direct.finish(shared).await;
            return;
        }
    }
}

/// The `route` label under which events whose direct settle was refused
/// are counted in `ferry_outcomes_refused_total`.
const DIRECT_REFUSED: &str = "(direct)";

/// How one round of the router went.
enum Step {
    /// `fetched` new events; `full`: the batch was full, more is likely
    /// waiting.
    Done { fetched: usize, full: bool },
    /// The store has no direct path.
    Unsupported,
    /// A database error, logged; back off.
    Failed,
}

/// Above this arrival rate (events per second) the router polls every
/// [`HOT_POLL`] instead of sleeping between commits. Asleep, it has every
/// producer call `pg_notify`, and NOTIFY serialises the committing
/// transactions on one lock: a relay that kept up with a steady stream of
/// several thousand commits a second used to sleep between them and cut the
/// producers' commit rate to a third. At this rate a poll finds an event on
/// average, so polling costs the database no more fetches than the
/// notifications would wake; below it, notifications are cheap for
/// producers and save idle polls.
const HOT_RATE: f64 = 1_000.0;
/// The poll interval while events arrive faster than [`HOT_RATE`].
const HOT_POLL: Duration = Duration::from_millis(1);
/// How long the arrival rate is measured over before the router decides
/// again whether to poll or to sleep.
const RATE_WINDOW: Duration = Duration::from_millis(100);

/// Whether the router sleeps (and wants producers to notify it), polls
/// while events stream in, or goes on at once while batches come full.
struct Idle {
    sleeping: bool,
    rechecks: Vec<Duration>,
    /// After the rechecks: producers that read the flag before it flipped
    /// and are still open.
    stragglers: Stragglers,
    rate: Arrivals,
}

/// Producers that may commit without notifying, after the relay went to
/// sleep: they wrote while it was awake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stragglers {
    /// Ask the store whether one is open; if so, look again after this.
    Watch(Duration),
    /// None is open: wait for notifications, and poll only as configured.
    Gone,
}

/// The first wait for an open producer, doubled each time it is still open.
const STRAGGLER_WAIT: Duration = Duration::from_secs(1);

impl Default for Idle {
    fn default() -> Self {
        Self {
            sleeping: false,
            rechecks: Vec::new(),
            stragglers: Stragglers::Gone,
            rate: Arrivals::new(Instant::now()),
        }
    }
}

/// The arrival rate of new events in the whole outbox, judged once per
/// [`RATE_WINDOW`].
#[derive(Debug)]
struct Arrivals {
    since: Instant,
    /// Events in the outbox since `since`, as estimated from this relay's
    /// share of them.
    events: f64,
    hot: bool,
}

impl Arrivals {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            events: 0.0,
            hot: false,
        }
    }

    /// Counts `fetched` events found at `now` in a `share` (0 to 1) of the
    /// outbox's partitions; whether events arrive in the outbox faster than
    /// [`HOT_RATE`], as of the last full window. The estimate assumes keys
    /// spread evenly over the partitions, as they hash.
    fn observe(&mut self, fetched: usize, share: f64, now: Instant) -> bool {
        self.events += fetched as f64 / share.clamp(f64::MIN_POSITIVE, 1.0);
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= RATE_WINDOW {
            let rate = self.events / elapsed.as_secs_f64();
            let hot = rate >= HOT_RATE;
            if hot != self.hot {
                debug!(
                    events_per_second = rate.round(),
                    polling = hot,
                    "the arrival rate changed how the router waits"
                );
            }
            *self = Self {
                since: now,
                events: 0.0,
                hot,
            };
        }
        self.hot
    }
}

impl Idle {
    /// After a round that found `fetched` events in a `share` of the
    /// partitions: go on at once while
    /// batches come full, poll while events stream in, else wait for a
    /// commit notification or a poll. `false` when the relay shuts down.
    async fn after<S: Store, C: Clock>(
        &mut self,
        shared: &Shared<S, C>,
        fetched: usize,
        share: f64,
        full: bool,
    ) -> bool {
        let hot = self.rate.observe(fetched, share, Instant::now());
        if full || hot {
            // Busy: spare producers the NOTIFY.
            if self.sleeping && shared.store.set_sleeping(&shared.settings.id, false).await.is_ok() {
                self.sleeping = false;
            }
            if full {
                return true;
            }
            return tokio::select! {
                _ = tokio::time::sleep(HOT_POLL) => true,
                _ = shared.cancel.cancelled() => false,
            };
        }
        if !self.sleeping {
            match shared.store.set_sleeping(&shared.settings.id, true).await {
                Ok(()) => {
                    self.sleeping = true;
                    self.rechecks = RECHECKS.iter().rev().copied().collect();
                    self.stragglers = Stragglers::Watch(STRAGGLER_WAIT);
                    return true;
                }
                Err(err) => warn!(error = %err, "could not ask producers for notifications; polling instead"),
            }
        }
        let poll = shared.settings.poll_interval;
        let wait = match (self.rechecks.pop(), self.stragglers) {
            (Some(wait), _) => wait,
            (None, Stragglers::Gone) => poll,
            // A producer that read the flag before it flipped and commits
            // later notifies nobody: look while one is open, then once more.
            (None, Stragglers::Watch(next)) => match shared.store.producers_open().await {
                Ok(true) => {
                    self.stragglers = Stragglers::Watch((next * 2).min(poll));
                    next.min(poll)
                }
                Ok(false) => {
                    self.stragglers = Stragglers::Gone;
                    return true;
                }
                Err(err) => {
                    debug!(error = %err, "could not look for open producers; polling as configured");
                    self.stragglers = Stragglers::Gone;
                    poll
                }
            },
        };
        let deadline = Instant::now() + wait;
        tokio::select! {
            _ = shared.router_wake.notified() => true,
            _ = tokio::time::sleep_until(deadline) => true,
            _ = shared.cancel.cancelled() => false,
        }
    }
}

/// The table path's routing: deliveries created for the route workers to
/// claim. For stores without direct delivery.
async fn route_step<S: Store, C: Clock>(shared: &Shared<S, C>, owned: &Ownership) -> Step {
    let events = match shared.store.fetch_unrouted(owned, shared.settings.batch_size).await {
        Ok(events) => events,
        Err(err) => {
            warn!(error = %err, "fetching unrouted events failed; retrying");
            ::metrics::counter!(metrics::STORE_ERRORS, "op" => "fetch_unrouted").increment(1);
            return Step::Failed;
        }
    };
    let fetched = events.len();
    let full = fetched >= shared.settings.batch_size;
    if events.is_empty() {
        return Step::Done { fetched, full };
    }
    let plans = plan_routes(&shared.routes, events);
    let touched: HashSet<&str> = plans.iter().flat_map(|p| p.routes.iter().map(String::as_str)).collect();
    match shared.store.route(owned, &plans, shared.clock.now()).await {
        Ok(n) => {
            debug!(routed = n, "routed events");
            ::metrics::counter!(metrics::ROUTED).increment(n);
            // A store that routed fewer (a lost lease) leaves the rest to the
            // relay that routes them next, which counts them.
            let partitions: Vec<_> = plans.iter().map(|p| p.event.partition).collect();
            let written = shared.written(owned, &partitions, n, false);
            let routed = || plans.iter().zip(&written).filter(|(_, w)| **w).map(|(p, _)| p);
            count_enqueued(routed().map(|p| p.event.event_type.as_str()));
            let unroutable = routed().filter(|p| p.routes.is_empty()).count();
            if unroutable > 0 {
                warn!(
                    events = unroutable,
                    "events matched no route and are dead with reason `no route`"
                );
                ::metrics::counter!(metrics::UNROUTABLE).increment(unroutable as u64);
            }
            for name in touched {
                shared.wake_route(name);
            }
            Step::Done { fetched, full }
        }
        Err(err) => {
            warn!(error = %err, "routing events failed; retrying");
            ::metrics::counter!(metrics::STORE_ERRORS, "op" => "route").increment(1);
            Step::Failed
        }
    }
}

/// Direct delivery: the router publishes new events itself, straight from
/// the outbox, and writes their delivery rows afterwards (settles). An event
/// goes to the delivery table instead (parked, for its route worker) when an
/// earlier delivery of its key on that route is pending or dead there, or
/// while its route's destination is down. Settling batch n overlaps
/// publishing batch n + 1, or, caught up, the wait for the next commit.
struct Direct<'a> {
    route_names: Vec<String>,
    /// Routes whose last direct publish failed transiently, wholly, or in
    /// part and slowly (see `direct::publish`), with the step that found
    /// them down: their events park until the route worker has emptied the
    /// table of them.
    down: HashMap<String, u64>,
    /// Steps taken, for telling which fetch could see which settle.
    steps: u64,
    unsettled: Option<Unsettled>,
    /// The next batch, fetched while the last one published (only while
    /// batches come full).
    ahead: Option<Ahead>,
    /// What the batch settled during `ahead`'s fetch parked, failed or
    /// killed: that fetch may not have seen it.
    ahead_carry: Carry,
    /// Held from a batch's publish until it is settled (see `Shared::quiesce`).
    gate: Option<RwLockReadGuard<'a, ()>>,
}

/// A batch fetched ahead, under the leases it was fetched with.
struct Ahead {
    leases: Vec<(ferry_core::Partition, i64)>,
    batch: DirectBatch,
    fetch_took: Duration,
    /// The step whose fetch it was.
    step: u64,
}

/// A batch published (or parked), its delivery rows not written yet.
struct Unsettled {
    owned: Ownership,
    seqs: Vec<i64>,
    /// Per event, as `seqs`: its partition and type.
    partitions: Vec<Partition>,
    types: Vec<String>,
    records: Vec<DirectRecord>,
    /// Each route's outcomes, counted once settled.
    tallies: Vec<Tally>,
    now: DateTime<Utc>,
}

/// What an unsettled batch means for the next one, before the table shows
/// it: the (route, key) pairs it parked, failed or killed.
#[derive(Debug, Default, Clone)]
pub(crate) struct Carry {
    held: HashSet<(String, String)>,
}

impl Carry {
    fn extend(&mut self, other: Carry) {
        self.held.extend(other.held);
    }

    fn of(u: &Unsettled) -> Carry {
        let mut carry = Carry::default();
        for r in &u.records {
            if matches!(r.outcome, DirectOutcome::Published { .. }) || r.route == NO_ROUTE {
                continue;
            }
            if let Some(key) = &r.key {
                carry.held.insert((r.route.clone(), key.clone()));
            }
        }
        carry
    }
}

/// Which events of a batch each route publishes directly and which it
/// parks, by index into the batch; and the events that matched no route.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct DirectPlan {
    /// Per route (index into the routes): (direct, parked).
    pub per_route: Vec<(Vec<usize>, Vec<usize>)>,
    pub unroutable: Vec<usize>,
}

/// Decides, without I/O, where each event of a direct batch goes.
pub(crate) fn plan_direct(
    routes: &[Route],
    batch: &DirectBatch,
    down: &HashMap<String, u64>,
    carry: &Carry,
) -> DirectPlan {
    let mut plan = DirectPlan {
        per_route: vec![(Vec::new(), Vec::new()); routes.len()],
        unroutable: Vec::new(),
    };
    for (i, c) in batch.events.iter().enumerate() {
        let mut matched = false;
        for (r, route) in routes.iter().enumerate() {
            if !route.matcher.matches(&c.event.event_type) {
                continue;
            }
            matched = true;
            let held = down.contains_key(&route.name)
                || c.event.key.as_ref().is_some_and(|k| {
                    batch.held.get(i).is_some_and(|h| h.contains(&route.name))
                        || carry.held.contains(&(route.name.clone(), k.clone()))
                });
            if held {
                plan.per_route[r].1.push(i);
            } else {
                plan.per_route[r].0.push(i);
            }
        }
        if !matched {
            plan.unroutable.push(i);
        }
    }
    plan
}

impl<'a> Direct<'a> {
    fn new(routes: &[Route]) -> Self {
        Self {
            route_names: routes.iter().map(|r| r.name.clone()).collect(),
            down: HashMap::new(),
            steps: 0,
            unsettled: None,
            ahead: None,
            ahead_carry: Carry::default(),
            gate: None,
        }
    }

    /// Settles what is unsettled and lets the gate go.
    async fn finish<S: Store, C: Clock>(&mut self, shared: &Shared<S, C>) {
        if let Some(u) = self.unsettled.take() {
            settle(shared, u).await;
        }
        // Not published: its events stay unrouted and are fetched again.
        self.ahead = None;
        self.gate = None;
    }

    async fn step<S: Store, C: Clock>(
        &mut self,
        shared: &'a Shared<S, C>,
        owned: Ownership,
        gate: RwLockReadGuard<'a, ()>,
    ) -> Step {
        let previous = self.unsettled.take();
        self.steps += 1;
        let step = self.steps;
        let down: Vec<String> = self.down.keys().cloned().collect();
        let (fetched, fetch_took, mut carry, fetch_step) = match self.ahead.take() {
            // Fetched while `previous` published: it skipped `previous`'s
            // events but may have missed what `previous` and the batch
            // settled beside it parked.
            Some(a) if a.leases == owned.leases => (
                Ok(Some(a.batch)),
                a.fetch_took,
                std::mem::take(&mut self.ahead_carry),
                a.step,
            ),
            _ => {
                self.ahead_carry = Carry::default();
                let exclude: Vec<i64> = previous.as_ref().map(|u| u.seqs.clone()).unwrap_or_default();
                let fetch_started = Instant::now();
                let fetched = shared
                    .store
                    .fetch_direct(&owned, shared.settings.batch_size, &self.route_names, &down, &exclude)
                    .await;
                (fetched, fetch_started.elapsed(), Carry::default(), step)
            }
        };
        let batch = match fetched {
            Ok(Some(batch)) => batch,
            Ok(None) => {
                debug_assert!(previous.is_none());
                return Step::Unsupported;
            }
            Err(err) => {
                if let Some(u) = previous {
                    settle(shared, u).await;
                }
                drop(gate);
                warn!(error = %err, "fetching new events failed; retrying");
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "fetch_direct").increment(1);
                return Step::Failed;
            }
        };
        shared.progress.advanced();
        // Told to stop while fetching: the batch is left to the next relay
        // (its events stay unrouted), as is one whose lease may lapse
        // before it is published. Publishing it would start new work after
        // the signal, in the time left for what is in flight.
        let stopping = shared.cancel.is_cancelled();
        let held = shared.still_holds(&owned, batch.events.iter().map(|c| c.partition));
        if batch.events.is_empty() || stopping || !held {
            if let Some(u) = previous {
                settle(shared, u).await;
            }
            self.ahead = None;
            drop(gate);
            if !batch.events.is_empty() && !stopping {
                return Step::Failed;
            }
            return Step::Done {
                fetched: 0,
                full: false,
            };
        }
        let fetched = batch.events.len();
        let full = fetched >= shared.settings.batch_size;
        let previous_carry = previous.as_ref().map(Carry::of).unwrap_or_default();
        // A down route is back once the table holds nothing pending for it,
        // as read by a fetch that asked about it and saw the failed batch
        // that put it down settled: the batch found down in step k is
        // settled within step k + 1, so a fetch of step k + 2 or later. An
        // earlier fetch (one made ahead, or beside that settle) cannot tell,
        // and trusting it would try a hanging destination again, holding
        // every route up for another `direct_publish_timeout`. What later
        // unsettled batches parked on the route is held back per key by
        // `carry`.
        self.down
            .retain(|r, since| fetch_step < *since + 2 || batch.busy.contains(r));
        // While batches come full, the next one is fetched beside this
        // one's publish, skipping this batch and the one being settled.
        let fetch_ahead = full && !shared.quiesce.load(Ordering::SeqCst) && !shared.cancel.is_cancelled();
        let ahead_exclude: Vec<i64> = if fetch_ahead {
            let mut seqs: Vec<i64> = batch.events.iter().map(|c| c.event.seq).collect();
            if let Some(u) = &previous {
                seqs.extend_from_slice(&u.seqs);
            }
            seqs
        } else {
            Vec::new()
        };
        // The batch being settled is carried into this plan, and into the
        // plan of the batch fetched ahead, whose fetch may not see it either.
        let settling_carry = if fetch_ahead {
            previous_carry.clone()
        } else {
            Carry::default()
        };
        carry.extend(previous_carry);
        let plan = plan_direct(&shared.routes, &batch, &self.down, &carry);
        let leases = owned.leases.clone();
        let ahead_owned = owned.clone();
        let publish_started = Instant::now();
        let ((previous_settled, settle_took), (published, publish_took), ahead) = tokio::join!(
            async {
                let settled = match previous {
                    Some(u) => settle(shared, u).await,
                    None => true,
                };
                (settled, publish_started.elapsed())
            },
            async {
                let published = shared.while_leased(Self::publish(shared, owned, batch, plan)).await;
                (published, publish_started.elapsed())
            },
            async {
                if !fetch_ahead {
                    return None;
                }
                let started = Instant::now();
                let fetched = shared
                    .store
                    .fetch_direct(
                        &ahead_owned,
                        shared.settings.batch_size,
                        &self.route_names,
                        &down,
                        &ahead_exclude,
                    )
                    .await;
                match fetched {
                    Ok(Some(batch)) if !batch.events.is_empty() => Some((batch, started.elapsed())),
                    Ok(_) => None,
                    Err(e) => {
                        // The next round fetches again.
                        debug!(error = %e, "fetching ahead failed");
                        None
                    }
                }
            },
        );
        let Some((published, now_down)) = published else {
            // Its events stay unrouted, for the partitions' next holder;
            // the batch fetched ahead was planned behind it.
            warn!("the lease ran out during a direct publish (renewals failing); abandoned, its events stay unrouted");
            self.ahead = None;
            drop(gate);
            return Step::Failed;
        };
        for route in now_down {
            if self.down.insert(route.clone(), step).is_none() {
                warn!(route = %route, "the destination failed; its events wait in the table for the route worker");
            }
        }
        if !previous_settled {
            // This batch, and the one fetched ahead, were planned behind the
            // batch that could not be written (the database was away, or
            // the fence refused it: this relay lost the lease it published
            // under, and may hold the partition again under a new token): a
            // key's events it failed or parked held theirs back only
            // through the carry. Written now, their rows would let those
            // later events out ahead of the earlier ones, still unrouted,
            // or past a dead one. Neither is written: all their events stay
            // unrouted and are fetched again, in order (published again:
            // the duplicates of an outage or a lost lease).
            warn!(
                events = published.seqs.len(),
                "not settling a batch planned behind one that could not be settled; it will be published again"
            );
            self.ahead = None;
            drop(gate);
            return Step::Failed;
        }
        if let Some((batch, fetch_took)) = ahead {
            self.ahead = Some(Ahead {
                leases,
                batch,
                fetch_took,
                step,
            });
            self.ahead_carry = settling_carry;
        }
        shared.progress.advanced();
        debug!(
            events = published.seqs.len(),
            ?fetch_took,
            ?publish_took,
            ?settle_took,
            "direct batch published"
        );
        if !shared.quiesce.load(Ordering::SeqCst) && !shared.cancel.is_cancelled() {
            // Settled while the next batch publishes, or while the router
            // waits for new commits.
            self.unsettled = Some(published);
            self.gate = Some(gate);
        } else {
            // The batch fetched ahead cannot see what this one parks once it
            // is settled here, and no carry will tell it: fetch it again.
            self.ahead = None;
            settle(shared, published).await;
            drop(gate);
        }
        Step::Done { fetched, full }
    }

    /// Publishes a planned batch; also returns the routes whose destination
    /// looked down.
    async fn publish<S: Store, C: Clock>(
        shared: &Shared<S, C>,
        owned: Ownership,
        batch: DirectBatch,
        plan: DirectPlan,
    ) -> (Unsettled, Vec<String>) {
        let now = shared.clock.now();
        let events = &batch.events;
        let mut records: Vec<DirectRecord> = Vec::with_capacity(events.len());
        let record = |i: usize, route: &str, outcome: DirectOutcome| DirectRecord {
            seq: events[i].event.seq,
            key: events[i].event.key.clone(),
            route: route.to_owned(),
            outcome,
        };
        for &i in &plan.unroutable {
            records.push(record(
                i,
                NO_ROUTE,
                DirectOutcome::no_route(&events[i].event.event_type),
            ));
        }
        let mut publishes = Vec::new();
        for (route, (direct_ix, parked)) in shared.routes.iter().zip(plan.per_route) {
            for i in parked {
                records.push(record(i, &route.name, DirectOutcome::Parked));
            }
            if direct_ix.is_empty() {
                continue;
            }
            let tagged: Vec<(usize, Claimed)> = direct_ix.into_iter().map(|i| (i, events[i].clone())).collect();
            publishes.push(async move {
                (
                    route,
                    direct::publish(
                        shared,
                        route,
                        tagged,
                        Some(shared.settings.direct_publish_timeout),
                        "direct",
                    )
                    .await,
                )
            });
        }
        let mut down = Vec::new();
        let mut tallies = Vec::new();
        for (route, published) in futures::future::join_all(publishes).await {
            if published.down {
                down.push(route.name.clone());
            }
            for (i, outcome) in published.outcomes {
                records.push(record(i, &route.name, outcome));
            }
            tallies.push(published.tally);
        }
        let unsettled = Unsettled {
            owned,
            seqs: events.iter().map(|c| c.event.seq).collect(),
            partitions: events.iter().map(|c| c.partition).collect(),
            types: events.iter().map(|c| c.event.event_type.clone()).collect(),
            records,
            tallies,
            now,
        };
        (unsettled, down)
    }
}

/// Counts each event type routed in `types`, in `ferry_events_enqueued_total`.
fn count_enqueued<'a>(types: impl IntoIterator<Item = &'a str>) {
    let mut per_type: HashMap<&str, u64> = HashMap::new();
    for t in types {
        *per_type.entry(t).or_default() += 1;
    }
    for (event_type, count) in per_type {
        ::metrics::counter!(metrics::ENQUEUED, "type" => event_type.to_owned()).increment(count);
    }
}

/// Counts a settled batch's events but those `left` unsettled: each event
/// is counted by the settle that takes it, not by every publish of it (a
/// batch whose settle failed or was refused is fetched and published
/// again), on this path as on the table path.
fn count_settled<S: Store, C: Clock>(shared: &Shared<S, C>, u: &Unsettled, left: &HashSet<i64>) {
    let settled = || u.seqs.iter().zip(&u.types).filter(|(s, _)| !left.contains(s));
    count_enqueued(settled().map(|(_, t)| t.as_str()));
    let unroutable = u
        .records
        .iter()
        .filter(|r| r.route == NO_ROUTE && !left.contains(&r.seq))
        .count();
    if unroutable > 0 {
        warn!(
            events = unroutable,
            "events matched no route and are dead with reason `no route`"
        );
        ::metrics::counter!(metrics::UNROUTABLE).increment(unroutable as u64);
    }
    for tally in &u.tallies {
        tally.count(shared, left);
    }
}

/// Writes a published batch's delivery rows, retrying while the lease
/// lasts (a write that fails costs a duplicate publish later, never an
/// event); then wakes the route workers of what it parked. False when it
/// gave up, or when the fence refused some of its events (a lease lost,
/// perhaps taken again since under a new token): those events stay
/// unrouted, and a batch planned behind this one must not be written.
async fn settle<S: Store, C: Clock>(shared: &Shared<S, C>, u: Unsettled) -> bool {
    let mut backoff = Duration::from_millis(20);
    let mut whole = true;
    let mut failures = 0u32;
    loop {
        let started = Instant::now();
        match shared.store.settle(&u.owned, &u.seqs, &u.records, u.now).await {
            Ok(taken) => {
                shared.progress.router_step(true);
                debug!(events = u.seqs.len(), took = ?started.elapsed(), "settled");
                // After a failed attempt, events found taken already were
                // taken by it (it committed, its answer was lost) as long
                // as their partitions are still held under the same tokens:
                // no fence could have refused them.
                let written = shared.written(&u.owned, &u.partitions, taken, failures > 0);
                let left: HashSet<i64> = u
                    .seqs
                    .iter()
                    .zip(&written)
                    .filter(|(_, w)| !**w)
                    .map(|(s, _)| *s)
                    .collect();
                count_settled(shared, &u, &left);
                let n = u.seqs.len() as u64;
                let (routed, refused) = if failures > 0 {
                    (n - left.len() as u64, left.len() as u64)
                } else {
                    (taken.min(n), n - taken.min(n))
                };
                if routed > taken {
                    debug!(events = n, taken, "a settle whose answer was lost had taken the events");
                }
                ::metrics::counter!(metrics::ROUTED).increment(routed);
                if refused > 0 {
                    warn!(
                        refused,
                        "settling refused: lease lost; the next owner publishes those events again"
                    );
                    shared.counters.refused.fetch_add(refused, Ordering::Relaxed);
                    ::metrics::counter!(metrics::REFUSED, "route" => DIRECT_REFUSED).increment(refused);
                    whole = false;
                }
                break;
            }
            Err(e) => {
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "settle").increment(1);
                if shared.valid_ownership().is_none()
                    || shared.cancel.is_cancelled() && backoff >= Duration::from_secs(1)
                {
                    warn!(events = u.seqs.len(), error = %e, "could not settle published events; they will be published again");
                    return false;
                }
                failures += 1;
                // Routing waits for it: the router fails as long as this does.
                shared.progress.router_step(false);
                if crate::worker::loud(failures) {
                    warn!(events = u.seqs.len(), failures, error = %e, "settling published events keeps failing; routing waits for it; retrying");
                } else {
                    debug!(events = u.seqs.len(), error = %e, "settling failed; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
    let parked: HashSet<&str> = u
        .records
        .iter()
        .filter(|r| !matches!(r.outcome, DirectOutcome::Published { .. }) && r.route != NO_ROUTE)
        .map(|r| r.route.as_str())
        .collect();
    for name in parked {
        shared.wake_route(name);
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::Glob;

    fn route(name: &str, glob: &str) -> Route {
        Route {
            name: name.into(),
            matcher: Glob::new(glob).unwrap(),
            sink: "s".into(),
            destination: "d".into(),
            routing_key: None,
        }
    }

    fn ev(seq: i64, t: &str) -> UnroutedEvent {
        UnroutedEvent {
            seq,
            partition: 0,
            event_type: t.into(),
            key: None,
        }
    }

    fn claimed(seq: i64, t: &str, key: Option<&str>) -> Claimed {
        Claimed {
            partition: 0,
            attempts: 0,
            event: ferry_core::StoredEvent {
                id: ferry_core::EventId::new(),
                seq,
                event_type: t.into(),
                key: key.map(Into::into),
                payload: Default::default(),
                content_type: "application/json".into(),
                headers: Default::default(),
                created_at: chrono::Utc::now(),
            },
        }
    }

    #[test]
    fn direct_delivery_parks_only_what_an_earlier_delivery_of_its_key_holds_back() {
        let routes = [route("orders", "order.*"), route("audit", "**")];
        let batch = DirectBatch {
            events: vec![
                claimed(1, "order.created", Some("a")),
                claimed(2, "order.created", Some("b")),
                claimed(3, "order.created", Some("c")),
                claimed(4, "order.created", None),
                claimed(5, "user.created", Some("a")),
            ],
            // a is held on orders by the table (a pending or dead delivery).
            held: vec![vec!["orders".into()], vec![], vec![], vec![], vec!["orders".into()]],
            busy: vec![],
        };
        // b failed on audit in the batch still being settled.
        let carry = Carry {
            held: [("audit".to_string(), "b".to_string())].into(),
        };
        let plan = plan_direct(&routes, &batch, &HashMap::new(), &carry);
        assert_eq!(plan.per_route[0], (vec![1, 2, 3], vec![0]), "orders");
        assert_eq!(plan.per_route[1], (vec![0, 2, 3, 4], vec![1]), "audit");
        assert!(plan.unroutable.is_empty());

        // A route that is down parks everything, keyless events too; an
        // event no route matches is reported.
        let plan = plan_direct(
            &routes[..1],
            &batch,
            &[("orders".to_string(), 1)].into(),
            &Carry::default(),
        );
        assert_eq!(plan.per_route[0], (vec![], vec![0, 1, 2, 3]));
        assert_eq!(plan.unroutable, vec![4]);
    }

    #[test]
    fn events_fan_out_to_every_matching_route_and_unmatched_get_none() {
        let routes = [
            route("orders", "order.*"),
            route("audit", "**"),
            route("billing", "billing.**"),
        ];
        let plans = plan_routes(
            &routes,
            vec![
                ev(1, "order.created"),
                ev(2, "billing.invoice.paid"),
                ev(3, "user.created"),
            ],
        );
        assert_eq!(plans[0].routes, vec!["orders", "audit"]);
        assert_eq!(plans[1].routes, vec!["audit", "billing"]);
        assert_eq!(plans[2].routes, vec!["audit"]);
        let plans = plan_routes(&routes[..1], vec![ev(4, "user.created")]);
        assert!(plans[0].routes.is_empty());
    }

    #[test]
    fn the_router_polls_only_while_events_arrive_faster_than_the_hot_rate() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut rate = Arrivals::new(start);
        // Judged once per window: a burst inside one does not switch at once.
        assert!(!rate.observe(500, 1.0, at(10)));
        // 500 in 100 ms: 5,000 events/s.
        assert!(rate.observe(0, 1.0, at(100)));
        // Within the next window it stays as judged, found events or not.
        assert!(rate.observe(0, 1.0, at(150)));
        // 50 in 100 ms: 500 events/s, back to sleeping between commits.
        assert!(!rate.observe(50, 1.0, at(200)));
        // Exactly the hot rate polls.
        assert!(rate.observe(100, 1.0, at(300)));
        // A long quiet spell ends with a verdict over all of it.
        assert!(!rate.observe(1_000, 1.0, at(10_300)));
        // Half the partitions (another relay has the rest): 60 events in
        // 100 ms here are about 1,200 events/s in the outbox.
        let mut rate = Arrivals::new(start);
        assert!(rate.observe(60, 0.5, at(100)));
        // A quarter: 20 in 100 ms are about 800/s.
        assert!(!rate.observe(20, 0.25, at(200)));
    }
}
