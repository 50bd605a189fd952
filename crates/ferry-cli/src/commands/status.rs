use std::process::ExitCode;

use anyhow::Context;
use ferry_store::StatusReport;

use crate::config::Config;

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
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(ExitCode::SUCCESS)
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
        "{:<24} {:>9} {:>9} {:>7} {:>9} {:>10} {:>9} {:>8} {:>8}",
        "ROUTE", "PENDING", "RETRYING", "DEAD", "CANCELLED", "PUBLISHED", "OLDEST", "BLOCKED", "WAITING"
    );
    for s in &r.routes {
        let _ = writeln!(
            out,
            "{:<24} {:>9} {:>9} {:>7} {:>9} {:>10} {:>9} {:>8} {:>8}",
            s.route,
            s.pending,
            s.retrying,
            s.dead,
            s.cancelled,
            s.published,
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
            "  {:<32} {:>3} partitions, heartbeat {} ago, lease expires in {}{}",
            l.relay,
            l.partitions,
            age(Some(l.heartbeat_age_seconds)),
            age(l.expires_in_seconds),
            if l.sleeping { ", idle" } else { "" }
        );
    }
    out
}
