use std::process::ExitCode;
#[cfg(feature = "postgres")]
use std::time::Duration;

#[cfg(feature = "postgres")]
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::Config;
use crate::sinks;

#[derive(Debug, Default, Serialize)]
struct Finding {
    what: String,
    ok: bool,
    detail: String,
    /// What a passing check could not verify (bindings the broker would
    /// not show): printed as `warn`, and no failure.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    caveats: Vec<String>,
}

/// Checks what `ferry run` refuses before it connects, the database and
/// schema, then every route's destination.
pub async fn run(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let mut findings = refused_at_start(cfg);
    findings.push(check_database(cfg).await);
    // Table capture exists on PostgreSQL only.
    if !crate::store::is_sqlite(&cfg.database.url) {
        findings.extend(check_captures(cfg).await);
        #[cfg(feature = "postgres")]
        findings.extend(check_clock(cfg).await);
        #[cfg(feature = "postgres")]
        if cfg.relay.mode == crate::config::RelayMode::Wal {
            findings.extend(check_wal(cfg).await);
        } else {
            findings.extend(check_no_slot_unread(cfg).await);
        }
    }
    // Loading a config without routes is fine (migrate, status, capture
    // need none), but a relay cannot run on it.
    if cfg.routes.is_empty() {
        let caveat = format!("`ferry run` refuses this config: {}", super::NO_ROUTES);
        findings.push(Finding {
            what: "routes".into(),
            ok: true,
            detail: caveat.clone(),
            caveats: vec![caveat],
        });
    }
    let sinks = sinks::build(cfg)?;
    for (i, route) in cfg.routes.iter().enumerate() {
        let sink = &sinks[&route.sink];
        // Route, sink name and kind, and the destination as configured (a
        // template is checked only as far as the sink can without an event).
        let what = format!(
            "routes[{i}] ({}) -> sinks.{} ({}) {}",
            route.name,
            route.sink,
            sink.kind(),
            ferry_core::redact::url(&route.destination)
        );
        findings.push(match sink.check_with_caveats(route).await {
            Ok(caveats) if caveats.is_empty() => Finding {
                what,
                ok: true,
                detail: "reachable".into(),
                ..Finding::default()
            },
            Ok(caveats) => Finding {
                what,
                ok: true,
                detail: caveats.join("; "),
                caveats,
            },
            Err(e) => Finding {
                what,
                ok: false,
                detail: e.to_string(),
                ..Finding::default()
            },
        });
    }
    for sink in sinks.values() {
        sink.close().await;
    }
    findings.extend(check_unserved(cfg).await);
    let failed = findings.iter().filter(|f| !f.ok).count();
    if json {
        println!("{}", serde_json::to_string_pretty(&findings)?);
    } else {
        for f in &findings {
            let mark = match (f.ok, f.caveats.is_empty()) {
                (false, _) => "FAIL",
                (true, true) => "ok  ",
                (true, false) => "warn",
            };
            println!("{mark} {}: {}", f.what, f.detail);
        }
        if failed > 0 {
            println!("{failed} problem(s)");
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A failed finding per thing `ferry run` would refuse at start without
/// connecting anywhere, from the code `run` itself uses.
fn refused_at_start(cfg: &Config) -> Vec<Finding> {
    super::run::refusals(cfg)
        .into_iter()
        .map(|problem| {
            // Each names its setting first: `retention.archive_dir: ...`.
            let (what, detail) = problem.split_once(": ").unwrap_or(("start-up", &problem));
            Finding {
                what: what.to_owned(),
                ok: false,
                detail: detail.to_owned(),
                ..Finding::default()
            }
        })
        .collect()
}

/// A finding per route name that holds undelivered deliveries but is not in
/// the config. A database that cannot be read is a finding of its own.
async fn check_unserved(cfg: &Config) -> Vec<Finding> {
    use ferry_store::Gauges;
    let Ok(store) = super::store(cfg) else {
        return Vec::new();
    };
    let Ok(gauges) = store.gauges().await else {
        return Vec::new();
    };
    super::unserved::from_gauges(cfg, &gauges)
        .into_iter()
        .map(|u| Finding {
            what: format!("route {:?}", u.route),
            ok: false,
            detail: u.detail(),
            ..Finding::default()
        })
        .collect()
}

async fn check_database(cfg: &Config) -> Finding {
    let what = format!("database {}", ferry_core::redact::url(&cfg.database.url));
    let found = match super::store(cfg) {
        Ok(store) => store.schema_version().await.map_err(|e| {
            format!(
                "cannot read the schema version from the database ({}): {e}",
                ferry_core::redact::url(&cfg.database.url)
            )
        }),
        Err(e) => Err(format!("{e:#}")),
    };
    let (ok, detail) = match found {
        Ok((Some(v), known)) if v == known => (true, format!("schema at version {v}")),
        Ok((Some(v), known)) if v > known => (false, format!("schema version {v} is newer than this ferry ({known})")),
        Ok((Some(v), known)) => (
            false,
            format!("schema at version {v}, want {known}; run `ferry migrate`"),
        ),
        Ok((None, _)) => (false, "no ferry schema; run `ferry migrate`".into()),
        Err(detail) => (false, detail),
    };
    Finding {
        what,
        ok,
        detail,
        ..Finding::default()
    }
}

#[cfg(feature = "postgres")]
/// WAL streaming: wal_level, the role's REPLICATION grant, the publication
/// and the slot with its lag, each problem with its fix.
async fn check_wal(cfg: &Config) -> Vec<Finding> {
    use ferry_store::postgres::wal::{WalConfig, diagnose};
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return Vec::new();
    };
    let config = WalConfig {
        url: cfg.database.url.clone(),
        slot: cfg.relay.wal_slot.clone(),
        publication: cfg.relay.wal_publication.clone(),
    };
    diagnose(pg.pool(), &config, cfg.relay.wal_lag_budget)
        .await
        .into_iter()
        .map(|f| Finding {
            what: f.what,
            ok: f.ok,
            detail: f.detail,
            ..Finding::default()
        })
        .collect()
}

#[cfg(feature = "postgres")]
/// Polling: a WAL slot that `ferry.emit` still writes tableless events for
/// would have them read by nobody. Silent when there is none.
async fn check_no_slot_unread(cfg: &Config) -> Vec<Finding> {
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return Vec::new();
    };
    match ferry_store::postgres::wal::emit_slots(pg.pool(), None).await {
        Ok(slots) => slots
            .first()
            .map(|slot| Finding {
                what: format!("WAL slot {slot}"),
                ok: false,
                detail: super::run::poll_beside_slot(slot),
                ..Finding::default()
            })
            .into_iter()
            .collect(),
        // No schema, no database: already findings of their own.
        Err(_) => Vec::new(),
    }
}

/// A skew between this host's clock and the database's that `check`
/// reports as a caveat, and one it reports as a problem.
#[cfg(feature = "postgres")]
const CLOCK_CAVEAT: Duration = Duration::from_secs(1);
#[cfg(feature = "postgres")]
const CLOCK_PROBLEM: Duration = Duration::from_secs(5);
/// How long reading the database's clock may take: a database that does
/// not answer is a finding of its own already.
#[cfg(feature = "postgres")]
const CLOCK_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The database's clock against this host's, from one reading taken at an
/// unknown moment between a query's sending and its answer: assumed half
/// way, so off by at most half the round trip.
#[cfg(feature = "postgres")]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ClockSkew {
    /// The database's clock minus this host's; negative when it is behind.
    pub ahead: chrono::TimeDelta,
    /// Half the round trip: how far off `ahead` may be.
    pub within: Duration,
}

