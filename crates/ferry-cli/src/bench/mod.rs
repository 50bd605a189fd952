//! `ferry bench`: how fast Ferry moves events on this machine, beside the
//! broker's own ceiling measured in the same run.
//!
//! Scenarios, each in its own module: `broker` (RabbitMQ's confirmed-publish
//! rate), `drain` (a backlog through the relay; also the hot-key run),
//! `latency` (commit to consumer), `idle` (what a relay with nothing to do
//! costs the database), `producer` (what the outbox costs a committing
//! application) and `sinks` (Kafka, NATS JetStream, Redis Streams and a
//! webhook, each beside its own confirmed-publish rate and with its latency,
//! plus one event type fanned out to RabbitMQ, Redis and NATS at once). The
//! relay runs in this process.
//!
//! Before the first scenario, every server the chosen scenarios need must
//! answer (`preflight`): PostgreSQL, RabbitMQ and, for `sinks`, Kafka, NATS
//! with JetStream and Redis.
//!
//! The bench works in a database of its own, `ferry_bench_<hex>`, and in
//! uniquely named RabbitMQ topology per scenario (and, for `sinks`, Kafka
//! topics, NATS streams and Redis streams); it removes them at the end, also
//! after an error or Ctrl-C (what an interrupted scenario left, through
//! `leftovers`). Progress goes to stderr, the markdown report to stdout
//! and, with `--write`, into a file; after an error or Ctrl-C, the
//! scenarios that completed, marked as a partial report.

mod broker;
mod db;
#[cfg(feature = "bench-sinks")]
mod dest;
mod drain;
mod idle;
mod latency;
mod leftovers;
mod machine;
mod preflight;
mod producer;
mod progress;
mod relay;
mod report;
mod retention;
mod sinks;
mod topology;
mod workload;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::anyhow;
use broker::Format;
use tokio::time::Instant;

use crate::config::{LogConfig, LogFormat};
use db::BenchDb;
use leftovers::Leftovers;
use report::Report;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// A PostgreSQL URL whose user may create databases. The bench creates
    /// `ferry_bench_<hex>` on that server and drops it at the end.
    #[arg(long, value_name = "URL", default_value = "postgres://root@127.0.0.1:5432/postgres")]
    pub database_url: String,
    /// The RabbitMQ broker.
    #[arg(long, value_name = "URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub amqp_url: String,
    /// Events in the broker, drain and hot-key runs.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Distinct event keys.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
    /// Rounds of the broker baselines (plain, plain with a timestamp, and
    /// with Ferry's message properties) and the drain, one after the other:
    /// the report gives the middle round of each and the spread of the
    /// shares.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub drain_rounds: u32,
    /// The relay's batch size, and the broker baseline's publish window.
    #[arg(long, default_value_t = 500, value_parser = positive_usize)]
    pub batch_size: usize,
    /// Events per second in the latency run.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub latency_rate: u32,
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub latency_seconds: u64,
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_seconds: u64,
    /// Seconds per producer variant.
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub producer_seconds: u64,
    /// Concurrent connections in the producer runs.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub producer_clients: u32,
    /// Events per second in the retention run.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub retention_rate: u32,
    /// How long the retention run produces.
    #[arg(long, value_name = "SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_seconds: u64,
    /// How long published events are kept in the retention run.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = crate::duration::parse_duration)]
    pub retention_window: std::time::Duration,
    #[command(flatten)]
    pub sinks: Box<SinkArgs>,
    /// Run only these scenarios (comma-separated). The broker baseline runs
    /// with `drain`, `hotkey` or `wal-drain`.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub only: Vec<Scenario>,
    /// Also write the report into FILE, between `<!-- ferry bench: begin -->`
    /// and `<!-- ferry bench: end -->` if those lines are there (the rest of
    /// the file is kept), else appended.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
}

