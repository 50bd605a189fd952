use std::net::SocketAddr;

use anyhow::Context;
use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Logs go to stderr so that stdout stays clean for the stdout sink and
/// `--json` output. `RUST_LOG` overrides the configured level.
pub fn init_logs(cfg: &LogConfig) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cfg.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Serves Prometheus text at `http://addr/metrics`.
pub fn serve_metrics(addr: SocketAddr) -> anyhow::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .with_context(|| format!("metrics.listen: cannot serve metrics on {addr}"))
}
