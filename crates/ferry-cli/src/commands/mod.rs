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
        Command::Bench(args) => {
            without_config(cli.config.as_deref(), "bench", BENCH_INSTEAD)?;
            return crate::bench::run(args).await;
        }
        #[cfg(feature = "demo")]
        Command::Demo(args) => {
            without_config(cli.config.as_deref(), "demo", DEMO_INSTEAD)?;
            return crate::demo::run(args).await;
        }
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

/// What `ferry bench` and `ferry demo` use instead of a config file.
#[cfg(any(test, all(feature = "postgres", feature = "rabbitmq")))]
const BENCH_INSTEAD: &str = "it takes its servers from its own flags (--database-url, --amqp-url, \
     --kafka-brokers, --nats-url, --redis-url; see `ferry bench --help`)";
#[cfg(any(test, feature = "demo"))]
const DEMO_INSTEAD: &str = "it writes and uses its own ferry.toml in its --dir";

/// For `ferry <verb>`, which reads no config file: refuses `--config`, and
/// warns on stderr of FERRY_CONFIG.
#[cfg(any(feature = "demo", all(feature = "postgres", feature = "rabbitmq")))]
fn without_config(config: Option<&std::path::Path>, verb: &str, instead: &str) -> Result<(), UsageError> {
    let env = std::env::var_os("FERRY_CONFIG");
    if let Some(warning) = no_config_file(config, env.as_deref(), verb, instead)? {
        eprintln!("{warning}");
    }
    Ok(())
}

/// Refuses `config` when it came from `--config`, and returns a warning
/// when it came from FERRY_CONFIG (`env`), which is often set for the other
/// verbs and so is no mistake of this command line.
#[cfg(any(test, feature = "demo", all(feature = "postgres", feature = "rabbitmq")))]
fn no_config_file(
    config: Option<&std::path::Path>,
    env: Option<&std::ffi::OsStr>,
    verb: &str,
    instead: &str,
) -> Result<Option<String>, UsageError> {
    let Some(config) = config else { return Ok(None) };
    // clap takes --config over FERRY_CONFIG: the same path is taken to be
    // the environment's.
    if env.is_some_and(|env| std::path::Path::new(env) == config) {
        return Ok(Some(format!(
            "warning: FERRY_CONFIG is set ({}), but `ferry {verb}` reads no config file: {instead}",
            config.display()
        )));
    }
    Err(UsageError(format!(
        "--config: `ferry {verb}` reads no config file: {instead}; run it without --config"
    )))
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

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::path::Path;

    use super::*;

    #[test]
    fn bench_and_demo_refuse_a_config_flag_and_warn_of_ferry_config() {
        let file = Path::new("ferry.toml");
        assert!(matches!(no_config_file(None, None, "demo", DEMO_INSTEAD), Ok(None)));

        let err = no_config_file(Some(file), None, "bench", BENCH_INSTEAD).unwrap_err().0;
        assert!(err.starts_with("--config: `ferry bench` reads no config file"), "{err}");
        assert!(err.contains("--database-url"), "{err}");
        // A flag beside a different FERRY_CONFIG is still the flag.
        let env = Some(OsStr::new("other.toml"));
        let err = no_config_file(Some(file), env, "demo", DEMO_INSTEAD).unwrap_err().0;
        assert!(err.contains("its own ferry.toml in its --dir"), "{err}");

        let env = Some(OsStr::new("ferry.toml"));
        let warning = no_config_file(Some(file), env, "demo", DEMO_INSTEAD).unwrap().unwrap();
        assert!(
            warning.starts_with("warning: FERRY_CONFIG is set (ferry.toml), but `ferry demo` reads no config file"),
            "{warning}"
        );
    }
}
