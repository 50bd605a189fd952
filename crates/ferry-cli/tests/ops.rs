//! Operations end to end: a running `ferry run` scraped at `/metrics`, its
//! `/healthz` and `/readyz` through a database outage, a lost WAL slot
//! reported and replaced, background retention with its archive, and
//! `ferry purge`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_core::Event;
use ferry_store::postgres::enqueue_batch;
use ferry_testkit::pg::TestDb;
#[cfg(feature = "postgres")]
use ferry_testkit::pg_server::PgServer;
use ferry_testkit::process::dies_with_test;
use ferry_testkit::proxy::Proxy;
use serde_json::json;
use sqlx::PgPool;

const BIN: &str = env!("CARGO_BIN_EXE_ferry");
const PATIENCE: Duration = Duration::from_secs(60);

struct Ops {
    db: TestDb,
    pool: PgPool,
    dir: tempfile::TempDir,
}

impl Ops {
    async fn new() -> Ops {
        Self::on(TestDb::create().await).await
    }

    /// On `db`, whatever server that is.
    async fn on(db: TestDb) -> Ops {
        let pool = db.pool().await;
        let ops = Ops {
            db,
            pool,
            dir: tempfile::tempdir().unwrap(),
        };
        let out = ops.ferry(&ops.config(&Settings::default()), &["migrate"]);
        assert!(
            out.status.success(),
            "migrate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ops
    }

    fn config(&self, s: &Settings) -> PathBuf {
        let db_url = s.db_url.clone().unwrap_or_else(|| self.db.url().to_owned());
        let mut text = format!(
            r#"
[database]
url = "{db_url}"
max_connections = 4

[relay]
lease = "3s"
poll_interval = "1s"
{wal}

[log]
level = "warn"

[retention]
enabled = {enabled}
published_window = "1s"
dead_window = "never"
batch_size = 7
batch_pause = "0s"
interval = "1s"
{archive}
[sinks.out]
kind = "stdout"

[[routes]]
name = "all"
match = "order.**"
sink = "out"
destination = "all"
"#,
            enabled = s.retention,
            // Slot names are server-wide: one per test database.
            wal = if s.wal {
                format!("mode = \"wal\"\nwal_slot = \"{}\"", self.db.name())
            } else {
                String::new()
            },
            archive = s
                .archive_dir
                .as_ref()
                .map(|d| format!("archive_dir = \"{}\"\n", d.display()))
                .unwrap_or_default(),
        );
        if let Some(addr) = s.metrics {
            text.push_str(&format!("\n[metrics]\nlisten = \"{addr}\"\n"));
        }
        let path = self.dir.path().join(format!("ferry-{}.toml", rand::random::<u32>()));
        std::fs::write(&path, text).unwrap();
        path
    }

    fn ferry(&self, config: &Path, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("--config")
            .arg(config)
            .args(args)
            .output()
            .expect("run ferry")
    }

    fn spawn(&self, config: &Path) -> Running {
        let log = self.dir.path().join(format!("relay-{}.log", rand::random::<u32>()));
        let child = dies_with_test(
            Command::new(BIN)
                .arg("--config")
                .arg(config)
                .arg("run")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap()),
        )
        .spawn()
        .expect("spawn ferry run");
        Running { child, log }
    }

    async fn produce(&self, n: usize) {
        let events: Vec<Event> = (0..n)
            .map(|i| Event::new("order.item.created", json!({ "n": i })).key(format!("k{}", i % 10)))
            .collect();
        let mut tx = self.pool.begin().await.unwrap();
        enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
    }

