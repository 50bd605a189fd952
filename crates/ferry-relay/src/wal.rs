//! WAL streaming mode: the streamer takes the router's place.
//!
//! It reads committed transactions from the slot in commit order, publishes
//! each event straight to its routes, settles the batch into the delivery
//! table, and only then confirms the slot position: a crash replays from the
//! last settled transaction and never skips one. A route whose destination
//! fails (or that still has deliveries pending in the table) does not hold
//! the stream up: its events are parked in the table, behind the failures,
//! and the route workers' table path delivers them in order while the stream
//! goes on for every other route. Once the table has nothing pending for the
//! route, the stream publishes to it directly again.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::Utc;
use ferry_core::{Claimed, Clock, ErrorKind, NO_ROUTE, Route, Store, StoreError};
use ferry_store::postgres::wal::{
    Mark, Outcome, Prepared, Settlement, SlotStatus, WalEvent, WalItem, WalSource, WalStream, WalTxn, unreachable,
};
use tokio::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

use crate::engine::Shared;
use crate::metrics;

/// How the streamer behaves.
#[derive(Debug, Clone)]
pub struct WalOptions {
    /// A route's publish taking longer than this counts as failed: its
    /// events go to the table path (and may arrive twice) rather than hold
    /// the stream for every other route. Keep it at least twice each sink's
    /// own timeout (the default suits the sinks' default 10 s), or a batch
    /// that merely takes the sink's time is abandoned and sent again.
    pub publish_timeout: Duration,
    /// WAL the slot may hold back before the relay warns, in bytes.
    pub lag_budget: u64,
    /// How often the slot's lag is read.
    pub lag_every: Duration,
}

impl Default for WalOptions {
    fn default() -> Self {
        Self {
            publish_timeout: Duration::from_secs(20),
            lag_budget: 1 << 30,
            lag_every: Duration::from_secs(5),
        }
    }
}

/// What the relay needs for WAL mode.
#[derive(Debug, Clone)]
pub struct Wal {
    pub source: WalSource,
    pub options: WalOptions,
}

