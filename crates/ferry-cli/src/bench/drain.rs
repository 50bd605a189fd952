//! Drain: a backlog of `events` committed events, then the relay started and
//! timed until the queue holds every one of them. The queue depth is polled
//! with a passive declare; nothing consumes during the drain, so the broker
//! does only what it did in the baseline.
//!
//! The hot-key scenario is this one with a single key.

use std::time::Duration;

use anyhow::Context;
use ferry_core::Event;
use ferry_store::postgres::enqueue_batch;
use sqlx::{Connection, PgConnection};
use tokio::time::{Instant, MissedTickBehavior, interval, sleep};

use super::broker::per_second;
use super::topology::{self, Topology};
use super::{Ctx, db, machine, progress, relay, workload};

/// Events per producer transaction while filling the backlog.
const PREFILL_TX: u64 = 1000;
const POLL: Duration = Duration::from_millis(50);
/// A drain that makes no progress for this long has failed.
const STALL: Duration = Duration::from_secs(60);
/// PostgreSQL 15 flushes a backend's counters at most once a second.
const STATS_MARGIN: Duration = Duration::from_millis(1100);

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DrainResult {
    pub events: u64,
    pub keys: u64,
    pub batch_size: usize,
    pub prefill: Duration,
    pub drain: Duration,
    /// This process's RSS when the relay started, and its peak during the
    /// drain (`None` where /proc does not tell, or the peak could not be reset).
    pub rss_before_kib: Option<u64>,
    pub peak_rss_kib: Option<u64>,
    /// Transactions on the bench database while the relay drained.
    pub transactions: Option<i64>,
    /// Deliveries the relay had to retry.
    pub retried: u64,
}

impl DrainResult {
    pub(crate) fn rate(&self) -> f64 {
        per_second(self.events, self.drain)
    }

    pub(crate) fn prefill_rate(&self) -> f64 {
        per_second(self.events, self.prefill)
    }

    /// Database transactions per claimed batch of `batch_size`.
    pub(crate) fn transactions_per_batch(&self) -> Option<f64> {
        let batches = self.events.div_ceil(self.batch_size.max(1) as u64).max(1);
        self.transactions.map(|t| t as f64 / batches as f64)
    }
}

/// `scenario` names the topology and the relay; `keys` is 1 for the hot key.
pub(crate) async fn run(ctx: &Ctx<'_>, scenario: &str, keys: u64) -> anyhow::Result<DrainResult> {
    topology::with_topology(ctx, scenario, async |t| drain(ctx, t, scenario, keys, false).await).await
}

/// The same in WAL streaming mode: the backlog is committed while the slot
/// exists and no relay reads it, so the relay drains it from the slot.
pub(crate) async fn run_wal(ctx: &Ctx<'_>) -> anyhow::Result<DrainResult> {
    topology::with_topology(ctx, "wal-drain", async |t| {
        drain(ctx, t, "wal-drain", ctx.args.keys, true).await
    })
    .await
}

async fn drain(
    ctx: &Ctx<'_>,
    topology: &Topology,
    scenario: &str,
    keys: u64,
    wal: bool,
) -> anyhow::Result<DrainResult> {
    let events = ctx.args.events;
    let batch_size = ctx.args.batch_size;
    ctx.db.reset_outbox().await?;
    if wal {
        // Creates the slot (and sweeps the empty outbox), then stops.
        let relay = relay::start(ctx, topology.exchange(), "bench-wal-setup", batch_size, true).await?;
        relay
            .wait_until_streaming(ctx.db.pool(), ctx.db.name(), Duration::from_secs(30))
            .await?;
        relay.stop().await?;
    }
    let prefill = prefill(ctx, scenario, events, keys).await?;

    let mut admin = ctx.db.admin().await?;
    sleep(STATS_MARGIN).await;
    let xacts_before = db::transactions(&mut admin, ctx.db.name()).await.ok();

    let peak_reset = machine::reset_peak_rss();
    let (rss_before_kib, _) = machine::rss_kib();
    let bar = progress::bar(events, scenario);
    let started = Instant::now();
    let relay = relay::start(ctx, topology.exchange(), &format!("bench-{scenario}"), batch_size, wal).await?;
    let waited = wait_for_depth(topology, &relay, events, &bar).await;
    let drained = started.elapsed();
    let (_, peak) = machine::rss_kib();
    let report = relay.stop().await;
    waited?;
    let report = report?;
    anyhow::ensure!(
        report.published >= events && report.dead == 0,
        "the relay published {} and killed {} of {events} events",
        report.published,
        report.dead
    );

    sleep(STATS_MARGIN).await;
    let xacts_after = db::transactions(&mut admin, ctx.db.name()).await.ok();
    let _ = admin.close().await;
    let result = DrainResult {
        events,
        keys,
        batch_size,
        prefill,
        drain: drained,
        rss_before_kib,
        peak_rss_kib: peak.filter(|_| peak_reset),
        transactions: xacts_before.zip(xacts_after).map(|(b, a)| a - b),
        retried: report.retried,
    };
    progress::done(
        &bar,
        format!(
            "{scenario}: {events} events ({keys} keys) in {:.1} s: {:.0}/s",
            drained.as_secs_f64(),
            result.rate()
        ),
    );
    Ok(result)
}

