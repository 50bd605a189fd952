//! The webhook sink against a receiver running inside the test (axum on
//! 127.0.0.1:0) that verifies every signature with its own HMAC code.
#![cfg(feature = "webhook")]

#[path = "webhook/bound.rs"]
mod bound;
#[path = "webhook/faults.rs"]
mod faults;
#[path = "webhook/receiver.rs"]
mod receiver;
#[path = "webhook/status.rs"]
mod status;

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, Sink, StoredEvent};
use ferry_sink::webhook::{CONTENT_TYPE, WebhookOptions, WebhookSink};
use ferry_testkit::sink_suite::{self, ARRIVAL_TIMEOUT, QUIET_PERIOD, ReceivedMessage, SinkHarness, event};
use receiver::{Received, Receiver};
use serde_json::json;

/// The Standard Webhooks specification's example secret.
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// A second secret, as during a rotation.
pub const NEXT_SECRET: &str = "whsec_c2VjcmV0LW9mLWEtcm90YXRlZC1lbmRwb2ludA==";

pub fn route(destination: &str) -> Route {
    Route {
        name: "hooks".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "web".into(),
        destination: destination.into(),
        routing_key: None,
    }
}

pub fn sink(options: WebhookOptions) -> WebhookSink {
    WebhookSink::new(WebhookOptions {
        secrets: vec![SECRET.into()],
        ..options
    })
    .expect("valid options")
}

/// A URL on a port nothing listens on.
pub fn closed_port_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}/hook")
}

/// `n` JSON events of type `test.item.created`, keyed by `key(seq)`.
pub fn keyed(n: i64, key: impl Fn(i64) -> String) -> Vec<StoredEvent> {
    (0..n)
        .map(|seq| event(seq, "test.item.created", Some(&key(seq)), json!({ "seq": seq })))
        .collect()
}

/// `outcome` is an error of `kind` whose message contains `text`.
pub fn expect_err(outcome: &PublishOutcome, kind: ErrorKind, text: &str) {
    match outcome {
        Ok(()) => panic!("reported published; expected a {kind} error mentioning {text:?}"),
        Err(e) => {
            assert_eq!(e.kind, kind, "{e}");
            assert!(e.message.contains(text), "{e} should mention {text:?}");
        }
    }
}

pub fn ids(events: &[StoredEvent]) -> Vec<String> {
    events.iter().map(|e| e.id.to_string()).collect()
}

pub fn received_ids(received: &[Received]) -> Vec<String> {
    received.iter().map(|r| r.id.clone()).collect()
}

struct Harness {
    receiver: Receiver,
    missing: String,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route(&self.receiver.url("/hook"))
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route(&self.missing))
    }
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
        self.receiver
            .receive(n, timeout)
            .await
            .into_iter()
            .map(|r| {
                assert_eq!(r.signed_with, vec![true], "a bad signature on {}", r.id);
                assert!(r.fresh, "a stale timestamp on {}", r.id);
                ReceivedMessage {
                    id: r.id.clone(),
                    key: r.key(),
                    body: serde_json::to_vec(&r.json["data"]).unwrap(),
                }
            })
            .collect()
    }
}

#[tokio::test]
async fn passes_the_sink_conformance_suite() {
    let harness = Harness {
        receiver: Receiver::start(&[SECRET]).await,
        missing: closed_port_url(),
    };
    let sink = sink(WebhookOptions::default());
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
}