    async fn events(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.events")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn published(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'published'")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

#[derive(Default)]
struct Settings {
    db_url: Option<String>,
    metrics: Option<SocketAddr>,
    retention: bool,
    archive_dir: Option<PathBuf>,
    /// WAL streaming mode, with a slot named after the test database.
    wal: bool,
}

struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// SIGTERM; the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("ferry did not exit after SIGTERM; log:\n{}", self.log());
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A plain HTTP/1.1 GET: (status, body); `None` while nothing listens.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Polls until `f` returns `Some`, or panics with `what` after `PATIENCE`.
async fn eventually<T>(what: &str, log: impl Fn() -> String, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; log:\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One sample of the Prometheus text format.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the whole exposition, failing on any line that does not parse.
fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels: {line}"));
                let labels = body
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .map(|pair| {
                        let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("bad label: {line}"));
                        (k.to_owned(), v.trim_end_matches('"').to_owned())
                    })
                    .collect();
                (name, labels)
            }
        };
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    samples
}

/// The sum over all series of `name` whose labels include `with`.
fn total(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> Option<f64> {
    let matching: Vec<&Sample> = samples
        .iter()
        .filter(|s| {
            s.name == name
                && with
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    (!matching.is_empty()).then(|| matching.iter().map(|s| s.value).sum())
}

#[tokio::test]
async fn a_running_relay_serves_metrics_health_and_readiness_and_retention_archives_what_it_deletes() {
    let ops = Ops::new().await;
    ops.produce(200).await;
    let addr = free_addr();
    let archive = ops.dir.path().join("archive");
    std::fs::create_dir(&archive).unwrap();
    let cfg = ops.config(&Settings {
        metrics: Some(addr),
        retention: true,
        archive_dir: Some(archive.clone()),
        ..Settings::default()
    });
    let relay = ops.spawn(&cfg);
    let log = || relay.log();

    assert_eq!(
        eventually("/healthz", log, async || get(addr, "/healthz")).await,
        (200, "ok\n".to_owned())
    );
    let ready = eventually("/readyz 200", log, async || {
        get(addr, "/readyz").filter(|(s, _)| *s == 200)
    })
    .await;
    let body: serde_json::Value = serde_json::from_str(&ready.1).unwrap();
    assert_eq!(body["ready"], true);
    assert_eq!(body["database"], "ok");
    assert_eq!(body["destinations"]["all"], "ok");

    // Every event published, then (after the one-second window) deleted by
    // the background job, archived first.
    let samples = eventually("200 published and retained", log, async || {
        let (status, text) = get(addr, "/metrics")?;
        assert_eq!(status, 200);
        let samples = parse_metrics(&text);
        let published = total(&samples, "ferry_deliveries_published_total", &[("route", "all")])?;
        let deleted = total(&samples, "ferry_retention_deleted_events_total", &[])?;
        (published == 200.0 && deleted == 200.0).then_some(samples)
    })
    .await;
    assert_eq!(ops.events().await, 0, "retention deleted every published event");
    assert_eq!(
        total(
            &samples,
            "ferry_deliveries_published_total",
            &[("route", "all"), ("type", "order.item.created")]
        ),
        Some(200.0)
    );
    assert_eq!(
        total(&samples, "ferry_retention_archived_events_total", &[]),
        Some(200.0)
    );
    assert_eq!(
        total(
            &samples,
            "ferry_events_enqueued_total",
            &[("type", "order.item.created")]
        ),
        Some(200.0)
    );
    assert!(total(&samples, "ferry_retention_last_success_timestamp_seconds", &[]).unwrap() > 1.7e9);
    let latency = total(&samples, "ferry_commit_to_publish_seconds_count", &[("route", "all")]);
    assert_eq!(latency, Some(200.0), "one latency sample per first-attempt publish");
    assert!(total(&samples, "ferry_commit_to_publish_seconds_bucket", &[("le", "+Inf")]).is_some());
    assert!(total(&samples, "ferry_publish_duration_seconds_bucket", &[("route", "all")]).is_some());
    assert!(total(&samples, "ferry_relay_batch_size_bucket", &[("route", "all")]).is_some());
    assert_eq!(total(&samples, "ferry_leased_partitions", &[]), Some(32.0));
    // The gauges come from the store every few seconds; once drained they
    // read zero.
    let samples = eventually("gauges at zero", log, async || {
        let samples = parse_metrics(&get(addr, "/metrics")?.1);
        let drained = total(&samples, "ferry_pending_deliveries", &[("route", "all")]) == Some(0.0)
            && total(&samples, "ferry_unrouted_events", &[]) == Some(0.0);
        drained.then_some(samples)
    })
    .await;
    for (name, value) in [
        ("ferry_oldest_pending_age_seconds", 0.0),
        ("ferry_blocked_keys", 0.0),
        ("ferry_dead_deliveries", 0.0),
        ("ferry_unrouted_events", 0.0),
        ("ferry_expired_leases", 0.0),
        ("ferry_database_up", 1.0),
        ("ferry_destination_up", 1.0),
        ("ferry_ready", 1.0),
    ] {
        assert_eq!(total(&samples, name, &[]), Some(value), "{name}");
    }
    assert!(total(&samples, "ferry_oldest_lease_age_seconds", &[]).unwrap() < 10.0);
    let read_at = total(&samples, "ferry_gauges_read_timestamp_seconds", &[]).expect("the gauges' read time");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!((now - read_at).abs() < 30.0, "read at {read_at}, now {now}");
    let text = get(addr, "/metrics").unwrap().1;
    assert!(
        text.contains("# HELP ferry_pending_deliveries "),
        "metrics carry help texts"
    );
    assert!(text.contains("# TYPE ferry_deliveries_published_total counter"));

    // The archive holds exactly the 200 events, each once.
    let files: Vec<PathBuf> = std::fs::read_dir(&archive)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!files.is_empty());
    let mut ids = std::collections::HashSet::new();
    for f in &files {
        for e in ferry_store::read_archive(f).unwrap() {
            assert!(ids.insert(e.id), "{} archived twice", e.id);
            assert_eq!(e.deliveries[0].state, "published");
        }
    }
    assert_eq!(ids.len(), 200);

    let status = relay.terminate();
    assert!(status.success(), "SIGTERM must exit 0, got {status:?}");
    assert!(get(addr, "/healthz").is_none(), "the endpoint stops with the relay");
}

/// A slot PostgreSQL invalidated while no relay ran: `ferry check` fails on
/// it, and the relay that starts next replaces it, delivers every outbox
/// row, logs the loss of the old slot's tableless events as an error and
/// counts it; with `max_slot_wal_keep_size` set, `/metrics` shows how far
/// the new slot is from the same fate, and without it an unbounded margin.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_relay_replaces_a_lost_slot_delivers_every_row_and_reports_the_loss() {
    replaces_a_lost_slot(Outage::Stopped).await;
}

/// The same with the relay paused (SIGSTOP) instead of stopped: the server
/// ends the walsender of the slot it invalidates, and the relay, resumed,
/// finds its stream gone and the slot lost.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_relay_paused_until_its_slot_is_lost_replaces_it_when_it_resumes() {
    replaces_a_lost_slot(Outage::Paused).await;
}

