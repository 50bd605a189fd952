use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use ferry_core::{Clock, ErrorKind, Ownership, Partition, Route, Sink, Store, StoreError};
use tokio::sync::{Notify, RwLock, watch};
use tokio::task::JoinSet;
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::bounded::Bounded;
use crate::{RelaySettings, lease, router, worker};

/// The longest the relay waits, after its workers stopped, to hand its leases
/// back and to close each sink.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(5);

/// A spawned task that is aborted when this handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A relay's configuration is wrong; nothing was published.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    #[error("routes[{index}] ({route}): no sink named {sink:?}")]
    UnknownSink { index: usize, route: String, sink: String },
    #[error("two routes are named {0:?}; route names key the delivery state and must be unique")]
    DuplicateRoute(String),
    #[error("the store is not usable: {0}")]
    Store(StoreError),
    /// A task of the relay ended on its own (a panic, which is a bug): the
    /// relay stopped, as on a signal, rather than run on with events that
    /// nothing routes or delivers.
    #[error("the relay's {task} stopped unexpectedly: {reason}")]
    TaskEnded { task: String, reason: String },
}

/// What a relay did before it stopped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RunReport {
    pub published: u64,
    pub retried: u64,
    pub dead: u64,
    /// Outcomes the store refused because the lease had moved on.
    pub refused: u64,
    /// Events confirmed after an earlier event of their key was rejected in
    /// the same pipelined batch (see `ferry_order_breaks_total`).
    pub order_breaks: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub published: AtomicU64,
    pub retried: AtomicU64,
    pub dead: AtomicU64,
    pub refused: AtomicU64,
    pub order_breaks: AtomicU64,
}

/// How recently the relay got anywhere, for a readiness probe: a route
/// worker reports each claim it completes and each batch it publishes, and
/// says when it waits with nothing to do. Cheap to clone and to read.
#[derive(Debug, Clone)]
pub struct Progress(Arc<ProgressState>);

#[derive(Debug)]
struct ProgressState {
    origin: std::time::Instant,
    /// Milliseconds after `origin` of the last step forward.
    last: AtomicU64,
    /// Workers waiting with nothing due (or no partitions to work).
    idle: AtomicUsize,
    workers: AtomicUsize,
    /// Milliseconds after `origin` of the last lease renewal the database
    /// accepted; `u64::MAX` before the first.
    renewed: AtomicU64,
    /// Milliseconds after `origin` of the router's first failure in a row;
    /// `u64::MAX` while its last step succeeded.
    router_failing: AtomicU64,
}

impl Default for Progress {
    fn default() -> Self {
        Self(Arc::new(ProgressState {
            origin: std::time::Instant::now(),
            last: AtomicU64::new(0),
            idle: AtomicUsize::new(0),
            workers: AtomicUsize::new(0),
            renewed: AtomicU64::new(u64::MAX),
            router_failing: AtomicU64::new(u64::MAX),
        }))
    }
}

impl Progress {
    /// Since the last claim or publish (since creation before the first).
    pub fn since_last(&self) -> Duration {
        let last = Duration::from_millis(self.0.last.load(Ordering::Relaxed));
        self.0.origin.elapsed().saturating_sub(last)
    }

    /// Every route worker is running and waits with nothing to do.
    pub fn idle(&self) -> bool {
        let workers = self.0.workers.load(Ordering::Relaxed);
        workers > 0 && self.0.idle.load(Ordering::Relaxed) >= workers
    }

    /// How long the router has failed without a step succeeding in
    /// between; `None` while it works. Its failures leave new events
    /// unrouted while every route worker, with nothing to claim, looks idle.
    pub fn router_failing_for(&self) -> Option<Duration> {
        let since = self.0.router_failing.load(Ordering::Relaxed);
        (since != u64::MAX).then(|| self.0.origin.elapsed().saturating_sub(Duration::from_millis(since)))
    }