#[tokio::test]
async fn wire_format_is_a_signed_structured_cloudevent() {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions {
        source: "shop".into(),
        headers: [("Authorization".to_owned(), "Bearer test-token".to_owned())].into(),
        ..WebhookOptions::default()
    });
    let mut traced = event(1, "order.item.created", Some("o-1"), json!({ "n": 1 }));
    traced.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    traced.headers.insert("authorization".into(), "forged".into());
    let mut raw = event(2, "order.item.archived", None, json!(null));
    raw.payload = bytes::Bytes::from_static(b"\x00\x01plain");
    raw.content_type = "application/octet-stream".into();
    let events = [traced, raw];

    let outcomes = sink.publish(&route(&receiver.url("/hook")), &events).await;
    assert_eq!(outcomes, vec![Ok(()), Ok(())]);
    let received = receiver.receive(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(received.len(), 2);
    let by_id: HashMap<&str, &Received> = received.iter().map(|r| (r.id.as_str(), r)).collect();

    let r = by_id[events[0].id.to_string().as_str()];
    assert_eq!(r.signed_with, vec![true]);
    assert!(r.fresh);
    assert_eq!(r.headers["content-type"], CONTENT_TYPE);
    assert_eq!(r.headers["authorization"], "Bearer test-token");
    assert_eq!(r.headers["traceparent"], events[0].headers["traceparent"]);
    assert!(r.headers["user-agent"].starts_with("ferry/"), "{:?}", r.headers);
    let v = &r.json;
    assert_eq!(v["id"], events[0].id.to_string());
    assert_eq!(v["type"], "order.item.created");
    assert_eq!(v["source"], "shop");
    assert_eq!(v["subject"], "o-1");
    assert_eq!(v["specversion"], "1.0");
    assert_eq!(v["datacontenttype"], "application/json");
    assert_eq!(v["data"], json!({ "n": 1 }));
    let time = chrono::DateTime::parse_from_rfc3339(v["time"].as_str().unwrap()).unwrap();
    assert_eq!(time, events[0].created_at);

    let r = by_id[events[1].id.to_string().as_str()];
    assert_eq!(r.signed_with, vec![true]);
    assert_eq!(r.json["datacontenttype"], "application/octet-stream");
    assert_eq!(r.json["data_base64"], "AAFwbGFpbg==");
    assert!(
        r.json.get("data").is_none() && r.json.get("subject").is_none(),
        "{}",
        r.json
    );
}

