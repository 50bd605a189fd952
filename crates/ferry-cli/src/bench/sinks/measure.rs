//! The measurements of the sinks scenario (feature `bench-sinks`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{anyhow, bail};
use ferry_core::{Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use sqlx::{Connection, PgConnection};
use tokio::time::{Instant, MissedTickBehavior, interval};

use super::{Round, SinkRound, SinksResult, summarise};
use crate::bench::broker::{self, per_second};
use crate::bench::dest::{Confirming, Dest, Endpoints, Kind, WEBHOOK_CONCURRENCY, with_dest};
use crate::bench::latency::{self, Arrivals, LatencyResult};
use crate::bench::relay::Discard;
use crate::bench::topology::{self, Topology};
use crate::bench::{Ctx, drain, progress, relay, workload};

/// How often the destinations are counted: a 20,000-event drain lasts about a
/// second, so a coarser poll would add its own error to the time.
const POLL: Duration = Duration::from_millis(20);
/// A drain that makes no progress for this long has failed.
const STALL: Duration = Duration::from_secs(60);
/// How long a relay on an empty outbox may take to start and go idle.
const IDLE_WITHIN: Duration = Duration::from_secs(30);

/// What a drain waits on.
enum Counter<'a> {
    Dest(&'a Dest),
    Queue(&'a Topology),
    Atomic(Arc<AtomicU64>),
}

impl Counter<'_> {
    async fn count(&self) -> anyhow::Result<u64> {
        match self {
            Counter::Dest(d) => d.count().await,
            Counter::Queue(t) => t.depth().await,
            Counter::Atomic(n) => Ok(n.load(Ordering::Relaxed)),
        }
    }
}

type Target = (String, Arc<dyn Sink>, String);

pub(crate) async fn run(ctx: &Ctx<'_>) -> anyhow::Result<SinksResult> {
    let args = &ctx.args.sinks;
    let at = Endpoints {
        kafka: args.kafka_brokers.clone(),
        nats: args.nats_url.clone(),
        redis: args.redis_url.clone(),
    };
    let rounds = args.sink_rounds as usize;
    let mut measured = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        if rounds > 1 {
            eprintln!("sinks: round {round} of {rounds}");
        }
        measured.push(one_round(ctx, &at).await?);
    }
    let mut result = summarise(args.sink_events, ctx.args.batch_size, measured);
    for kind in Kind::ALL {
        result.latencies.push((kind.label(), latency_of(ctx, &at, kind).await?));
    }
    Ok(result)
}

/// Commit-to-confirmation latency at `--latency-rate` for
/// `--sink-latency-seconds` through a relay with one route to `kind`: an
/// event arrives when its destination confirms it to the relay (Kafka's
/// delivery report, JetStream's PubAck, Redis's reply to XADD, the
/// webhook's 2xx), which is when a consumer can have it.
async fn latency_of(ctx: &Ctx<'_>, at: &Endpoints, kind: Kind) -> anyhow::Result<LatencyResult> {
    let args = ctx.args;
    with_dest(ctx, kind, "latency", at, async |d| {
        ctx.db.reset_outbox().await?;
        let arrivals = Arc::new(Arrivals::default());
        let sink: Arc<dyn Sink> = Arc::new(Confirming {
            inner: d.sink()?,
            confirmed: Arc::new(AtomicU64::new(0)),
            arrivals: Some(Arc::clone(&arrivals)),
        });
        let target = (kind.label().to_owned(), sink, d.destination().to_owned());
        let id = format!("bench-sinks-latency-{}", kind.label());
        let relay = relay::start_routes(ctx, &id, args.batch_size, vec![target]).await?;
        let label = format!("{} latency", kind.label());
        let result = latency::through(ctx, &relay, &arrivals, &label, args.sinks.sink_latency_seconds).await;
        let stopped = relay.stop().await;
        let result = result?;
        stopped?;
        Ok(result)
    })
    .await
}