    /// A step of the router succeeded (`ok`) or failed. Called by the
    /// relay's router.
    pub fn router_step(&self, ok: bool) {
        if ok {
            self.0.router_failing.store(u64::MAX, Ordering::Relaxed);
        } else {
            let now = self.0.origin.elapsed().as_millis().min(u64::MAX as u128 - 1) as u64;
            // The first failure in a row is when it began.
            let _ = self
                .0
                .router_failing
                .compare_exchange(u64::MAX, now, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    pub(crate) fn advanced(&self) {
        let now = self.0.origin.elapsed().as_millis().min(u64::MAX as u128) as u64;
        self.0.last.fetch_max(now, Ordering::Relaxed);
    }

    /// A lease renewal (the relay's heartbeat) succeeded. Called by the
    /// relay's lease keeper.
    pub fn renewed(&self) {
        let now = self.0.origin.elapsed().as_millis().min(u64::MAX as u128 - 1) as u64;
        self.0.renewed.store(now, Ordering::Relaxed);
    }

    /// Since the last lease renewal the database accepted; `None` before
    /// the first. While renewals fail the relay holds no lease it may work
    /// under, and its workers wait, looking idle.
    pub fn since_renewed(&self) -> Option<Duration> {
        match self.0.renewed.load(Ordering::Relaxed) {
            u64::MAX => None,
            at => Some(self.0.origin.elapsed().saturating_sub(Duration::from_millis(at))),
        }
    }

    pub(crate) fn worker_started(&self) {
        self.0.workers.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts the caller as idle until the guard drops.
    pub(crate) fn idle_guard(&self) -> IdleGuard<'_> {
        self.0.idle.fetch_add(1, Ordering::Relaxed);
        IdleGuard(self)
    }
}

pub(crate) struct IdleGuard<'a>(&'a Progress);

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        self.0.0.idle.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The leases as the workers see them: valid only until `valid_until`.
#[derive(Debug, Clone)]
pub(crate) struct LeaseView {
    pub owned: Ownership,
    pub valid_until: Instant,
}

impl LeaseView {
    /// The view a tick sent at `sent` answered with: a lease runs from the
    /// request, not from its answer, which may come late.
    pub fn granted(owned: Ownership, sent: Instant, settings: &RelaySettings) -> Self {
        Self {
            owned,
            valid_until: sent + settings.lease.saturating_sub(settings.lease_margin()),
        }
    }

    /// Holding partitions, under a lease that has not run out at `now`.
    pub fn valid_at(&self, now: Instant) -> bool {
        !self.owned.is_empty() && now < self.valid_until
    }

    /// Valid at `now`, and holding each of `partitions` under the token
    /// `owned` had for it.
    pub fn holds(&self, owned: &Ownership, partitions: impl IntoIterator<Item = Partition>, now: Instant) -> bool {
        if !self.valid_at(now) {
            return false;
        }
        let token = |o: &Ownership, p: Partition| o.leases.iter().find(|(q, _)| *q == p).map(|(_, t)| *t);
        partitions.into_iter().all(|p| {
            let then = token(owned, p);
            then.is_some() && then == token(&self.owned, p)
        })
    }
}

/// State shared by the relay's tasks.
pub(crate) struct Shared<S, C> {
    pub store: S,
    pub clock: C,
    pub settings: RelaySettings,
    pub routes: Vec<Route>,
    pub sinks: HashMap<String, Arc<dyn Sink>>,
    pub lease: watch::Receiver<LeaseView>,
    /// Workers hold a read guard for each unit of work; the lease keeper takes
    /// the write guard to hand partitions back only when nothing is in flight.
    pub gate: RwLock<()>,
    /// Set while the lease keeper waits for `gate` to hand partitions back:
    /// workers then record each batch before letting go of the gate instead
    /// of overlapping the record with the next batch.
    pub quiesce: AtomicBool,
    pub router_wake: Notify,
    pub route_wake: HashMap<String, Notify>,
    pub cancel: CancellationToken,
    pub counters: Counters,
    pub progress: Progress,
}

impl<S: Store, C: Clock> Shared<S, C> {
    /// The leases, if they are still safely inside their deadline.
    pub fn valid_ownership(&self) -> Option<Ownership> {
        let view = self.lease.borrow();
        view.valid_at(Instant::now()).then(|| view.owned.clone())
    }

    /// Whether the lease view is valid and still holds each of
    /// `partitions` under the token it had in `owned`, the view a claim or
    /// fetch was made under. A read whose answer came late may have been
    /// overtaken by a tick that lost some of its partitions (their lease
    /// lapsed and another relay took them): their events are that relay's
    /// to publish now.
    pub fn still_holds(&self, owned: &Ownership, partitions: impl IntoIterator<Item = Partition>) -> bool {
        self.lease.borrow().holds(owned, partitions, Instant::now())
    }

    /// Which of the items of a write fenced by the leases to count as
    /// written: the store applied `applied` of them, read under `owned`
    /// from `partitions` (one per item). All when it says all; none when it
    /// says none, unless an earlier attempt whose answer was lost may have
    /// written them (`retried`); otherwise those of the partitions still
    /// held under the token they were read with, whose fence could not
    /// have refused them, as long as their number is the store's.
    ///
    /// The store says how many, not which. Fewer applied than held means
    /// some items had moved on (a delivery an operator cancelled while it
    /// was in flight), and more means the lease was lost after the write;
    /// either way which items were written is not known, and none is
    /// counted: a written outcome missing from the totals misleads less
    /// than a cancelled delivery counted as published or dead beside the
    /// refusal. After a lost answer the earlier attempt's share is not
    /// known either, and the held ones are counted.
    pub fn written(&self, owned: &Ownership, partitions: &[Partition], applied: u64, retried: bool) -> Vec<bool> {
        let n = partitions.len();
        if applied >= n as u64 {
            return vec![true; n];
        }
        if applied == 0 && !retried {
            return vec![false; n];
        }
        let view = self.lease.borrow();
        let now = Instant::now();
        let held: Vec<bool> = partitions.iter().map(|&p| view.holds(owned, [p], now)).collect();
        if !retried && held.iter().filter(|h| **h).count() as u64 != applied {
            return vec![false; n];
        }
        held
    }

    /// Runs `work` (a publish) while the lease is valid: `None` if the lease
    /// ran out first (renewals failing, the database out of reach), and the
    /// work is dropped. Past that point another relay may take the
    /// partitions and publish the same keys; a publish still sending then
    /// would interleave with it.
    pub async fn while_leased<F: Future>(&self, work: F) -> Option<F::Output> {
        tokio::select! {
            out = work => Some(out),
            () = self.lease_lapsed() => None,
        }
    }

    /// Resolves once the lease view's deadline passes without a renewal.
    async fn lease_lapsed(&self) {
        let mut rx = self.lease.clone();
        loop {
            let until = rx.borrow_and_update().valid_until;
            if Instant::now() >= until {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(until) => {}
                changed = rx.changed() => {
                    if changed.is_err() {
                        // No keeper any more: the deadline stands.
                        tokio::time::sleep_until(until).await;
                    }
                }
            }
        }
    }

    /// Waits for a new lease view (or the next renewal's time), for a
    /// caller that found no valid lease.
    pub async fn wait_for_lease(&self) {
        let mut rx = self.lease.clone();
        // A clone starts from the shared receiver's seen version, which
        // never advances: without this, every view ever sent counts as new
        // and the caller spins for as long as it holds no valid lease.
        rx.borrow_and_update();
        // A view that came between the caller's look and the line above.
        if self.valid_ownership().is_some() {
            return;
        }
        tokio::select! {
            _ = rx.changed() => {}
            _ = tokio::time::sleep(self.settings.renew_every()) => {}
            _ = self.cancel.cancelled() => {}
        }
    }

    pub fn wake_route(&self, name: &str) {
        if let Some(n) = self.route_wake.get(name) {
            n.notify_one();
        }
    }

    pub fn wake_all(&self) {
        self.router_wake.notify_one();
        for n in self.route_wake.values() {
            n.notify_one();
        }
    }

    /// Sleeps unless the relay is shutting down.
    pub async fn sleep(&self, d: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.cancel.cancelled() => {}
        }
    }
}

/// The relay: claims, publishes and records, until told to stop.
///
/// ```no_run
/// # async fn demo(store: impl ferry_core::Store, sink: std::sync::Arc<dyn ferry_core::Sink>) {
/// use ferry_core::{Glob, Route, SystemClock};
/// use ferry_relay::{Relay, RelaySettings};
/// let route = Route { name: "orders".into(), matcher: Glob::new("order.*").unwrap(), sink: "rabbit".into(),
///                     destination: "orders".into(), routing_key: None };
/// let relay = Relay::new(store, SystemClock, RelaySettings::new("relay-a"), vec![route],
///                        [("rabbit".to_string(), sink)].into()).unwrap();
/// let report = relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await.unwrap();
/// println!("published {}", report.published);
/// # }
/// ```
pub struct Relay<S, C> {
    store: S,
    clock: C,
    settings: RelaySettings,
    routes: Vec<Route>,
    sinks: HashMap<String, Arc<dyn Sink>>,
    progress: Progress,
    #[cfg(feature = "wal")]
    wal: Option<crate::wal::Wal>,
}

impl<S: Store, C: Clock> Relay<S, C> {
    pub fn new(
        store: S,
        clock: C,
        settings: RelaySettings,
        routes: Vec<Route>,
        sinks: HashMap<String, Arc<dyn Sink>>,
    ) -> Result<Self, RelayError> {
        let mut names = std::collections::HashSet::new();
        for (index, r) in routes.iter().enumerate() {
            if !sinks.contains_key(&r.sink) {
                return Err(RelayError::UnknownSink {
                    index,
                    route: r.name.clone(),
                    sink: r.sink.clone(),
                });
            }
            if !names.insert(r.name.as_str()) {
                return Err(RelayError::DuplicateRoute(r.name.clone()));
            }
        }
        Ok(Self {
            store,
            clock,
            settings,
            routes,
            sinks,
            progress: Progress::default(),
            #[cfg(feature = "wal")]
            wal: None,
        })
    }

