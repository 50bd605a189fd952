//! Step two for the `[tracing]` section: OpenTelemetry export, off unless an
//! endpoint is set.

use ferry_core::redact;

use super::Checker;
use super::raw::RawTracing;

/// Where `ferry run` sends its spans (OTLP over HTTP, protobuf).
#[derive(Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP traces URL: the configured base with
    /// `/v1/traces` appended, unless it already ends so.
    pub traces_url: String,
    /// The `service.name` resource attribute. Default "ferry".
    pub service_name: String,
    /// The share of publish batches traced, 0.0 to 1.0. Default 1.0.
    pub sample_ratio: f64,
}

// Config is logged at start-up: a collector URL may carry credentials.
impl std::fmt::Debug for TracingConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TracingConfig")
            .field("traces_url", &redact::url(&self.traces_url))
            .field("service_name", &self.service_name)
            .field("sample_ratio", &self.sample_ratio)
            .finish()
    }
}

const TRACES_PATH: &str = "/v1/traces";

pub(super) fn tracing(check: &mut Checker, raw: RawTracing) -> Option<TracingConfig> {
    let Some(endpoint) = raw.otlp_endpoint else {
        if raw.service_name.is_some() || raw.sample_ratio.is_some() {
            check.problem(
                "tracing.otlp_endpoint",
                "is missing, so tracing is off and the other [tracing] fields do nothing; \
                 set it (e.g. \"http://127.0.0.1:4318\") or remove the section",
            );
        }
        return None;
    };
    let endpoint = endpoint.trim().trim_end_matches('/');
    let shown = redact::url(endpoint);
    let fix = "write the collector's OTLP/HTTP address, e.g. \"http://127.0.0.1:4318\"";
    if endpoint.starts_with("https://") {
        check.problem(
            "tracing.otlp_endpoint",
            format!(
                "{shown:?} uses https, which ferry's exporter does not speak; \
                 send to a local OpenTelemetry Collector over http and let it forward over TLS"
            ),
        );
    } else if endpoint
        .strip_prefix("http://")
        .is_none_or(|host| host.is_empty() || host.starts_with('/'))
    {
        check.problem(
            "tracing.otlp_endpoint",
            format!("{shown:?} is not an http:// URL; {fix}"),
        );
    }
    let service_name = raw.service_name.unwrap_or_else(|| "ferry".to_owned());
    if service_name.trim().is_empty() {
        check.problem(
            "tracing.service_name",
            "must be non-empty; it names this process in the tracing backend",
        );
    }
    let sample_ratio = raw.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_ratio) {
        check.problem(
            "tracing.sample_ratio",
            format!("must be between 0.0 and 1.0 (the share of batches traced), got {sample_ratio}"),
        );
    }
    let traces_url = if endpoint.ends_with(TRACES_PATH) {
        endpoint.to_owned()
    } else {
        format!("{endpoint}{TRACES_PATH}")
    };
    Some(TracingConfig {
        traces_url,
        service_name,
        sample_ratio,
    })
}