/// What the relay does while the server invalidates its slot.
#[cfg(feature = "postgres")]
enum Outage {
    Stopped,
    Paused,
}

#[cfg(feature = "postgres")]
async fn replaces_a_lost_slot(outage: Outage) {
    let server = PgServer::start().await;
    let ops = Ops::on(TestDb::create_on(&server.admin_url()).await).await;
    let slot = ops.db.name().to_owned();
    let addr = free_addr();
    let cfg = ops.config(&Settings {
        metrics: Some(addr),
        wal: true,
        ..Settings::default()
    });
    let relay = ops.spawn(&cfg);
    eventually(
        "streaming",
        || relay.log(),
        async || {
            ferry_store::postgres::wal::streaming(&ops.pool, &slot)
                .await
                .unwrap()
                .then_some(())
        },
    )
    .await;
    ops.produce(100).await;
    eventually(
        "100 published",
        || relay.log(),
        async || (ops.published().await == 100).then_some(()),
    )
    .await;
    let paused = match outage {
        Outage::Stopped => {
            assert!(relay.terminate().success());
            None
        }
        Outage::Paused => {
            relay.signal(libc::SIGSTOP);
            Some(relay)
        }
    };

    ops.produce(100).await;
    server.invalidate_slot(&slot).await;
    ops.produce(100).await;
    let check = ops.ferry(&cfg, &["check"]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert_eq!(check.status.code(), Some(1), "{report}");
    assert!(
        report.contains(&format!("FAIL replication slot {slot}: lost:")),
        "{report}"
    );
    let out = ops.ferry(&cfg, &["status"]);
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(status.contains(&format!("wal slot {slot}: LOST")), "{status}");
    // An alert, as `[alerts]` thresholds are: the exit code says so.
    assert_eq!(out.status.code(), Some(3), "{status}");
    assert!(status.contains(&format!("ALERT wal slot {slot} is LOST")), "{status}");

    let relay = match paused {
        None => ops.spawn(&cfg),
        Some(relay) => {
            relay.signal(libc::SIGCONT);
            relay
        }
    };
    let log = || relay.log();
    eventually("300 published", log, async || {
        (ops.published().await == 300).then_some(())
    })
    .await;
    let samples = eventually("the lag read on the new slot", log, async || {
        let samples = parse_metrics(&get(addr, "/metrics")?.1);
        total(&samples, "ferry_wal_safe_bytes", &[])
            .is_some()
            .then_some(samples)
    })
    .await;
    assert_eq!(
        total(&samples, "ferry_wal_slot_replaced_total", &[("reason", "lost")]),
        Some(1.0),
        "log:\n{}",
        relay.log()
    );
    let logged = relay.log();
    assert!(
        logged.contains("ERROR") && logged.contains("PostgreSQL invalidated the replication slot"),
        "{logged}"
    );
    let out = ops.ferry(&cfg, &["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let wal = &status["wal_slot"];
    assert_eq!(wal["wal_status"], "reserved", "{status}");
    assert!(wal["streaming_pid"].is_i64(), "{status}");
    assert_eq!(wal["ready"], true, "{status}");
    assert!(wal["safe_bytes"].is_i64(), "{status}");
    let text = String::from_utf8_lossy(&ops.ferry(&cfg, &["status"]).stdout).into_owned();
    assert!(
        text.contains(&format!("wal slot {slot}: streaming (walsender pid")) && text.contains("invalidated after"),
        "{text}"
    );
    // Without the cap the server never invalidates the slot: the margin is
    // unbounded, not the last one read while the cap was set.
    server.uncap_slots().await;
    eventually("an unbounded margin", log, async || {
        let samples = parse_metrics(&get(addr, "/metrics")?.1);
        (total(&samples, "ferry_wal_safe_bytes", &[]) == Some(f64::INFINITY)).then_some(())
    })
    .await;
    assert!(relay.terminate().success());
    ops.pool.close().await;
}

/// Two relays in WAL mode: one streams, the other stands by and tries the
/// slot again every few seconds, reading its lag each time. When the
/// streaming one hangs (SIGSTOP here), its own gauges freeze where they
/// were; the standby's must show the lag growing, so that the lag alert
/// still fires.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_standby_relay_shows_the_slot_lag_while_the_streaming_relay_hangs() {
    let ops = Ops::new().await;
    let addrs = [free_addr(), free_addr()];
    let relays = addrs.map(|addr| {
        ops.spawn(&ops.config(&Settings {
            metrics: Some(addr),
            wal: true,
            ..Settings::default()
        }))
    });
    let logs = || format!("{}\n{}", relays[0].log(), relays[1].log());
    let gauge = |relay: usize, name: &'static str| {
        let samples = get(addrs[relay], "/metrics").map(|r| parse_metrics(&r.1));
        samples.and_then(|s| total(&s, name, &[]))
    };
    let (streamer, standby) = eventually("a relay streaming", logs, async || {
        (0..2)
            .find(|&i| gauge(i, "ferry_wal_streaming") == Some(1.0))
            .map(|i| (i, 1 - i))
    })
    .await;
    relays[streamer].signal(libc::SIGSTOP);
    ops.produce(2_000).await;
    let lag = eventually("the standby showing the lag", logs, async || {
        gauge(standby, "ferry_wal_lag_bytes").filter(|&lag| lag > 100_000.0)
    })
    .await;
    relays[streamer].signal(libc::SIGCONT);
    eventually("2,000 published", logs, async || {
        (ops.published().await == 2_000).then_some(())
    })
    .await;
    let [a, b] = relays;
    assert!(a.terminate().success() && b.terminate().success(), "lag {lag}");
    ops.pool.close().await;
}

/// Leaving WAL mode: a relay polling while `ferry.emit` still writes
/// tableless events for the slot would never deliver them, so `ferry run`
/// refuses with the fix and `ferry check` fails; `ferry wal retire` (with
/// the streaming relay still running) takes the slot out of use, after
/// which polling is allowed.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn polling_is_refused_beside_a_ready_slot_until_it_is_retired() {
    let ops = Ops::new().await;
    let wal = ops.config(&Settings {
        wal: true,
        ..Settings::default()
    });
    let poll = ops.config(&Settings::default());
    let streaming = ops.spawn(&wal);
    eventually(
        "the relay streaming",
        || streaming.log(),
        async || {
            ferry_store::postgres::wal::streaming(&ops.pool, ops.db.name())
                .await
                .unwrap()
                .then_some(())
        },
    )
    .await;
    let refused = ops.ferry(&poll, &["run"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    for needle in [
        format!("WAL slot {}", ops.db.name()),
        format!("ferry wal retire --slot {}", ops.db.name()),
    ] {
        assert!(err.contains(&needle), "missing {needle:?} in: {err}");
    }
    let check = ops.ferry(&poll, &["check"]);
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(!check.status.success() && out.contains("ferry wal retire"), "{out}");

    let retired = ops.ferry(&wal, &["wal", "retire"]);
    let out = String::from_utf8_lossy(&retired.stdout);
    assert!(
        retired.status.success() && out.contains("is retired"),
        "{out}\n{}",
        String::from_utf8_lossy(&retired.stderr)
    );
    assert!(streaming.terminate().success());
    let check = ops.ferry(&poll, &["check"]);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    ops.pool.close().await;
}

/// Alerts and dashboards read `ferry_ready` from `/metrics`; it must be
/// there and current even where nothing probes `/readyz`.
#[tokio::test]
async fn ferry_ready_is_served_without_a_readiness_probe() {
    let ops = Ops::new().await;
    let addr = free_addr();
    let cfg = ops.config(&Settings {
        metrics: Some(addr),
        ..Settings::default()
    });
    let relay = ops.spawn(&cfg);
    let log = || relay.log();
    eventually("ferry_ready 1 in /metrics", log, async || {
        let samples = parse_metrics(&get(addr, "/metrics")?.1);
        (total(&samples, "ferry_ready", &[]) == Some(1.0)).then_some(())
    })
    .await;
    assert!(relay.terminate().success());
}

#[tokio::test]
async fn readyz_fails_while_the_database_is_unreachable_and_recovers() {
    let ops = Ops::new().await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).unwrap();
    let url = ops.db.url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, ops.db.url(), "the database URL must go through the proxy");
    let addr = free_addr();
    let cfg = ops.config(&Settings {
        db_url: Some(url),
        metrics: Some(addr),
        ..Settings::default()
    });
    let relay = ops.spawn(&cfg);
    let log = || relay.log();
    eventually("ready", log, async || get(addr, "/readyz").filter(|(s, _)| *s == 200)).await;

    proxy.set_refuse(true);
    proxy.cut();
    let (_, body) = eventually("/readyz 503", log, async || {
        get(addr, "/readyz").filter(|(s, _)| *s == 503)
    })
    .await;
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["ready"], false);
    assert!(body["database"].as_str().unwrap().starts_with("database"), "{body}");
    assert_eq!(get(addr, "/healthz").map(|r| r.0), Some(200), "alive, though not ready");
    let samples = parse_metrics(&get(addr, "/metrics").unwrap().1);
    assert_eq!(total(&samples, "ferry_database_up", &[]), Some(0.0));
    assert_eq!(total(&samples, "ferry_ready", &[]), Some(0.0));

    // Events committed during the outage are delivered once it ends.
    ops.produce(50).await;
    proxy.set_refuse(false);
    eventually("ready again", log, async || {
        get(addr, "/readyz").filter(|(s, _)| *s == 200)
    })
    .await;
    eventually("50 published after the outage", log, async || {
        (ops.published().await == 50).then_some(())
    })
    .await;
    assert!(relay.terminate().success());
}