    /// Streams new events from a logical replication slot instead of
    /// polling the outbox for them (WAL streaming mode). Every relay sharing
    /// the database must run in this mode; one streams, the others stand by
    /// for the slot and work the table path.
    #[cfg(feature = "wal")]
    pub fn with_wal(mut self, wal: crate::wal::Wal) -> Self {
        self.wal = Some(wal);
        self
    }

    /// A handle that reports how recently this relay made progress; take it
    /// before [`run`](Self::run) to serve a readiness probe.
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// Runs until `shutdown` resolves; then stops claiming, waits up to the
    /// shutdown timeout for in-flight confirms, hands its leases back and
    /// returns. A store that is down is retried; a store without the Ferry
    /// schema is an error.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<RunReport, RelayError> {
        let Relay {
            store,
            clock,
            settings,
            routes,
            sinks,
            progress,
            #[cfg(feature = "wal")]
            wal,
        } = self;
        // Every call the relay's tasks make goes through this bound: a
        // connection gone silent fails the call instead of holding the
        // router or a worker on it while the lease keeper, on connections
        // of its own, goes on renewing the leases.
        let store = Bounded::new(store, settings.store_timeout());
        let mut shutdown = std::pin::pin!(shutdown);
        // Fail fast on a missing schema, before any task starts.
        let (first, sent) = loop {
            // The lease runs from the request, not from its answer, which
            // may come late.
            let sent = Instant::now();
            // A tick against an unreachable database may wait out a connect
            // timeout; a shutdown meanwhile ends the wait.
            let limit = settings.tick_timeout();
            let tick = tokio::select! {
                tick = tokio::time::timeout(limit, store.tick(&settings.id, settings.lease, &[])) => {
                    // A connection gone silent is tried again, like one refused.
                    tick.unwrap_or_else(|_| Err(StoreError::transient(format!(
                        "the database did not answer the first lease request within {limit:?} (7/15 of relay.lease)"
                    ))))
                }
                _ = &mut shutdown => {
                    // The tick given up on may still run on the server and
                    // take partitions, under tokens never seen: those
                    // expire on their own. A leave frees only leases named
                    // with their tokens, so that one reaching the server
                    // late cannot free what a later run under this id holds.
                    let leave = store.leave(&settings.id, &[]);
                    if !matches!(tokio::time::timeout(farewell(&settings), leave).await, Ok(Ok(()))) {
                        warn!("could not withdraw this relay's heartbeat; it lapses on its own");
                    }
                    return Ok(RunReport::default());
                }
            };
            match tick {
                Ok(own) => break (own, sent),
                Err(e) if e.kind == ErrorKind::Transient => {
                    warn!(error = %e, "database unreachable at start; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = &mut shutdown => return Ok(RunReport::default()),
                    }
                }
                Err(e) => return Err(RelayError::Store(e)),
            }
        };
        let mut first = first;
        first.relay = settings.id.clone();
        progress.renewed();
        let (lease_tx, lease_rx) = watch::channel(LeaseView::granted(first, sent, &settings));
        let route_wake = routes.iter().map(|r| (r.name.clone(), Notify::new())).collect();
        let shared = Arc::new(Shared {
            store,
            clock,
            settings,
            routes,
            sinks,
            lease: lease_rx,
            gate: RwLock::new(()),
            quiesce: AtomicBool::new(false),
            router_wake: Notify::new(),
            route_wake,
            cancel: CancellationToken::new(),
            counters: Counters::default(),
            progress,
        });
        info!(relay = %shared.settings.id, routes = shared.routes.len(), "relay started");

