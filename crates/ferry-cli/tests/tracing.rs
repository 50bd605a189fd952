//! Tracing end to end: a producer enqueues inside a traced span, `ferry run`
//! publishes the event and exports its spans over OTLP/HTTP to a receiver in
//! this test, and the relay's publish span links back to the producer's
//! trace.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use ferry_core::Event;
use ferry_core::trace::TRACEPARENT;
use ferry_store::postgres::enqueue;
use ferry_testkit::pg::TestDb;
use ferry_testkit::process::dies_with_test;
use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_sdk::trace::SdkTracerProvider;
use prost::Message;
use serde_json::json;
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const BIN: &str = env!("CARGO_BIN_EXE_ferry");
const PATIENCE: Duration = Duration::from_secs(30);

/// What the receiver got: one decoded export request per POST.
type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// A minimal OTLP/HTTP receiver: accepts protobuf POSTs on `/v1/traces`.
async fn receiver() -> (SocketAddr, Received) {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            post(|State(received): State<Received>, body: Bytes| async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
                received.lock().unwrap().push(request);
                // An empty ExportTraceServiceResponse.
                ([("content-type", "application/x-protobuf")], Bytes::new())
            }),
        )
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, received)
}

/// Enqueues `event` inside a sampled span of the producer's own tracer and
/// returns the producer's trace id.
async fn enqueue_in_a_span(pool: &sqlx::PgPool, event: Event) -> TraceId {
    let provider = SdkTracerProvider::builder().build();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("producer"))),
    );
    // A span remembers the subscriber it was made under.
    let span = tracing::dispatcher::with_default(&dispatch, || tracing::info_span!("checkout"));
    async {
        let span = tracing::Span::current();
        let trace_id = span.context().span().span_context().trace_id();
        let mut tx = pool.begin().await.unwrap();
        enqueue(&mut tx, event).await.unwrap();
        tx.commit().await.unwrap();
        trace_id
    }
    .instrument(span)
    .with_subscriber(dispatch)
    .await
}

fn write_config(dir: &Path, db_url: &str, collector: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("ferry.toml");
    let text = format!(
        r#"
[database]
url = "{db_url}"

[relay]
lease = "3s"
poll_interval = "1s"

[log]
level = "warn"

[tracing]
otlp_endpoint = "http://{collector}"
service_name = "ferry-under-test"

[sinks.out]
kind = "stdout"

[[routes]]
name = "orders"
match = "order.**"
sink = "out"
destination = "-"
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn string_attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a str> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::StringValue(s) => Some(s.as_str()),
            _ => None,
        })
}

/// The relay's publish spans received so far, with their service name.
fn publish_spans(received: &Received) -> Vec<(String, Span)> {
    let received = received.lock().unwrap();
    let mut spans = Vec::new();
    for request in received.iter() {
        for resource_spans in &request.resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| string_attribute(&r.attributes, "service.name"))
                .unwrap_or_default()
                .to_owned();
            for scope in &resource_spans.scope_spans {
                for span in &scope.spans {
                    if span.name == "ferry.publish" {
                        spans.push((service.clone(), span.clone()));
                    }
                }
            }
        }
    }
    spans
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publish_span_links_to_the_producers_trace() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let dir = tempfile::tempdir().unwrap();
    let (collector, received) = receiver().await;
    let config = write_config(dir.path(), db.url(), collector);
    let migrate = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("migrate")
        .output()
        .unwrap();
    assert!(
        migrate.status.success(),
        "migrate: {}",
        String::from_utf8_lossy(&migrate.stderr)
    );

    let traced = Event::new("order.paid", json!({"id": 1})).key("order-1");
    let traced_id = traced.id();
    let trace_id = enqueue_in_a_span(&pool, traced).await;
    assert_ne!(trace_id, TraceId::INVALID);
    // A caller's explicit traceparent is stored as given.
    let explicit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let pinned = Event::new("order.paid", json!({"id": 2}))
        .key("order-2")
        .header(TRACEPARENT, explicit);
    let pinned_id = pinned.id();
    enqueue_in_a_span(&pool, pinned).await;
    let stored: Vec<(uuid::Uuid, serde_json::Value)> = sqlx::query_as("SELECT id, headers FROM ferry.events")
        .fetch_all(&pool)
        .await
        .unwrap();
    for (id, headers) in &stored {
        let traceparent = headers[TRACEPARENT].as_str().unwrap();
        if *id == pinned_id.0 {
            assert_eq!(traceparent, explicit);
        } else {
            assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
        }
    }

    let log = dir.path().join("relay.log");
    let _relay = Running(
        dies_with_test(
            Command::new(BIN)
                .arg("--config")
                .arg(&config)
                .arg("run")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap()),
        )
        .spawn()
        .unwrap(),
    );

    // The SDK exports in batches every few seconds; wait for both links.
    let deadline = Instant::now() + PATIENCE;
    let links = loop {
        let links: Vec<(String, Vec<u8>, String)> = publish_spans(&received)
            .into_iter()
            .flat_map(|(service, span)| {
                span.links.into_iter().map(move |link| {
                    let event_id = string_attribute(&link.attributes, "ferry.event_id")
                        .unwrap_or_default()
                        .to_owned();
                    (service.clone(), link.trace_id, event_id)
                })
            })
            .collect();
        if links.len() >= 2 {
            break links;
        }
        assert!(
            Instant::now() < deadline,
            "no publish span with both links after {PATIENCE:?}; got {links:?}; relay log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for (service, _, _) in &links {
        assert_eq!(service, "ferry-under-test");
    }
    let link_of = |event: ferry_core::EventId| {
        links
            .iter()
            .find(|(_, _, id)| *id == event.to_string())
            .map(|(_, trace, _)| trace.clone())
            .unwrap_or_else(|| panic!("no link for event {event}: {links:?}"))
    };
    assert_eq!(link_of(traced_id), trace_id.to_bytes().to_vec());
    assert_eq!(
        link_of(pinned_id),
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c")
            .unwrap()
            .to_bytes()
            .to_vec()
    );
}
