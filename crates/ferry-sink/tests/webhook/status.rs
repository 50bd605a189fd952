//! The status classification table, one test per row, each through the
//! receiver: it answers `/status/{code}` with that code.

use ferry_core::{ErrorKind, Sink};
use ferry_sink::webhook::WebhookOptions;
use serde_json::json;

use crate::receiver::{RETRY_DATE, Receiver};
use crate::{SECRET, expect_err, route, sink};

/// Publishes one keyed event to `/status/{code}`, plus a later event of the
/// same key, and returns both outcomes.
async fn answer(code: u16) -> (ferry_core::PublishOutcome, ferry_core::PublishOutcome) {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions::default());
    let events = [
        ferry_testkit::sink_suite::event(0, "test.item.created", Some("k"), json!({ "seq": 0 })),
        ferry_testkit::sink_suite::event(1, "test.item.created", Some("k"), json!({ "seq": 1 })),
    ];
    let mut outcomes = sink
        .publish(&route(&receiver.url(&format!("/status/{code}"))), &events)
        .await
        .into_iter();
    let first = outcomes.next().unwrap();
    let second = outcomes.next().unwrap();
    match &first {
        // A failure holds back the rest of the key; a success lets it through.
        Err(_) => expect_err(&second, ErrorKind::Transient, "held back"),
        Ok(()) => assert_eq!(second, Ok(())),
    }
    (first, second)
}

#[tokio::test]
async fn status_200_is_published() {
    assert_eq!(answer(200).await.0, Ok(()));
}

#[tokio::test]
async fn status_204_is_published() {
    assert_eq!(answer(204).await.0, Ok(()));
}

#[tokio::test]
async fn status_301_is_permanent_and_names_the_location() {
    let (outcome, _) = answer(301).await;
    expect_err(&outcome, ErrorKind::Permanent, "HTTP 301 Moved Permanently");
    // The Location may carry the receiver's token, as the destination may.
    expect_err(
        &outcome,
        ErrorKind::Permanent,
        "\"https://moved.example/hook?token=***\"",
    );
    let Err(e) = outcome else { unreachable!() };
    assert!(!e.message.contains("s3cret"), "{e}");
}

#[tokio::test]
async fn status_400_is_permanent() {
    let (outcome, _) = answer(400).await;
    expect_err(&outcome, ErrorKind::Permanent, "HTTP 400 Bad Request");
    expect_err(&outcome, ErrorKind::Permanent, "answered 400 on purpose");
}

#[tokio::test]
async fn status_404_is_permanent() {
    expect_err(&answer(404).await.0, ErrorKind::Permanent, "HTTP 404 Not Found");
}

#[tokio::test]
async fn status_408_is_transient() {
    expect_err(&answer(408).await.0, ErrorKind::Transient, "HTTP 408 Request Timeout");
}

#[tokio::test]
async fn status_410_is_permanent() {
    expect_err(&answer(410).await.0, ErrorKind::Permanent, "HTTP 410 Gone");
}

#[tokio::test]
async fn status_429_is_transient_with_the_retry_after_delay() {
    let (outcome, _) = answer(429).await;
    expect_err(&outcome, ErrorKind::Transient, "HTTP 429 Too Many Requests");
    expect_err(&outcome, ErrorKind::Transient, "retry after 7s (Retry-After: 7)");
}

#[tokio::test]
async fn status_500_is_transient() {
    expect_err(
        &answer(500).await.0,
        ErrorKind::Transient,
        "HTTP 500 Internal Server Error",
    );
}

#[tokio::test]
async fn status_503_is_transient_with_a_retry_after_date() {
    let (outcome, _) = answer(503).await;
    expect_err(&outcome, ErrorKind::Transient, "HTTP 503 Service Unavailable");
    expect_err(&outcome, ErrorKind::Transient, &format!("(Retry-After: {RETRY_DATE})"));
    expect_err(&outcome, ErrorKind::Transient, "retry after ");
}
