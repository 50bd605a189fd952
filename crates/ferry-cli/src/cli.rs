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
    /// keys, dead reasons and relay leases.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Measure drain rate, latency, idle cost, producer cost and a hot key on
    /// this machine, beside the broker's own rate; optionally write the
    /// report to docs/BENCHMARKS.md. Needs no config file.
    Bench(crate::bench::BenchArgs),
    /// Check the configuration, the database schema and every route's
    /// destination; exit non-zero on any problem.
    Check {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}
