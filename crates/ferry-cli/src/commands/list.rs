//! `ferry list`: deliveries by state, route, type, key, time and error, a
//! page at a time. Its filter flags are shared by `requeue` and `cancel`.

use std::borrow::Cow;
use std::process::ExitCode;

use anyhow::Context;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, Glob};
use ferry_store::{Admin, AdminState, Cursor, DeliverySummary, Filter, ListPage, Page};
use uuid::Uuid;

use crate::config::Config;

/// Which deliveries a command is about. Every flag narrows the selection.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FilterArgs {
    /// Only deliveries in this state: pending, retrying, dead, cancelled or
    /// published (repeat the flag for several).
    #[arg(long = "state", value_name = "STATE")]
    pub states: Vec<AdminState>,
    /// Only deliveries of this route (`(no route)` for unroutable events).
    #[arg(long)]
    pub route: Option<String>,
    /// Only events whose type matches this glob: `order.*`, `order.**`.
    #[arg(long = "type", value_name = "GLOB", value_parser = parse_glob)]
    pub type_glob: Option<Glob>,
    /// Only events with this key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only events created at or after this time: RFC 3339
    /// (`2026-05-01T12:00:00Z`) or an age (`2h`, `30m`).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Only events created before this time (RFC 3339 or an age).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Only deliveries whose last error contains this text (any case).
    #[arg(long, value_name = "TEXT", value_parser = parse_error_text)]
    pub error: Option<String>,
}

impl FilterArgs {
    /// The filter, or what is wrong with the options: a window that ends
    /// before it starts matches nothing, and "no deliveries match" would
    /// tell the operator nothing needs doing.
    pub fn to_filter(&self, ids: &[Uuid]) -> anyhow::Result<Filter> {
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since >= until
        {
            return Err(super::UsageError(format!(
                "--since ({}) is not before --until ({}): no event could match; an age counts back from now, \
                 so `--since 2h --until 1h` selects the hour before the last one",
                since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ))
            .into());
        }
        Ok(Filter {
            ids: ids.iter().copied().map(EventId).collect(),
            states: self.states.clone(),
            route: self.route.clone(),
            type_glob: self.type_glob.clone(),
            key: self.key.clone(),
            since: self.since,
            until: self.until,
            error: self.error.clone(),
        })
    }
}

/// Text to look for in a last error. Empty text is in every error, and in
/// none: a filter that narrows nothing, which would let `requeue --error ""`
/// act on every delivery.
fn parse_error_text(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("give some text to look for in the last error; leave --error out to match any".into());
    }
    Ok(text.to_owned())
}

fn parse_glob(text: &str) -> Result<Glob, String> {
    Glob::new(text)
}

/// An RFC 3339 time, or an age such as `2h` meaning that long ago.
pub fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    match crate::duration::parse_duration(text) {
        Ok(age) => chrono::Duration::from_std(age)
            .map(|age| Utc::now() - age)
            .map_err(|_| format!("{text:?} is too long ago")),
        Err(_) => Err(format!(
            "{text:?} is not a time; write it like 2026-05-01T12:00:00Z, or as an age like 2h or 30m"
        )),
    }
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Deliveries per page.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,
    /// Start after this cursor: the `next` a previous page printed.
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<Cursor>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cfg: &Config, args: ListArgs) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let page = Page {
        after: args.after,
        limit: args.limit as usize,
    };
    let listed = store
        .list(&args.filter.to_filter(&[])?, &page)
        .await
        .context("listing deliveries")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
    } else {
        print!("{}", render(&listed));
    }
    Ok(ExitCode::SUCCESS)
}