#[tokio::test]
async fn rotation_sends_one_signature_per_secret() {
    let receiver = Receiver::start(&[SECRET, NEXT_SECRET]).await;
    let sink = WebhookSink::new(WebhookOptions {
        secrets: vec![SECRET.into(), NEXT_SECRET.into()],
        ..WebhookOptions::default()
    })
    .unwrap();
    let events = keyed(3, |seq| format!("k{seq}"));
    assert!(
        sink.publish(&route(&receiver.url("/hook")), &events)
            .await
            .iter()
            .all(Result::is_ok)
    );
    for r in receiver.receive(3, ARRIVAL_TIMEOUT).await {
        assert_eq!(r.signed_with, vec![true, true], "{:?}", r.headers["webhook-signature"]);
        assert_eq!(r.headers["webhook-signature"].split(' ').count(), 2);
    }

    // A receiver that already moved to the new secret accepts the request.
    let moved = Receiver::start(&[NEXT_SECRET]).await;
    let unsigned = WebhookSink::new(WebhookOptions::default()).unwrap();
    let events = keyed(1, |_| "k".into());
    assert!(sink.publish(&route(&moved.url("/hook")), &events).await[0].is_ok());
    assert!(unsigned.publish(&route(&moved.url("/hook")), &events).await[0].is_ok());
    let received = moved.receive(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(received[0].signed_with, vec![true]);
    assert_eq!(received[1].signed_with, vec![false], "an unsigned request verified");
    assert!(!received[1].headers.contains_key("webhook-signature"));
}

#[tokio::test]
async fn the_concurrency_limit_holds_per_endpoint() {
    let receiver = Receiver::start(&[SECRET]).await;
    let events = keyed(30, |seq| format!("k{seq}"));
    receiver.hold_first(3);
    let sink = sink(WebhookOptions {
        concurrency: 3,
        ..WebhookOptions::default()
    });
    let outcomes = sink.publish(&route(&receiver.url("/hook")), &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(receiver.receive(30, ARRIVAL_TIMEOUT).await.len(), 30);
    assert_eq!(receiver.max_in_flight().0, 3, "requests in flight at once");
}

#[tokio::test]
async fn keys_go_concurrently_and_each_key_one_at_a_time_in_order() {
    let receiver = Receiver::start(&[SECRET]).await;
    let events = keyed(200, |seq| format!("k{}", seq % 5));
    receiver.hold_first(5);
    let sink = sink(WebhookOptions::default());
    let outcomes = sink.publish(&route(&receiver.url("/hook")), &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let received = receiver.receive(200, ARRIVAL_TIMEOUT).await;
    assert_eq!(received.len(), 200);
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &received {
        if let Some(previous) = last.insert(r.key().unwrap(), r.seq()) {
            assert!(
                previous < r.seq(),
                "key {:?}: seq {} after {previous}",
                r.key(),
                r.seq()
            );
        }
    }
    assert_eq!(receiver.max_in_flight(), (5, 1), "(all keys at once, one per key)");
}

#[tokio::test]
async fn a_failed_event_holds_back_the_rest_of_its_key_only() {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions::default());
    let events = keyed(6, |seq| if seq % 2 == 0 { "a".into() } else { "b".into() });
    receiver.reject(&events[2].id.to_string());
    let outcomes = sink.publish(&route(&receiver.url("/hook")), &events).await;
    assert_eq!(outcomes[0], Ok(()));
    expect_err(&outcomes[2], ErrorKind::Transient, "HTTP 500 Internal Server Error");
    expect_err(&outcomes[2], ErrorKind::Transient, "rejected by the test");
    expect_err(&outcomes[4], ErrorKind::Transient, "held back");
    expect_err(&outcomes[4], ErrorKind::Transient, &events[2].id.to_string());
    for i in [1, 3, 5] {
        assert_eq!(outcomes[i], Ok(()), "key b, event {i}");
    }
    let received = receiver.receive(4, ARRIVAL_TIMEOUT).await;
    let mut got = received_ids(&received);
    got.sort();
    let mut want = ids(&[
        events[0].clone(),
        events[1].clone(),
        events[3].clone(),
        events[5].clone(),
    ]);
    want.sort();
    assert_eq!(got, want);
    assert!(
        receiver.receive(1, QUIET_PERIOD).await.is_empty(),
        "a held-back event was sent"
    );
}

#[tokio::test]
async fn an_oversized_body_is_refused_before_sending() {
    let receiver = Receiver::start(&[SECRET]).await;
    let to = route(&receiver.url("/hook"));
    let probe = WebhookSink::new(WebhookOptions::default()).unwrap();
    let small = event(0, "test.item.created", Some("a"), json!({ "seq": 0 }));
    // Measure the envelope through the receiver, then allow exactly that.
    assert!(probe.publish(&to, std::slice::from_ref(&small)).await[0].is_ok());
    let envelope = receiver.receive(1, ARRIVAL_TIMEOUT).await[0].body.len();
    let sink = sink(WebhookOptions {
        max_body_bytes: envelope,
        ..WebhookOptions::default()
    });
    sink.admit(&to, &small).expect("a body at the limit is admitted");
    // Same time as `small`, so the bodies differ only by the payload's byte.
    let at = |mut e: StoredEvent| {
        e.created_at = small.created_at;
        e
    };
    let big = at(event(1, "test.item.created", Some("a"), json!({ "seq": 10 })));
    let err = sink.admit(&to, &big).expect_err("one byte over the limit");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(err.message.contains("sinks.web.max_body_bytes"), "{err}");

    let events = [
        big,
        at(event(2, "test.item.created", Some("a"), json!({ "seq": 2 }))),
        at(event(3, "test.item.created", Some("b"), json!({ "seq": 3 }))),
    ];
    let outcomes = sink.publish(&to, &events).await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "too large");
    expect_err(&outcomes[1], ErrorKind::Transient, "held back");
    assert_eq!(outcomes[2], Ok(()));
    assert_eq!(
        received_ids(&receiver.receive(2, QUIET_PERIOD).await),
        ids(&events[2..])
    );
}

#[tokio::test]
async fn check_reports_reachability() {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions::default());
    // HEAD on a POST-only path answers 405, and an unknown path 404: both
    // prove a server is listening, but a 404 may mean a wrong path, which
    // `ferry check` shows on the route's line.
    let caveats = sink
        .check_with_caveats(&route(&receiver.url("/hook")))
        .await
        .expect("405 is reachable");
    assert!(caveats.is_empty(), "{caveats:?}");
    let caveats = sink
        .check_with_caveats(&route(&receiver.url("/nowhere")))
        .await
        .expect("404 is reachable");
    assert!(
        caveats.len() == 1 && caveats[0].contains("404") && caveats[0].contains("routes[].destination"),
        "{caveats:?}"
    );
    sink.check(&route(&receiver.url("/nowhere")))
        .await
        .expect("a caveat is no failure");
    // A redirect or a refusal of the caller says deliveries will go dead.
    for (code, says) in [
        (301, "redirects are not followed"),
        (308, "redirects are not followed"),
        (401, "credentials"),
        (403, "credentials"),
    ] {
        let caveats = sink
            .check_with_caveats(&route(&receiver.url(&format!("/status/{code}"))))
            .await
            .expect("an answer is reachable");
        assert!(
            caveats.len() == 1 && caveats[0].contains(&code.to_string()) && caveats[0].contains(says),
            "{code}: {caveats:?}"
        );
        assert!(!caveats[0].contains("s3cret"), "{caveats:?}");
    }
    // A gateway answering for a receiver that is down: down, not reachable
    // (a proxy in front of a stopped receiver showed it up).
    for code in [502, 503, 504] {
        let err = sink
            .check_with_caveats(&route(&receiver.url(&format!("/status/{code}"))))
            .await
            .expect_err("a gateway's error is no receiver");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(
            err.message.contains(&code.to_string()) && err.message.contains("unavailable"),
            "{err}"
        );
    }
    // A template: its fixed host is probed at its root, a templated host
    // is not contacted; either way a caveat says what was not checked.
    let caveats = sink
        .check_with_caveats(&route("http://{domain}.example/hook"))
        .await
        .expect("a templated host is not contacted");
    assert!(
        caveats.len() == 1 && caveats[0].contains("not contacted"),
        "{caveats:?}"
    );
    let caveats = sink
        .check_with_caveats(&route(&receiver.url("/hooks/{domain}")))
        .await
        .expect("the host answers");
    assert!(
        caveats.len() == 1 && caveats[0].contains("only its host was probed"),
        "{caveats:?}"
    );

    let closed = closed_port_url();
    let err = sink.check(&route(&closed)).await.expect_err("closed port");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains(&closed), "{err}");
    assert!(err.message.contains("unreachable"), "{err}");
    // A templated path on a host nobody listens on: unreachable too.
    let err = sink
        .check(&route(&format!("{}/{{domain}}", closed.trim_end_matches('/'))))
        .await
        .expect_err("closed port, templated path");
    assert!(err.message.contains("unreachable"), "{err}");

    for bad in ["ftp://example.com/x", "hooks.example/x", "{domain}://x"] {
        let err = sink.check(&route(bad)).await.expect_err(bad);
        assert_eq!(err.kind, ErrorKind::Config, "{bad}: {err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
    }
    assert!(
        receiver.receive(1, QUIET_PERIOD).await.is_empty(),
        "check() posted something"
    );
}

#[tokio::test]
async fn a_malformed_secret_is_refused_at_construction() {
    let err = WebhookSink::new(WebhookOptions {
        secrets: vec![SECRET.into(), "whsec_%%%".into()],
        ..WebhookOptions::default()
    })
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.starts_with("secrets[1]"), "{err}");
}
