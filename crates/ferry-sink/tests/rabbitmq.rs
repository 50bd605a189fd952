//! The RabbitMQ sink against a real broker (`FERRY_TEST_AMQP_URL`, default
//! the local one). Every test declares its own uniquely named topology.
#![cfg(feature = "rabbitmq")]

#[path = "rabbitmq/alternate.rs"]
mod alternate;
#[path = "rabbitmq/channel_limit.rs"]
mod channel_limit;
#[path = "rabbitmq/deadline.rs"]
mod deadline;
#[path = "rabbitmq/faults.rs"]
mod faults;
#[path = "rabbitmq/poison.rs"]
mod poison;
mod support;
#[path = "rabbitmq/user.rs"]
mod user;

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Route, Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::{TestTopology, amqp_url, unique_name};
use ferry_testkit::sink_suite::{self, ARRIVAL_TIMEOUT, QUIET_PERIOD, ReceivedMessage, SinkHarness, event};
use serde_json::json;
use support::{LIMIT, expect_err, ids, keyed, received_ids, route, sink_at};

struct Harness {
    topology: TestTopology,
    missing: String,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route(self.topology.exchange(), None)
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route(&self.missing, None))
    }
    fn max_payload_bytes(&self) -> Option<usize> {
        Some(LIMIT)
    }
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
        let received = self.topology.receive(n, timeout).await;
        received
            .into_iter()
            .map(|r| ReceivedMessage {
                id: r.message_id.unwrap_or_default(),
                key: r.headers.get("ferry-key").cloned(),
                body: r.body,
            })
            .collect()
    }
}

#[tokio::test]
async fn passes_the_sink_conformance_suite() {
    let harness = Harness {
        topology: TestTopology::create("suite").await,
        missing: unique_name("missing"),
    };
    let sink = sink_at(amqp_url());
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
    harness.topology.delete().await;
}

#[tokio::test]
async fn a_batch_spread_over_many_channels_keeps_each_keys_order() {
    let topology = TestTopology::create("lanes").await;
    let sink = RabbitMqSink::new(RabbitMqOptions {
        url: amqp_url(),
        channels: 8,
        ..RabbitMqOptions::default()
    });
    let events = keyed(2_000, |seq| format!("k{}", seq % 50));
    publish_and_expect_once_in_key_order(&sink, &topology, &events).await;
    sink.close().await;
    topology.delete().await;
}

