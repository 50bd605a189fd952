//! `ferry demo`: Ferry end to end with no server and no configuration.
//!
//! A shop writes orders and their events to an SQLite database in the same
//! transactions; the relay delivers them to a webhook receiver in this
//! process (down for a while on purpose) and refunds also to stdout. Some
//! transactions roll back and one order is malformed. The summary checks
//! what the guarantees promise and exits non-zero if any does not hold.

mod producer;
mod receiver;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferry_core::SystemClock;
use ferry_relay::Relay;
use ferry_store::StatusReport;
use ferry_store::sqlite::SqliteStore;
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use crate::commands::{UsageError, relay_settings};
use crate::{config, sinks};
use producer::{POISON_ORDER, Produced};
use receiver::{Outage, Receiver, Seen};

/// The route names the demo's config uses.
const WEBHOOK_ROUTE: &str = "shop-webhook";
const STDOUT_ROUTE: &str = "refunds-stdout";

/// When the webhook receiver is down, counted from the first order.
const OUTAGE: Outage = Outage {
    after: Duration::from_millis(800),
    lasting: Duration::from_secs(2),
};

/// How long the demo waits, after the shop closes, for every delivery to
/// settle before it calls it a failure.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The directory for the demo's database and config file; an earlier
    /// demo's are replaced, a ferry.db or ferry.toml of anyone else's is
    /// refused.
    #[arg(long, default_value = "ferry-demo", value_name = "DIR")]
    dir: PathBuf,
    /// How many orders the shop takes.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(20..=100_000))]
    orders: u64,
    /// The pause between the shop's rounds of orders.
    #[arg(long, default_value = "25ms", value_parser = crate::duration::parse_duration)]
    pace: Duration,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let db = prepare_dir(&args.dir)?;
    let stop = CancellationToken::new();
    let receiver = Receiver::start(stop.clone())
        .await
        .context("starting the webhook receiver")?;
    let toml = config_toml(&db, receiver.addr);
    let config_path = args.dir.join("ferry.toml");
    std::fs::write(&config_path, &toml).with_context(|| format!("writing {}", config_path.display()))?;
    // The demo reads its config the way `ferry --config` does.
    let cfg = config::from_toml_str(&toml).map_err(|e| anyhow::anyhow!("the demo's own config is invalid: {e}"))?;

    let store = SqliteStore::open(&cfg.database.url)
        .await
        .context("opening the demo database")?;
    let pool = store.pool().clone();
    {
        let mut conn = pool.acquire().await?;
        ferry_store::sqlite::migrate(&mut conn)
            .await
            .context("creating the ferry tables")?;
    }
    producer::create_schema(&pool)
        .await
        .context("creating the shop's table")?;
    let status = SqliteStore::new(pool.clone());

    println!(
        "Ferry demo: a shop commits {} orders with their events to {}; the relay delivers them\n\
         to a webhook (down for {:.1}s on purpose) and refunds also to stdout.\n",
        args.orders,
        db.display(),
        OUTAGE.lasting.as_secs_f64()
    );

    let sinks = sinks::build(&cfg)?;
    let relay = Relay::new(store, SystemClock, relay_settings(&cfg), cfg.routes.clone(), sinks)
        .map_err(|e| UsageError(e.to_string()))?;
    let relay_stop = CancellationToken::new();
    let relay_task = tokio::spawn(relay.run(relay_stop.clone().cancelled_owned()));

    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{spinner} {bar:20} {pos}/{len} settled  {msg}").expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    let started = Instant::now();
    receiver.schedule(OUTAGE);

    let watch = tokio::spawn(watch(status.clone(), receiver.clone(), bar.clone(), stop.clone()));
    let produced = producer::run(&pool, args.orders, args.pace, |p| {
        // Each committed event has a webhook delivery; refunds also one to stdout.
        bar.set_length(p.committed.len() as u64 + p.refunds);
    })
    .await
    .context("the shop failed")?;
    let report = settle(&status).await;
    relay_stop.cancel();
    let relay_report = relay_task
        .await
        .context("the relay panicked")?
        .context("the relay stopped")?;
    stop.cancel();
    let _ = watch.await;
    // The last connection's close checkpoints the WAL into the file, so the
    // database left behind is one file.
    pool.close().await;
    bar.finish_and_clear();
    let report = report?;

    let verdict = Verdict::new(&produced, &receiver.seen(), &report);
    print!(
        "{}",
        verdict.render(
            &produced,
            &receiver.seen(),
            &report,
            relay_report.retried,
            started.elapsed()
        )
    );
    let dead = receiver.seen().rejected.into_iter().next();
    println!("{}", next_steps(&config_path, &db, dead.as_deref()));
    Ok(if verdict.holds() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The first line of the config the demo writes: what marks the config, and
/// a database beside it, as ones the demo may replace.
const WRITTEN_BY_DEMO: &str = "# Written by `ferry demo`.";

/// Creates `dir`, removes an earlier demo's database, returns the database
/// path (absolute, so the printed commands work from anywhere). A config or
/// database the demo did not leave, or a database a relay is running on, is
/// never replaced.
fn prepare_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("--dir: cannot create {}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("--dir: cannot resolve {}", dir.display()))?;
    // The path goes into a `sqlite://` URL, which reads these as syntax.
    if dir.to_string_lossy().contains(['?', '#', '%']) {
        return Err(UsageError(format!(
            "--dir: {} has a '?', '#' or '%' in its path, which a database URL would misread; \
             choose another directory",
            dir.display()
        ))
        .into());
    }
    let config_path = dir.join("ferry.toml");
    let config = match std::fs::read_to_string(&config_path) {
        Ok(config) => Some(config),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("--dir: reading {}", config_path.display())),
    };
    if let Some(config) = &config
        && !config.starts_with(WRITTEN_BY_DEMO)
    {
        return Err(UsageError(format!(
            "--dir: {} is not a config an earlier `ferry demo` wrote, and the demo writes its own \
             there; give the demo another --dir",
            config_path.display()
        ))
        .into());
    }
    let db = dir.join("ferry.db");
    if db.exists() {
        if config.is_none() {
            return Err(UsageError(format!(
                "--dir: {} holds a database that no earlier `ferry demo` left (no demo ferry.toml \
                 beside it); the demo replaces the database in its directory, so give it another --dir",
                dir.display()
            ))
            .into());
        }
        ensure_no_relay_on(&db)?;
    }
    for suffix in ["", "-wal", "-shm"] {
        let file = PathBuf::from(format!("{}{suffix}", db.display()));
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing the earlier demo's {}", file.display())),
        }
    }
    Ok(db)
}