        // Each task by name, so that one ending early is named.
        let mut work = JoinSet::new();
        let mut names = HashMap::new();
        #[cfg(feature = "wal")]
        match wal {
            Some(wal) => {
                names.insert(
                    work.spawn(crate::wal::run(shared.clone(), wal)).id(),
                    "WAL streamer".to_owned(),
                );
            }
            None => {
                names.insert(work.spawn(router::run(shared.clone())).id(), "router".to_owned());
            }
        }
        #[cfg(not(feature = "wal"))]
        names.insert(work.spawn(router::run(shared.clone())).id(), "router".to_owned());
        for route in shared.routes.clone() {
            let name = format!("worker for route {:?}", route.name);
            names.insert(work.spawn(worker::run(shared.clone(), route)).id(), name);
        }
        // Aborted on drop like the workers in `work`: a `run` future dropped
        // half-way (its task aborted, a lost `select!`) must not leave a
        // keeper renewing this relay's leases forever.
        let keeper_stop = CancellationToken::new();
        let mut keeper = AbortOnDrop(tokio::spawn(lease::keep(shared.clone(), lease_tx, keeper_stop.clone())));
        let listener = AbortOnDrop(tokio::spawn(lease::listen(shared.clone())));

        // The tasks run until cancelled: one that ends before (a panic in
        // a sink's client, a bug) stops the relay, which a supervisor then
        // restarts, instead of leaving its events undelivered behind a
        // relay that looks healthy.
        let ended = tokio::select! {
            () = &mut shutdown => None,
            Some(ended) = work.join_next_with_id() => Some(match ended {
                Ok((id, ())) => (names.remove(&id), "it returned".to_owned()),
                Err(e) => (names.remove(&e.id()), panic_text(e)),
            }),
        };
        let ended = ended.map(|(task, reason)| {
            let task = task.unwrap_or_else(|| "task".to_owned());
            error!(%task, %reason, "a relay task stopped unexpectedly; stopping the relay");
            RelayError::TaskEnded { task, reason }
        });
        info!("shutting down: no new claims; waiting for in-flight publishes");
        shared.cancel.cancel();
        let drained = tokio::time::timeout(shared.settings.shutdown_timeout, async {
            while work.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("shutdown timeout passed with publishes in flight; their deliveries stay pending for the next relay");
            work.abort_all();
            while work.join_next().await.is_some() {}
        }
        // Nothing below may hold the exit up: with the database or a broker
        // unreachable, a lease renewal, the hand-back or a sink's close could
        // each wait out a connect timeout. Leases not handed back expire.
        drop(listener);
        let farewell = farewell(&shared.settings);
        // The sinks close while the leases are still held and renewed: a
        // publish the timeout cut short may have left messages in a client's
        // queue (librdkafka's), which closing flushes. Sent after the
        // hand-back, they would reach the destination beside, or after, the
        // next relay's copies of the same events and of later ones of their
        // keys. A close that does not finish keeps the leases, to expire.
        let closing = futures::future::join_all(shared.sinks.values().map(|sink| sink.close()));
        let closed = tokio::time::timeout(farewell, closing).await.is_ok();
        if !closed {
            warn!(
                ?farewell,
                "closing the sinks took too long; the leases are left to expire, so that no other relay publishes \
                 beside what they may still send"
            );
        }
        // The leases were renewed until here: another relay taking them
        // while publishes drained would publish the same events beside them.
        keeper_stop.cancel();
        // A renewal in flight finishes first (the keeper stops at its next
        // wait): aborted half-way, its statement would still run on the
        // server and could take the leases again after the hand-back.
        if tokio::time::timeout(farewell, &mut keeper.0).await.is_err() {
            keeper.0.abort();
            let _ = (&mut keeper.0).await;
        }
        if closed {
            // The leases of the last answered renewal, under their tokens: a
            // hand-back given up on below may still run on the server once
            // a later run under this relay id holds them again, under new
            // tokens, and then frees nothing. A lease not in the view (a
            // renewal given up on that took it) expires on its own.
            let held = shared.lease.borrow().owned.leases.clone();
            match tokio::time::timeout(farewell, shared.store.leave(&shared.settings.id, &held)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "could not hand leases back; they expire on their own"),
                Err(_) => warn!(?farewell, "handing leases back took too long; they expire on their own"),
            }
        }
        let c = &shared.counters;
        let report = RunReport {
            published: c.published.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            dead: c.dead.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            order_breaks: c.order_breaks.load(Ordering::Relaxed),
        };
        info!(?report, "relay stopped");
        match ended {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}

/// The bound on each step after the drain: closing the sinks, a renewal in
/// flight, the hand-back.
fn farewell(settings: &RelaySettings) -> Duration {
    settings.shutdown_timeout.min(FAREWELL_TIMEOUT)
}

/// What a task that failed said: its panic message, when it has one.
fn panic_text(e: tokio::task::JoinError) -> String {
    if !e.is_panic() {
        return e.to_string();
    }
    let payload = e.into_panic();
    match payload.downcast::<String>() {
        Ok(text) => format!("panicked: {text}"),
        Err(payload) => match payload.downcast::<&'static str>() {
            Ok(text) => format!("panicked: {text}"),
            Err(_) => "panicked".to_owned(),
        },
    }
}

#[cfg(test)]
mod lease_view_tests {
    use super::*;

