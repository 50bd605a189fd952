//! `ferry show EVENT_ID`: the event, its headers and payload, and per route
//! its state, every failed attempt and every operator action.

use std::process::ExitCode;

use anyhow::Context;
use ferry_core::EventId;
use ferry_store::{Admin, EventView};
use uuid::Uuid;

use crate::config::Config;

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// The event's id (a UUID, as `ferry list` prints it).
    #[arg(value_name = "EVENT_ID")]
    pub id: Uuid,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The payload is printed up to this many bytes; `--json` has all of it.
const PAYLOAD_SHOWN: usize = 4096;

pub async fn run(cfg: &Config, args: ShowArgs) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let view = store
        .show(EventId(args.id))
        .await
        .context("reading the event")?
        .ok_or_else(|| anyhow::anyhow!("no event with id {}; check the id with `ferry list`", args.id))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print!("{}", render(&view));
    }
    Ok(ExitCode::SUCCESS)
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()
}

/// Text for people; `--json` is for machines.
pub fn render(v: &EventView) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "event     {}", v.id.0);
    let _ = writeln!(out, "type      {}", v.event_type);
    let _ = writeln!(out, "key       {}", v.key.as_deref().unwrap_or("-"));
    let _ = writeln!(out, "created   {}", time(v.created_at));
    let _ = writeln!(out, "seq       {}", v.seq);
    if let Some(d) = &v.dispatch_key {
        let _ = writeln!(out, "dispatch  {d}");
    }
    let _ = writeln!(out, "headers");
    if v.headers.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (name, value) in &v.headers {
        let _ = writeln!(out, "  {name}: {value}");
    }
    let _ = writeln!(out, "payload   {} bytes, {}", v.payload_bytes, v.content_type);
    match &v.payload {
        Some(text) if text.len() <= PAYLOAD_SHOWN => {
            let _ = writeln!(out, "  {text}");
        }
        Some(text) => {
            let cut = (0..=PAYLOAD_SHOWN)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            let _ = writeln!(out, "  {}… (the rest with --json)", &text[..cut]);
        }
        None => {
            let _ = writeln!(out, "  (binary)");
        }
    }
    if v.unrouted {
        let _ = writeln!(out, "\nnot routed yet: no relay has picked it up");
    }
    for d in &v.deliveries {
        let _ = writeln!(out, "\nroute {}: {}, {} attempts", d.route, d.state, d.attempts);
        if let Some(at) = d.published_at {
            let _ = writeln!(out, "  published {}", time(at));
        }
        if let Some(at) = d.next_attempt_at {
            let _ = writeln!(out, "  next attempt {}", time(at));
        }
        if let Some(e) = &d.last_error {
            let _ = writeln!(out, "  last error: {e}");
        }
        for f in &d.failures {
            let _ = writeln!(
                out,
                "  attempt {:>2} failed {}{}: {}",
                f.attempt,
                time(f.at),
                if f.dead { " (dead)" } else { "" },
                f.error
            );
        }
        for a in &d.actions {
            let _ = writeln!(
                out,
                "  {} by {} at {} (was {}){}",
                a.action,
                a.actor,
                time(a.at),
                a.from_state,
                a.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()
            );
        }
    }
    out
}