#[cfg(feature = "postgres")]
impl ClockSkew {
    /// `database` read by a query sent at `sent` (this host's clock) and
    /// answered `rtt` later.
    pub(crate) fn measure(sent: DateTime<Utc>, rtt: Duration, database: DateTime<Utc>) -> Self {
        let within = rtt / 2;
        let midpoint = sent + chrono::TimeDelta::from_std(within).unwrap_or(chrono::TimeDelta::MAX);
        ClockSkew {
            ahead: database - midpoint,
            within,
        }
    }

    fn size(&self) -> Duration {
        self.ahead.abs().to_std().unwrap_or(Duration::MAX)
    }

    fn describe(&self) -> String {
        let secs = |d: Duration| format!("{:.3}s", d.as_secs_f64());
        let way = if self.ahead < chrono::TimeDelta::zero() {
            "behind"
        } else {
            "ahead of"
        };
        format!(
            "the database's clock is {} {way} this host's (± {}, half the round trip)",
            secs(self.size()),
            secs(self.within)
        )
    }

    /// What `ferry run` logs at start: `None` within [`CLOCK_CAVEAT`].
    pub(crate) fn warning(&self) -> Option<String> {
        (self.size() > CLOCK_CAVEAT).then(|| format!("{}; {CLOCK_FIX}", self.describe()))
    }

