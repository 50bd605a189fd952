use std::process::ExitCode;

use anyhow::Context;
use ferry_store::{Admin, StatusReport};

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
    let breaches = breaches(&report, &cfg.alerts);
    if json {
        let mut out = serde_json::to_value(&report)?;
        out["breaches"] = serde_json::to_value(&breaches)?;
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render(&report));
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

/// Tables for people; `--json` is for machines.
pub fn render(r: &StatusReport) -> String {
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
        let _ = writeln!(
            out,
            "{:<24} {:>9} {:>9} {:>9} {:>7} {:>9} {:>10} {:>8} {:>9} {:>8} {:>8}",
            s.route,
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
        let _ = writeln!(out, "\ndead by reason:");
        for d in &r.dead_reasons {
            let _ = writeln!(out, "  {:>6}  {:<20} {}", d.count, d.route, d.reason);
        }
    }
    let _ = writeln!(out, "\nrelays ({} partitions):", r.partitions);
    if r.leases.is_empty() {
        let _ = writeln!(out, "  none running");
    }
    for l in &r.leases {
        let _ = writeln!(
            out,
            "  {:<32} {:>3} partitions, heartbeat {} ago, oldest lease held {}, expires in {}{}",
            l.relay,
            l.partitions,
            age(Some(l.heartbeat_age_seconds)),
            age(l.oldest_lease_seconds),
            age(l.expires_in_seconds),
            if l.sleeping { ", idle" } else { "" }
        );
    }
    out
}