/// The sinks scenario's flags (boxed: they would make `BenchArgs` the
/// largest command by far).
#[derive(Debug, clap::Args)]
pub struct SinkArgs {
    /// Events per run in the sinks scenario.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub sink_events: u64,
    /// Rounds of the sinks scenario: each measures every baseline, sink alone
    /// and drain once; the report gives medians and the spread of the rounds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub sink_rounds: u32,
    /// Seconds of each sink's latency run (at `--latency-rate`), after the
    /// rounds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub sink_latency_seconds: u64,
    /// The Kafka brokers of the sinks scenario.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:19092")]
    pub kafka_brokers: String,
    /// The NATS server (with JetStream) of the sinks scenario.
    #[arg(long, value_name = "URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// The Redis server of the sinks scenario.
    #[arg(long, value_name = "URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    Drain,
    Latency,
    /// Latency with the relay streaming from a WAL slot (wal_level=logical).
    WalLatency,
    /// Drain with the relay streaming the backlog from a WAL slot.
    WalDrain,
    Idle,
    Producer,
    Hotkey,
    /// Kafka, NATS JetStream, Redis and a webhook beside RabbitMQ: needs the
    /// servers of --kafka-brokers, --nats-url and --redis-url.
    Sinks,
    /// Not in the default set: it takes `--retention-seconds` (10 minutes).
    Retention,
}

fn positive_usize(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

/// What the scenarios share.
pub(crate) struct Ctx<'a> {
    pub db: &'a BenchDb,
    pub args: &'a BenchArgs,
    /// What the scenarios created on the brokers and have not deleted yet.
    pub left: &'a Leftovers,
}

impl BenchArgs {
    fn runs(&self, scenario: Scenario) -> bool {
        (self.only.is_empty() && scenario != Scenario::Retention) || self.only.contains(&scenario)
    }

