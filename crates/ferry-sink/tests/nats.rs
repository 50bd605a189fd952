//! The NATS JetStream sink against a real server (`FERRY_TEST_NATS_URL`,
//! default the local one). Every test creates its own uniquely named stream.
#![cfg(feature = "nats")]

#[path = "nats/faults.rs"]
mod faults;
#[path = "nats/permissions.rs"]
mod permissions;
#[path = "nats/support.rs"]
mod support;
#[path = "nats/templates.rs"]
mod templates;

use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Route, Sink};
use ferry_testkit::sink_suite::{self, ARRIVAL_TIMEOUT, QUIET_PERIOD, ReceivedMessage, SinkHarness, event};
use serde_json::json;
use support::{LIMIT, TestStream, expect_err, ids, keyed, nats_url, route, sink_at, unique};

struct Harness {
    stream: TestStream,
    missing: String,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route(&self.stream.subject)
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route(&self.missing))
    }
    fn max_payload_bytes(&self) -> Option<usize> {
        Some(LIMIT)
    }
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
        self.stream
            .receive(n, timeout)
            .await
            .into_iter()
            .map(|m| ReceivedMessage {
                id: m.id(),
                key: m.headers.get("ce-subject").cloned(),
                body: m.payload.to_vec(),
            })
            .collect()
    }
}

#[tokio::test]
async fn passes_the_sink_conformance_suite() {
    let harness = Harness {
        stream: TestStream::create("suite").await,
        missing: unique("ferry.missing").replace('_', "."),
    };
    let sink = sink_at(nats_url());
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
    harness.stream.delete().await;
}

