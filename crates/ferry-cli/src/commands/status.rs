use std::process::ExitCode;

use anyhow::Context;
use ferry_core::NO_ROUTE;
use ferry_store::{Admin, StatusReport};

use super::list::printable;
use super::unserved;
use crate::config::{AlertsConfig, Config};

pub async fn run(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let mut report = store.status().await.context("reading the outbox status")?;
    // Every configured route shows, with zeros before its first delivery.
    for route in &cfg.routes {
        if !report.routes.iter().any(|r| r.route == route.name) {
            report.routes.push(ferry_store::RouteStatus {
                route: route.name.clone(),
                ..Default::default()
            });
        }
    }
    report.routes.sort_by(|a, b| a.route.cmp(&b.route));
    #[allow(unused_mut)]
    let mut breaches = breaches(&report, &cfg.alerts);
    let unserved = unserved::from_status(cfg, &report);
    let configured = |route: &str| is_configured(cfg, route);
    #[cfg(feature = "postgres")]
    let slot = slot(cfg).await?;
    #[cfg(feature = "postgres")]
    if let Some(slot) = &slot {
        breaches.extend(slot_breaches(slot, cfg.relay.wal_lag_budget));
    }
    if json {
        let mut out = serde_json::to_value(&report)?;
        if let Some(routes) = out["routes"].as_array_mut() {
            for route in routes {
                let name = route["route"].as_str().unwrap_or_default().to_owned();
                route["configured"] = serde_json::to_value(configured(&name))?;
            }
        }
        out["breaches"] = serde_json::to_value(&breaches)?;
        #[cfg(feature = "postgres")]
        if let Some(slot) = &slot {
            out["wal_slot"] = serde_json::to_value(slot)?;
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render(&report, configured));
        if !unserved.is_empty() {
            println!("\nnot in the config:");
            for u in &unserved {
                println!("  {}", u.explain());
            }
        }
        #[cfg(feature = "postgres")]
        if let Some(slot) = &slot {
            println!("\n{}", render_slot(slot));
        }
        for b in &breaches {
            println!("ALERT {}", b.message);
        }
    }
    if breaches.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::from(BREACHED))
    }
}

/// In WAL mode on PostgreSQL, the state of the relay's slot.
#[cfg(feature = "postgres")]
async fn slot(cfg: &Config) -> anyhow::Result<Option<ferry_store::postgres::wal::SlotStatus>> {
    if cfg.relay.mode != crate::config::RelayMode::Wal {
        return Ok(None);
    }
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return Ok(None);
    };
    let status = ferry_store::postgres::wal::slot_status(pg.pool(), &cfg.relay.wal_slot)
        .await
        .context("reading the WAL slot's state")?;
    Ok(Some(status))
}

/// The WAL slot's own alerts: lost, about to be, or further behind than
/// `relay.wal_lag_budget_mb`. Tableless events (`ferry.emit`) wait in the
/// WAL until a relay streams them, where no outbox figure sees them: a
/// slot nobody reads is found here or not at all.
#[cfg(feature = "postgres")]
pub fn slot_breaches(s: &ferry_store::postgres::wal::SlotStatus, budget_bytes: u64) -> Vec<Breach> {
    let name = &s.slot;
    let mut out = Vec::new();
    match s.wal_status.as_deref() {
        Some("lost") => out.push(Breach {
            threshold: "relay.wal_slot",
            route: None,
            value: 1.0,
            limit: 0.0,
            message: format!(
                "wal slot {name} is LOST: tableless events it had not handed over are gone; a relay in WAL mode \
                 makes it anew (see `ferry check`)"
            ),
        }),
        Some("unreserved") => out.push(Breach {
            threshold: "relay.wal_slot",
            route: None,
            value: 1.0,
            limit: 0.0,
            message: format!(
                "wal slot {name} is past max_slot_wal_keep_size: the next checkpoint invalidates it unless a \
                 relay catches up"
            ),
        }),
        _ => {}
    }
    if let Some(behind) = s.behind_bytes.filter(|&b| b > 0 && b as u64 > budget_bytes) {
        let mb = |b: f64| b / (1024.0 * 1024.0);
        out.push(Breach {
            threshold: "relay.wal_lag_budget_mb",
            route: None,
            value: mb(behind as f64),
            limit: mb(budget_bytes as f64),
            message: format!(
                "wal slot {name} is {} behind, over relay.wal_lag_budget_mb ({}): {}",
                bytes(behind),
                bytes(budget_bytes as i64),
                if s.streaming_pid.is_some() {
                    "the relay streaming from it cannot keep up"
                } else {
                    "no relay streams from it"
                }
            ),
        });
    }
    out
}