/// Commits `events` events in transactions of [`PREFILL_TX`] on a connection
/// of its own, closed afterwards so that its statistics are flushed before
/// the drain is counted. Returns how long the commits took.
pub(crate) async fn prefill(ctx: &Ctx<'_>, scenario: &str, events: u64, keys: u64) -> anyhow::Result<Duration> {
    let mut conn = PgConnection::connect_with(ctx.db.options()).await?;
    let bar = progress::bar(events, "prefill");
    let started = Instant::now();
    for chunk in chunks(events) {
        let end = chunk.end;
        let mut tx = conn.begin().await?;
        enqueue_batch(&mut tx, backlog(chunk, keys))
            .await
            .context("enqueue_batch")?;
        tx.commit().await?;
        bar.set_position(end);
    }
    let elapsed = started.elapsed();
    progress::done(
        &bar,
        format!(
            "{scenario} prefill: {events} events in {:.1} s: {:.0}/s",
            elapsed.as_secs_f64(),
            per_second(events, elapsed)
        ),
    );
    // A backlog that built up over time has been analysed by autovacuum.
    sqlx::raw_sql(ANALYZE).execute(&mut conn).await?;
    conn.close().await?;
    Ok(elapsed)
}

/// Writes a backlog of `events` events into the caller's transaction, in
/// statements of [`PREFILL_TX`], and analyses the outbox inside it: the
/// backlog appears at once when the caller commits, to a relay that is
/// already running, with the statistics a backlog that built up over time
/// would have.
#[cfg(feature = "bench-sinks")]
pub(crate) async fn stage(tx: &mut PgConnection, events: u64, keys: u64) -> anyhow::Result<()> {
    for chunk in chunks(events) {
        enqueue_batch(&mut *tx, backlog(chunk, keys))
            .await
            .context("enqueue_batch")?;
    }
    sqlx::raw_sql(ANALYZE).execute(&mut *tx).await?;
    Ok(())
}

const ANALYZE: &str = "ANALYZE ferry.events; ANALYZE ferry.unrouted;";

/// `0..events` in runs of [`PREFILL_TX`], one `enqueue_batch` each.
fn chunks(events: u64) -> impl Iterator<Item = std::ops::Range<u64>> {
    (0..events)
        .step_by(PREFILL_TX as usize)
        .map(move |start| start..(start + PREFILL_TX).min(events))
}

/// The bench workload's events numbered `seqs`, spread over `keys` keys.
fn backlog(seqs: std::ops::Range<u64>, keys: u64) -> Vec<Event> {
    seqs.map(|i| {
        let key = workload::key(i, keys);
        Event::new(workload::EVENT_TYPE, workload::payload(i, &key)).key(key)
    })
    .collect()
}

async fn wait_for_depth(
    topology: &Topology,
    relay: &relay::RunningRelay,
    events: u64,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    let mut tick = interval(POLL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut last, mut moved) = (0, Instant::now());
    loop {
        tick.tick().await;
        relay.ensure_running()?;
        let depth = topology.depth().await?;
        bar.set_position(depth);
        if depth >= events {
            return Ok(());
        }
        if depth > last {
            (last, moved) = (depth, Instant::now());
        }
        anyhow::ensure!(
            moved.elapsed() < STALL,
            "the drain stalled at {depth} of {events} messages for {STALL:?}"
        );
    }
}
