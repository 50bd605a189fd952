//! `ferry requeue`: dead or cancelled deliveries (published ones with
//! `--include-published`) go back to pending with a fresh attempt count.
//! One that would reach its destination after a later event of its key is
//! refused unless `--out-of-order` says to send it anyway.
//!
//! Also the machinery `cancel` shares: plan, print, confirm, apply in
//! batches with a progress bar, report. Exit codes: 0 when everything
//! selected was changed (or a filter matched nothing), 1 when some
//! deliveries were refused or a named event id matched nothing, 2 for bad
//! input, including a large change without `--yes` when no one is at a
//! terminal to confirm it.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use crate::store::AnyStore;
use anyhow::Context;
use ferry_core::{ErrorKind, StoreError};
use ferry_store::{Action, Admin, Applied, Filter, Gauges, Plan, Refusal, Target};
use serde_json::json;
use uuid::Uuid;

use super::list::{FilterArgs, clip, printable};
use super::{UsageError, unserved};
use crate::config::Config;

/// More deliveries than this ask for confirmation unless `--yes`.
pub const CONFIRM_ABOVE: usize = 10;
/// Deliveries changed per transaction: short enough never to hold the
/// relay's partition locks for long (cancel takes them). A requeue keeps
/// each key's changes in one batch, however many ([`Plan::batches`]); a
/// cancel's batches hold at most this many.
const BATCH: usize = 500;

#[derive(Debug, clap::Args)]
pub struct RequeueArgs {
    /// Event ids; all their deliveries, narrowed by the filter flags.
    #[arg(value_name = "EVENT_ID")]
    pub ids: Vec<Uuid>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Also deliver published deliveries again.
    #[arg(long)]
    pub include_published: bool,
    /// Also requeue deliveries that would reach their destination after a
    /// later event of their key (published since, or maybe being published
    /// now), breaking the key's order for them. Asks for confirmation
    /// (or --yes).
    #[arg(long)]
    pub out_of_order: bool,
    #[command(flatten)]
    pub change: ChangeArgs,
}

/// How a change is carried out.
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeArgs {
    /// Print what would change, and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Change more than a few deliveries without asking.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cfg: &Config, args: RequeueArgs) -> anyhow::Result<ExitCode> {
    let action = Action::requeue(args.include_published, args.out_of_order);
    change(cfg, &action, args.filter.to_filter(&args.ids)?, &args.change).await
}

/// Who ran the command, for the admin log.
fn actor() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

