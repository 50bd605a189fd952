use std::net::SocketAddr;

use anyhow::Context;
use metrics_exporter_prometheus::PrometheusHandle;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{LogConfig, LogFormat};

/// Logs go to stderr so that stdout stays clean for the stdout sink and
/// `--json` output. `RUST_LOG` overrides the configured level.
pub fn init_logs(cfg: &LogConfig) {
    init_logs_with(cfg, None);
}

/// [`init_logs`] beside a span exporter. The log level filters the log
/// lines only: the exporter gets every span at info and above, so that
/// `level = "warn"` does not also switch tracing off.
pub fn init_logs_with(cfg: &LogConfig, spans: Option<Box<dyn Layer<Registry> + Send + Sync>>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let lines = match cfg.format {
        LogFormat::Text => lines.with_filter(filter).boxed(),
        LogFormat::Json => lines.json().flatten_event(true).with_filter(filter).boxed(),
    };
    let spans = spans.map(|layer| layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    let _ = tracing_subscriber::registry().with(spans).with(lines).try_init();
}

/// Installs the Prometheus recorder; [`crate::health::serve`] then serves
/// its text at `/metrics` beside the health probes. Durations get histogram
/// buckets (not summaries) so that dashboards can aggregate across relays.
pub fn install_metrics(addr: SocketAddr) -> anyhow::Result<PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: [f64; 14] = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    const BATCH: [f64; 10] = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ferry_relay::metrics::BATCH_SIZE.into()), &BATCH))
        .and_then(|b| b.install_recorder())
        .with_context(|| format!("metrics.listen: cannot set up metrics for {addr}"))?;
    ferry_relay::metrics::describe();
    Ok(handle)
}