#[tokio::test]
async fn purge_counts_when_dry_deletes_and_archives_when_not() {
    let ops = Ops::new().await;
    ops.produce(30).await;
    let archive = ops.dir.path().join("archive");
    std::fs::create_dir(&archive).unwrap();
    let cfg = ops.config(&Settings {
        archive_dir: Some(archive.clone()),
        ..Settings::default()
    });
    let relay = ops.spawn(&cfg);
    eventually(
        "30 published",
        || relay.log(),
        async || (ops.published().await == 30).then_some(()),
    )
    .await;
    assert!(relay.terminate().success());
    // Past the one-second window.
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let out = ops.ferry(&cfg, &["purge", "--dry-run", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["dry_run"].as_bool(), report["events"].as_u64()),
        (Some(true), Some(30))
    );
    assert_eq!(ops.events().await, 30, "a dry run deletes nothing");
    assert_eq!(std::fs::read_dir(&archive).unwrap().count(), 0, "nor archives");

    let out = ops.ferry(&cfg, &["purge"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("deleted 30 events and 30 deliveries in 5 batches; archived 30 events to "),
        "{text}"
    );
    assert_eq!(ops.events().await, 0);
    let file = std::fs::read_dir(&archive).unwrap().next().unwrap().unwrap().path();
    assert_eq!(ferry_store::read_archive(&file).unwrap().len(), 30);
}

#[tokio::test]
async fn purge_with_an_unwritable_archive_deletes_nothing_and_says_why() {
    let ops = Ops::new().await;
    ops.produce(10).await;
    let cfg = ops.config(&Settings::default());
    let relay = ops.spawn(&cfg);
    eventually(
        "10 published",
        || relay.log(),
        async || (ops.published().await == 10).then_some(()),
    )
    .await;
    assert!(relay.terminate().success());
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    // A file where the directory should be: nothing can be written there,
    // whatever the user's privileges.
    let not_a_dir = ops.dir.path().join("archive");
    std::fs::write(&not_a_dir, b"").unwrap();
    let cfg = ops.config(&Settings {
        archive_dir: Some(not_a_dir.clone()),
        ..Settings::default()
    });
    // A dry run says so too: it tells what the real run would do.
    for args in [&["purge", "--dry-run"][..], &["purge"]] {
        let out = ops.ferry(&cfg, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: a configuration problem");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("retention.archive_dir: cannot write to"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(ops.events().await, 10, "nothing deleted without its archive");
    // `ferry run` refuses to start with it, too, rather than fail hours later.
    let cfg = ops.config(&Settings {
        retention: true,
        archive_dir: Some(not_a_dir),
        ..Settings::default()
    });
    let out = ops.ferry(&cfg, &["run"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("retention.archive_dir"), "{err}");
}

#[test]
fn the_dashboard_uses_only_metrics_that_exist() {
    let dashboard = include_str!("../../../docs/grafana-dashboard.json");
    let names = include_str!("../../ferry-relay/src/metrics.rs");
    let json: serde_json::Value = serde_json::from_str(dashboard).expect("the dashboard is valid JSON");
    assert!(json["panels"].as_array().is_some_and(|p| p.len() > 10));
    let mut used = std::collections::BTreeSet::new();
    let mut rest = dashboard;
    while let Some(at) = rest.find("ferry_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        used.insert(base.to_owned());
    }
    assert!(used.len() > 20, "{used:?}");
    for name in &used {
        assert!(
            names.contains(&format!("\"{name}\"")),
            "{name} is not a metric in ferry_relay::metrics"
        );
    }
}