/// Fails while a relay holds the database's relay lock: removing its files
/// under it would split it across two databases.
fn ensure_no_relay_on(db: &Path) -> anyhow::Result<()> {
    let lock = PathBuf::from(format!("{}.relay-lock", db.display()));
    let file = match std::fs::File::open(&lock) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", lock.display())),
    };
    match file.try_lock() {
        // Released when `file` is dropped, before the demo's relay takes it.
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::WouldBlock) => Err(UsageError(format!(
            "--dir: a relay is running on the earlier demo's database {} (it holds {}); stop it, \
             or give the demo another --dir",
            db.display(),
            lock.display()
        ))
        .into()),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", lock.display())),
    }
}

/// The demo's configuration: written beside the database, so that `ferry
/// --config <dir>/ferry.toml status` inspects what the demo left.
fn config_toml(db: &Path, receiver: std::net::SocketAddr) -> String {
    let url = format!("sqlite://{}", db.display());
    let url = toml::Value::String(url);
    format!(
        r#"{WRITTEN_BY_DEMO} Inspect the demo's database with
# `ferry --config <this file> status`.
[database]
url = {url}

[relay]
id = "demo"
lease = "5s"
backoff_base = "100ms"   # short, so the demo's outage is over quickly
backoff_max = "1s"
max_attempts = 50

[log]
level = "error"

[sinks.shop]
kind = "webhook"
timeout = "2s"

[sinks.console]
kind = "stdout"

[[routes]]
name = "{WEBHOOK_ROUTE}"
match = "shop.order.*"
sink = "shop"
destination = "http://{receiver}/hooks/{{domain}}"

[[routes]]
name = "{STDOUT_ROUTE}"
match = "shop.order.refunded"
sink = "console"
destination = "refunds"
"#
    )
}

/// Updates the progress bar from the database and the receiver until `stop`.
async fn watch(status: SqliteStore, receiver: Receiver, bar: ProgressBar, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Ok(report) = status.status().await else { continue };
        let (mut settled, mut retrying, mut dead) = (0, 0, 0);
        for r in &report.routes {
            settled += r.published + r.dead + r.cancelled;
            retrying += r.retrying;
            dead += r.dead;
        }
        bar.set_position(settled);
        let webhook = if receiver.is_down() { "DOWN (503)" } else { "up" };
        bar.set_message(format!("retrying {retrying}, dead {dead}, webhook {webhook}"));
    }
}