pub(super) async fn change(
    cfg: &Config,
    action: &Action,
    selection: Filter,
    how: &ChangeArgs,
) -> anyhow::Result<ExitCode> {
    let verb = action.verb();
    if selection.is_everything() {
        return Err(UsageError(format!(
            "nothing selected; give event ids or a filter such as --state dead (see ferry {verb} --help)"
        ))
        .into());
    }
    let store = super::store(cfg)?;
    let requeue = action.is_requeue();
    if requeue
        && let Some(route) = &selection.route
        && !unserved::configured(cfg, route)
    {
        return Err(UsageError(not_configured(cfg, &store, route).await).into());
    }
    let mut plan = store.plan(action, &selection).await.context("selecting deliveries")?;
    if requeue {
        refuse_unserved(cfg, &mut plan);
    }
    // Ids the operator named but nothing matched: a typo, or an event not
    // routed yet (`ferry show` tells which).
    let unmatched: Vec<_> = selection
        .ids
        .iter()
        .filter(|id| {
            !plan.changes.iter().any(|t| t.event_id == **id) && !plan.refused.iter().any(|r| r.target.event_id == **id)
        })
        .collect();
    for id in &unmatched {
        eprintln!(
            "no delivery of event {} matches; check the id and filters with `ferry show {}`",
            id.0, id.0
        );
    }
    if how.dry_run {
        if how.json {
            let out = json!({
                "action": action, "dry_run": true,
                "would_change": plan.changes, "refused": plan.refused,
                "out_of_order": plan.out_of_order,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print!("{}", render_plan(verb, &plan));
        }
        // The real run's code: 1 when anything would be refused.
        if !plan.refused.is_empty() {
            eprintln!("{} deliveries would be refused (reasons above)", plan.refused.len());
        }
        return Ok(if unmatched.is_empty() && plan.refused.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    let count = plan.changes.len();
    // Breaking a key's order is confirmed however few it touches.
    if (count > CONFIRM_ABOVE || !plan.out_of_order.is_empty()) && !how.yes {
        confirm(verb, count, plan.out_of_order.len())?;
    }
    let applied = apply(&store, action, &plan.batches(action, BATCH), how.json).await?;
    let mut refused = plan.refused;
    refused.extend(applied.refused);
    if how.json {
        let out = json!({
            "action": action, "dry_run": false,
            "changed": applied.changed, "refused": refused,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render_done(verb, &applied.changed, &plan.out_of_order, &refused));
    }
    if !refused.is_empty() {
        eprintln!("{} deliveries were refused (reasons above)", refused.len());
    }
    if refused.is_empty() && unmatched.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::from(1))
    }
}

/// Why `ferry requeue --route <route>` is refused when the config has no
/// such route: what it requeued would wait for ever on a name no relay
/// running this config claims.
async fn not_configured(cfg: &Config, store: &AnyStore, route: &str) -> String {
    if cfg.routes.is_empty() {
        return format!(
            "nothing requeued: this config has no routes, so it cannot tell whether a relay delivers \
             route {route:?}; run requeue with the config the relays run (--config FILE or FERRY_CONFIG)"
        );
    }
    let names: Vec<&str> = cfg.routes.iter().map(|r| r.name.as_str()).collect();
    let waiting = match store.gauges().await {
        Ok(gauges) => unserved::from_gauges(cfg, &gauges)
            .into_iter()
            .find(|u| u.route == route),
        // The reason to refuse stands without the counts.
        Err(_) => None,
    };
    let why = match waiting {
        Some(u) => u.explain(),
        None => format!(
            "route {route:?} is not in the config, so no relay running this config would deliver what \
             is requeued. {}",
            unserved::fixes(route)
        ),
    };
    format!("nothing requeued: {why}. The config's routes: {}", names.join(", "))
}

/// A delivery requeued on a route the config does not have would wait for
/// ever: it is refused instead, as `--route` would be.
fn refuse_unserved(cfg: &Config, plan: &mut Plan) {
    let (served, stranded): (Vec<Target>, Vec<Target>) = std::mem::take(&mut plan.changes)
        .into_iter()
        .partition(|t| unserved::configured(cfg, &t.route));
    plan.changes = served;
    plan.out_of_order.retain(|o| {
        !stranded
            .iter()
            .any(|t| t.seq == o.target.seq && t.route == o.target.route)
    });
    plan.refused.extend(stranded.into_iter().map(|target| Refusal {
        reason: if cfg.routes.is_empty() {
            "this config has no routes, so it cannot tell whether a relay delivers this; run requeue \
             with the config the relays run (--config FILE or FERRY_CONFIG)"
                .to_owned()
        } else {
            format!(
                "route {:?} is not in the config: no relay running it would deliver this (`ferry \
                 check` says what to do)",
                target.route
            )
        },
        target,
    }));
}

/// "N deliveries", and how many of them break their key's order.
fn how_many(count: usize, out_of_order: usize) -> String {
    if out_of_order == 0 {
        format!("{count} deliveries")
    } else {
        format!("{count} deliveries, {out_of_order} of them out of order (after later events of their key)")
    }
}

/// Asks on the terminal; refuses when there is none to ask at.
fn confirm(verb: &str, count: usize, out_of_order: usize) -> anyhow::Result<()> {
    let what = how_many(count, out_of_order);
    if !std::io::stdin().is_terminal() {
        return Err(UsageError(format!(
            "this would {verb} {what}; pass --yes to confirm (no terminal to ask at), \
             or --dry-run to see them first"
        ))
        .into());
    }
    eprint!("{verb} {what}? [y/N] ");
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(UsageError(format!("not confirmed; nothing was changed ({verb} {what})")).into())
    }
}

/// Applies `batches`, each its own transaction, with a progress bar on a
/// terminal when there is more than one.
async fn apply(store: &AnyStore, action: &Action, batches: &[Vec<Target>], quiet: bool) -> anyhow::Result<Applied> {
    let targets: usize = batches.iter().map(Vec::len).sum();
    let bar = if !quiet && batches.len() > 1 && std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(targets as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta} left)")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_message(action.verb());
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let actor = actor();
    let mut total = Applied::default();
    for (i, batch) in batches.iter().enumerate() {
        let done = apply_batch(store, action, &actor, batch).await.with_context(|| {
            format!(
                "applying batch {} of {}; the {} deliveries before it were changed",
                i + 1,
                batches.len(),
                total.changed.len()
            )
        })?;
        bar.inc(batch.len() as u64);
        total.changed.extend(done.changed);
        total.refused.extend(done.refused);
    }
    bar.finish_and_clear();
    Ok(total)
}

/// One batch, tried again on a transient error: each batch is one
/// transaction, so a failed one changed nothing. Cancel's partition locks
/// can meet a relay's lease renewal in a deadlock, which PostgreSQL breaks
/// by failing one side. (When only the answer to its COMMIT was lost, the
/// commit applied, and the retry refuses what it changed as changed since
/// it was selected.)
async fn apply_batch(store: &AnyStore, action: &Action, actor: &str, batch: &[Target]) -> Result<Applied, StoreError> {
    let mut tries = 0;
    loop {
        match store.apply(action, actor, batch).await {
            Err(e) if e.kind == ErrorKind::Transient && tries < 3 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(200 * tries)).await;
            }
            other => return other,
        }
    }
}