/// One line on the slot: whether a relay streams from it, how far behind
/// it is, and how far from being invalidated.
#[cfg(feature = "postgres")]
pub fn render_slot(s: &ferry_store::postgres::wal::SlotStatus) -> String {
    let name = &s.slot;
    let Some(wal_status) = s.wal_status.as_deref() else {
        return format!("wal slot {name}: missing; a relay in WAL mode creates it (and sweeps the outbox) at start");
    };
    if wal_status == "lost" {
        return format!(
            "wal slot {name}: LOST, invalidated by PostgreSQL (max_slot_wal_keep_size); a relay in WAL mode \
             replaces it and sweeps the outbox; tableless events it had not handed over are gone"
        );
    }
    let who = match s.streaming_pid {
        Some(pid) => format!("streaming (walsender pid {pid})"),
        None => "NOT streaming: no relay reads it".to_owned(),
    };
    let sweep = if s.ready { "" } else { ", start-up sweep not done" };
    let behind = s.behind_bytes.map_or("?".to_owned(), bytes);
    let risk = match (wal_status, s.safe_bytes) {
        ("unreserved", _) => {
            "; past max_slot_wal_keep_size: the next checkpoint invalidates it unless a relay catches up".to_owned()
        }
        (_, Some(safe)) => format!("; invalidated after {} more", bytes(safe.max(0))),
        _ => String::new(),
    };
    format!("wal slot {name}: {who}{sweep}; {behind} behind{risk}")
}

/// A byte count for people: 0 B, 12.3 kB, 4.0 MB, 1.2 GB.
#[cfg(feature = "postgres")]
fn bytes(n: i64) -> String {
    let n = n as f64;
    match n {
        _ if n < 1e3 => format!("{n} B"),
        _ if n < 1e6 => format!("{:.1} kB", n / 1e3),
        _ if n < 1e9 => format!("{:.1} MB", n / 1e6),
        _ => format!("{:.1} GB", n / 1e9),
    }
}

/// Whether the config has this route: `None` for `(no route)`, which is no
/// route at all, and under a config without routes, which cannot tell.
fn is_configured(cfg: &Config, route: &str) -> Option<bool> {
    (route != NO_ROUTE && !cfg.routes.is_empty()).then(|| unserved::configured(cfg, route))
}

/// The exit code when a threshold is breached: distinct from 1 (the status
/// could not be read) and 2 (bad input), so a check can tell them apart.
pub const BREACHED: u8 = 3;

/// One threshold of `[alerts]` that the outbox is over.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Breach {
    /// The config field: `alerts.max_dead`.
    pub threshold: &'static str,
    /// The route, or none for the unrouted backlog.
    pub route: Option<String>,
    pub value: f64,
    pub limit: f64,
    pub message: String,
}

/// Every threshold breached, per route.
pub fn breaches(r: &StatusReport, alerts: &AlertsConfig) -> Vec<Breach> {
    let mut out = Vec::new();
    if let Some(max) = alerts.max_pending_age {
        let limit = max.as_secs_f64();
        let waiting = std::iter::once((None, r.oldest_unrouted_seconds))
            .chain(r.routes.iter().map(|s| (Some(&s.route), s.oldest_pending_seconds)));
        for (route, oldest) in waiting {
            if let Some(waited) = oldest.filter(|&waited| waited > limit) {
                let place = route.map_or("not yet routed".to_owned(), |r| format!("on route {r}"));
                out.push(Breach {
                    threshold: "alerts.max_pending_age",
                    route: route.cloned(),
                    value: waited,
                    limit,
                    message: format!(
                        "the oldest event {place} has waited {}, over alerts.max_pending_age ({})",
                        age(Some(waited)),
                        crate::duration::format_duration(max)
                    ),
                });
            }
        }
    }
    for s in &r.routes {
        let counts = [
            ("alerts.max_dead", alerts.max_dead, s.dead, "dead deliveries"),
            (
                "alerts.max_blocked_keys",
                alerts.max_blocked_keys,
                s.blocked.keys,
                "blocked keys",
            ),
        ];
        for (threshold, max, value, what) in counts {
            if let Some(max) = max.filter(|&max| value > max) {
                out.push(Breach {
                    threshold,
                    route: Some(s.route.clone()),
                    value: value as f64,
                    limit: max as f64,
                    message: format!("route {} has {value} {what}, over {threshold} ({max})", s.route),
                });
            }
        }
    }
    out
}

