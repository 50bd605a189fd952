//! The `otel` feature: `enqueue` (and PostgreSQL's `emit`) writes the
//! producer's span into the event's `traceparent` and `tracestate` headers,
//! on both stores, and keeps one the producer set itself.

use std::future::Future;

use ferry_core::trace::TRACEPARENT;
use ferry_core::{Event, Headers};
use ferry_store::{postgres, sqlite};
use ferry_testkit::pg::TestDb;
use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde_json::json;
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const EXPLICIT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Runs `write` inside a sampled span and returns the span's trace id.
async fn in_a_span(write: impl Future<Output = ()>) -> TraceId {
    let provider = SdkTracerProvider::builder().build();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("producer"))),
    );
    let span = tracing::dispatcher::with_default(&dispatch, || tracing::info_span!("checkout"));
    let trace_id = span.context().span().span_context().trace_id();
    assert_ne!(trace_id, TraceId::INVALID);
    write.instrument(span).with_subscriber(dispatch).await;
    trace_id
}

fn events() -> Vec<Event> {
    vec![
        Event::new("order.paid", json!({"n": 1})).key("a"),
        Event::new("order.paid", json!({"n": 2}))
            .key("b")
            .header(TRACEPARENT, EXPLICIT),
    ]
}

/// The first event carries the span's trace, the second its own.
fn assert_traced(trace_id: TraceId, stored: &[Headers]) {
    assert_eq!(stored.len(), 2);
    let traceparent = &stored[0][TRACEPARENT];
    assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
    assert_eq!(stored[1][TRACEPARENT], EXPLICIT);
    assert_eq!(
        ferry_core::trace::span_context(&stored[0]).unwrap().trace_id(),
        trace_id
    );
}

#[tokio::test]
async fn postgres_enqueue_writes_the_current_span() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    postgres::migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let trace_id = in_a_span(async {
        let mut tx = pool.begin().await.unwrap();
        postgres::enqueue_batch(&mut tx, events()).await.unwrap();
        tx.commit().await.unwrap();
    })
    .await;
    let mut tx = pool.begin().await.unwrap();
    postgres::enqueue(&mut tx, Event::new("order.paid", json!({"n": 3})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored: Vec<sqlx::types::Json<Headers>> = sqlx::query_scalar("SELECT headers FROM ferry.events ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let stored: Vec<Headers> = stored.into_iter().map(|h| h.0).collect();
    assert_traced(trace_id, &stored[..2]);
    assert!(stored[2].is_empty(), "no span, no header: {:?}", stored[2]);
}

/// A tableless event carries the span too. Without a replication slot
/// `emit` writes an outbox row, where the headers can be read.
#[cfg(feature = "wal")]
#[tokio::test]
async fn postgres_emit_writes_the_current_span() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    postgres::migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let trace_id = in_a_span(async {
        let mut tx = pool.begin().await.unwrap();
        for event in events() {
            postgres::wal::emit(&mut tx, event).await.unwrap();
        }
        tx.commit().await.unwrap();
    })
    .await;
    let stored: Vec<sqlx::types::Json<Headers>> = sqlx::query_scalar("SELECT headers FROM ferry.events ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let stored: Vec<Headers> = stored.into_iter().map(|h| h.0).collect();
    assert_traced(trace_id, &stored);
}

#[tokio::test]
async fn sqlite_enqueue_writes_the_current_span() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.db");
    let store = sqlite::SqliteStore::open(path.to_str().unwrap()).await.unwrap();
    let pool = store.pool().clone();
    sqlite::migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let trace_id = in_a_span(async {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        sqlite::enqueue_batch(&mut tx, events()).await.unwrap();
        tx.commit().await.unwrap();
    })
    .await;
    let stored: Vec<String> = sqlx::query_scalar("SELECT headers FROM ferry_events ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let stored: Vec<Headers> = stored.iter().map(|h| serde_json::from_str(h).unwrap()).collect();
    assert_traced(trace_id, &stored);
}