/// Waits until nothing is unrouted, pending or waiting for a retry.
async fn settle(status: &SqliteStore) -> anyhow::Result<StatusReport> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let report = status.status().await.context("reading the outbox status")?;
        let busy = report.unrouted > 0 || report.routes.iter().any(|r| r.pending > 0 || r.retrying > 0);
        if !busy {
            return Ok(report);
        }
        if Instant::now() > deadline {
            bail!(
                "deliveries did not settle within {}s of the last order: {} unrouted, {} pending, {} retrying",
                SETTLE_TIMEOUT.as_secs(),
                report.unrouted,
                report.routes.iter().map(|r| r.pending).sum::<u64>(),
                report.routes.iter().map(|r| r.retrying).sum::<u64>()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The guarantees, checked against what the shop committed and what the
/// receiver saw.
struct Verdict {
    /// Committed events the receiver never accepted nor refused.
    lost: Vec<String>,
    /// Rolled-back events that reached the receiver.
    leaked: Vec<String>,
    out_of_order: Vec<String>,
    stdout_published: u64,
    /// Refunds committed: each one's event goes to stdout too.
    refunds: u64,
    webhook_dead: u64,
}

impl Verdict {
    fn new(produced: &Produced, seen: &Seen, report: &StatusReport) -> Self {
        let reached: HashSet<&String> = seen.accepted.iter().chain(&seen.rejected).collect();
        let mut lost: Vec<String> = produced
            .committed
            .iter()
            .filter(|id| !reached.contains(id))
            .cloned()
            .collect();
        lost.sort();
        let mut leaked: Vec<String> = produced
            .rolled_back
            .iter()
            .filter(|id| reached.contains(id))
            .cloned()
            .collect();
        leaked.sort();
        let route = |name: &str| report.routes.iter().find(|r| r.route == name);
        Self {
            lost,
            leaked,
            out_of_order: seen.out_of_order.clone(),
            stdout_published: route(STDOUT_ROUTE).map_or(0, |r| r.published),
            refunds: produced.refunds,
            webhook_dead: route(WEBHOOK_ROUTE).map_or(0, |r| r.dead),
        }
    }

    fn holds(&self) -> bool {
        self.lost.is_empty()
            && self.leaked.is_empty()
            && self.out_of_order.is_empty()
            && self.stdout_published == self.refunds
    }

    fn render(&self, produced: &Produced, seen: &Seen, report: &StatusReport, retried: u64, took: Duration) -> String {
        use std::fmt::Write;
        let mark = |ok: bool| if ok { "ok" } else { "FAILED" };
        let committed = produced.committed.len();
        let mut out = String::new();
        let _ = writeln!(out, "\nSummary ({:.1}s)", took.as_secs_f64());
        let _ = writeln!(
            out,
            "  transactions committed     {:>6}  each an order change and its event, together",
            produced.committed_transactions
        );
        let _ = writeln!(
            out,
            "  transactions rolled back   {:>6}  their events reached no one: {} sent  [{}]",
            produced.rolled_back_transactions,
            self.leaked.len(),
            mark(self.leaked.is_empty())
        );
        let _ = writeln!(
            out,
            "  delivered to the webhook   {:>6}  of {committed} committed events, in order per key  [{}]",
            seen.accepted.len(),
            mark(self.out_of_order.is_empty())
        );
        if let (Some((p50, p99)), Some((all50, all99))) =
            (percentiles(&seen.latencies_up_ms), percentiles(&seen.latencies_ms))
        {
            let _ = writeln!(
                out,
                "  commit to webhook          p50 {}, p99 {} while it was up; p50 {}, p99 {} for all",
                millis(p50),
                millis(p99),
                millis(all50),
                millis(all99)
            );
        }
        let _ = writeln!(
            out,
            "  redelivered                {:>6}  duplicates at least once allows; receivers dedup on webhook-id",
            seen.duplicates
        );
        let _ = writeln!(
            out,
            "  printed to stdout          {:>6}  of {} refunds (route {STDOUT_ROUTE})  [{}]",
            self.stdout_published,
            self.refunds,
            mark(self.stdout_published == self.refunds)
        );
        let _ = writeln!(
            out,
            "  attempts retried           {:>6}  {} requests met the webhook down (503) and were retried",
            retried, seen.refused_while_down
        );
        let _ = writeln!(
            out,
            "  dead                       {:>6}  order {POISON_ORDER}'s event, refused for good (422)",
            self.webhook_dead
        );
        for d in &report.dead_reasons {
            let _ = writeln!(out, "      {} x{}: {}", d.route, d.count, d.reason);
        }
        let _ = writeln!(
            out,
            "  lost                       {:>6}  committed events that reached no one  [{}]",
            self.lost.len(),
            mark(self.lost.is_empty())
        );
        for problem in self.lost.iter().map(|id| format!("lost: {id}")).chain(
            self.leaked
                .iter()
                .map(|id| format!("rolled back but sent: {id}"))
                .chain(self.out_of_order.iter().map(|o| format!("out of order: {o}"))),
        ) {
            let _ = writeln!(out, "      {problem}");
        }
        if !self.holds() {
            let _ = writeln!(
                out,
                "\nA guarantee did not hold: this is a bug in Ferry; please report it with this output."
            );
        }
        out
    }
}

/// The median and the 99th percentile of `values`.
fn percentiles(values: &[f64]) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    Some((at(0.5), at(0.99)))
}

fn millis(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{:.1} s", ms / 1000.0)
    }
}