/// Streams until the relay shuts down; reconnects after any failure.
pub(crate) async fn run<S: Store, C: Clock>(shared: Arc<Shared<S, C>>, wal: Wal) {
    let mut backoff = Duration::from_millis(500);
    loop {
        if shared.cancel.is_cancelled() {
            return;
        }
        let started = Instant::now();
        match session(&shared, &wal).await {
            Ok(()) => return,
            Err(e) => {
                ::metrics::gauge!(metrics::WAL_STREAMING).set(0.0);
                // Another relay holding the slot is the normal standby state.
                // Otherwise nothing new reaches the routes while this lasts:
                // the streamer is the router of WAL mode, for readiness too.
                if held_elsewhere(&e) {
                    shared.progress.router_step(true);
                    info!(slot = %wal.source.config().slot, "another relay streams from the slot; standing by");
                } else if e.kind == ErrorKind::Config {
                    shared.progress.router_step(false);
                    warn!(error = %e, "WAL streaming cannot start; retrying");
                } else {
                    shared.progress.router_step(false);
                    warn!(error = %e, "WAL stream lost; reconnecting");
                    ::metrics::counter!(metrics::RECONNECTS, "component" => "wal").increment(1);
                }
                // The streaming relay reads the slot's lag as it goes; one
                // that is not streaming reads it between attempts, so that
                // a streaming relay that hangs (its own gauges frozen) still
                // shows as a growing lag, and so does a slot nobody reads.
                read_lag(&wal.source, &wal.options).await;
                if started.elapsed() > Duration::from_secs(30) {
                    backoff = Duration::from_millis(500);
                }
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// Whether a session failed because another process streams from the slot
/// (SQLSTATE 55006, object_in_use: "replication slot ... is active for
/// PID"): the normal standby state. Told by the code, which the stream's
/// errors carry (`[55006]`, or `SQLSTATE 55006`), as the message is in the
/// server's `lc_messages` language: read by its English words, a standby
/// beside a German or Japanese server counted each attempt a failure and
/// was never ready.
fn held_elsewhere(e: &StoreError) -> bool {
    ["[55006]", "SQLSTATE 55006", "is active for PID"]
        .iter()
        .any(|sign| e.message.contains(sign))
}

/// Reports a slot that [`WalSource::prepare`] found lost and replaced: an
/// error, since tableless events may be gone, and
/// [`metrics::WAL_SLOT_REPLACED`].
pub fn report_prepared(prepared: &Prepared, slot: &str) {
    if let Some(loss) = prepared.replaced {
        error!(
            slot,
            reason = loss.as_str(),
            "{loss}. A new slot replaces it and every outbox row not yet delivered is swept into the table \
             path, so none is lost; tableless events (ferry.emit) the old slot had not handed over are lost"
        );
        ::metrics::counter!(metrics::WAL_SLOT_REPLACED, "reason" => loss.as_str()).increment(1);
    }
}

/// Waits, before the first sweep of a slot, for the transactions writing
/// now ([`WalSource::await_writers`]): one committed just before the slot's
/// consistent point may not be visible yet. Says every ten seconds whom it
/// waits for. `false` if the relay is shutting down meanwhile.
async fn await_writers<S: Store, C: Clock>(shared: &Shared<S, C>, source: &WalSource) -> Result<bool, StoreError> {
    let started = Instant::now();
    let mut said = started;
    let wait = source.await_writers(|pids| {
        if said.elapsed() >= Duration::from_secs(10) {
            said = Instant::now();
            warn!(
                slot = %source.config().slot,
                waited_s = started.elapsed().as_secs(),
                ?pids,
                "the sweep of the new slot waits for transactions still open since it was made (0 is a prepared \
                 transaction): it must see every row the slot will not stream; end or commit them \
                 (pg_stat_activity, pg_prepared_xacts)"
            );
        }
    });
    tokio::select! {
        done = wait => done.map(|()| true),
        _ = shared.cancel.cancelled() => Ok(false),
    }
}

/// Transactions read from the stream, processed together.
#[derive(Default)]
struct Batch {
    txns: Vec<WalTxn>,
    events: usize,
    /// The position to confirm once the batch is settled.
    confirm: u64,
    /// When the batch ends inside a large transaction, how far into it.
    part: Option<(u64, u64)>,
}

impl Batch {
    fn take(&mut self, item: WalItem) {
        match item {
            WalItem::Txn(t) => {
                self.confirm = self.confirm.max(t.end_lsn);
                self.part = (t.end_lsn == 0).then_some((t.commit_lsn, t.read));
                self.events += t.events.len();
                self.txns.push(t);
            }
            WalItem::Idle { lsn } => self.confirm = self.confirm.max(lsn),
        }
    }
}

/// One replication session: prepare, sweep, stream. `Ok` only on shutdown.
async fn session<S: Store, C: Clock>(shared: &Shared<S, C>, wal: &Wal) -> Result<(), StoreError> {
    let source = &wal.source;
    let prepared = source.prepare().await?;
    report_prepared(&prepared, &source.config().slot);
    let unswept = prepared.unswept;
    // Before the stream opens: a relay whose stream PostgreSQL took for a
    // synchronous standby would have committing writers wait for it, and
    // it for them.
    if unswept && !await_writers(shared, source).await? {
        return Ok(());
    }
    let mut stream: WalStream = tokio::select! {
        s = source.open(&prepared) => s?,
        _ = shared.cancel.cancelled() => return Ok(()),
    };
    info!(slot = %source.config().slot, publication = %source.config().publication, "streaming from the WAL");
    shared.progress.router_step(true);
    ::metrics::gauge!(metrics::WAL_STREAMING).set(1.0);
    // The slot is ours now. On a new slot, what is still unrouted was
    // committed before the slot existed and will never be streamed: the
    // table path takes it, ahead of what the stream brings next (which finds
    // it routed and skips it, or queues behind it). Later sessions sweep
    // nothing: every row not settled is replayed from the slot, in commit
    // order with the tableless events around it.
    let mut retired = prepared.retired;
    if unswept {
        sweep(shared, source, Sweep::Unrouted).await?;
        retired = !source.mark_swept(&prepared).await?;
    }
    if retired {
        warn!(
            slot = %source.config().slot,
            "the slot is retired (ferry wal retire): ferry.emit writes outbox rows, which this relay streams; \
             to finish leaving it, stop the relays, drop the slot and start them polling or on the new slot"
        );
    }
    let mut lag_at = Instant::now();
    read_lag(source, &wal.options).await;
    sweep_requeued(shared, source).await;
    // Rows committed before now that the stream passes without handing
    // them over are looked for once it is past this point.
    let mut net = Net::default();
    sweep_missed(shared, source, &stream, &mut net).await;
    // Batch n is settled while batch n + 1 is published, so the database
    // write is off the publish path; positions are confirmed in order, each
    // after its own batch is settled.
    let mut unsettled: Option<Published> = None;
    loop {
        if shared.cancel.is_cancelled() {
            if let Some(p) = unsettled.take() {
                let _ = settle_and_confirm(shared, wal, Some(&stream), p, Persist::Bounded).await;
            }
            stream.close().await;
            return Ok(());
        }
        // Busy, the stream never waits on the timer below: read the lag here.
        if lag_at.elapsed() >= wal.options.lag_every {
            lag_at = Instant::now();
            if let Err(e) = now_and_then(shared, wal, &stream, &mut net).await {
                return Err(settle_then_fail(shared, wal, stream, unsettled.take(), e).await);
            }
        }
        let first = if unsettled.is_some() {
            let next = match stream.try_next() {
                Ok(next) => next,
                Err(e) => return Err(settle_then_fail(shared, wal, stream, unsettled.take(), e).await),
            };
            match next {
                Some(item) => item,
                None => {
                    // Nothing more has arrived: settle what is published.
                    let p = unsettled.take().expect("checked");
                    match settle_and_confirm(shared, wal, Some(&stream), p, Persist::Bounded).await {
                        Ok(()) => continue,
                        Err(halt) => return halt.end(stream).await,
                    }
                }
            }
        } else {
            tokio::select! {
                item = stream.next() => item?,
                _ = tokio::time::sleep_until(lag_at + wal.options.lag_every) => {
                    lag_at = Instant::now();
                    if let Err(e) = now_and_then(shared, wal, &stream, &mut net).await {
                        return Err(settle_then_fail(shared, wal, stream, None, e).await);
                    }
                    continue;
                }
                _ = shared.cancel.cancelled() => continue,
            }
        };
        let mut batch = Batch::default();
        batch.take(first);
        // Whatever else has arrived joins the batch, up to its size.
        let mut failed = None;
        while batch.events < shared.settings.batch_size {
            match stream.try_next() {
                Ok(Some(item)) => batch.take(item),
                Ok(None) => break,
                // What this batch read so far is published and settled all
                // the same, then the stream ends: the next session may be on
                // a new slot, which would not replay it (a slot that cannot
                // stream past a change, see WalSource::prepare).
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let carry = unsettled.as_ref().map(Carry::of).unwrap_or_default();
        let previous = unsettled.take();
        let (settled, published) = tokio::join!(
            async {
                match previous {
                    Some(p) => settle_and_confirm(shared, wal, Some(&stream), p, Persist::Bounded).await,
                    None => Ok(()),
                }
            },
            publish_batch(shared, wal, batch, &carry, stream.generation()),
        );
        // Stopped mid-batch: nothing after the last settled batch is
        // confirmed; the next session (or relay) replays it.
        match (settled, published) {
            (Ok(()), Ok(p)) => unsettled = Some(p),
            (Err(Halt::Failed(e)), _) | (_, Err(Halt::Failed(e))) => return Halt::Failed(e).end(stream).await,
            _ => return Halt::Shutdown.end(stream).await,
        }
        shared.progress.advanced();
        if let Some(e) = failed {
            return Err(settle_then_fail(shared, wal, stream, unsettled.take(), e).await);
        }
    }
}

/// A batch published (or parked), its outcomes not yet written.
struct Published {
    events: Vec<WalEvent>,
    /// (index into `events`, route, outcome).
    outcomes: Vec<(usize, String, Outcome)>,
    confirm: u64,
    part: Option<(u64, u64)>,
    last_commit: Option<chrono::DateTime<Utc>>,
    /// The slot generation of the session that streamed it.
    generation: i64,
}

/// What an unsettled batch means for the next one, before the table shows
/// it: routes that parked or failed something are busy, keys that went dead
/// are held.
#[derive(Default)]
struct Carry {
    busy_routes: HashSet<String>,
    dead_keys: HashSet<(String, String)>,
}

impl Carry {
    fn of(p: &Published) -> Carry {
        let mut carry = Carry::default();
        for (i, route, outcome) in &p.outcomes {
            match outcome {
                Outcome::Published { .. } => {}
                Outcome::Dead { .. } if route == NO_ROUTE => {}
                Outcome::Dead { .. } => {
                    if let Some(key) = &p.events[*i].event.key {
                        carry.dead_keys.insert((route.clone(), key.clone()));
                    }
                }
                Outcome::Parked | Outcome::Retry { .. } => {
                    carry.busy_routes.insert(route.clone());
                }
            }
        }
        carry
    }
}

/// The stream failed (or is to stop) with a batch published but not yet
/// settled: end the stream, then settle the batch (the write goes through
/// the pool, not the stream), so that the next session skips its events
/// rather than publish them all again, then pass the failure on. The settle
/// is retried until it succeeds or the relay shuts down: the next session
/// may be on a new slot, which would not replay the batch's tableless
/// events, and with the stream ended no walsender waits on it.
async fn settle_then_fail<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    wal: &Wal,
    stream: WalStream,
    unsettled: Option<Published>,
    failure: StoreError,
) -> StoreError {
    stream.close().await;
    if let Some(p) = unsettled {
        let _ = settle_and_confirm(shared, wal, None, p, Persist::Always).await;
    }
    failure
}

/// Writes a published batch's outcomes, then confirms its position to the
/// stream, if it is still open. An error when the relay shut down before
/// the write succeeded, or the database could not be reached ([`persist`]).
async fn settle_and_confirm<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    wal: &Wal,
    stream: Option<&WalStream>,
    p: Published,
    how: Persist,
) -> Result<(), Halt> {
    if !p.outcomes.is_empty() {
        let settlement = Settlement {
            outcomes: p
                .outcomes
                .iter()
                .map(|(i, route, outcome)| (&p.events[*i], route.clone(), outcome.clone()))
                .collect(),
            through: p.confirm,
            generation: p.generation,
            part: p.part,
        };
        let now = shared.clock.now();
        let settled = persist(shared, "settle", how, || wal.source.settle(&settlement, now)).await?;
        ::metrics::counter!(metrics::ROUTED).increment(settled.routed + settled.written);
        let mut parked_routes = HashSet::new();
        for (_, route, outcome) in &p.outcomes {
            if !matches!(outcome, Outcome::Published { .. }) && route != NO_ROUTE {
                parked_routes.insert(route.as_str());
            }
        }
        for name in parked_routes {
            shared.wake_route(name);
        }
    }
    if let Some(stream) = stream.filter(|_| p.confirm > 0) {
        stream.confirm(p.confirm);
    }
    let behind = p
        .last_commit
        .map(|t| (Utc::now() - t).to_std().unwrap_or_default())
        .unwrap_or_default();
    ::metrics::gauge!(metrics::WAL_LAG_SECONDS).set(behind.as_secs_f64());
    Ok(())
}

async fn read_lag(source: &WalSource, options: &WalOptions) {
    match source.status().await {
        Ok(SlotStatus {
            behind_bytes: Some(behind),
            safe_bytes,
            ..
        }) => {
            ::metrics::gauge!(metrics::WAL_LAG_BYTES).set(behind as f64);
            // Without `max_slot_wal_keep_size` the server never invalidates
            // the slot: the margin is unbounded, not the last one seen while
            // a cap was set.
            let safe = safe_bytes.map_or(f64::INFINITY, |b| b as f64);
            ::metrics::gauge!(metrics::WAL_SAFE_BYTES).set(safe);
            if behind.max(0) as u64 > options.lag_budget {
                warn!(
                    lag_bytes = behind,
                    budget = options.lag_budget,
                    slot = %source.config().slot,
                    "the WAL slot holds back more than its budget"
                );
            }
        }
        // No slot, or a lost one: nothing held back to report.
        Ok(_) => {}
        Err(e) => debug!(error = %e, "could not read the slot's lag"),
    }
}

/// What a sweep takes into the table path.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sweep {
    /// Every outbox row still unrouted: on a new slot, before it streams.
    Unrouted,
    /// Events an operator requeued after they were dead with no route,
    /// which the stream never brings again.
    Requeued,
    /// Outbox rows committed before the mark that the stream went past
    /// without handing them over ([`WalSource::missed`]).
    Missed(Mark),
}

/// Routes outbox rows into the table path; says how many.
async fn sweep<S: Store, C: Clock>(shared: &Shared<S, C>, source: &WalSource, what: Sweep) -> Result<u64, StoreError> {
    let mut swept = 0u64;
    loop {
        let limit = shared.settings.batch_size as i64;
        let batch = match what {
            Sweep::Unrouted => source.unrouted(limit).await?,
            Sweep::Requeued => source.requeued(limit).await?,
            Sweep::Missed(mark) => source.missed(&mark, limit).await?,
        };
        if batch.is_empty() {
            break;
        }
        let now = shared.clock.now();
        let mut settlement = Settlement::default();
        let mut touched = HashSet::new();
        for e in &batch {
            let routes = matching(&shared.routes, e);
            if routes.is_empty() {
                settlement.outcomes.push((e, NO_ROUTE.to_owned(), no_route(e)));
            }
            for r in routes {
                touched.insert(r.name.clone());
                settlement.outcomes.push((e, r.name.clone(), Outcome::Parked));
            }
        }
        let settled = source.settle(&settlement, now).await?;
        swept += settled.routed;
        for name in &touched {
            shared.wake_route(name);
        }
    }
    if swept > 0 {
        match what {
            Sweep::Unrouted => info!(
                events = swept,
                "events committed before streaming began go through the table path"
            ),
            Sweep::Requeued => info!(events = swept, "requeued events go through the table path"),
            // Said by the caller.
            Sweep::Missed(_) => {}
        }
    }
    Ok(swept)
}

/// What the streaming relay does every `lag_every`: reads the slot's lag,
/// takes requeued events and rows the stream passed by into the table path
/// (a failure waits for the next time, the stream goes on), and checks the
/// publication. An error only when the publication is gone or no longer
/// carries every insert into the outbox
/// ([`WalSource::check_publication`]): the stream stops.
async fn now_and_then<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    wal: &Wal,
    stream: &WalStream,
    net: &mut Net,
) -> Result<(), StoreError> {
    read_lag(&wal.source, &wal.options).await;
    sweep_requeued(shared, &wal.source).await;
    sweep_missed(shared, &wal.source, stream, net).await;
    match wal.source.check_publication().await {
        Err(e) if e.kind == ErrorKind::Config => {
            error!(error = %e, "the publication does not carry the outbox's events; the WAL stream stops");
            Err(e)
        }
        Err(e) => {
            debug!(error = %e, "could not check the publication");
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

async fn sweep_requeued<S: Store, C: Clock>(shared: &Shared<S, C>, source: &WalSource) {
    if let Err(e) = sweep(shared, source, Sweep::Requeued).await {
        warn!(error = %e, "could not take requeued events into the table path; trying again shortly");
    }
}

/// The safety net under the stream. Once the relay has settled the stream
/// past `mark`, every outbox row committed before the mark that the stream
/// carries is routed: one still unrouted was never streamed, and would
/// wait in `ferry.unrouted` for ever. It is taken into the table path, and
/// said loudly, since it may reach its destinations after later events of
/// its key. Then a new mark is taken. PostgreSQL streams an insert only if
/// the publication carried the table when it was committed: a publication
/// altered without `ferry.events` and mended while no relay was checking
/// it (stopped for a deploy, say) is the likely cause. Failures wait for
/// the next time; the stream goes on.
async fn sweep_missed<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    source: &WalSource,
    stream: &WalStream,
    net: &mut Net,
) {
    if let Some(m) = net.mark {
        if stream.settled() < m.lsn() {
            return;
        }
        match sweep(shared, source, Sweep::Missed(m)).await {
            Ok(0) => {}
            Ok(n) => {
                let config = source.config();
                warn!(
                    events = n,
                    slot = %config.slot,
                    publication = %config.publication,
                    "{n} outbox rows were committed before a position the WAL stream has passed, and never \
                     streamed: most likely publication {} did not carry ferry.events for a while (altered by \
                     hand and mended while no relay was checking it). They go through the table path now and \
                     may reach their destinations after later events of their keys",
                    config.publication
                );
                ::metrics::counter!(metrics::WAL_UNSTREAMED).increment(n);
            }
            Err(e) => {
                warn!(error = %e, "could not look for outbox rows the WAL stream passed by; trying again shortly");
                return;
            }
        }
    }
    net.mark = match source.mark().await {
        Ok(m) => Some(m),
        Err(e) => {
            // Every time, if a pooler sends the read to a standby.
            if net.warned.is_none_or(|at| at.elapsed() >= MARK_WARN_EVERY) {
                net.warned = Some(Instant::now());
                warn!(
                    error = %e,
                    "could not mark the WAL position to look for outbox rows the stream passes by: until a mark \
                     succeeds, rows the stream never hands over (a publication without ferry.events for a while) \
                     wait in ferry.unrouted. The mark reads pg_current_snapshot() and pg_current_wal_insert_lsn() \
                     on the primary: a connection pooler sending it to a standby fails it every time"
                );
            } else {
                debug!(error = %e, "could not mark the WAL position to look for rows the stream passes by");
            }
            None
        }
    };
}

/// How often a failing mark of the safety net is said at `warn`.
const MARK_WARN_EVERY: Duration = Duration::from_secs(300);

/// The safety net's state ([`sweep_missed`]).
#[derive(Default)]
struct Net {
    mark: Option<Mark>,
    /// When a failed mark was last said at `warn`.
    warned: Option<Instant>,
}

fn matching<'a>(routes: &'a [Route], e: &WalEvent) -> Vec<&'a Route> {
    routes
        .iter()
        .filter(|r| r.matcher.matches(&e.event.event_type))
        .collect()
}

fn no_route(e: &WalEvent) -> Outcome {
    Outcome::no_route(&e.event.event_type)
}

/// Publishes one batch (or parks it behind what the table, or the batch
/// before it, holds). An error when the relay shut down first, or the
/// database kept failing ([`persist`]).
async fn publish_batch<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    wal: &Wal,
    batch: Batch,
    carry: &Carry,
    generation: i64,
) -> Result<Published, Halt> {
    let Batch {
        txns, confirm, part, ..
    } = batch;
    let last_commit = txns.last().map(|t| t.commit_time);
    let xids = visible_first(&txns);
    let events: Vec<WalEvent> = txns.into_iter().flat_map(|t| t.events).collect();
    let mut published = Published {
        events: Vec::new(),
        outcomes: Vec::new(),
        confirm,
        part,
        last_commit,
        generation,
    };
    if events.is_empty() {
        return Ok(published);
    }
    let source = &wal.source;
    let seqs: Vec<i64> = events.iter().filter(|e| !e.tableless()).map(|e| e.event.seq).collect();
    // A message that does not decode goes nowhere (see below).
    let plans: Vec<Vec<&Route>> = events
        .iter()
        .map(|e| match e.undecodable {
            Some(_) => Vec::new(),
            None => matching(&shared.routes, e),
        })
        .collect();
    let mut route_names: Vec<String> = plans.iter().flatten().map(|r| r.name.clone()).collect();
    route_names.sort();
    route_names.dedup();
    let mut keys: Vec<String> = events.iter().filter_map(|e| e.event.key.clone()).collect();
    keys.sort();
    keys.dedup();
    // A transaction the slot handed over may not be visible yet; until it
    // is, its rows would look routed, and its commit may yet wait for a
    // standby (`visible_first`). Wait for it (it committed, so it will be),
    // warning if that takes long (synchronous replication waiting for a
    // standby does that).
    let waiting = Instant::now();
    let mut warned = waiting;
    let mut look = loop {
        let look = persist(shared, "look", Persist::Bounded, || {
            source.look(&seqs, &route_names, &keys, &xids)
        })
        .await?;
        if look.invisible.is_empty() {
            break look;
        }
        if warned.elapsed() > Duration::from_secs(10) {
            warned = Instant::now();
            warn!(
                transactions = look.invisible.len(),
                waited = ?waiting.elapsed(),
                "streamed transactions are committed but not visible yet; waiting (synchronous replication?)"
            );
        }
        if shared.cancel.is_cancelled() {
            return Err(Halt::Shutdown);
        }
        tokio::time::sleep(
            Duration::from_micros(200)
                .max(waiting.elapsed() / 4)
                .min(Duration::from_millis(100)),
        )
        .await;
    };
    look.busy_routes.extend(carry.busy_routes.iter().cloned());
    look.dead_keys.extend(carry.dead_keys.iter().cloned());
    // Rows routed before (a replay) were taken care of by whoever routed them.
    let (events, plans): (Vec<WalEvent>, Vec<Vec<&Route>>) = events
        .into_iter()
        .zip(plans)
        .filter(|(e, _)| e.tableless() || look.unrouted.contains(&e.event.seq))
        .unzip();
    published.events = events;
    let events = &published.events;
    let mut outcomes = Vec::new();
    for (i, routes) in plans.iter().enumerate() {
        // It would fail every session that reads it, holding the slot (and
        // the WAL) where it is for good: it is settled as a dead event
        // instead, for an operator to see, cancel or requeue.
        if let Some(reason) = &events[i].undecodable {
            error!(
                slot = %source.config().slot,
                event_id = %events[i].event.id,
                "{reason}"
            );
            let labels = [
                ("route", NO_ROUTE.to_owned()),
                ("type", events[i].event.event_type.clone()),
            ];
            ::metrics::counter!(metrics::DEAD, &labels).increment(1);
            let dead = Outcome::Dead {
                attempts: 0,
                reason: reason.clone(),
            };
            outcomes.push((i, NO_ROUTE.to_owned(), dead));
            continue;
        }
        if routes.is_empty() {
            outcomes.push((i, NO_ROUTE.to_owned(), no_route(&events[i])));
            ::metrics::counter!(metrics::UNROUTABLE).increment(1);
        }
        ::metrics::counter!(metrics::ENQUEUED, "type" => events[i].event.event_type.clone()).increment(1);
    }
    let publishes = shared.routes.iter().filter_map(|route| {
        let mine: Vec<usize> = plans
            .iter()
            .enumerate()
            .filter(|(_, rs)| rs.iter().any(|r| r.name == route.name))
            .map(|(i, _)| i)
            .collect();
        (!mine.is_empty()).then(|| publish_route(shared, wal, route, events, mine, &look))
    });
    for (route, route_outcomes) in futures::future::join_all(publishes).await {
        outcomes.extend(route_outcomes.into_iter().map(|(i, o)| (i, route.name.clone(), o)));
    }
    published.outcomes = outcomes;
    Ok(published)
}

/// The transactions of a batch that must be visible before any of its
/// events is published: every one with events. The slot hands a
/// transaction over once its commit is flushed locally; other sessions see
/// it only later, and under synchronous replication only once a standby
/// has confirmed it. Until then its outbox rows would read as routed
/// before, and a transaction of tableless events only would be published
/// while its commit may still be lost with a failover (a phantom event).
fn visible_first(txns: &[WalTxn]) -> Vec<u32> {
    let mut xids: Vec<u32> = txns.iter().filter(|t| !t.events.is_empty()).map(|t| t.xid).collect();
    // The parts of a large transaction come one after the other.
    xids.dedup();
    xids
}

/// How long the database may stay unreachable ([`unreachable`]) before the
/// session ends. A server stopping cleanly waits for its walsenders'
/// clients to confirm everything sent: a relay that kept its stream open
/// while it retried, confirming nothing, would hold the stop for as long as
/// the database stays unreachable, which is for ever once it is shutting
/// down.
const PERSIST_FOR: Duration = Duration::from_secs(10);

/// Whether a store call may give up ([`persist`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Persist {
    /// After [`PERSIST_FOR`] of failures saying the database cannot be
    /// reached: the stream is open, and would hold a stopping server.
    Bounded,
    /// Never: the stream has ended already.
    Always,
}

