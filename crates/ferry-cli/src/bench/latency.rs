//! Latency: with the relay running and idle, one producer commits one event
//! per transaction at a fixed rate; a consumer on the queue notes when each
//! message arrives. Latency is arrival minus the instant the producer's
//! COMMIT returned, matched by event id (the AMQP message id). The sinks
//! scenario runs the same producer against its other destinations, where
//! an event arrives when its destination confirms it to the relay
//! ([`Arrivals`] filled by the sink's wrapper).
//!
//! The producer's clock is a tokio interval with `MissedTickBehavior::Burst`:
//! a late commit is caught up at once, so the offered load stays at the rate
//! asked for instead of quietly dropping when the system is slow.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use ferry_core::Event;
use ferry_store::postgres::enqueue;
use futures::StreamExt;
use hdrhistogram::Histogram;
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior, interval, sleep};
use uuid::Uuid;

use super::report::Percentiles;
use super::topology::{self, Topology};
use super::{Ctx, progress, relay, workload};

/// How long the last messages may take to arrive before they count as missing.
const TAIL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LatencyResult {
    pub rate: u32,
    pub sent: u64,
    /// How long the producer took to commit them all.
    pub sending: Duration,
    pub missing: u64,
    /// Commit-to-consumer latency, microseconds.
    pub latency: Option<Percentiles>,
}

impl LatencyResult {
    pub(crate) fn achieved_rate(&self) -> f64 {
        super::broker::per_second(self.sent, self.sending)
    }
}

/// Arrival instants by event id, filled by the consumer task.
#[derive(Default)]
pub(crate) struct Arrivals {
    at: Mutex<HashMap<Uuid, Instant>>,
    count: AtomicU64,
}

