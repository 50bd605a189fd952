//! The `ferry` binary: parses flags, sets up logging and calls one library
//! function per subcommand. Errors map to exit codes here and only here.

#[cfg(all(feature = "postgres", feature = "rabbitmq"))]
mod bench;
mod cli;
mod commands;
mod config;
#[cfg(feature = "demo")]
mod demo;
mod duration;
mod health;
mod sinks;
mod store;
mod telemetry;
#[cfg(feature = "otel")]
mod tracing_otel;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = match runtime.block_on(commands::dispatch(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(commands::exit_code(&err))
        }
    };
    // Dropped, the runtime would wait for every blocking-pool thread, and
    // one may never end: a write to a stdout nobody reads, a file on a hung
    // mount. The relay has already stopped, and its work is either done
    // or left pending for the next one.
    runtime.shutdown_timeout(BLOCKING_THREADS_WAIT);
    code
}

/// How long the exit waits for blocking-pool threads still running.
const BLOCKING_THREADS_WAIT: Duration = Duration::from_secs(3);
