//! `ferry wal`: the WAL streaming slot's life, beyond what the relay does by
//! itself.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferry_core::ErrorKind;
use ferry_store::postgres::wal::{self, Retiring};

use super::UsageError;
use crate::config::Config;
use crate::store::AnyStore;

#[derive(Debug, clap::Args)]
pub struct WalArgs {
    #[command(subcommand)]
    pub command: WalCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum WalCommand {
    /// Take the WAL slot out of use without losing a tableless event, to
    /// leave WAL mode or move to another slot: `ferry.emit` writes outbox
    /// rows from now on, and the command waits until the relay streaming
    /// from the slot has settled every tableless event written before.
    /// Then stop the relays, drop the slot and start them polling (or on
    /// the new slot).
    Retire {
        /// The slot; `relay.wal_slot` when left out.
        #[arg(long)]
        slot: Option<String>,
    },
}

pub async fn run(cfg: &Config, args: WalArgs) -> anyhow::Result<ExitCode> {
    let WalCommand::Retire { slot } = args.command;
    let slot = slot.unwrap_or_else(|| cfg.relay.wal_slot.clone());
    if !wal::valid_name(&slot) {
        return Err(UsageError(format!(
            "--slot {slot:?}: a slot name takes a-z, 0-9 and _ only, at most 63 bytes"
        ))
        .into());
    }
    #[cfg_attr(not(feature = "sqlite"), allow(irrefutable_let_patterns))]
    let AnyStore::Postgres(pg) = super::store(cfg)? else {
        return Err(UsageError("ferry wal: WAL streaming needs a postgres:// database.url".into()).into());
    };
    let mut told_no_relay = false;
    // Transactions end in moments as a rule: whom the wait is for is said
    // once it has lasted, and every ten seconds after.
    let mut told_waiting = Instant::now();
    let through = wal::retire(pg.pool(), &slot, |step| match step {
        Retiring::Marked => eprintln!(
            "slot {slot} marked not ready: ferry.emit writes outbox rows from now on; \
             waiting for transactions that may still emit for it"
        ),
        Retiring::Waiting { pids, prepared } => {
            if told_waiting.elapsed() < Duration::from_secs(10) {
                return;
            }
            told_waiting = Instant::now();
            if !pids.is_empty() {
                eprintln!(
                    "still waiting for sessions whose transactions were open when the slot was marked (server \
                     process ids {pids:?}): end them (commit or roll back; a session idle in a transaction: \
                     SELECT pg_terminate_backend(pid)), see pg_stat_activity"
                );
            }
            if !prepared.is_empty() {
                eprintln!(
                    "still waiting for prepared transactions {prepared:?}: COMMIT PREPARED or ROLLBACK PREPARED \
                     them, see pg_prepared_xacts"
                );
            }
        }
        Retiring::Draining { behind, .. } => {
            told_no_relay = false;
            eprintln!("waiting for the relay to settle the slot: {behind} bytes of WAL to go");
        }
        // Said once per stretch, not every second.
        Retiring::NoRelay if !told_no_relay => {
            told_no_relay = true;
            eprintln!(
                "no relay streams from slot {slot}: start one in WAL mode, or the tableless events the slot \
                 holds are never delivered"
            );
        }
        Retiring::NoRelay => {}
    })
    .await
    .map_err(|e| match e.kind {
        ErrorKind::Config => anyhow::Error::from(UsageError(e.message)),
        _ => anyhow::Error::from(e),
    })?;
    println!(
        "slot {slot} is retired: the relay has settled every tableless event written for it (through WAL \
         position {through}), and ferry.emit writes outbox rows. Now stop the relays in WAL mode, drop the \
         slot (SELECT pg_drop_replication_slot('{slot}')) and start them with relay.mode = \"poll\" or another \
         relay.wal_slot. Until then, relays in WAL mode stream outbox rows through it but never take it up again."
    );
    Ok(ExitCode::SUCCESS)
}
