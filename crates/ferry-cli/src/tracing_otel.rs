//! OpenTelemetry export for `ferry run` (feature `otel`): the relay's spans
//! go to a collector over OTLP/HTTP (protobuf).
//!
//! The exporter sends through the same reqwest as the sinks, driven by the
//! process's tokio runtime: the SDK exports from a thread of its own, which
//! has no runtime, so each request is spawned onto the runtime and awaited
//! from there. That keeps a second HTTP client and TLS stack out of the
//! binary.

use std::fmt;
use std::sync::Arc;

use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::{Layer, Registry};

use crate::config::TracingConfig;

/// Keeps the exporter alive; [`Exporting::shutdown`] flushes what is
/// buffered.
pub struct Exporting {
    provider: SdkTracerProvider,
}

impl Exporting {
    /// Sends the spans still buffered and stops the exporter. The SDK blocks
    /// while it flushes, so it runs off the async workers.
    pub async fn shutdown(self) {
        let provider = self.provider;
        match tokio::task::spawn_blocking(move || provider.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not flush the last spans to the collector"),
            Err(e) => tracing::warn!(error = %e, "the span exporter did not shut down"),
        }
    }
}

/// The `tracing` layer that turns spans into OpenTelemetry spans and exports
/// them. `max_links` bounds the links of one span: a publish span links to
/// every event of its batch, so it is the relay's batch size.
pub fn layer(
    cfg: &TracingConfig,
    max_links: usize,
) -> anyhow::Result<(Box<dyn Layer<Registry> + Send + Sync>, Exporting)> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(RuntimeClient::new()?)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(&cfg.traces_url)
        .build()
        .with_context(|| {
            format!(
                "tracing.otlp_endpoint: cannot export to {}",
                ferry_core::redact::url(&cfg.traces_url)
            )
        })?;
    // A relay's publish spans are roots; ParentBased keeps the ratio's
    // decision for anything started beneath them.
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio)));
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(sampler)
        .with_max_links_per_span(u32::try_from(max_links).unwrap_or(u32::MAX))
        .with_resource(Resource::builder().with_service_name(cfg.service_name.clone()).build())
        .build();
    let tracer = provider.tracer("ferry");
    let layer = tracing_opentelemetry::layer().with_tracer(tracer).boxed();
    Ok((layer, Exporting { provider }))
}

/// An OTLP HTTP client whose requests run on the tokio runtime it was made
/// on, whichever thread asks.
struct RuntimeClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

impl RuntimeClient {
    fn new() -> anyhow::Result<Self> {
        // Plain http only (the config refuses https), but reqwest still
        // wants a TLS configuration; it gets one with no roots.
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .context("tracing: TLS setup for the span exporter failed")?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
            // The exporter's own timeout does not reach a client it is given:
            // a collector that takes a request and never answers would stall
            // every export after it.
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .context("tracing: the span exporter's HTTP client could not be built")?;
        let runtime = tokio::runtime::Handle::try_current().context("tracing: the exporter needs a tokio runtime")?;
        Ok(Self { client, runtime })
    }
}

impl fmt::Debug for RuntimeClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeClient").finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl HttpClient for RuntimeClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let request = reqwest::Request::try_from(request)?;
            let mut response = client.execute(request).await?.error_for_status()?;
            let headers = std::mem::take(response.headers_mut());
            let mut out = Response::builder()
                .status(response.status())
                .body(response.bytes().await?)?;
            *out.headers_mut() = headers;
            Ok::<_, HttpError>(out)
        });
        sent.await?
    }
}
