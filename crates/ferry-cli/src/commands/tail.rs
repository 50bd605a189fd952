//! `ferry tail`: delivery outcomes as they happen (route, type, key,
//! commit-to-publish latency, outcome) until Ctrl-C.
//!
//! It polls deliveries changed since the last poll, through a cheap index
//! on the change time. A relay stamps a change before its transaction
//! commits, so each poll looks back a little and skips what it printed.

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

type Seen = (i64, String, DateTime<Utc>, AdminState);

pub async fn run(cfg: &Config, args: TailArgs) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let mut cursor = args.since.unwrap_or_else(Utc::now);
    let mut seen: HashSet<Seen> = HashSet::new();
    // Registered before the first poll, so an early Ctrl-C or SIGTERM
    // ends the tail cleanly rather than killing it.
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    loop {
        let mut from = cursor - LOOKBACK;
        let mut after: Option<(i64, String)> = None;
        loop {
            let changes = store
                .changes_since(from, after.as_ref().map(|(s, r)| (*s, r.as_str())), PAGE)
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
                Some(last) if changes.len() == PAGE => {
                    from = last.updated_at;
                    after = Some((last.seq, last.route.clone()));
                }
                _ => break,
            }
        }
        let horizon = cursor - LOOKBACK;
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
