//! `ferry tail`: delivery outcomes as they happen (route, type, key,
//! commit-to-publish latency, outcome) until Ctrl-C.
//!
//! It polls deliveries changed since the last poll, through a cheap index
//! on the change time. A relay stamps a change before its transaction
//! commits, so each poll looks back a little and skips what it printed.
//! The stamp is the relay's clock when it published, and a relay that
//! cannot reach the database keeps retrying that write, with that stamp,
//! while its lease lasts: every so often a poll looks back a lease further,
//! so such an outcome is printed late rather than never. No poll looks
//! back past where the tail starts (now, or `--since`): what changed
//! before is not the tail's to print.

use std::collections::HashSet;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use ferry_store::{Admin, AdminState, Change};
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};

use super::list::{clip, parse_time, short_age};
use crate::config::Config;
use crate::duration::parse_duration;

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    /// Only this route.
    #[arg(long)]
    pub route: Option<String>,
    /// Start this far back (an age such as 10m, or an RFC 3339 time)
    /// instead of now.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// How often to look.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How far each poll looks back for changes that committed late.
const LOOKBACK: chrono::Duration = chrono::Duration::seconds(2);
const PAGE: usize = 2000;
/// Every this many polls, one looks back as far as a relay may take to
/// write an outcome (see [`late`]), in larger pages: it reads many changes
/// to find the few it has not printed.
const SWEEP_EVERY: u32 = 20;
const SWEEP_PAGE: usize = 20_000;

/// How far back from its commit an outcome's change time can be: a relay
/// retries writing its outcomes while its lease lasts, and the sweep that
/// finds one comes up to [`SWEEP_EVERY`] polls later.
/// Bounded by a day, which no lease comes near.
fn late(lease: Duration, interval: Duration) -> chrono::Duration {
    let day = Duration::from_secs(86_400);
    let wait = lease.saturating_add(interval.saturating_mul(SWEEP_EVERY)).min(day);
    chrono::Duration::from_std(wait).expect("a day fits") + LOOKBACK
}

type Seen = (i64, String, DateTime<Utc>, AdminState);

pub async fn run(cfg: &Config, args: TailArgs) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let start = args.since.unwrap_or_else(Utc::now);
    let mut cursor = start;
    let mut seen: HashSet<Seen> = HashSet::new();
    let late = late(cfg.relay.lease, args.interval);
    // From 1, so the first poll is not a sweep: it reads from `start`.
    let mut polls = 1u32;
    // Registered before the first poll, so an early Ctrl-C or SIGTERM
    // ends the tail cleanly rather than killing it.
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    loop {
        let sweep = polls.is_multiple_of(SWEEP_EVERY);
        polls = polls.wrapping_add(1);
        let (back, page) = if sweep { (late, SWEEP_PAGE) } else { (LOOKBACK, PAGE) };
        let mut from = (cursor - back).max(start);
        let mut after: Option<(i64, String)> = None;
        loop {
            let changes = store
                .changes_since(from, after.as_ref().map(|(s, r)| (*s, r.as_str())), page)
                .await
                .context("reading delivery outcomes")?;
            for c in &changes {
                cursor = cursor.max(c.updated_at);
                let id = (c.seq, c.route.clone(), c.updated_at, c.state);
                if seen.contains(&id) || args.route.as_ref().is_some_and(|r| *r != c.route) {
                    continue;
                }
                seen.insert(id);
                let text = if args.json { line_json(c) } else { line(c) };
                // Read by `head` or a pager that quit: the reader is done,
                // and so is the tail (println! would panic, exit 101).
                match writeln!(std::io::stdout().lock(), "{text}") {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(ExitCode::SUCCESS),
                    Err(e) => return Err(e).context("writing to stdout"),
                }
            }
            // A full page goes on after its last change: many can share
            // one time, and a page that ends among them must not skip the
            // rest.
            match changes.last() {
                Some(last) if changes.len() == page => {
                    from = last.updated_at;
                    after = Some((last.seq, last.route.clone()));
                }
                _ => break,
            }
        }
        // Nothing older is read again: what was seen of it can go.
        let horizon = (cursor - late).max(start);
        seen.retain(|s| s.2 >= horizon);
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            _ = interrupt.recv() => return Ok(ExitCode::SUCCESS),
            _ = terminate.recv() => return Ok(ExitCode::SUCCESS),
        }
    }
}

fn outcome(c: &Change) -> String {
    match c.state {
        AdminState::Retrying => format!("failed (attempt {}, will retry)", c.attempts),
        AdminState::Dead => format!("dead after {} attempts", c.attempts),
        state => state.to_string(),
    }
}

fn line(c: &Change) -> String {
    let latency = c.latency_seconds().map(short_age).unwrap_or_else(|| "-".into());
    let error = match (c.state, &c.last_error) {
        (AdminState::Retrying | AdminState::Dead, Some(e)) => format!(": {}", clip(e, 80)),
        _ => String::new(),
    };
    format!(
        "{} {:<16} {:<28} {:<16} {:>7}  {}  {}{}",
        c.updated_at.format("%H:%M:%S%.3f"),
        clip(&c.route, 16),
        clip(&c.event_type, 28),
        clip(c.key.as_deref().unwrap_or("-"), 16),
        latency,
        c.event_id.0,
        outcome(c),
        error
    )
}

fn line_json(c: &Change) -> String {
    json!({
        "at": c.updated_at,
        "event_id": c.event_id,
        "route": c.route,
        "type": c.event_type,
        "key": c.key,
        "outcome": c.state,
        "attempts": c.attempts,
        "latency_seconds": c.latency_seconds(),
        "error": c.last_error,
    })
    .to_string()
}