    /// `ferry check`'s finding: a caveat above [`CLOCK_CAVEAT`], a problem
    /// above [`CLOCK_PROBLEM`].
    fn finding(&self) -> Finding {
        let what = "clocks (this host, database)".to_owned();
        let size = self.size();
        if size > CLOCK_PROBLEM {
            return Finding {
                what,
                ok: false,
                detail: format!("{}; {CLOCK_FIX}", self.describe()),
                ..Finding::default()
            };
        }
        if size > CLOCK_CAVEAT {
            let caveat = format!("{}; {CLOCK_FIX}", self.describe());
            return Finding {
                what,
                ok: true,
                detail: caveat.clone(),
                caveats: vec![caveat],
            };
        }
        Finding {
            what,
            ok: true,
            detail: self.describe(),
            ..Finding::default()
        }
    }
}

/// Why a skew matters and how to end it.
#[cfg(feature = "postgres")]
const CLOCK_FIX: &str = "the relay times retries and claims by its host's clock, while leases and `ferry cancel`'s \
                         \"due or in flight\" test go by the database's, so `ferry cancel` can cancel a delivery \
                         being published and a key can be held back after a takeover; run NTP (chrony or \
                         systemd-timesyncd) on the relay host and the database host (OPERATIONS.md, \"Clocks\")";

/// Reads the database's clock a few times on one connection and keeps the
/// reading with the shortest round trip: the first includes preparing the
/// statement. `None` when the database cannot be read in time.
#[cfg(feature = "postgres")]
async fn read_clock_skew(pool: &sqlx::PgPool) -> Option<ClockSkew> {
    let read = async {
        let mut conn = pool.acquire().await.ok()?;
        let mut best: Option<ClockSkew> = None;
        for _ in 0..3 {
            let sent = Utc::now();
            let started = std::time::Instant::now();
            let database = ferry_store::postgres::database_clock(&mut *conn).await.ok()?;
            let skew = ClockSkew::measure(sent, started.elapsed(), database);
            if best.is_none_or(|b| skew.within < b.within) {
                best = Some(skew);
            }
        }
        best
    };
    tokio::time::timeout(CLOCK_READ_TIMEOUT, read).await.ok().flatten()
}

/// At `ferry run` start: warns when this host's clock and the database's
/// differ by over a second. Silent on SQLite (one host, one clock) and
/// when the database cannot be read (the relay reports that itself).
#[cfg(feature = "postgres")]
pub(crate) async fn warn_on_clock_skew(store: &crate::store::AnyStore) {
    #[cfg_attr(not(feature = "sqlite"), allow(irrefutable_let_patterns))]
    let crate::store::AnyStore::Postgres(pg) = store else {
        return;
    };
    if let Some(warning) = read_clock_skew(pg.pool()).await.and_then(|s| s.warning()) {
        tracing::warn!("{warning}");
    }
}

/// PostgreSQL only: SQLite's clock is this host's. Nothing when the
/// database cannot be read, which is a finding of its own.
#[cfg(feature = "postgres")]
async fn check_clock(cfg: &Config) -> Option<Finding> {
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return None;
    };
    Some(read_clock_skew(pg.pool()).await?.finding())
}