    fn describe(&self) -> String {
        format!(
            "{} events over {} keys, batch {}; latency {}/s for {} s; idle {} s; producers {} × {} s; \
             drain × {} rounds; sinks {} events × {} rounds, latency {} s each",
            report::thousands(self.events),
            report::thousands(self.keys),
            self.batch_size,
            self.latency_rate,
            self.latency_seconds,
            self.idle_seconds,
            self.producer_clients,
            self.producer_seconds,
            self.drain_rounds,
            report::thousands(self.sinks.sink_events),
            self.sinks.sink_rounds,
            self.sinks.sink_latency_seconds
        )
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    crate::telemetry::init_logs(&LogConfig {
        format: LogFormat::Text,
        level: "warn".into(),
    });
    let started = Instant::now();
    preflight::check(&args).await?;
    let db = BenchDb::create(&args.database_url).await?;
    eprintln!("bench database {} created", db.name());
    let mut report = Report {
        settings: args.describe(),
        ..Report::default()
    };
    let left = Leftovers::default();
    let ctx = Ctx {
        db: &db,
        args: &args,
        left: &left,
    };
    // Ctrl-C drops the scenario at its current await: what it created and
    // had not deleted yet is deleted by `left`.
    let outcome = tokio::select! {
        outcome = run_scenarios(&ctx, &mut report) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    left.delete_all().await;
    let name = db.name().to_owned();
    match db.drop_db().await {
        Ok(()) => eprintln!("bench database {name} dropped"),
        Err(e) => eprintln!("warning: could not drop bench database {name}: {e:#}"),
    }
    report.wall = Some(started.elapsed());
    finish(&mut report, outcome, args.write.as_deref())?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the report and writes it into `write`. After an error or Ctrl-C,
/// the scenarios that completed are printed and written too, marked as a
/// partial report, before the error is returned; a run that completed
/// none writes nothing.
fn finish(report: &mut Report, outcome: anyhow::Result<()>, write: Option<&Path>) -> anyhow::Result<()> {
    if let Err(e) = &outcome {
        report.stopped = Some(format!("{e:#}"));
    }
    let markdown = report.render();
    print!("{markdown}");
    let Some(path) = write else { return outcome };
    if outcome.is_err() && !report.has_results() {
        eprintln!("no scenario completed: nothing written into {}", path.display());
        return outcome;
    }
    match (report::write_into(path, &markdown), &outcome) {
        (Ok(()), Ok(())) => eprintln!("report written into {}", path.display()),
        (Ok(()), Err(_)) => eprintln!("partial report written into {}", path.display()),
        (Err(e), Ok(())) => return Err(e),
        (Err(e), Err(_)) => eprintln!("warning: could not write the partial report: {e:#}"),
    }
    outcome
}

/// Runs the chosen scenarios, filling `report` as each one ends. Idle runs
/// first, on the freshly migrated database, so that autovacuum catching up
/// after the bulk scenarios does not count against the relay.
async fn run_scenarios(ctx: &Ctx<'_>, report: &mut Report) -> anyhow::Result<()> {
    let args = ctx.args;
    report.machine = Some(machine::gather(ctx.db.pool()).await);
    if args.runs(Scenario::Idle) {
        report.idle = Some(idle::run(ctx).await?);
    }
    if args.runs(Scenario::Drain) {
        // The baselines and the drain alternate, so that a slow spell of
        // the machine weighs on every side of a round's shares.
        let rounds = args.drain_rounds as usize;
        let baseline = async |format| broker::run(ctx, args.events, args.batch_size, args.keys, format).await;
        let (mut brokers, mut stamped, mut formatted, mut drains) = (
            Vec::with_capacity(rounds),
            Vec::with_capacity(rounds),
            Vec::with_capacity(rounds),
            Vec::with_capacity(rounds),
        );
        for round in 1..=rounds {
            if rounds > 1 {
                eprintln!("drain: round {round} of {rounds}");
            }
            brokers.push(baseline(Format::Plain).await?);
            stamped.push(baseline(Format::Stamped).await?);
            formatted.push(baseline(Format::Ferry).await?);
            drains.push(drain::run(ctx, "drain", args.keys).await?);
        }
        // Per round: the drain's rate as a share of that round's baseline.
        let shares = |baselines: &[broker::BrokerResult]| -> Vec<f64> {
            baselines
                .iter()
                .zip(&drains)
                .map(|(b, d)| d.rate() / b.rate())
                .collect()
        };
        report.drain_shares = shares(&brokers);
        report.format_shares = shares(&formatted);
        report.broker = middle(brokers, |b| b.elapsed);
        report.broker_ferry_format = middle(formatted, |b| b.elapsed);
        report.broker_stamped = middle(stamped, |b| b.elapsed);
        report.drain = middle(drains, |d| d.drain);
    } else if args.runs(Scenario::Hotkey) || args.runs(Scenario::WalDrain) {
        report.broker = Some(broker::run(ctx, args.events, args.batch_size, args.keys, Format::Plain).await?);
    }
    if args.runs(Scenario::Hotkey) {
        report.hotkey = Some(drain::run(ctx, "hotkey", 1).await?);
    }
    if args.runs(Scenario::Latency) {
        report.latency = Some(latency::run(ctx).await?);
    }
    if args.runs(Scenario::WalDrain) {
        report.wal_drain = Some(drain::run_wal(ctx).await?);
    }
    if args.runs(Scenario::WalLatency) {
        report.wal_latency = Some(latency::run_wal(ctx).await?);
    }
    if args.runs(Scenario::Producer) {
        report.producer = producer::run(ctx).await?;
    }
    if args.runs(Scenario::Retention) {
        report.retention = Some(retention::run(ctx).await?);
    }
    if args.runs(Scenario::Sinks) {
        #[cfg(feature = "bench-sinks")]
        {
            report.sinks = Some(sinks::run(ctx).await?);
        }
        #[cfg(not(feature = "bench-sinks"))]
        {
            anyhow::ensure!(
                args.only.is_empty(),
                "the sinks scenario needs a ferry built with the bench-sinks feature"
            );
            eprintln!("sinks: skipped (this ferry was built without the bench-sinks feature)");
        }
    }
    Ok(())
}

/// The middle of per-round times (the mean of the two middle ones for an
/// even count), where no other figure of the rounds is kept.
#[cfg(any(test, feature = "bench-sinks"))]
pub(crate) fn median(mut times: Vec<std::time::Duration>) -> Option<std::time::Duration> {
    times.sort();
    let n = times.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(times[n / 2]),
        _ => Some((times[n / 2 - 1] + times[n / 2]) / 2),
    }
}

/// The round whose `time` is in the middle (for an even count, the upper
/// of the two middle ones): a real run, so its other figures stay its own.
pub(crate) fn middle<T>(mut runs: Vec<T>, time: impl Fn(&T) -> std::time::Duration) -> Option<T> {
    runs.sort_by_key(|r| time(r));
    let mid = runs.len() / 2;
    (!runs.is_empty()).then(|| runs.swap_remove(mid))
}

#[cfg(test)]
mod tests;
