use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Ferry: a transactional outbox relay. Events committed with your business
/// writes are delivered at least once, in order per key.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about, propagate_version = true)]
pub struct Cli {
    /// The configuration file (TOML). Fields can be overridden with
    /// environment variables such as FERRY_DATABASE__URL.
    #[arg(long, short, global = true, env = "FERRY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the `ferry` schema (idempotent).
    Migrate,
    /// Run the relay until SIGTERM or SIGINT.
    Run,
    /// Show deliveries per route and state, the oldest waiting work, blocked
    /// keys, dead reasons and relay leases. Exits 3 when a threshold of the
    /// config's [alerts] section is breached, so it can serve as a check.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// List deliveries by state, route, type, key, time or error, a page at
    /// a time.
    List(crate::commands::list::ListArgs),
    /// Show one event: headers, payload, and per route every failed attempt
    /// and operator action.
    Show(crate::commands::show::ShowArgs),
    /// Send dead or cancelled deliveries again, with a fresh attempt count;
    /// pending and in-flight ones are refused, and so, without
    /// --out-of-order, is one that would arrive after a later event of its
    /// key. Exits 1 if any were refused.
    Requeue(crate::commands::requeue::RequeueArgs),
    /// Cancel deliveries with a reason, unblocking their key; one a relay may
    /// be publishing right now is refused. Exits 1 if any were refused.
    Cancel(crate::commands::cancel::CancelArgs),
    /// Follow delivery outcomes live (route, type, key, latency, outcome)
    /// until Ctrl-C.
    Tail(crate::commands::tail::TailArgs),
    /// Ferry end to end with no server: a shop commits orders and their
    /// events to SQLite, the relay delivers them to a local webhook (down for
    /// a while on purpose) and stdout, and a summary checks every guarantee.
    /// Reads no config file: it writes its own into its --dir.
    #[cfg(feature = "demo")]
    Demo(crate::demo::DemoArgs),
    /// Measure drain rate, latency, idle cost, producer cost, a hot key and
    /// the other sinks on this machine, each beside its broker's own rate;
    /// optionally write the report to docs/BENCHMARKS.md. Needs PostgreSQL
    /// and RabbitMQ, and for the `sinks` scenario (in the default set; leave
    /// it out with --only) Kafka, NATS with JetStream and Redis. Reads no
    /// config file: its flags name the servers.
    #[cfg(all(feature = "postgres", feature = "rabbitmq"))]
    Bench(crate::bench::BenchArgs),
    /// Run retention now, with the same rules as the background job:
    /// delete settled events past their window, archiving them first when
    /// `retention.archive_dir` is set.
    Purge {
        /// Count what would be deleted; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Capture a table's changes as events with triggers, for code paths
    /// that cannot call the producer API (add, refresh, list, remove).
    Capture(crate::commands::capture::CaptureArgs),
    /// Check the configuration, the database schema and every route's
    /// destination; exit non-zero on any problem.
    Check {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Manage the WAL streaming slot: `retire` takes it out of use without
    /// losing a tableless event (to leave WAL mode or change the slot).
    #[cfg(feature = "postgres")]
    Wal(crate::commands::wal::WalArgs),
}
