//! `ferry capture`: triggers that write events for a table's changes, for
//! code paths that cannot call the producer API. See
//! `ferry_store::postgres::capture` for what the events hold.

use std::process::ExitCode;

use anyhow::Context;
use ferry_store::postgres::capture::{self, CaptureError, CaptureSpec, OnError, Operation, Tables};

use super::UsageError;
use crate::config::Config;

/// `ferry capture refresh`'s exit code when it passed over a captured
/// table it could not refresh: its trigger is still out of date.
pub const NOT_REFRESHED: u8 = 1;

#[derive(Debug, clap::Args)]
pub struct CaptureArgs {
    #[command(subcommand)]
    pub command: CaptureCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CaptureCommand {
    /// Install a trigger that writes `<prefix>.created`, `.updated` and
    /// `.deleted` events for TABLE's changes, in the same transaction;
    /// with --replace, change the spec of a table already captured.
    Add(AddArgs),
    /// Regenerate the trigger of TABLE (all captured tables when left out)
    /// from the table's columns now; run it after a schema change. A table
    /// renamed since it was captured is followed, and captured by its new
    /// name; one whose refresh would break another table's trigger is
    /// refused, with what to run first. Refreshing all passes over a table
    /// it cannot refresh, says why, and exits 1 (the others stay
    /// refreshed).
    Refresh {
        /// A captured table, as `ferry capture list` names it.
        table: Option<String>,
    },
    /// List the captured tables, their spec, tracked columns and dropped
    /// events.
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Drop TABLE's trigger and stop capturing it. Refused while the
    /// trigger fires on another table (TABLE renamed since): `refresh`
    /// follows the rename.
    Remove {
        /// A captured table, as `ferry capture list` names it.
        table: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct AddArgs {
    /// The table, in SQL syntax: orders, app.orders, 'app."Order Items"'.
    pub table: String,
    /// Event types are <PREFIX>.created, .updated and .deleted.
    #[arg(long, value_name = "PREFIX")]
    pub type_prefix: String,
    /// The column whose value is the event key: events of one key are
    /// delivered in commit order.
    #[arg(long, value_name = "COLUMN")]
    pub key: String,
    /// A column to leave out of payloads (secrets, large blobs); repeatable.
    #[arg(long, value_name = "COLUMN")]
    pub exclude: Vec<String>,
    /// A column whose change from NULL to a value is a `.deleted` event.
    #[arg(long, value_name = "COLUMN")]
    pub soft_delete: Option<String>,
    /// The operations that write events.
    #[arg(long, value_delimiter = ',', default_value = "insert,update,delete")]
    pub on: Vec<Operation>,
    /// When the event cannot be written: `fail` fails the business write
    /// too; `warn` keeps it and drops the event (lossy; each drop is
    /// counted and shown by `ferry capture list`).
    #[arg(long, value_enum, default_value_t = OnErrorArg::Fail)]
    pub on_error: OnErrorArg,
    /// TABLE is captured already: give it this spec instead, in one
    /// transaction under the table's lock, so that every change commits
    /// with the old spec's events or the new one's. (A remove then an add
    /// would let changes commit between the two with no event.)
    #[arg(long)]
    pub replace: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum OnErrorArg {
    Fail,
    Warn,
}

pub async fn run(cfg: &Config, args: CaptureArgs) -> anyhow::Result<ExitCode> {
    if crate::store::is_sqlite(&cfg.database.url) {
        return Err(super::UsageError(
            "ferry capture installs PostgreSQL triggers; database.url names SQLite, where producers call \
             ferry::sqlite::enqueue in their own transactions instead"
                .into(),
        )
        .into());
    }
    let mut conn = super::connect(cfg).await?;
    match args.command {
        CaptureCommand::Add(add) => {
            let spec = CaptureSpec {
                table: add.table,
                type_prefix: add.type_prefix,
                key_column: add.key,
                exclude: add.exclude,
                soft_delete: add.soft_delete,
                on: add.on,
                on_error: match add.on_error {
                    OnErrorArg::Fail => OnError::Fail,
                    OnErrorArg::Warn => OnError::Warn,
                },
            };
            let (table, key_change) = if add.replace {
                let replaced = capture::replace(&mut conn, &spec).await.map_err(usage)?;
                (replaced.table, replaced.key_change)
            } else {
                (capture::add(&mut conn, &spec).await.map_err(usage)?, None)
            };
            let ops: Vec<&str> = spec.on.iter().map(|op| op.as_str()).collect();
            println!(
                "capturing {table}{}: {} as {}.* events keyed by {}",
                if add.replace { " (spec replaced)" } else { "" },
                ops.join(", "),
                spec.type_prefix,
                spec.key_column
            );
            if let Some(change) = key_change.filter(|c| c.unpublished > 0) {
                println!(
                    "warning: the key column changed from {} to {} while {} event(s) of {}.* were unpublished: \
                     a row's events under the new key may be delivered before its events still waiting under \
                     the old one; change a key with the table's events drained (`ferry status` shows none \
                     pending or dead for their routes)",
                    change.from, spec.key_column, change.unpublished, change.type_prefix
                );
            }
            if spec.on_error == OnError::Warn {
                println!("warning: on-error warn drops events it cannot write; watch `ferry capture list`");
            }
            // A key the producer refuses is a write refused (or an event
            // dropped): told, not refused, as the table's values may keep
            // within the limits.
            match capture::text_key(&mut conn, &table).await {
                Ok(Some(key)) => println!(
                    "warning: {table}: its key column {} is of type {}: a row whose key is empty, over 512 bytes \
                     or holds a line break (CR or LF) is refused as an event key, so {}; keep such values out \
                     with `ALTER TABLE {table} ADD CHECK ({} <> '' AND octet_length({}) <= 512 AND {} !~ \
                     '[\\r\\n]')`",
                    key.column,
                    key.column_type,
                    match spec.on_error {
                        OnError::Fail => "writing such a row fails (on-error fail)",
                        OnError::Warn => "such a row is written without its event (on-error warn drops it)",
                    },
                    key.column,
                    key.column,
                    key.column
                ),
                Ok(None) => {}
                Err(e) => println!("warning: could not read {table}'s key column type ({e})"),
            }
            // What `ferry check` would say of it now (a nullable key column).
            // The capture is committed: a check that fails is only told.
            match capture::check(&mut conn).await {
                Ok(drifts) => {
                    for drift in drifts.into_iter().filter(|d| d.table == table) {
                        println!("warning: {table}: {}; fix: {}", drift.problem, drift.fix);
                    }
                }
                Err(e) => println!("warning: could not check {table} afterwards ({e}); run `ferry check`"),
            }
        }
        CaptureCommand::Refresh { table } => {
            let which = table.as_deref().map_or(Tables::All, Tables::One);
            let done = capture::refresh(&mut conn, which).await.map_err(usage)?;
            for table in &done {
                println!("refreshed {table}");
            }
            // Refreshing all passes over a table that is gone: say which,
            // with its fix. The refresh is committed: a check that fails is
            // only told.
            let skipped = match table {
                Some(_) => Vec::new(),
                None => match capture::check(&mut conn).await {
                    Ok(drifts) => drifts.into_iter().filter(|d| !done.contains(&d.table)).collect(),
                    Err(e) => {
                        println!("warning: could not check the tables not refreshed ({e}); run `ferry check`");
                        Vec::new()
                    }
                },
            };
            for drift in &skipped {
                println!("not refreshed {}: {}; fix: {}", drift.table, drift.problem, drift.fix);
            }
            if done.is_empty() && skipped.is_empty() {
                println!("no captured tables");
            }
            // A deploy's `ferry migrate && ferry capture refresh` stops on
            // a trigger left out of date; the others stay refreshed.
            if !skipped.is_empty() {
                eprintln!(
                    "{} captured table(s) not refreshed (fixes above); the others were",
                    skipped.len()
                );
                return Ok(ExitCode::from(NOT_REFRESHED));
            }
        }
        CaptureCommand::List { json } => {
            let captures = capture::list(&mut conn).await.map_err(usage)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&captures)?);
            } else if captures.is_empty() {
                println!("no captured tables");
            } else {
                for c in &captures {
                    println!(
                        "{} type={}.* key={} on={} on-error={} columns={}{}{}",
                        c.table,
                        c.type_prefix,
                        c.key_column,
                        c.on.join(","),
                        c.on_error,
                        c.columns.join(","),
                        c.soft_delete
                            .as_deref()
                            .map(|s| format!(" soft-delete={s}"))
                            .unwrap_or_default(),
                        if c.on_error == "warn" {
                            format!(" dropped={}", c.dropped)
                        } else {
                            String::new()
                        }
                    );
                }
            }
        }
        CaptureCommand::Remove { table } => {
            let table = capture::remove(&mut conn, &table).await.map_err(usage)?;
            println!("stopped capturing {table}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Bad input and a missing schema are the operator's to fix (exit 2).
fn usage(err: CaptureError) -> anyhow::Error {
    match err {
        CaptureError::Invalid { .. } | CaptureError::NotMigrated => UsageError(err.to_string()).into(),
        other => anyhow::Error::new(other).context("ferry capture"),
    }
}

/// `ferry check`'s findings: one per captured table, ok or out of date with
/// its fix. None when the capture schema is missing: the schema finding
/// already says to migrate.
pub(crate) async fn check_findings(conn: &mut sqlx::PgConnection) -> anyhow::Result<Vec<(String, bool, String)>> {
    let captures = match capture::list(conn).await {
        Ok(c) => c,
        Err(CaptureError::NotMigrated) => return Ok(Vec::new()),
        Err(e) => return Err(e).context("listing captured tables"),
    };
    let drift = capture::check(conn).await.context("checking captured tables")?;
    Ok(captures
        .into_iter()
        .map(|c| {
            let what = format!("capture {}", c.table);
            match drift.iter().find(|d| d.table == c.table) {
                Some(d) => (
                    what,
                    false,
                    format!("trigger out of date: {}; fix: `{}`", d.problem, d.fix),
                ),
                None if c.dropped > 0 => (
                    what,
                    true,
                    format!(
                        "trigger matches the table; on-error warn has dropped {} event(s), last: {}",
                        c.dropped,
                        c.last_dropped_error.as_deref().unwrap_or("")
                    ),
                ),
                None => (
                    what,
                    true,
                    format!("trigger matches the table ({} columns)", c.columns.len()),
                ),
            }
        })
        .collect())
}