    fn owning(leases: &[(Partition, i64)]) -> Ownership {
        Ownership {
            leases: leases.to_vec(),
            ..Ownership::default()
        }
    }

    #[test]
    fn a_read_is_published_only_while_its_partitions_are_held_under_the_same_token() {
        let now = Instant::now();
        let claimed_under = owning(&[(1, 7), (2, 7)]);
        let view = |leases: &[(Partition, i64)]| LeaseView {
            owned: owning(leases),
            valid_until: now + Duration::from_secs(1),
        };
        assert!(view(&[(1, 7), (2, 7), (3, 1)]).holds(&claimed_under, [1, 2], now));
        // Partition 2 lost since (another relay took it): the read is stale.
        assert!(!view(&[(1, 7), (3, 1)]).holds(&claimed_under, [1, 2], now));
        // Held again, but under a new token: someone else held it between.
        assert!(!view(&[(1, 7), (2, 8)]).holds(&claimed_under, [2], now));
        // A partition the read did not hold then.
        assert!(!view(&[(1, 7), (2, 7), (3, 1)]).holds(&claimed_under, [3], now));
        // Only the partitions of what was read matter.
        assert!(view(&[(1, 7)]).holds(&claimed_under, [1], now));
        // A view past its deadline holds nothing.
        assert!(!view(&[(1, 7), (2, 7)]).holds(&claimed_under, [1], now + Duration::from_secs(1)));
    }
}
