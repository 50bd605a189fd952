pub mod cancel;
pub mod capture;
mod check;
pub mod list;
mod migrate;
mod purge;
pub mod requeue;
mod run;
pub mod show;
mod status;
pub mod tail;
mod unserved;
#[cfg(feature = "postgres")]
pub mod wal;

use std::process::ExitCode;

use crate::store::AnyStore;
use anyhow::Context;

#[cfg(feature = "demo")]
pub(crate) use run::relay_settings;

use crate::cli::{Cli, Command};
use crate::config::{self, Config};

/// A start-up error in the operator's input (config, flags): exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        #[cfg(all(feature = "postgres", feature = "rabbitmq"))]
        Command::Bench(args) => return crate::bench::run(args).await,
        #[cfg(feature = "demo")]
        Command::Demo(args) => return crate::demo::run(args).await,
        _ => {}
    }
    let cfg = config::load(cli.config.as_deref()).map_err(|e| UsageError(e.to_string()))?;
    match cli.command {
        #[cfg(all(feature = "postgres", feature = "rabbitmq"))]
        Command::Bench(_) => unreachable!("handled above"),
        #[cfg(feature = "demo")]
        Command::Demo(_) => unreachable!("handled above"),
        Command::Migrate => migrate::run(&cfg).await,
        Command::Run => run::run(cfg).await,
        Command::Status { json } => status::run(&cfg, json).await,
        Command::List(args) => list::run(&cfg, args).await,
        Command::Show(args) => show::run(&cfg, args).await,
        Command::Requeue(args) => requeue::run(&cfg, args).await,
        Command::Cancel(args) => cancel::run(&cfg, args).await,
        Command::Tail(args) => tail::run(&cfg, args).await,
        Command::Capture(args) => capture::run(&cfg, args).await,
        Command::Check { json } => check::run(&cfg, json).await,
        Command::Purge { dry_run, json } => purge::run(&cfg, dry_run, json).await,
        #[cfg(feature = "postgres")]
        Command::Wal(args) => wal::run(&cfg, args).await,
    }
}

/// Why a config without routes cannot run a relay, and the fix. Loading such
/// a config is fine: `migrate`, `status`, `check` and the admin verbs need
/// no routes; only `ferry run` refuses it.
pub(crate) const NO_ROUTES: &str = "none configured, so the relay would record every event dead with \
     \"(no route)\"; add a [[routes]] section to the config file (see ferry.example.toml), or pass the \
     file that has them with --config FILE or FERRY_CONFIG";

pub fn exit_code(err: &anyhow::Error) -> u8 {
    if err.is::<UsageError>() { 2 } else { 1 }
}

/// The outbox store `database.url` names (PostgreSQL or SQLite).
pub(crate) fn store(cfg: &Config) -> anyhow::Result<AnyStore> {
    AnyStore::open(cfg).map_err(|e| UsageError(e.message).into())
}

/// [`store`] for the relay (`ferry run`).
pub(crate) fn relay_store(cfg: &Config) -> anyhow::Result<AnyStore> {
    AnyStore::open_for_relay(cfg).map_err(|e| UsageError(e.message).into())
}

pub(crate) async fn connect(cfg: &Config) -> anyhow::Result<sqlx::PgConnection> {
    use sqlx::Connection;
    // sqlx sets no connect timeout: a server that takes the connection and
    // never answers (a host dropping packets after the handshake, a proxy
    // with nothing behind it) would hold the command until the OS gives up.
    let connecting = sqlx::PgConnection::connect(&cfg.database.url);
    let connected = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(connected) => connected.map_err(anyhow::Error::from),
        Err(_) => Err(anyhow::anyhow!("no answer within {}s", CONNECT_TIMEOUT.as_secs())),
    };
    connected.with_context(|| {
        format!(
            "cannot connect to the database ({})",
            ferry_core::redact::url(&cfg.database.url)
        )
    })
}

/// How long a command waits for the database to answer a connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `arg` as one shell word: as is when it is plain, else single-quoted.
pub(crate) fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}