/// Why a batch stopped short.
enum Halt {
    /// The relay is shutting down.
    Shutdown,
    /// The database could not be reached for [`PERSIST_FOR`].
    Failed(StoreError),
}

impl Halt {
    /// Ends the session: cleanly on shutdown; on a failure at once, the
    /// replication connection closed without the watermark write a clean
    /// end tries (the database cannot be reached), to stream again from the
    /// last settled position once it answers. Nothing is confirmed past
    /// what was settled, so nothing is lost.
    async fn end(self, stream: WalStream) -> Result<(), StoreError> {
        match self {
            Halt::Shutdown => {
                stream.close().await;
                Ok(())
            }
            Halt::Failed(e) => {
                stream.abandon().await;
                Err(e)
            }
        }
    }
}

/// Runs a store call until it succeeds; an error if the relay shuts down
/// first or, [`Persist::Bounded`], once its failures have said for
/// [`PERSIST_FOR`] that the database cannot be reached (the server going
/// away, or unreachable: [`unreachable`]), counted from the end of the
/// first of them. Any other failure (a write the database refuses: a
/// trigger, a constraint, a full disk) is retried for as long as it lasts,
/// the stream held where it is: ending the session would replay, and
/// publish again, what the stream handed over since the last settle.
async fn persist<T, F, Fut>(
    shared: &Shared<impl Store, impl Clock>,
    op: &'static str,
    how: Persist,
    mut call: F,
) -> Result<T, Halt>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Duration::from_millis(50);
    let mut unreachable_since: Option<Instant> = None;
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => op).increment(1);
                if shared.cancel.is_cancelled() {
                    warn!(error = %e, op, "WAL batch: database write failed while shutting down");
                    return Err(Halt::Shutdown);
                }
                if !unreachable(&e) {
                    unreachable_since = None;
                } else if how == Persist::Bounded {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= PERSIST_FOR {
                        warn!(
                            error = %e,
                            op,
                            unreachable_s = since.elapsed().as_secs(),
                            "WAL batch: the database cannot be reached; ending the stream, to stream again from \
                             the last settled position once it answers"
                        );
                        return Err(Halt::Failed(e));
                    }
                }
                warn!(error = %e, op, "WAL batch: database write failed; retrying");
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Publishes one route's share of the batch, unless the table holds earlier
/// deliveries it must queue behind.
async fn publish_route<'a, S: Store, C: Clock>(
    shared: &Shared<S, C>,
    wal: &Wal,
    route: &'a Route,
    all: &[WalEvent],
    mine: Vec<usize>,
    look: &ferry_store::postgres::wal::Look,
) -> (&'a Route, Vec<(usize, Outcome)>) {
    if look.busy_routes.contains(&route.name) {
        ::metrics::counter!(metrics::WAL_PARKED, "route" => route.name.clone()).increment(mine.len() as u64);
        return (route, mine.into_iter().map(|i| (i, Outcome::Parked)).collect());
    }
    let mut out: Vec<(usize, Outcome)> = Vec::with_capacity(mine.len());
    let mut direct: Vec<usize> = Vec::with_capacity(mine.len());
    let dead: HashSet<&str> = look
        .dead_keys
        .iter()
        .filter(|(r, _)| *r == route.name)
        .map(|(_, k)| k.as_str())
        .collect();
    for i in mine {
        let held = all[i].event.key.as_deref().is_some_and(|k| dead.contains(k));
        if held {
            out.push((i, Outcome::Parked));
        } else {
            direct.push(i);
        }
    }
    if direct.is_empty() {
        return (route, out);
    }
    let tagged: Vec<(usize, Claimed)> = direct
        .iter()
        .map(|&i| {
            let c = Claimed {
                partition: all[i].partition.unwrap_or(0),
                attempts: 0,
                event: all[i].event.clone(),
            };
            (i, c)
        })
        .collect();
    let published = crate::direct::publish(shared, route, tagged, Some(wal.options.publish_timeout), "wal").await;
    // Counted as published, as the streamed events are counted as enqueued
    // above: the settle that follows is retried until it succeeds.
    published.tally.count(shared, &HashSet::new());
    out.extend(published.outcomes);
    let parked = out.iter().filter(|(_, o)| matches!(o, Outcome::Parked)).count();
    if parked > 0 {
        ::metrics::counter!(metrics::WAL_PARKED, "route" => route.name.clone()).increment(parked as u64);
    }
    (route, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot another relay streams from is told by its SQLSTATE, in any
    /// language the server speaks, and nothing else is.
    #[test]
    fn a_slot_held_elsewhere_is_told_in_any_language() {
        for message in [
            "replication stream: replication slot \"ferry\" is active for PID 1234 (SQLSTATE 55006)",
            "replication stream: [55006] Replikations-Slot »ferry« ist aktiv für PID 1234",
            "replication stream: server error: レプリケーションスロット\"ferry\"はPID1234で使用中です (SQLSTATE 55006)",
        ] {
            assert!(held_elsewhere(&StoreError::transient(message)), "{message}");
        }
        for message in [
            "replication stream: [57P01] terminating connection due to administrator command",
            "replication stream: Replikations-Slot »ferry« existiert nicht (SQLSTATE 42704)",
        ] {
            assert!(!held_elsewhere(&StoreError::transient(message)), "{message}");
        }
    }
}