/// Publishes `events` to the topology's exchange and checks that each
/// arrived once, every key's in order.
async fn publish_and_expect_once_in_key_order(sink: &RabbitMqSink, topology: &TestTopology, events: &[StoredEvent]) {
    let outcomes = sink.publish(&route(topology.exchange(), None), events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let received = topology.receive(events.len(), ARRIVAL_TIMEOUT).await;
    let stored: Vec<String> = received
        .iter()
        .map(|r| r.message_id.clone().expect("a message id"))
        .collect();
    let duplicates = sink_suite::assert_all_arrived_in_key_order(events, &stored, &ids(events));
    assert_eq!(duplicates, 0);
}

#[tokio::test]
async fn a_broker_allowing_fewer_channels_gets_a_batch_over_those_it_allows() {
    let topology = TestTopology::create("few-lanes").await;
    // The client asks for at most 3 channels; the sink is configured for 8.
    let sink = RabbitMqSink::new(RabbitMqOptions {
        url: format!("{}?channel_max=3", amqp_url()),
        channels: 8,
        ..RabbitMqOptions::default()
    });
    let good = route(topology.exchange(), None);
    sink.check(&good).await.expect("the sink connects within the limit");
    // Twice: the second batch reuses the channels the first one opened.
    for _ in 0..2 {
        let events = keyed(400, |seq| format!("k{}", seq % 20));
        publish_and_expect_once_in_key_order(&sink, &topology, &events).await;
    }
    // With the publishing channels open, one stays free for the passive
    // declare that checks an exchange.
    sink.check(&good)
        .await
        .expect("a channel is left for checking exchanges");
    // And a missing exchange is still told apart from other failures.
    let missing = route(&unique_name("few-lanes-missing"), None);
    let outcomes = sink.publish(&missing, &keyed(3, |seq| format!("m{seq}"))).await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "does not exist");
    }
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn wire_format_carries_ids_cloudevents_headers_and_persistence() {
    let topology = TestTopology::create("wire").await;
    let sink = sink_at(amqp_url());
    let mut traced = event(1, "order.item.created", Some("o-1"), json!({ "n": 1 }));
    traced.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    let mut raw = event(2, "order.item.archived", None, json!(null));
    raw.payload = bytes::Bytes::from_static(b"\x00\x01plain");
    raw.content_type = "application/octet-stream".into();
    let events = [traced, raw];

    let outcomes = sink
        .publish(&route(topology.exchange(), Some("{domain}.{type}")), &events)
        .await;
    assert_eq!(outcomes, vec![Ok(()), Ok(())]);
    let mut received = topology.receive(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(received.len(), 2);
    // The two events have different keys, so they may travel on different
    // channels and arrive in either order: pair them up by message id.
    let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    received.sort_by_key(|r| ids.iter().position(|id| r.message_id.as_ref() == Some(id)));

    for (e, r) in events.iter().zip(&received) {
        let id = e.id.to_string();
        assert_eq!(r.message_id.as_deref(), Some(id.as_str()));
        assert_eq!(r.routing_key, format!("order.{}", e.event_type));
        assert_eq!(r.body, e.payload);
        assert_eq!(r.content_type.as_deref(), Some(e.content_type.as_str()));
        assert_eq!(r.delivery_mode, Some(2), "persistent");
        assert_eq!(r.message_type.as_deref(), Some(e.event_type.as_str()));
        assert_eq!(r.timestamp, Some(e.created_at.timestamp() as u64));
        let h = &r.headers;
        assert_eq!(h["cloudEvents:specversion"], "1.0");
        assert_eq!(h["cloudEvents:id"], id);
        assert_eq!(h["cloudEvents:type"], e.event_type);
        assert_eq!(h["cloudEvents:source"], "ferry");
        let time = chrono::DateTime::parse_from_rfc3339(&h["cloudEvents:time"]).expect("RFC 3339");
        assert_eq!(time, e.created_at);
        assert_eq!(h.get("cloudEvents:subject"), e.key.as_ref());
        assert_eq!(h.get("ferry-key"), e.key.as_ref());
    }
    assert_eq!(received[0].headers["traceparent"], events[0].headers["traceparent"]);
    assert!(!received[1].headers.contains_key("traceparent"));

    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn an_exchange_without_a_queue_fails_every_event_until_one_is_bound() {
    let counts = ferry_testkit::metrics::Counts::by_label("exchange");
    // The test's runtime has one thread, so a thread-local recorder sees all.
    let _recorder = metrics::set_default_local_recorder(&counts);
    let topology = TestTopology::create_unbound("unbound").await;
    let sink = sink_at(amqp_url());
    let events = keyed(50, |seq| format!("k-{}", seq % 3));
    let outcomes = sink.publish(&route(topology.exchange(), None), &events).await;
    assert_eq!(outcomes.len(), events.len());
    assert_eq!(
        counts.get(ferry_sink::rabbitmq::UNROUTABLE_METRIC, topology.exchange()),
        50,
        "every return counted"
    );
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "unroutable");
        expect_err(outcome, ErrorKind::Transient, "312 NO_ROUTE");
    }
    // check() asks the management API and says so before any publish.
    let err = sink
        .check(&route(topology.exchange(), None))
        .await
        .expect_err("nobody home");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("reaches nobody"), "{err}");
    assert!(err.message.contains("no queue is bound"), "{err}");
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn a_batch_abandoned_before_its_confirms_leaves_no_confirm_to_take_a_later_return() {
    // A relay bounds a publish and drops it when the bound passes. Confirms
    // still owed on the channels would take the next batch's returns, and
    // an unroutable message could pass for delivered: the sink starts over.
    let counts = ferry_testkit::metrics::Counts::by_label("kind");
    let _recorder = metrics::set_default_local_recorder(&counts);
    let topology = TestTopology::create_with_binding("abandoned", "routable.#").await;
    let sink = sink_at(amqp_url());
    let routed = route(topology.exchange(), Some("{key}"));
    let warm = keyed(5, |seq| format!("routable.{seq}"));
    assert!(sink.publish(&routed, &warm).await.iter().all(Result::is_ok));
    assert_eq!(counts.get(ferry_sink::CONNECTIONS_METRIC, "rabbitmq"), 1);
    let mut abandoned = false;
    for n in [2_000, 10_000, 50_000] {
        let big = keyed(n, |seq| format!("routable.{seq}"));
        if tokio::time::timeout(Duration::from_millis(2), sink.publish(&routed, &big))
            .await
            .is_err()
        {
            abandoned = true;
            break;
        }
    }
    assert!(abandoned, "every batch finished within 2 ms; nothing was abandoned");
    let mixed = keyed(300, |seq| {
        if seq % 2 == 0 {
            format!("dropped.{seq}")
        } else {
            format!("routable.{seq}")
        }
    });
    let outcomes = sink.publish(&routed, &mixed).await;
    assert_eq!(
        counts.get(ferry_sink::CONNECTIONS_METRIC, "rabbitmq"),
        2,
        "the abandoned batch's connection is not used again"
    );
    for (e, outcome) in mixed.iter().zip(&outcomes) {
        if e.seq % 2 == 0 {
            expect_err(outcome, ErrorKind::Transient, "unroutable");
        } else {
            assert_eq!(outcome, &Ok(()), "event {}", e.seq);
        }
    }
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn check_refuses_wrong_credentials_and_a_missing_vhost() {
    // A broken connection string is a start-up error naming the fix, not an
    // outage the relay would retry every event through.
    let topology = TestTopology::create("creds").await;
    let url = amqp_url();
    let (base, _vhost) = url.rsplit_once('/').expect("a vhost in the URL");
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (userinfo, host_and_vhost) = rest.rsplit_once('@').expect("the test broker's URL has credentials");
    let user = userinfo.split(':').next().unwrap();
    let wrong_password = format!("{scheme}://{user}:n0t-the-password@{host_and_vhost}");
    for (url, says) in [
        (wrong_password, "ACCESS_REFUSED"),
        (format!("{base}/ferry-no-such-vhost"), "ferry-no-such-vhost"),
    ] {
        let sink = sink_at(url.clone());
        let err = sink
            .check(&route(topology.exchange(), None))
            .await
            .expect_err("refused");
        assert_eq!(err.kind, ErrorKind::Config, "{url}: {err}");
        assert!(err.message.contains(says), "{url}: {err}");
        assert!(err.message.contains("url"), "names the field: {err}");
        assert!(!err.message.contains("n0t-the-password"), "{err}");
        // Publishing is not refused for good: a broker may refuse a user for
        // a moment (restarting, its user database not yet loaded).
        let outcomes = sink
            .publish(&route(topology.exchange(), None), &keyed(2, |s| format!("k{s}")))
            .await;
        for outcome in &outcomes {
            assert_eq!(outcome.as_ref().unwrap_err().kind, ErrorKind::Transient, "{outcome:?}");
        }
        sink.close().await;
    }
    topology.delete().await;
}

#[tokio::test]
async fn returns_are_matched_to_their_own_events_in_a_mixed_batch() {
    let topology = TestTopology::create_with_binding("mixed", "routable.#").await;
    let sink = sink_at(amqp_url());
    let events = keyed(1000, |seq| {
        if seq % 3 == 0 {
            format!("dropped.{seq}")
        } else {
            format!("routable.{seq}")
        }
    });
    let outcomes = sink.publish(&route(topology.exchange(), Some("{key}")), &events).await;

    let mut routable = Vec::new();
    for (e, outcome) in events.iter().zip(&outcomes) {
        if e.seq % 3 == 0 {
            expect_err(outcome, ErrorKind::Transient, "unroutable");
        } else {
            assert_eq!(outcome, &Ok(()), "event {} ({:?})", e.seq, e.key);
            routable.push(e.clone());
        }
    }
    let received = topology.receive(routable.len(), ARRIVAL_TIMEOUT).await;
    assert_eq!(received_ids(&received), ids(&routable));
    assert!(topology.receive(1, QUIET_PERIOD).await.is_empty(), "no duplicates");
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
/// A missing exchange: `check` refuses the route as a configuration error;
/// a publish fails transiently, with the fix named, since an application
/// redeclaring its exchange makes it missing for a moment.
async fn a_missing_exchange_fails_transiently_with_the_fix_and_the_sink_keeps_working() {
    let topology = TestTopology::create("after-404").await;
    let missing = unique_name("missing");
    let sink = sink_at(amqp_url());

    let err = sink.check(&route(&missing, None)).await.expect_err("missing exchange");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(
        err.message.contains(&format!("exchange {missing:?} does not exist")),
        "{err}"
    );
    assert!(err.message.contains("routes[].destination"), "{err}");

    for round in 0..2 {
        let lost = keyed(5, |seq| format!("lost-{seq}"));
        for outcome in sink.publish(&route(&missing, None), &lost).await {
            expect_err(&outcome, ErrorKind::Transient, "does not exist");
        }
        let good = keyed(20, |seq| format!("good-{round}-{}", seq % 4));
        let outcomes = sink.publish(&route(topology.exchange(), None), &good).await;
        assert!(outcomes.iter().all(Result::is_ok), "round {round}: {outcomes:?}");
        let received = topology.receive(good.len(), ARRIVAL_TIMEOUT).await;
        assert_eq!(received_ids(&received), ids(&good));
    }
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn a_templated_batch_fails_only_the_events_of_the_missing_exchange() {
    let topology = TestTopology::create("tmpl").await;
    let missing = unique_name("tmpl-missing");
    let sink = sink_at(amqp_url());
    let templated = route("{domain}", None);
    sink.check(&templated).await.expect("templates only check connectivity");

    let events: Vec<StoredEvent> = (0..30)
        .map(|seq| {
            let domain = if seq % 5 == 2 { &missing } else { topology.exchange() };
            event(
                seq,
                &format!("{domain}.item.created"),
                Some(&format!("k{}", seq % 5)),
                json!({ "seq": seq }),
            )
        })
        .collect();
    let outcomes = sink.publish(&templated, &events).await;
    let mut good = Vec::new();
    let mut first_missing = true;
    for (e, outcome) in events.iter().zip(&outcomes) {
        if e.seq % 5 == 2 {
            // Key k2's first event fails; the later ones wait behind it.
            let says = if first_missing { "does not exist" } else { "held back" };
            expect_err(outcome, ErrorKind::Transient, says);
            first_missing = false;
            continue;
        }
        // Not failed for the missing exchange's events beside them.
        assert_eq!(outcome, &Ok(()), "event {} of an existing exchange", e.seq);
        good.push(e.clone());
    }

    // Events that reached the queue but lost their confirm to the channel
    // close may arrive twice; each good event must arrive at least once.
    let wanted = ids(&good);
    let mut seen = HashSet::new();
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    while !wanted.is_subset(&seen) && tokio::time::Instant::now() < deadline {
        seen.extend(received_ids(
            &topology
                .receive(wanted.len() - seen.len(), deadline - tokio::time::Instant::now())
                .await,
        ));
    }
    assert!(
        wanted.is_subset(&seen),
        "{} good events never arrived",
        wanted.difference(&seen).count()
    );
    assert!(seen.is_subset(&wanted), "an event of the missing exchange arrived");
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn an_oversized_event_holds_back_later_events_of_its_key_only() {
    let topology = TestTopology::create("held").await;
    let sink = sink_at(amqp_url());
    let big = event(0, "test.item.created", Some("a"), json!("x".repeat(LIMIT)));
    let events = vec![
        big,
        event(1, "test.item.created", Some("a"), json!({ "seq": 1 })),
        event(2, "test.item.created", Some("b"), json!({ "seq": 2 })),
    ];
    let outcomes = sink.publish(&route(topology.exchange(), None), &events).await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "payload too large");
    expect_err(&outcomes[0], ErrorKind::Permanent, "sinks.rabbit.max_message_bytes");
    expect_err(&outcomes[1], ErrorKind::Transient, "held back");
    assert_eq!(outcomes[2], Ok(()));
    let received = topology.receive(2, QUIET_PERIOD).await;
    assert_eq!(received_ids(&received), ids(&events[2..]));
    sink.close().await;
    topology.delete().await;
}

/// Headers that fit one AMQP frame go; headers past it, which RabbitMQ
/// answers by closing the connection, are refused before sending, and the
/// events after them on the same connection go.
#[tokio::test]
async fn headers_past_one_frame_are_refused_before_they_cost_the_connection() {
    let topology = TestTopology::create("frame").await;
    let sink = sink_at(amqp_url());
    let mut fits = event(0, "test.item.created", Some("a"), json!({ "seq": 0 }));
    fits.headers.insert("x-big".into(), "x".repeat(120_000));
    let mut too_big = event(1, "test.item.created", Some("b"), json!({ "seq": 1 }));
    too_big.headers.insert("x-big".into(), "x".repeat(140_000));
    let after = event(2, "test.item.created", Some("c"), json!({ "seq": 2 }));
    let events = vec![fits, too_big, after];
    let outcomes = sink.publish(&route(topology.exchange(), None), &events).await;
    assert_eq!(outcomes[0], Ok(()));
    expect_err(&outcomes[1], ErrorKind::Permanent, "frame_max");
    assert_eq!(outcomes[2], Ok(()));
    let received = topology.receive(2, QUIET_PERIOD).await;
    assert_eq!(received_ids(&received), ids(&[events[0].clone(), events[2].clone()]));
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn a_test_topology_dropped_without_delete_leaves_no_exchange() {
    let sink = sink_at(amqp_url());
    for topology in [
        TestTopology::create_unbound("dropped").await,
        TestTopology::create("dropped").await,
    ] {
        let exchange = route(topology.exchange(), None);
        let exists = async || match sink.check(&exchange).await {
            Ok(()) => true,
            Err(e) => !e.message.contains("does not exist"),
        };
        assert!(exists().await, "declared");
        drop(topology);
        // A bound exchange goes with its queue once the broker saw the close.
        let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
        while exists().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} outlived its topology",
                exchange.destination
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    sink.close().await;
}

#[tokio::test]
async fn check_names_a_route_whose_routing_key_no_queue_takes() {
    let topology = TestTopology::create_with_binding("nobody", "shop.order.*").await;
    let sink = sink_at(amqp_url());
    sink.check(&route(topology.exchange(), Some("shop.order.paid")))
        .await
        .expect("a queue takes shop.order.paid");
    // A key that varies per event: any binding counts.
    sink.check(&route(topology.exchange(), Some("{type}")))
        .await
        .expect("bound");
    let err = sink
        .check(&route(topology.exchange(), Some("billing.invoice.sent")))
        .await
        .expect_err("no queue takes billing.invoice.sent");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(
        err.message.contains("for routing key \"billing.invoice.sent\""),
        "{err}"
    );
    assert!(err.message.contains("routes[].routing_key"), "{err}");
    sink.close().await;
    topology.delete().await;
}
