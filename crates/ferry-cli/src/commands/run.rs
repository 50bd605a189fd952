use std::process::ExitCode;

use anyhow::Context;
use ferry_core::{ErrorKind, SystemClock};
use ferry_relay::{Relay, RelaySettings};
use tracing::{info, warn};

use super::UsageError;
use crate::config::Config;
use crate::{sinks, telemetry};

pub async fn run(cfg: Config) -> anyhow::Result<ExitCode> {
    telemetry::init_logs(&cfg.log);
    if let Some(addr) = cfg.metrics {
        telemetry::serve_metrics(addr)?;
        info!(%addr, "serving Prometheus metrics at /metrics");
    }
    let store = super::store(&cfg)?;
    let sinks = sinks::build(&cfg)?;
    // A route to nowhere is reported before any event is lost to it.
    let mut refused = Vec::new();
    for (i, route) in cfg.routes.iter().enumerate() {
        match sinks[&route.sink].check(route).await {
            Ok(()) => info!(route = %route.name, "destination checked"),
            Err(e) if e.kind == ErrorKind::Transient => {
                warn!(route = %route.name, error = %e, "destination unreachable at start; the relay retries")
            }
            Err(e) => refused.push(format!("routes[{i}] ({}): {}", route.name, e.message)),
        }
    }
    if !refused.is_empty() {
        return Err(UsageError(format!("routes reach no destination:\n  {}", refused.join("\n  "))).into());
    }
    let settings = RelaySettings {
        id: ferry_core::RelayId(cfg.relay.id.clone()),
        batch_size: cfg.relay.batch_size,
        lease: cfg.relay.lease,
        retry: cfg.retry_policy(),
        poll_interval: cfg.relay.poll_interval,
        shutdown_timeout: cfg.relay.shutdown_timeout,
    };
    let relay =
        Relay::new(store, SystemClock, settings, cfg.routes.clone(), sinks).map_err(|e| UsageError(e.to_string()))?;
    let report = relay.run(shutdown_signal()).await.context("the relay stopped")?;
    info!(
        published = report.published,
        retried = report.retried,
        dead = report.dead,
        "bye"
    );
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