fn age(seconds: Option<f64>) -> String {
    match seconds {
        None => "-".into(),
        Some(s) if s < 1.0 => format!("{:.0}ms", s * 1000.0),
        Some(s) if s < 120.0 => format!("{s:.1}s"),
        Some(s) if s < 7200.0 => format!("{:.0}m", s / 60.0),
        Some(s) => format!("{:.1}h", s / 3600.0),
    }
}

/// Tables for people; `--json` is for machines. A route `configured` says
/// the config lacks is marked so.
pub fn render(r: &StatusReport, configured: impl Fn(&str) -> Option<bool>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "unrouted: {} (oldest {})",
        r.unrouted,
        age(r.oldest_unrouted_seconds)
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<24} {:>9} {:>9} {:>9} {:>7} {:>9} {:>10} {:>8} {:>9} {:>8} {:>8}",
        "ROUTE",
        "PENDING",
        "IN FLIGHT",
        "RETRYING",
        "DEAD",
        "CANCELLED",
        "PUBLISHED",
        "LAST 1H",
        "OLDEST",
        "BLOCKED",
        "WAITING"
    );
    for s in &r.routes {
        let route = match configured(&s.route) {
            Some(false) => format!("{} (not configured)", printable(&s.route)),
            _ => printable(&s.route).into_owned(),
        };
        let _ = writeln!(
            out,
            "{:<24} {:>9} {:>9} {:>9} {:>7} {:>9} {:>10} {:>8} {:>9} {:>8} {:>8}",
            route,
            s.pending,
            s.in_flight,
            s.retrying,
            s.dead,
            s.cancelled,
            s.published,
            s.published_last_hour,
            age(s.oldest_pending_seconds),
            s.blocked.keys,
            s.blocked.waiting
        );
    }
    if r.routes.is_empty() {
        let _ = writeln!(out, "(no deliveries yet)");
    }
    if !r.dead_reasons.is_empty() {
        // A reason is a broker's or endpoint's error text: escapes in it
        // would drive the terminal, and a line break would forge rows.
        let _ = writeln!(out, "\ndead by reason:");
        for d in &r.dead_reasons {
            let _ = writeln!(
                out,
                "  {:>6}  {:<20} {}",
                d.count,
                printable(&d.route),
                printable(&d.reason)
            );
        }
    }
    let _ = writeln!(out, "\nrelays ({} partitions):", r.partitions);
    if r.leases.is_empty() {
        let _ = writeln!(out, "  none running");
    }
    for l in &r.leases {
        let expiry = match l.expires_in_seconds {
            Some(s) if s < 0.0 => format!("expired {} ago", age(Some(-s))),
            other => format!("expires in {}", age(other)),
        };
        let _ = writeln!(
            out,
            "  {:<32} {:>3} partitions, heartbeat {} ago, oldest lease held {}, {expiry}{}",
            printable(&l.relay),
            l.partitions,
            age(Some(l.heartbeat_age_seconds)),
            age(l.oldest_lease_seconds),
            if l.sleeping { ", idle" } else { "" }
        );
    }
    out
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use ferry_store::postgres::wal::SlotStatus;

    use super::{StatusReport, bytes, render, render_slot, slot_breaches};

    fn slot(wal_status: Option<&str>, pid: Option<i32>, ready: bool, safe: Option<i64>) -> SlotStatus {
        SlotStatus {
            slot: "ferry".into(),
            wal_status: wal_status.map(str::to_owned),
            streaming_pid: pid,
            ready,
            behind_bytes: Some(2_500),
            safe_bytes: safe,
        }
    }

    /// Events emitted to the WAL wait there while no relay streams: only
    /// the slot can say so, and `ferry status` exited 0.
    #[test]
    fn a_slot_lost_at_risk_or_over_its_lag_budget_is_an_alert() {
        let fine = slot(Some("reserved"), Some(42), true, None);
        assert!(slot_breaches(&fine, 1 << 20).is_empty());
        let behind = slot_breaches(&slot(Some("reserved"), None, true, None), 1_000);
        assert_eq!(behind.len(), 1);
        assert_eq!(behind[0].threshold, "relay.wal_lag_budget_mb");
        assert!(
            behind[0].message.contains("no relay streams from it"),
            "{}",
            behind[0].message
        );
        for (status, says) in [("lost", "LOST"), ("unreserved", "invalidates it")] {
            let b = slot_breaches(&slot(Some(status), None, true, None), 1 << 20);
            assert_eq!(b.len(), 1, "{status}");
            assert!(b[0].message.contains(says), "{}", b[0].message);
        }
        let missing = SlotStatus {
            behind_bytes: None,
            ..slot(None, None, false, None)
        };
        assert!(slot_breaches(&missing, 0).is_empty(), "no slot yet");
    }

    #[test]
    fn the_slot_line_says_what_an_operator_must_act_on() {
        assert_eq!(
            render_slot(&slot(Some("reserved"), Some(42), true, None)),
            "wal slot ferry: streaming (walsender pid 42); 2.5 kB behind"
        );
        assert_eq!(
            render_slot(&slot(Some("extended"), None, false, Some(3_000_000_000))),
            "wal slot ferry: NOT streaming: no relay reads it, start-up sweep not done; 2.5 kB behind; \
             invalidated after 3.0 GB more"
        );
        let at_risk = render_slot(&slot(Some("unreserved"), None, true, Some(-5)));
        assert!(at_risk.contains("the next checkpoint invalidates it"), "{at_risk}");
        assert!(render_slot(&slot(Some("lost"), None, false, None)).contains("LOST"));
        assert!(render_slot(&slot(None, None, false, None)).contains("missing"));
    }

    /// A relay that died leaves its leases to expire: the line says how
    /// long ago they did, not a negative countdown.
    #[test]
    fn an_expired_lease_reads_as_expired() {
        let lease = |expires_in: f64| ferry_store::LeaseInfo {
            relay: "relay-a".into(),
            partitions: 3,
            heartbeat_age_seconds: 1.0,
            expires_in_seconds: Some(expires_in),
            oldest_lease_seconds: Some(60.0),
            sleeping: false,
        };
        let report = |l| StatusReport {
            unrouted: 0,
            oldest_unrouted_seconds: None,
            routes: Vec::new(),
            dead_reasons: Vec::new(),
            leases: vec![l],
            partitions: 3,
        };
        let text = render(&report(lease(-30.0)), |_| Some(true));
        assert!(text.contains("expired 30.0s ago"), "{text}");
        let text = render(&report(lease(12.0)), |_| Some(true));
        assert!(text.contains("expires in 12.0s"), "{text}");
    }

    /// A dead reason is a broker's or endpoint's error text: escapes in it
    /// would drive the terminal, and a line break would forge rows.
    #[test]
    fn a_dead_reason_prints_escaped_on_one_line() {
        let report = StatusReport {
            unrouted: 0,
            oldest_unrouted_seconds: None,
            routes: Vec::new(),
            dead_reasons: vec![ferry_store::DeadReason {
                route: "orders".into(),
                reason: "x\u{1b}[2J\nforged".into(),
                count: 2,
            }],
            leases: Vec::new(),
            partitions: 32,
        };
        let text = render(&report, |_| Some(true));
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(
            text.lines()
                .any(|l| l == "       2  orders               x\\u{1b}[2J\\nforged"),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("forged")), "{text}");
    }

    #[test]
    fn byte_counts_read_in_their_unit() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(12_345), "12.3 kB");
        assert_eq!(bytes(4_000_000), "4.0 MB");
        assert_eq!(bytes(1_250_000_000), "1.2 GB");
    }
}
