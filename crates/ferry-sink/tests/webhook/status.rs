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

/// A receiver that deduplicates on `webhook-id` answers 409 to a resend
/// of an event it is still processing (the first request outlived
/// `timeout`): retried, not dead, or the key stays blocked.
#[tokio::test]
async fn status_409_is_transient() {
    expect_err(&answer(409).await.0, ErrorKind::Transient, "HTTP 409 Conflict");
}

#[tokio::test]
async fn status_410_is_permanent() {
    expect_err(&answer(410).await.0, ErrorKind::Permanent, "HTTP 410 Gone");
}

/// RFC 8470: a receiver that will not take the request yet (425 Too
/// Early) asks for a retry; it used to be taken as a refusal for good.
#[tokio::test]
async fn status_425_is_transient() {
    expect_err(&answer(425).await.0, ErrorKind::Transient, "HTTP 425 Too Early");
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

/// A receiver that answers its first request 429 with `Retry-After:
/// retry_after` and every later one 200; its URL and hit count.
async fn shedding(retry_after: &'static str) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    let app = axum::Router::new().route(
        "/shedding",
        axum::routing::post(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after", retry_after)],
                        "slow down",
                    )
                        .into_response()
                } else {
                    StatusCode::OK.into_response()
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/shedding", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, hits)
}

#[tokio::test]
async fn a_retry_after_pauses_the_whole_endpoint_not_only_its_own_event() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    let (url, hits) = shedding("2").await;
    // One request at a time, so every other event is decided after the 429.
    let sink = sink(WebhookOptions {
        concurrency: 1,
        ..WebhookOptions::default()
    });
    let events = crate::keyed(6, |seq| format!("k{seq}"));
    let outcomes = sink.publish(&route(&url), &events).await;
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the receiver was asked to be left alone"
    );
    let (paused, refused): (Vec<_>, Vec<_>) = outcomes
        .iter()
        .map(|o| o.as_ref().expect_err("nothing is published in the pause"))
        .partition(|e| e.message.starts_with("not sent"));
    assert_eq!(refused.len(), 1, "{outcomes:?}");
    assert!(refused[0].message.contains("HTTP 429"), "{outcomes:?}");
    assert_eq!(paused.len(), 5, "{outcomes:?}");
    for e in paused {
        assert!(e.is_transient() && e.message.contains("asked to be left alone"), "{e}");
        // The relay's next attempt waits for the end of the pause, no longer.
        let left = e.retry_after.expect("the pause's remainder");
        assert!(left > Duration::ZERO && left <= Duration::from_secs(2), "{left:?}");
    }
    // After the pause every event goes through.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let outcomes = sink.publish(&route(&url), &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 7);
}

#[tokio::test]
async fn the_pause_lasts_no_longer_than_max_pause_and_zero_turns_it_off() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    // The relay retries no later than backoff_max (which ferry run passes
    // as max_pause): a pause past it would refuse the retries unsent.
    let (url, hits) = shedding("120").await;
    let capped = sink(WebhookOptions {
        concurrency: 1,
        max_pause: Duration::from_secs(1),
        ..WebhookOptions::default()
    });
    let events = crate::keyed(3, |seq| format!("k{seq}"));
    let outcomes = capped.publish(&route(&url), &events).await;
    let refused = outcomes[0].as_ref().expect_err("429");
    // The refused event keeps the receiver's ask; the relay caps it.
    assert_eq!(refused.retry_after, Some(Duration::from_secs(120)), "{refused}");
    for outcome in &outcomes[1..] {
        let left = outcome.as_ref().expect_err("paused").retry_after.expect("remainder");
        assert!(left <= Duration::from_secs(1), "{left:?}");
    }
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(capped.publish(&route(&url), &events).await.iter().all(Result::is_ok));
    assert_eq!(hits.load(Ordering::SeqCst), 4);

    let (url, hits) = shedding("120").await;
    let unpaused = sink(WebhookOptions {
        concurrency: 1,
        max_pause: Duration::ZERO,
        ..WebhookOptions::default()
    });
    let outcomes = unpaused.publish(&route(&url), &events).await;
    assert!(
        outcomes[0].is_err() && outcomes[1..].iter().all(Result::is_ok),
        "{outcomes:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 3);
}

/// An error response's body is quoted in the delivery's error up to
/// `error_response_bytes`, and not at all with 0: some receivers echo the
/// request, personal data included, into their error bodies.
#[tokio::test]
async fn an_error_body_is_quoted_up_to_error_response_bytes_and_zero_quotes_none() {
    let receiver = Receiver::start(&[SECRET]).await;
    let event = ferry_testkit::sink_suite::event(0, "test.item.created", None, json!({ "seq": 0 }));
    let route = route(&receiver.url("/status/400"));
    for (bytes, quoted) in [
        (256, "; response: \"answered 400 on purpose\""),
        (8, "; response: \"answered\""),
    ] {
        let sink = sink(WebhookOptions {
            error_response_bytes: bytes,
            ..WebhookOptions::default()
        });
        let outcome = sink.publish(&route, std::slice::from_ref(&event)).await.remove(0);
        expect_err(&outcome, ErrorKind::Permanent, quoted);
    }
    let sink = sink(WebhookOptions {
        error_response_bytes: 0,
        ..WebhookOptions::default()
    });
    let outcome = sink.publish(&route, std::slice::from_ref(&event)).await.remove(0);
    expect_err(&outcome, ErrorKind::Permanent, "HTTP 400");
    let message = outcome.unwrap_err().message;
    assert!(
        !message.contains("response:") && !message.contains("on purpose"),
        "{message}"
    );
}