#[tokio::test]
async fn wire_format_carries_msg_id_cloudevents_and_producer_headers() {
    let stream = TestStream::create("wire").await;
    let sink = sink_at(nats_url());
    let mut traced = event(1, "order.item.created", Some("o-1"), json!({ "n": 1 }));
    traced.headers.insert("traceparent".into(), "00-4bf92f35-01".into());
    let mut raw = event(2, "order.item.archived", None, json!(null));
    raw.payload = bytes::Bytes::from_static(b"\x00\x01plain");
    raw.content_type = "application/octet-stream".into();
    let events = [traced, raw];

    let templated = route(&format!("{}.{{domain}}.{{type}}", stream.subject));
    sink.check(&templated)
        .await
        .expect("a stream captures the template's subjects");
    let outcomes = sink.publish(&templated, &events).await;
    assert_eq!(outcomes, vec![Ok(()), Ok(())]);
    let stored = stream.receive(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(stored.len(), 2);
    for (e, m) in events.iter().zip(&stored) {
        let id = e.id.to_string();
        let h = &m.headers;
        assert_eq!(m.subject, format!("{}.order.{}", stream.subject, e.event_type));
        assert_eq!(m.payload, e.payload);
        assert_eq!(h["Nats-Msg-Id"], format!("{id}:{}", m.subject));
        assert_eq!(h["ce-id"], id);
        assert_eq!(h["ce-specversion"], "1.0");
        assert_eq!(h["ce-type"], e.event_type);
        assert_eq!(h["ce-source"], "ferry");
        assert_eq!(h["content-type"], e.content_type);
        let time = chrono::DateTime::parse_from_rfc3339(&h["ce-time"]).expect("RFC 3339");
        assert_eq!(time, e.created_at);
        assert_eq!(h.get("ce-subject"), e.key.as_ref());
    }
    assert_eq!(stored[0].headers["traceparent"], "00-4bf92f35-01");
    assert!(!stored[1].headers.contains_key("traceparent"));
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn a_republished_event_is_stored_once_and_both_publishes_succeed() {
    let stream = TestStream::create("dup").await;
    let sink = sink_at(nats_url());
    let to = route(&stream.subject);
    let events = keyed(3, |seq| format!("k{seq}"));
    assert!(sink.publish(&to, &events).await.iter().all(Result::is_ok));
    // The same events again, as after a crash before the outbox was updated,
    // in a batch with one new event.
    let mut again = events.clone();
    let fresh = event(9, "test.item.created", Some("k0"), json!({ "seq": 9 }));
    again.push(fresh.clone());
    let outcomes = sink.publish(&to, &again).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let stored = stream.receive(4, ARRIVAL_TIMEOUT).await;
    let stored_ids: Vec<String> = stored.iter().map(|m| m.id()).collect();
    let mut expected: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    expected.push(fresh.id.to_string());
    assert_eq!(stored_ids, expected);
    assert!(
        stream.receive(1, QUIET_PERIOD).await.is_empty(),
        "a duplicate was stored"
    );
    assert_eq!(stream.count().await, 4);
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn one_event_routed_to_two_subjects_of_one_stream_is_stored_under_both() {
    let stream = TestStream::create("fanout").await;
    let sink = sink_at(nats_url());
    let orders = route(&format!("{}.orders", stream.subject));
    let audit = route(&format!("{}.audit", stream.subject));
    let events = keyed(2, |seq| format!("k{seq}"));
    assert_eq!(sink.publish(&orders, &events).await, vec![Ok(()), Ok(())]);
    assert_eq!(sink.publish(&audit, &events).await, vec![Ok(()), Ok(())]);
    // A re-publish to a subject that already holds the events, as after a
    // crash, is still dropped by the duplicate window.
    assert_eq!(sink.publish(&audit, &events).await, vec![Ok(()), Ok(())]);

    let stored = stream.receive(4, ARRIVAL_TIMEOUT).await;
    let copies: Vec<(String, String)> = stored.iter().map(|m| (m.subject.clone(), m.id())).collect();
    let expected: Vec<(String, String)> = [&orders, &audit]
        .iter()
        .flat_map(|to| events.iter().map(|e| (to.destination.clone(), e.id.to_string())))
        .collect();
    assert_eq!(
        copies, expected,
        "every route's copy is stored, with the event id in ce-id"
    );
    assert!(
        stream.receive(1, QUIET_PERIOD).await.is_empty(),
        "a re-publish was stored"
    );
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn check_names_the_subject_no_stream_captures() {
    let stream = TestStream::create("check").await;
    let sink = sink_at(nats_url());
    sink.check(&route(&stream.subject)).await.expect("captured");
    sink.check(&route(&format!("{}.deeper", stream.subject)))
        .await
        .expect("captured by the wildcard");

    let missing = unique("ferry.nowhere").replace('_', ".");
    let err = sink.check(&route(&missing)).await.expect_err("no stream");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains(&format!("{missing:?}")), "{err}");
    assert!(err.message.contains("nats stream add"), "{err}");

    let err = sink.check(&route("bad subject")).await.expect_err("invalid");
    assert_eq!(err.kind, ErrorKind::Config);

    // Publishing gets 503 no responders, which a leader election answers as
    // well: retried, with a reason that says what to fix if it lasts.
    let outcomes = sink.publish(&route(&missing), &keyed(3, |s| format!("m{s}"))).await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "503 no responders");
        expect_err(outcome, ErrorKind::Transient, &missing);
        expect_err(outcome, ErrorKind::Transient, "no stream captures the subject");
    }
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn check_refuses_a_stream_that_never_acknowledges_and_warns_of_a_short_duplicate_window() {
    let sink = sink_at(nats_url());
    // No PubAck ever: every event would wait it out and go dead, stored or not.
    let silent = TestStream::create_with("noack", json!({ "no_ack": true })).await;
    let err = sink.check(&route(&silent.subject)).await.expect_err("no_ack");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("no_ack"), "{err}");
    silent.delete().await;
    // A retry after a lost PubAck, later than the window, is stored twice.
    let short = TestStream::create_with("shortdupe", json!({ "duplicate_window": 30_000_000_000u64 })).await;
    let caveats = sink.check_with_caveats(&route(&short.subject)).await.expect("usable");
    assert!(
        caveats.len() == 1 && caveats[0].contains("30s") && caveats[0].contains("--dupe-window"),
        "{caveats:?}"
    );
    short.delete().await;
    let long = TestStream::create_with("longdupe", json!({ "duplicate_window": 600_000_000_000u64 })).await;
    let caveats = sink.check_with_caveats(&route(&long.subject)).await.expect("usable");
    assert!(caveats.is_empty(), "{caveats:?}");
    long.delete().await;
    sink.close().await;
}

/// A stream with interest retention and no consumer acknowledges every
/// publish and deletes the message at once: a route to it reaches nobody,
/// and check says so before an event is lost to it. With a consumer it is
/// usable.
#[tokio::test]
async fn check_refuses_an_interest_stream_that_no_consumer_wants() {
    let sink = sink_at(nats_url());
    let stream = TestStream::create_with("interest", json!({ "retention": "interest" })).await;
    let err = sink.check(&route(&stream.subject)).await.expect_err("nobody wants it");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(
        err.message.contains("interest") && err.message.contains("no consumer"),
        "{err}"
    );
    stream.add_consumer("readers").await;
    sink.check(&route(&stream.subject)).await.expect("a consumer wants it");
    stream.delete().await;
    sink.close().await;
}

/// An interest stream keeps a message only for the consumers whose filter
/// matches its subject. With consumers on other subjects alone, a publish
/// to the route's subject gets its PubAck and is deleted at once: the
/// event would count as published and reach nobody.
#[tokio::test]
async fn check_refuses_an_interest_stream_whose_consumers_filter_other_subjects() {
    let sink = sink_at(nats_url());
    let stream = TestStream::create_with("interestfilter", json!({ "retention": "interest" })).await;
    let base = stream.subject.clone();
    let payments = format!("{base}.payment.>");
    stream
        .add_consumer_with("payments", json!({ "filter_subject": payments }))
        .await;
    let orders = route(&format!("{base}.order"));
    // What check is there to prevent: acknowledged, and gone.
    assert_eq!(sink.publish(&orders, &keyed(1, |_| "o".into())).await, vec![Ok(())]);
    assert_eq!(stream.count().await, 0, "the server kept an event nobody wants");

    let err = sink.check(&orders).await.expect_err("no consumer wants the subject");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("interest"), "{err}");
    assert!(err.message.contains(&format!("{payments:?}")), "{err}");
    assert!(err.message.contains(&format!("{:?}", orders.destination)), "{err}");
    let card = route(&format!("{base}.payment.card"));
    let caveats = sink.check_with_caveats(&card).await.expect("the consumer wants it");
    assert!(caveats.is_empty(), "{caveats:?}");
    // A second consumer, on the orders, makes the route usable.
    stream
        .add_consumer_with("orders", json!({ "filter_subject": orders.destination }))
        .await;
    sink.check(&orders).await.expect("a consumer wants it");
    stream.delete().await;
    sink.close().await;
}