/// Seconds or larger units, short: for table cells.
pub fn short_age(seconds: f64) -> String {
    match seconds {
        s if s < 1.0 => format!("{:.0}ms", s * 1000.0),
        s if s < 120.0 => format!("{s:.1}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s if s < 172_800.0 => format!("{:.1}h", s / 3600.0),
        s => format!("{:.1}d", s / 86_400.0),
    }
}

/// `text` for a line of text output. Keys, types and error texts are
/// anyone's text: a newline in one would split its row and could forge
/// others (in the list an operator confirms a requeue from), and an escape
/// sequence could rewrite the terminal. So control characters, and the
/// marks that reorder text (bidirectional overrides), are shown escaped,
/// as Rust writes them (`\n`, `\u{1b}`). `--json` keeps the text as it is.
pub fn printable(text: &str) -> Cow<'_, str> {
    fn hidden(c: char) -> bool {
        c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    }
    if !text.chars().any(hidden) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// [`printable`] `text` cut to `max` characters, marking the cut.
pub fn clip(text: &str, max: usize) -> String {
    let text = printable(text);
    if text.chars().count() <= max {
        return text.into_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn row(d: &DeliverySummary, now: DateTime<Utc>) -> String {
    let age = (now - d.created_at).num_milliseconds().max(0) as f64 / 1000.0;
    format!(
        "{:<36}  {:<16} {:<10} {:>3} {:>7}  {:<28} {:<16} {}",
        d.event_id.0,
        clip(&d.route, 16),
        // Display of the state ignores width; pad the string.
        d.state.to_string(),
        d.attempts,
        short_age(age),
        clip(&d.event_type, 28),
        clip(d.key.as_deref().unwrap_or("-"), 16),
        clip(d.last_error.as_deref().unwrap_or(""), 60)
    )
}

/// Tables for people; `--json` is for machines.
pub fn render(page: &ListPage) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if page.deliveries.is_empty() {
        let _ = writeln!(out, "no deliveries match");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<36}  {:<16} {:<10} {:>3} {:>7}  {:<28} {:<16} LAST ERROR",
        "EVENT", "ROUTE", "STATE", "TRY", "AGE", "TYPE", "KEY"
    );
    let now = Utc::now();
    for d in &page.deliveries {
        let _ = writeln!(out, "{}", row(d, now));
    }
    if let Some(next) = &page.next {
        // A route name can hold what a shell would split or expand:
        // `(no route)` does.
        let next = super::shell_quote(&next.to_string());
        let _ = writeln!(out, "\nmore: ferry list ... --after {next}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_ages_and_errors_say_how() {
        let t = parse_time("2026-05-01T12:00:00Z").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-05-01T12:00:00+00:00");
        let ago = Utc::now() - parse_time("2h").unwrap();
        assert!((ago.num_seconds() - 7200).abs() < 60);
        assert!(parse_time("yesterday").unwrap_err().contains("2026-05-01T12:00:00Z"));
    }

    #[test]
    fn the_next_page_hint_is_one_shell_word() {
        let page = |route: &str| ListPage {
            deliveries: vec![DeliverySummary {
                event_id: EventId::new(),
                seq: 7,
                event_type: "order.created".into(),
                key: None,
                route: route.into(),
                state: AdminState::Dead,
                attempts: 1,
                created_at: Utc::now(),
                updated_at: Utc::now(),
                next_attempt_at: None,
                last_error: None,
                published_at: None,
            }],
            next: Some(Cursor {
                seq: 7,
                route: route.into(),
            }),
        };
        assert!(render(&page("orders")).ends_with("--after 7:orders\n"));
        assert!(render(&page("(no route)")).ends_with("--after '7:(no route)'\n"));
    }

    #[test]
    fn long_cells_are_clipped_visibly() {
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("abc", 4), "abc");
    }

    /// A key is any text up to its length limit: a newline in it split its
    /// row in two, the second looking like a delivery of its own, and an
    /// escape sequence reached the terminal.
    #[test]
    fn control_characters_in_cells_are_escaped_so_a_row_stays_one_line() {
        assert_eq!(printable("order-7"), "order-7");
        assert_eq!(
            printable("k\n0190\r\t\u{1b}[2J\u{7f}\u{202e}"),
            r"k\n0190\r\t\u{1b}[2J\u{7f}\u{202e}"
        );
        assert_eq!(clip("a\u{1b}[31mred", 8), r"a\u{1b}…");
        let forged = "k\n01900000-0000-7000-8000-000000000000  orders           dead";
        let page = ListPage {
            deliveries: vec![DeliverySummary {
                event_id: EventId::new(),
                seq: 7,
                event_type: "order.\u{1b}[2Jcreated".into(),
                key: Some(forged.into()),
                route: "orders".into(),
                state: AdminState::Dead,
                attempts: 1,
                created_at: Utc::now(),
                updated_at: Utc::now(),
                next_attempt_at: None,
                last_error: Some("refused\nby the broker".into()),
                published_at: None,
            }],
            next: None,
        };
        let text = render(&page);
        assert_eq!(text.lines().count(), 2, "a header and one row: {text}");
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(text.contains(r"order.\u{1b}[2Jcre"), "{text}");
        assert!(
            text.contains(r"k\n01900000-000…") && text.contains(r"refused\nby the broker"),
            "{text}"
        );
    }
}