/// A finding per captured table: its trigger matches the table, or is out
/// of date with the fix. A database that cannot be reached is already a
/// finding of its own.
async fn check_captures(cfg: &Config) -> Vec<Finding> {
    let Ok(mut conn) = super::connect(cfg).await else {
        return Vec::new();
    };
    match super::capture::check_findings(&mut conn).await {
        Ok(found) => found
            .into_iter()
            .map(|(what, ok, detail)| Finding {
                what,
                ok,
                detail,
                ..Finding::default()
            })
            .collect(),
        Err(e) => vec![Finding {
            what: "captured tables".into(),
            ok: false,
            detail: format!("{e:#}"),
            ..Finding::default()
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config with an archive directory that does not exist, retention
    /// `enabled` or not, and, in a binary without `otel`, a `[tracing]`
    /// section.
    fn config(archive_dir: &std::path::Path, enabled: bool) -> Config {
        let tracing = if cfg!(feature = "otel") {
            ""
        } else {
            "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"
        };
        crate::config::from_toml_str(&format!(
            "[database]\nurl = \"postgres://h/db\"\n[retention]\nenabled = {enabled}\narchive_dir = \"{}\"\n{tracing}",
            archive_dir.display()
        ))
        .unwrap()
    }

    #[cfg(feature = "postgres")]
    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn a_clock_reading_is_taken_half_way_through_the_round_trip() {
        // Sent at :00.000, answered 200 ms later, the database read :00.100:
        // the same clock.
        let sent = at("2025-01-01T00:00:00Z");
        let same = ClockSkew::measure(sent, Duration::from_millis(200), at("2025-01-01T00:00:00.100Z"));
        assert_eq!(same.ahead, chrono::TimeDelta::zero());
        assert_eq!(same.within, Duration::from_millis(100));
        assert_eq!(same.warning(), None);
        let f = same.finding();
        assert!(f.ok && f.caveats.is_empty(), "{f:?}");

        // The relay host 60 s fast: the database reads a minute earlier.
        let fast = ClockSkew::measure(sent, Duration::from_millis(20), at("2024-12-31T23:59:00.010Z"));
        assert_eq!(fast.ahead, chrono::TimeDelta::seconds(-60));
        let warning = fast.warning().unwrap();
        assert!(
            warning.starts_with("the database's clock is 60.000s behind this host's"),
            "{warning}"
        );
        assert!(
            warning.contains("run NTP") && warning.contains("the database host"),
            "{warning}"
        );
        let f = fast.finding();
        assert!(!f.ok, "{f:?}");
        assert!(f.detail.contains("60.000s behind"), "{f:?}");
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn check_reports_a_skew_over_a_second_as_a_caveat_and_over_five_as_a_problem() {
        let sent = at("2025-01-01T00:00:00Z");
        let rtt = Duration::from_millis(4);
        let read = |database: &str| ClockSkew::measure(sent, rtt, at(database));
        // Half the round trip (2 ms) corrected: exactly 1 s is no caveat.
        let one = read("2025-01-01T00:00:01.002Z");
        assert_eq!(one.ahead, chrono::TimeDelta::seconds(1));
        assert!(one.warning().is_none());
        assert!(one.finding().ok && one.finding().caveats.is_empty());

        let two = read("2025-01-01T00:00:02.002Z").finding();
        assert!(two.ok && two.caveats.len() == 1, "{two:?}");
        assert!(two.detail.contains("2.000s ahead of this host's"), "{two:?}");
        // Behind counts as ahead does.
        let behind = read("2024-12-31T23:59:57.002Z").finding();
        assert!(behind.ok && behind.caveats.len() == 1, "{behind:?}");

        assert!(read("2025-01-01T00:00:05.002Z").finding().ok, "5 s is the edge");
        let six = read("2025-01-01T00:00:06.002Z").finding();
        assert!(!six.ok && six.detail.contains("6.000s ahead"), "{six:?}");
    }

    /// Against the local server, whose clock is this host's.
    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn the_local_database_clock_agrees_with_this_host() {
        let db = ferry_testkit::pg::TestDb::create().await;
        let pool = db.pool().await;
        let skew = read_clock_skew(&pool).await.expect("the clock was read");
        let f = skew.finding();
        assert!(f.ok && f.caveats.is_empty(), "{f:?}");
        pool.close().await;
        db.drop_db().await;
    }

    /// `ferry run` refuses these before it connects anywhere; `check`
    /// passed them.
    #[test]
    fn what_run_refuses_at_start_fails_check() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let findings = refused_at_start(&config(&missing, true));
        let archive = findings
            .iter()
            .find(|f| f.what == "retention.archive_dir")
            .unwrap_or_else(|| panic!("{findings:?}"));
        assert!(!archive.ok);
        assert!(
            archive
                .detail
                .starts_with(&format!("cannot write to {}", missing.display())),
            "{archive:?}"
        );
        let tracing = findings.iter().find(|f| f.what == "tracing.otlp_endpoint");
        if cfg!(feature = "otel") {
            assert!(tracing.is_none(), "{findings:?}");
        } else {
            let tracing = tracing.unwrap_or_else(|| panic!("{findings:?}"));
            assert!(!tracing.ok && tracing.detail.contains("built without the `otel` feature"));
        }
        // With retention off, a relay writes no archive.
        let off = refused_at_start(&config(&missing, false));
        assert!(off.iter().all(|f| f.what != "retention.archive_dir"), "{off:?}");
        std::fs::create_dir(&missing).unwrap();
        let made = refused_at_start(&config(&missing, true));
        assert!(made.iter().all(|f| f.what != "retention.archive_dir"), "{made:?}");
    }
}