async fn one_round(ctx: &Ctx<'_>, at: &Endpoints) -> anyhow::Result<Round> {
    let args = ctx.args;
    let (events, window, keys) = (args.sinks.sink_events, args.batch_size, args.keys);

    // Nothing to check at a discard sink beyond its confirmations.
    let target = (
        "discard".to_owned(),
        Arc::new(Discard) as Arc<dyn Sink>,
        "nowhere".to_owned(),
    );
    let handover = drain_into(ctx, "hand-over", vec![target], &[]).await?;

    let mut sinks = Vec::new();
    let rabbit = broker::run(ctx, events, window, keys, broker::Format::Plain).await?;
    let alone = topology::with_topology(ctx, "alone", async |t| {
        publish_alone(ctx, rabbit_target(&args.amqp_url, t), &Counter::Queue(t)).await
    })
    .await?;
    let drained = topology::with_topology(ctx, "sinks", async |t| {
        drain_into(
            ctx,
            "rabbitmq",
            vec![rabbit_target(&args.amqp_url, t)],
            &[Counter::Queue(t)],
        )
        .await
    })
    .await?;
    sinks.push(SinkRound {
        kind: "rabbitmq",
        in_flight: None,
        baseline: rabbit.elapsed,
        alone,
        drain: drained,
    });

    for kind in Kind::ALL {
        let baseline = with_dest(ctx, kind, "baseline", at, async |d| {
            d.baseline(events, window, keys).await
        })
        .await?;
        let alone = with_dest(ctx, kind, "alone", at, async |d| {
            let target = (kind.label().to_owned(), d.sink()?, d.destination().to_owned());
            publish_alone(ctx, target, &Counter::Dest(d)).await
        })
        .await?;
        let drained = with_dest(ctx, kind, "drain", at, async |d| {
            let target = (kind.label().to_owned(), d.sink()?, d.destination().to_owned());
            drain_into(ctx, kind.label(), vec![target], &[Counter::Dest(d)]).await
        })
        .await?;
        sinks.push(SinkRound {
            kind: kind.label(),
            in_flight: (kind == Kind::Webhook).then_some(WEBHOOK_CONCURRENCY),
            baseline,
            alone,
            drain: drained,
        });
    }

    let fanout = topology::with_topology(ctx, "fanout", async |t| {
        with_dest(ctx, Kind::Redis, "fanout", at, async |redis| {
            with_dest(ctx, Kind::Nats, "fanout", at, async |nats| {
                let targets = vec![
                    rabbit_target(&args.amqp_url, t),
                    ("redis".to_owned(), redis.sink()?, redis.destination().to_owned()),
                    ("nats".to_owned(), nats.sink()?, nats.destination().to_owned()),
                ];
                let counters = [Counter::Queue(t), Counter::Dest(redis), Counter::Dest(nats)];
                drain_into(ctx, "fan-out", targets, &counters).await
            })
            .await
        })
        .await
    })
    .await?;
    Ok(Round {
        handover,
        sinks,
        fanout,
    })
}

fn rabbit_target(amqp_url: &str, topology: &Topology) -> Target {
    let sink: Arc<dyn Sink> = Arc::new(RabbitMqSink::new(RabbitMqOptions {
        url: amqp_url.to_owned(),
        ..RabbitMqOptions::default()
    }));
    ("rabbitmq".to_owned(), sink, topology.exchange().to_owned())
}

/// The production sink without the database: the drain's events, built in
/// memory before the clock starts, published in batches of `--batch-size`
/// one after the other, as the relay publishes a route's batches, timed to
/// the last batch's confirmations; then checked, untimed, at the
/// destination. Its destination is checked first, as the relay's is.
async fn publish_alone(
    ctx: &Ctx<'_>,
    (name, sink, destination): Target,
    counter: &Counter<'_>,
) -> anyhow::Result<Duration> {
    let (events, keys) = (ctx.args.sinks.sink_events, ctx.args.keys);
    let label = format!("{name} alone");
    let route = relay::route(&name, destination)?;
    sink.check(&route)
        .await
        .map_err(|e| anyhow!("sinks: {label}: checking the destination: {e}"))?;
    let messages = workload::Messages::build(events, keys);
    let backlog: Vec<StoredEvent> = (0..events).map(|seq| messages.event(seq)).collect();
    let bar = progress::bar(events, &label);
    let started = Instant::now();
    for batch in backlog.chunks(ctx.args.batch_size.max(1)) {
        let outcomes = sink.publish(&route, batch).await;
        anyhow::ensure!(
            outcomes.len() == batch.len(),
            "sinks: {label}: {} outcomes for a batch of {}",
            outcomes.len(),
            batch.len()
        );
        if let Some((event, Err(e))) = batch.iter().zip(&outcomes).find(|(_, o)| o.is_err()) {
            bail!("sinks: {label}: event {} was not published: {e}", event.seq);
        }
        bar.inc(batch.len() as u64);
    }
    let took = started.elapsed();
    wait_for_all(std::slice::from_ref(counter), None, events, &bar).await?;
    progress::done(
        &bar,
        format!(
            "sinks: {label}: {events} events in {:.1} s: {:.0}/s",
            took.as_secs_f64(),
            per_second(events, took)
        ),
    );
    Ok(took)
}