/// The commands that inspect what the demo left behind.
fn next_steps(config: &Path, db: &Path, dead: Option<&str>) -> String {
    // The binary as it was invoked, so the commands work when pasted.
    let ferry = std::env::args()
        .next()
        .filter(|a| a.contains('/'))
        .unwrap_or_else(|| "ferry".into());
    let config = config.display();
    let dead = dead.unwrap_or("<event id from the list>");
    format!(
        "\nThe database is left at {}. Look inside:\n  \
         {ferry} --config {config} status                  # per route and state\n  \
         {ferry} --config {config} list --state dead       # what is stuck, and why\n  \
         {ferry} --config {config} show {dead}   # the event and every attempt\n  \
         {ferry} --config {config} requeue {dead} --dry-run   # once the cause is fixed\n",
        db.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_the_demo_did_not_leave_is_never_removed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ferry.db"), b"an application's outbox").unwrap();
        let err = prepare_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no earlier `ferry demo` left"), "{err}");
        assert!(err.contains("another --dir"), "{err}");
        assert!(dir.path().join("ferry.db").exists());
        // Nor is one beside a config someone else wrote.
        std::fs::write(dir.path().join("ferry.toml"), "[database]\n").unwrap();
        assert!(prepare_dir(dir.path()).is_err());
        assert!(dir.path().join("ferry.db").exists());
    }

    #[test]
    fn an_earlier_demos_database_is_replaced_unless_a_relay_runs_on_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("ferry.db");
        std::fs::write(&db, b"the last demo's").unwrap();
        std::fs::write(
            dir.path().join("ferry.toml"),
            config_toml(&db, "127.0.0.1:9".parse().unwrap()),
        )
        .unwrap();
        let lock = std::fs::File::create(dir.path().join("ferry.db.relay-lock")).unwrap();
        lock.try_lock().unwrap();
        let err = prepare_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("a relay is running"), "{err}");
        assert!(db.exists());
        drop(lock);
        let expected = dir.path().canonicalize().unwrap().join("ferry.db");
        assert_eq!(prepare_dir(dir.path()).unwrap(), expected);
        assert!(!db.exists());
    }

    #[test]
    fn a_config_the_demo_did_not_write_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("ferry.toml");
        let mine = "[database]\nurl = \"postgres://app@db/app\"\n";
        std::fs::write(&config, mine).unwrap();
        let err = prepare_dir(dir.path()).unwrap_err();
        assert!(err.is::<UsageError>(), "{err}");
        let err = err.to_string();
        assert!(
            err.contains("ferry.toml is not a config an earlier `ferry demo` wrote"),
            "{err}"
        );
        assert!(err.contains("another --dir"), "{err}");
        assert_eq!(std::fs::read_to_string(&config).unwrap(), mine);
        // One the demo wrote is the demo's to replace.
        std::fs::write(
            &config,
            config_toml(&dir.path().join("ferry.db"), "127.0.0.1:9".parse().unwrap()),
        )
        .unwrap();
        prepare_dir(dir.path()).unwrap();
    }

    #[test]
    fn a_refund_missing_from_stdout_fails_the_verdict() {
        let verdict = |stdout_published| Verdict {
            lost: Vec::new(),
            leaked: Vec::new(),
            out_of_order: Vec::new(),
            stdout_published,
            refunds: 4,
            webhook_dead: 1,
        };
        assert!(verdict(4).holds());
        assert!(!verdict(3).holds());
    }

    #[test]
    fn a_directory_a_database_url_would_misread_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = prepare_dir(&dir.path().join("50%off")).unwrap_err().to_string();
        assert!(err.contains("'%'"), "{err}");
    }
}