#[tokio::test]
async fn a_message_over_the_streams_max_msg_size_is_permanent_and_holds_nothing_else() {
    let stream = TestStream::create_with("small", json!({ "max_msg_size": 1024 })).await;
    let sink = sink_at(nats_url());
    let to = route(&stream.subject);
    let events = vec![
        event(0, "test.item.created", Some("a"), json!({ "seq": 0 })),
        event(1, "test.item.created", Some("b"), json!("x".repeat(4096))),
        event(2, "test.item.created", Some("c"), json!({ "seq": 2 })),
    ];
    // admit() only knows the sink's and the server's limits, not the stream's.
    assert!(sink.admit(&to, &events[1]).is_ok());
    let outcomes = sink.publish(&to, &events).await;
    assert_eq!(outcomes[0], Ok(()));
    expect_err(&outcomes[1], ErrorKind::Permanent, "err_code 10054");
    expect_err(&outcomes[1], ErrorKind::Permanent, "message size exceeds maximum");
    assert_eq!(outcomes[2], Ok(()));
    let stored = stream.receive(3, QUIET_PERIOD).await;
    let stored_ids: std::collections::HashSet<String> = stored.iter().map(|m| m.id()).collect();
    assert_eq!(stored_ids, ids(&[events[0].clone(), events[2].clone()]));
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn admit_refuses_what_the_servers_max_payload_cannot_carry() {
    let stream = TestStream::create("maxpayload").await;
    // The sink's own limit is above the server's 1 MiB max_payload.
    let sink = support::sink_with(nats_url(), 8 * 1024 * 1024);
    let to = route(&stream.subject);
    let big = event(0, "test.item.created", Some("a"), json!("x".repeat(1024 * 1024)));
    // Before the first connect the server's limit is unknown; publish connects
    // first and refuses it all the same.
    let outcomes = sink.publish(&to, std::slice::from_ref(&big)).await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "max_payload");
    let err = sink.admit(&to, &big).expect_err("over max_payload");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(stream.receive(1, QUIET_PERIOD).await.is_empty());
    sink.close().await;
    stream.delete().await;
}
