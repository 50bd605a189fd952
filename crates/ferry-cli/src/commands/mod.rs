mod check;
mod migrate;
mod run;
mod status;

use std::process::ExitCode;

use anyhow::Context;
use ferry_store::postgres::PgStore;

use crate::cli::{Cli, Command};
use crate::config::{self, Config};

/// A start-up error in the operator's input (config, flags): exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    if let Command::Bench(args) = cli.command {
        return crate::bench::run(args).await;
    }
    let cfg = config::load(cli.config.as_deref()).map_err(|e| UsageError(e.to_string()))?;
    match cli.command {
        Command::Bench(_) => unreachable!("handled above"),
        Command::Migrate => migrate::run(&cfg).await,
        Command::Run => run::run(cfg).await,
        Command::Status { json } => status::run(&cfg, json).await,
        Command::Check { json } => check::run(&cfg, json).await,
    }
}

pub fn exit_code(err: &anyhow::Error) -> u8 {
    if err.is::<UsageError>() { 2 } else { 1 }
}

pub(crate) fn store(cfg: &Config) -> anyhow::Result<PgStore> {
    PgStore::connect_lazy(&cfg.database.url, cfg.database.max_connections).map_err(|e| UsageError(e.message).into())
}

pub(crate) async fn connect(cfg: &Config) -> anyhow::Result<sqlx::PgConnection> {
    use sqlx::Connection;
    sqlx::PgConnection::connect(&cfg.database.url)
        .await
        .with_context(|| format!("cannot connect to the database ({})", redact(&cfg.database.url)))
}

/// A URL without its password, for messages.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}://{}:***{}", &url[..s], &creds[..c], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            super::redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(super::redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