impl Arrivals {
    /// Notes that event `id` arrived at `at`.
    pub(crate) fn record(&self, id: Uuid, at: Instant) {
        self.at.lock().expect("not poisoned").insert(id, at);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) async fn run(ctx: &Ctx<'_>) -> anyhow::Result<LatencyResult> {
    topology::with_topology(ctx, "latency", async |t| measure(ctx, t, false).await).await
}

/// The same, with the relay streaming from a WAL slot instead of polling.
pub(crate) async fn run_wal(ctx: &Ctx<'_>) -> anyhow::Result<LatencyResult> {
    topology::with_topology(ctx, "wal-latency", async |t| measure(ctx, t, true).await).await
}

async fn measure(ctx: &Ctx<'_>, topology: &Topology, wal: bool) -> anyhow::Result<LatencyResult> {
    ctx.db.reset_outbox().await?;
    let arrivals = Arc::new(Arrivals::default());
    let consumer = consume(topology, arrivals.clone()).await?;
    let relay = relay::start(ctx, topology.exchange(), "bench-latency", ctx.args.batch_size, wal).await?;
    let label = if wal { "wal-latency" } else { "latency" };
    let result = produce(ctx, &relay, &arrivals, wal, label, ctx.args.latency_seconds).await;
    let stopped = relay.stop().await;
    consumer.abort();
    let result = result?;
    stopped?;
    Ok(result)
}

async fn consume(topology: &Topology, arrivals: Arc<Arrivals>) -> anyhow::Result<JoinHandle<()>> {
    let mut consumer = topology.consume().await?;
    Ok(tokio::spawn(async move {
        while let Some(Ok(delivery)) = consumer.next().await {
            let at = Instant::now();
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .and_then(|id| Uuid::parse_str(id.as_str()).ok());
            if let Some(id) = id {
                arrivals.record(id, at);
            }
        }
    }))
}

/// Commits `--latency-rate` events per second for `seconds` through an idle
/// `relay` (table mode, whose sink fills `arrivals`) and reads their
/// latency.
#[cfg(feature = "bench-sinks")]
pub(crate) async fn through(
    ctx: &Ctx<'_>,
    relay: &relay::RunningRelay,
    arrivals: &Arrivals,
    label: &str,
    seconds: u64,
) -> anyhow::Result<LatencyResult> {
    produce(ctx, relay, arrivals, false, label, seconds).await
}

async fn produce(
    ctx: &Ctx<'_>,
    relay: &relay::RunningRelay,
    arrivals: &Arrivals,
    wal: bool,
    label: &str,
    seconds: u64,
) -> anyhow::Result<LatencyResult> {
    let args = ctx.args;
    let mut conn = PgConnection::connect_with(ctx.db.options()).await?;
    let idle = async || {
        if wal {
            relay
                .wait_until_streaming(ctx.db.pool(), ctx.db.name(), Duration::from_secs(30))
                .await
        } else {
            relay.wait_until_sleeping(ctx.db.pool(), Duration::from_secs(10)).await
        }
    };
    idle().await?;
    // Warm-up: the sink connects to its destination on its first publish.
    commit_one(&mut conn, 0, args.keys).await?;
    wait_for(arrivals, 1, Duration::from_secs(10)).await;
    anyhow::ensure!(
        arrivals.count.load(Ordering::Relaxed) >= 1,
        "the warm-up event never arrived"
    );
    idle().await?;

    let total = u64::from(args.latency_rate) * seconds;
    let bar = progress::bar(total, label);
    let mut tick = interval(Duration::from_secs_f64(1.0 / f64::from(args.latency_rate)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let mut commits = Vec::with_capacity(total as usize);
    let started = Instant::now();
    for i in 1..=total {
        tick.tick().await;
        commits.push(commit_one(&mut conn, i, args.keys).await?);
        if i.is_multiple_of(100) {
            bar.set_position(i);
            relay.ensure_running()?;
        }
    }
    let sending = started.elapsed();
    let _ = conn.close().await;
    wait_for(arrivals, total + 1, TAIL).await;

    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).context("creating a histogram")?;
    let mut missing = Vec::new();
    {
        let at = arrivals.at.lock().expect("not poisoned");
        for (id, committed) in &commits {
            match at.get(id) {
                // A message can arrive a hair before COMMIT's reply does.
                Some(arrived) => {
                    let micros = arrived.saturating_duration_since(*committed).as_micros();
                    histogram.saturating_record(u64::try_from(micros).unwrap_or(u64::MAX).max(1));
                }
                None => missing.push(*id),
            }
        }
    }
    if !missing.is_empty() {
        explain_missing(ctx, &missing).await;
    }
    let missing = missing.len() as u64;
    let result = LatencyResult {
        rate: args.latency_rate,
        sent: total,
        sending,
        missing,
        latency: Percentiles::of(&histogram),
    };
    let summary = result
        .latency
        .as_ref()
        .map_or_else(|| "no message arrived".to_owned(), Percentiles::describe);
    progress::done(&bar, format!("{label}: {total} events, {missing} missing; {summary}"));
    Ok(result)
}

/// Commits one event in a transaction of its own; returns its id and the
/// instant COMMIT returned.
/// Where the events that never arrived are, by the outbox's account.
async fn explain_missing(ctx: &Ctx<'_>, missing: &[Uuid]) {
    // (state, attempts, count, last error); no state: still unrouted.
    type Row = (Option<String>, Option<i32>, i64, Option<String>);
    let rows: Result<Vec<Row>, _> = sqlx::query_as(
        "SELECT d.state, d.attempts, count(*), max(d.last_error) \
           FROM ferry.events e LEFT JOIN ferry.deliveries d ON d.seq = e.seq \
          WHERE e.id = ANY($1) GROUP BY d.state, d.attempts ORDER BY 3 DESC",
    )
    .bind(missing)
    .fetch_all(ctx.db.pool())
    .await;
    match rows {
        Ok(rows) => {
            for (state, attempts, n, error) in rows {
                eprintln!(
                    "missing: {n} with delivery {} after {} attempt(s){}",
                    state.as_deref().unwrap_or("(none: unrouted)"),
                    attempts.unwrap_or(0),
                    error.map(|e| format!(", last error: {e}")).unwrap_or_default()
                );
            }
        }
        Err(e) => eprintln!("missing: could not look them up: {e}"),
    }
}

async fn commit_one(conn: &mut PgConnection, seq: u64, keys: u64) -> anyhow::Result<(Uuid, Instant)> {
    let key = workload::random_key(keys);
    let event = Event::new(workload::EVENT_TYPE, workload::payload(seq, &key)).key(key);
    let mut tx = conn.begin().await?;
    let sent = enqueue(&mut tx, event).await.context("enqueue")?;
    tx.commit().await?;
    Ok((sent.id.0, Instant::now()))
}

/// Waits until `n` messages arrived, or `within` passed.
async fn wait_for(arrivals: &Arrivals, n: u64, within: Duration) {
    let deadline = Instant::now() + within;
    while arrivals.count.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        sleep(Duration::from_millis(10)).await;
    }
}
