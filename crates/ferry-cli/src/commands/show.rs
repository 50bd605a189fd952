//! `ferry show EVENT_ID`: the event, its headers and payload, and per route
//! its state, every failed attempt and every operator action.

use std::process::ExitCode;

use anyhow::Context;
use ferry_core::EventId;
use ferry_store::{Admin, EventView};
use uuid::Uuid;

use super::list::printable;
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

/// A payload's lines, each indented under the `payload` heading so none
/// can pass for a line of `show`'s own, with their other control
/// characters escaped ([`printable`]).
fn payload_lines(text: &str) -> String {
    text.split('\n')
        .map(|line| format!("  {}", printable(line)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Text for people; `--json` is for machines. The event's own text (type,
/// key, headers, errors, reasons) is shown [`printable`].
pub fn render(v: &EventView) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "event     {}", v.id.0);
    let _ = writeln!(out, "type      {}", printable(&v.event_type));
    let _ = writeln!(out, "key       {}", printable(v.key.as_deref().unwrap_or("-")));
    let _ = writeln!(out, "created   {}", time(v.created_at));
    let _ = writeln!(out, "seq       {}", v.seq);
    if let Some(d) = &v.dispatch_key {
        let _ = writeln!(out, "dispatch  {}", printable(d));
    }
    let _ = writeln!(out, "headers");
    if v.headers.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (name, value) in &v.headers {
        let _ = writeln!(out, "  {}: {}", printable(name), printable(value));
    }
    let _ = writeln!(
        out,
        "payload   {} bytes, {}",
        v.payload_bytes,
        printable(&v.content_type)
    );
    match &v.payload {
        Some(text) if text.len() <= PAYLOAD_SHOWN => {
            let _ = writeln!(out, "{}", payload_lines(text));
        }
        Some(text) => {
            let cut = (0..=PAYLOAD_SHOWN)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            let _ = writeln!(out, "{}… (the rest with --json)", payload_lines(&text[..cut]));
        }
        None => {
            let _ = writeln!(out, "  (binary)");
        }
    }
    if v.unrouted {
        let _ = writeln!(out, "\nnot routed yet: no relay has picked it up");
    }
    for d in &v.deliveries {
        let _ = writeln!(
            out,
            "\nroute {}: {}, {} attempts",
            printable(&d.route),
            d.state,
            d.attempts
        );
        if let Some(at) = d.published_at {
            let _ = writeln!(out, "  published {}", time(at));
        }
        if let Some(at) = d.next_attempt_at {
            let _ = writeln!(out, "  next attempt {}", time(at));
        }
        if let Some(e) = &d.last_error {
            let _ = writeln!(out, "  last error: {}", printable(e));
        }
        for f in &d.failures {
            let _ = writeln!(
                out,
                "  attempt {:>2} failed {}{}: {}",
                f.attempt,
                time(f.at),
                if f.dead { " (dead)" } else { "" },
                printable(&f.error)
            );
        }
        for a in &d.actions {
            let _ = writeln!(
                out,
                "  {} by {} at {} (was {}){}",
                printable(&a.action),
                printable(&a.actor),
                time(a.at),
                a.from_state,
                a.reason
                    .as_deref()
                    .map(|r| format!(": {}", printable(r)))
                    .unwrap_or_default()
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event's key, headers, payload and errors are its producer's text:
    /// none of it may add a line of `show`'s own, nor reach the terminal as
    /// an escape sequence.
    #[test]
    fn the_events_text_cannot_forge_lines_or_reach_the_terminal() {
        let now = chrono::Utc::now();
        let view = EventView {
            id: EventId::new(),
            seq: 7,
            event_type: "order.created".into(),
            key: Some("k\nroute orders: published, 1 attempts".into()),
            content_type: "application/json".into(),
            headers: [("tenant".to_string(), "acme\u{1b}[2J".to_string())].into(),
            payload: Some("{\n\"a\": 1}\nroute audit: published, 1 attempts".into()),
            payload_bytes: 40,
            dispatch_key: None,
            created_at: now,
            unrouted: false,
            deliveries: vec![ferry_store::DeliveryView {
                route: "orders".into(),
                state: ferry_store::AdminState::Dead,
                attempts: 1,
                next_attempt_at: None,
                last_error: Some("refused\r\nroute x: published".into()),
                published_at: None,
                updated_at: now,
                failures: Vec::new(),
                actions: Vec::new(),
            }],
        };
        let text = render(&view);
        let sections: Vec<&str> = text.lines().filter(|l| l.starts_with("route ")).collect();
        assert_eq!(sections, ["route orders: dead, 1 attempts"], "{text}");
        assert!(text.contains(r"key       k\nroute orders"), "{text}");
        assert!(
            text.contains(r"tenant: acme\u{1b}[2J") && !text.contains('\u{1b}'),
            "{text}"
        );
        assert!(text.contains("  {\n  \"a\": 1}\n  route audit"), "{text}");
        assert!(text.contains(r"last error: refused\r\nroute x"), "{text}");
    }
}