/// Starts a relay routing to every target on an empty outbox and lets it go
/// idle, then commits `sink-events` events in one transaction and times the
/// relay from that commit until every target's destination confirmed every
/// event to it (what the baselines time too, on connections made before
/// their clocks start); then checks, untimed, that every counter reached
/// the count. Neither the relay's start-up (connections, destination
/// checks) nor a consumer's own lag (Kafka's fetch wait) is drain time.
async fn drain_into(
    ctx: &Ctx<'_>,
    label: &str,
    targets: Vec<Target>,
    counters: &[Counter<'_>],
) -> anyhow::Result<Duration> {
    let events = ctx.args.sinks.sink_events;
    ctx.db.reset_outbox().await?;
    let id = format!("bench-sinks-{}", label.replace(' ', "-"));
    let mut confirmed = Vec::with_capacity(targets.len());
    let targets = targets
        .into_iter()
        .map(|(name, inner, destination)| {
            let count = Arc::new(AtomicU64::new(0));
            confirmed.push(Counter::Atomic(Arc::clone(&count)));
            let sink: Arc<dyn Sink> = Arc::new(Confirming {
                inner,
                confirmed: count,
                arrivals: None,
            });
            (name, sink, destination)
        })
        .collect();
    let relay = relay::start_routes(ctx, &id, ctx.args.batch_size, targets).await?;
    let staged = async {
        relay.wait_until_sleeping(ctx.db.pool(), IDLE_WITHIN).await?;
        let mut conn = PgConnection::connect_with(ctx.db.options()).await?;
        let mut tx = conn.begin().await?;
        drain::stage(&mut tx, events, ctx.args.keys).await?;
        tx.commit().await?;
        let started = Instant::now();
        let _ = conn.close().await;
        anyhow::Ok(started)
    }
    .await;
    let started = match staged {
        Ok(started) => started,
        Err(e) => {
            let _ = relay.stop().await;
            return Err(e.context(format!("sinks: {label}: staging the backlog")));
        }
    };
    let bar = progress::bar(events, label);
    let mut waited = wait_for_all(&confirmed, Some(&relay), events, &bar).await;
    let drained = started.elapsed();
    if waited.is_ok() {
        waited = wait_for_all(counters, Some(&relay), events, &bar).await;
    }
    let report = relay.stop().await;
    waited?;
    let report = report?;
    anyhow::ensure!(
        report.published >= events && report.dead == 0,
        "sinks: {label}: the relay published {} and killed {} deliveries of {events} events",
        report.published,
        report.dead
    );
    progress::done(
        &bar,
        format!(
            "sinks: {label} drain: {events} events in {:.1} s: {:.0}/s",
            drained.as_secs_f64(),
            per_second(events, drained)
        ),
    );
    Ok(drained)
}

/// Waits until every counter reaches `events`, failing if `relay` stops or
/// the counts stall.
async fn wait_for_all(
    counters: &[Counter<'_>],
    relay: Option<&relay::RunningRelay>,
    events: u64,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    let mut tick = interval(POLL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut last, mut moved) = (0, Instant::now());
    loop {
        tick.tick().await;
        if let Some(relay) = relay {
            relay.ensure_running()?;
        }
        let mut least = u64::MAX;
        let mut total = 0;
        for counter in counters {
            let n = counter.count().await?;
            least = least.min(n);
            total += n;
        }
        bar.set_position(least.min(events));
        if least >= events {
            return Ok(());
        }
        if total > last {
            (last, moved) = (total, Instant::now());
        }
        anyhow::ensure!(
            moved.elapsed() < STALL,
            "the drain stalled at {least} of {events} messages for {STALL:?}"
        );
    }
}