/// One target, one line: its key is shown [`printable`], so a key holding a
/// newline cannot add a row to the list an operator confirms.
fn target_line(t: &Target) -> String {
    format!(
        "  {}  {:<16} {:<10} {:<28} {}",
        t.event_id.0,
        clip(&t.route, 16),
        t.state,
        clip(&t.event_type, 28),
        printable(t.key.as_deref().unwrap_or("-"))
    )
}

fn refused_lines(out: &mut String, refused: &[Refusal]) {
    use std::fmt::Write;
    if refused.is_empty() {
        return;
    }
    let _ = writeln!(out, "refused {}:", refused.len());
    for r in refused {
        let _ = writeln!(out, "{}\n      {}", target_line(&r.target), printable(&r.reason));
    }
}

/// The changed (or to be changed) targets, each out of its key's order
/// followed by why.
fn changed_lines(out: &mut String, changed: &[Target], out_of_order: &[Refusal]) {
    use std::fmt::Write;
    for t in changed {
        let _ = writeln!(out, "{}", target_line(t));
        if let Some(o) = out_of_order
            .iter()
            .find(|o| o.target.seq == t.seq && o.target.route == t.route)
        {
            let _ = writeln!(out, "      sent anyway (--out-of-order): {}", printable(&o.reason));
        }
    }
}

fn render_plan(verb: &str, plan: &Plan) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if plan.changes.is_empty() && plan.refused.is_empty() {
        let _ = writeln!(out, "no deliveries match");
        return out;
    }
    let _ = writeln!(
        out,
        "would {verb} {} (dry run: nothing changed):",
        how_many(plan.changes.len(), plan.out_of_order.len())
    );
    changed_lines(&mut out, &plan.changes, &plan.out_of_order);
    refused_lines(&mut out, &plan.refused);
    out
}

fn render_done(verb: &str, changed: &[Target], out_of_order: &[Refusal], refused: &[Refusal]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if changed.is_empty() && refused.is_empty() {
        let _ = writeln!(out, "no deliveries match");
        return out;
    }
    let done = if verb == "cancel" { "cancelled" } else { "requeued" };
    let sent: Vec<Refusal> = out_of_order
        .iter()
        .filter(|o| {
            changed
                .iter()
                .any(|t| t.seq == o.target.seq && t.route == o.target.route)
        })
        .cloned()
        .collect();
    let _ = writeln!(out, "{done} {}", how_many(changed.len(), sent.len()));
    changed_lines(&mut out, changed, &sent);
    refused_lines(&mut out, refused);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::EventId;
    use ferry_store::AdminState;

    fn target(seq: i64, key: &str) -> Target {
        Target {
            event_id: EventId::new(),
            seq,
            route: "orders".into(),
            event_type: "order.created".into(),
            key: Some(key.into()),
            state: AdminState::Dead,
        }
    }

    /// The dry run's list is what an operator confirms: a key with a
    /// newline (keys are only length-checked) made one delivery read as
    /// two, the second forged, and an escape sequence reached the terminal.
    #[test]
    fn a_key_with_a_newline_or_an_escape_stays_on_its_row() {
        let forged = "k\n  01900000-0000-7000-8000-000000000000  orders           dead";
        let plan = Plan {
            changes: vec![target(7, forged), target(8, "red\u{1b}[31m")],
            ..Plan::default()
        };
        let text = render_plan("requeue", &plan);
        assert_eq!(text.lines().count(), 3, "a heading and two rows: {text}");
        assert!(
            text.contains(r"k\n  01900000") && text.contains(r"red\u{1b}[31m"),
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text:?}");
    }

    /// What goes out of its key's order is said in the dry run, the
    /// confirmation and the report.
    #[test]
    fn out_of_order_targets_are_marked() {
        let late = target(7, "k");
        let reason = "out of order: a later event of its key was published on this route since".to_string();
        let plan = Plan {
            changes: vec![late.clone(), target(8, "k")],
            out_of_order: vec![Refusal {
                target: late.clone(),
                reason: reason.clone(),
            }],
            ..Plan::default()
        };
        let text = render_plan("requeue", &plan);
        assert!(
            text.starts_with("would requeue 2 deliveries, 1 of them out of order (after later events of their key)"),
            "{text}"
        );
        assert_eq!(
            text.matches("sent anyway (--out-of-order): out of order").count(),
            1,
            "{text}"
        );
        let done = render_done("requeue", &plan.changes, &plan.out_of_order, &[]);
        assert!(
            done.starts_with("requeued 2 deliveries, 1 of them out of order"),
            "{done}"
        );
    }
}
