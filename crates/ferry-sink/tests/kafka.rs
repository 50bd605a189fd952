//! The Kafka sink against librdkafka's mock cluster (fast, in-process, with
//! fault injection) and, in `kafka/tansu.rs`, against a real broker.
#![cfg(feature = "kafka")]

#[path = "kafka/fatal.rs"]
mod fatal;
#[path = "kafka/faults.rs"]
mod faults;
#[path = "kafka/support.rs"]
mod kafka_support;
#[path = "kafka/tansu.rs"]
mod tansu;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use ferry_core::{ErrorKind, Sink};
use ferry_sink::kafka::{KafkaOptions, KafkaSink};
use ferry_testkit::sink_suite::{self, ARRIVAL_TIMEOUT, event};
use kafka_support::{Harness, LIMIT, TopicReader, expect_err, ids, keyed, route, sink_at, unique};
use rdkafka::mocking::MockCluster;
use serde_json::json;

fn mock_with_topic(partitions: i32) -> (MockCluster<'static, rdkafka::producer::DefaultProducerContext>, String) {
    let cluster = MockCluster::new(3).expect("a mock cluster");
    let topic = unique("mock");
    cluster.create_topic(&topic, partitions, 3).expect("a topic");
    (cluster, topic)
}

#[tokio::test]
async fn passes_the_sink_conformance_suite_on_a_mock_cluster() {
    let (cluster, topic) = mock_with_topic(4);
    let bootstrap = cluster.bootstrap_servers();
    let harness = Harness {
        reader: TopicReader::new(&bootstrap, &topic).await,
        missing: unique("missing"),
        topic,
    };
    let sink = sink_at(&bootstrap);
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
}

#[tokio::test]
async fn wire_format_carries_key_id_cloudevents_and_producer_headers() {
    let (cluster, topic) = mock_with_topic(1);
    assert_wire_format(&cluster.bootstrap_servers(), &topic).await;
}

/// Publishes a keyed JSON event with a producer header and an unkeyed binary
/// one to `topic` (one partition) and checks every field a consumer sees.
async fn assert_wire_format(bootstrap: &str, topic: &str) {
    let reader = TopicReader::new(bootstrap, topic).await;
    let sink = sink_at(bootstrap);
    let mut traced = event(1, "order.item.created", Some("o-1"), json!({ "n": 1 }));
    traced.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    traced.headers.insert("ce_id".into(), "forged".into());
    let mut raw = event(2, "order.item.archived", None, json!(null));
    raw.payload = Bytes::from_static(b"\x00\x01plain");
    raw.content_type = "application/octet-stream".into();
    let events = [traced, raw];

    let outcomes = sink.publish(&route(topic), &events).await;
    assert_eq!(outcomes, vec![Ok(()), Ok(())]);
    let consumed = reader.read(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(consumed.len(), 2);
    for (e, c) in events.iter().zip(&consumed) {
        assert_eq!(c.key, e.key, "the message key is the event key");
        assert_eq!(c.body, e.payload);
        assert_eq!(c.timestamp, Some(e.created_at.timestamp_millis()));
        assert_eq!(c.header("ce_id"), Some(e.id.to_string().as_str()));
        assert_eq!(c.header("ce_specversion"), Some("1.0"));
        assert_eq!(c.header("ce_type"), Some(e.event_type.as_str()));
        assert_eq!(c.header("ce_source"), Some("ferry"));
        assert_eq!(c.header("ce_subject"), e.key.as_deref());
        assert_eq!(c.header("content-type"), Some(e.content_type.as_str()));
        let time = chrono::DateTime::parse_from_rfc3339(c.header("ce_time").unwrap()).expect("RFC 3339");
        assert_eq!(time, e.created_at);
    }
    assert_eq!(
        consumed[0].header("traceparent"),
        Some(events[0].headers["traceparent"].as_str())
    );
    assert_eq!(consumed[1].header("traceparent"), None);
    sink.close().await;
}

#[tokio::test]
async fn a_templated_topic_renders_per_event_and_checks_connectivity_only() {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    let domain = format!("d{}", uuid::Uuid::now_v7().simple());
    let topic = format!("events.{domain}");
    cluster.create_topic(&topic, 2, 1).expect("a topic");
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let sink = sink_at(&bootstrap);
    let templated = route("events.{domain}");
    sink.check(&templated)
        .await
        .expect("a template checks connectivity only");

    let events: Vec<_> = (0..20)
        .map(|seq| {
            event(
                seq,
                &format!("{domain}.item.created"),
                Some(&format!("k{}", seq % 3)),
                json!({ "seq": seq }),
            )
        })
        .collect();
    let outcomes = sink.publish(&templated, &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let consumed = reader.read_until(&ids(&events), ARRIVAL_TIMEOUT).await;
    assert_eq!(kafka_support::assert_complete_and_ordered(&events, &consumed), 0);

    // An event whose rendered topic is not a valid name is refused before sending.
    let mut bad = event(0, "test.item.created", Some("a b"), json!({}));
    bad.key = Some("a b".into());
    let err = sink.admit(&route("t.{key}"), &bad).expect_err("space in a topic name");
    assert_eq!(err.kind, ErrorKind::Permanent);
    sink.close().await;
}

#[tokio::test]
async fn check_names_the_missing_topic_and_refuses_a_routing_key() {
    let (cluster, topic) = mock_with_topic(1);
    let sink = sink_at(&cluster.bootstrap_servers());
    sink.check(&route(&topic)).await.expect("the topic exists");

    let missing = unique("missing");
    let err = sink.check(&route(&missing)).await.expect_err("missing topic");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(
        err.message.contains(&format!("topic {missing:?} does not exist")),
        "{err}"
    );
    assert!(err.message.contains("routes[].destination"), "{err}");

    // Asking did not create it.
    let err = sink.check(&route(&missing)).await.expect_err("still missing");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");

    let mut keyed_route = route(&topic);
    keyed_route.routing_key = Some("{key}".into());
    let err = sink.check(&keyed_route).await.expect_err("routing key");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains("routing_key"), "{err}");

    let err = sink.check(&route("bad name")).await.expect_err("invalid name");
    assert_eq!(err.kind, ErrorKind::Config);
    sink.close().await;
}

#[tokio::test]
/// A topic the cluster says is missing: `check` (run before a relay
/// starts) refuses the route as a configuration error; a publish is retried
/// with the fix named, since a broker out of sync can say the same of a
/// topic in use, and as a configuration error every event would be dead on
/// its first attempt.
async fn publishing_to_a_missing_topic_is_retried_with_the_fix_and_creates_nothing() {
    let (cluster, topic) = mock_with_topic(1);
    let sink = sink_at(&cluster.bootstrap_servers());
    let missing = unique("missing");
    // The first publish waits out the topic's metadata propagation and
    // fails in the delivery reports; once librdkafka knows the topic is
    // missing, the next fails as it is enqueued: both name the fix.
    for _ in 0..2 {
        for outcome in sink.publish(&route(&missing), &keyed(3, |s| format!("k{s}"))).await {
            expect_err(&outcome, ErrorKind::Transient, &format!("{missing:?}"));
            expect_err(&outcome, ErrorKind::Transient, "routes[].destination");
        }
    }
    let err = sink.check(&route(&missing)).await.expect_err("not auto-created");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("does not exist"), "{err}");
    // The sink still works for the good topic.
    let reader = TopicReader::new(&cluster.bootstrap_servers(), &topic).await;
    let good = keyed(5, |s| format!("k{}", s % 2));
    assert!(sink.publish(&route(&topic), &good).await.iter().all(Result::is_ok));
    let consumed = reader.read_until(&ids(&good), ARRIVAL_TIMEOUT).await;
    assert_eq!(kafka_support::assert_complete_and_ordered(&good, &consumed), 0);
    sink.close().await;
}

#[tokio::test]
async fn an_unreachable_cluster_fails_transiently_within_the_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let sink = KafkaSink::new(KafkaOptions {
        publish_timeout: Duration::from_millis(1500),
        ..kafka_support::options(&addr.to_string())
    })
    .expect("created while the cluster is down");
    let attempt = async {
        for outcome in sink.publish(&route("anything"), &keyed(3, |s| format!("k{s}"))).await {
            expect_err(&outcome, ErrorKind::Transient, "");
        }
        let err = sink.check(&route("anything")).await.expect_err("unreachable");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(err.message.contains(&addr.to_string()), "{err}");
    };
    // publish_timeout + the delivery grace + check's metadata wait.
    tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .expect("bounded by the configured timeouts");
}

#[tokio::test]
async fn an_oversized_event_holds_back_later_events_of_its_key_only() {
    let (cluster, topic) = mock_with_topic(2);
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let sink = sink_at(&bootstrap);
    let events = vec![
        event(0, "test.item.created", Some("a"), json!("x".repeat(LIMIT))),
        event(1, "test.item.created", Some("a"), json!({ "seq": 1 })),
        event(2, "test.item.created", Some("b"), json!({ "seq": 2 })),
    ];
    let outcomes = sink.publish(&route(&topic), &events).await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "payload too large");
    expect_err(&outcomes[0], ErrorKind::Permanent, "sinks.kafka.max_message_bytes");
    expect_err(&outcomes[1], ErrorKind::Transient, "held back");
    assert_eq!(outcomes[2], Ok(()));
    // Wait for the one that went, then briefly for anything that should not.
    let mut consumed = reader.read_until(&ids(&events[2..]), ARRIVAL_TIMEOUT).await;
    consumed.extend(reader.read(1, Duration::from_secs(2)).await);
    let got: Vec<String> = consumed.iter().map(|c| c.id()).collect();
    assert_eq!(got, vec![events[2].id.to_string()]);
    sink.close().await;
}

#[test]
fn options_that_would_weaken_the_guarantees_are_refused() {
    for (name, value) in [
        ("acks", "1"),
        ("enable.idempotence", "false"),
        ("message.timeout.ms", "5"),
    ] {
        let mut extra = BTreeMap::new();
        extra.insert(name.to_owned(), value.to_owned());
        let err = KafkaSink::new(KafkaOptions {
            extra,
            ..KafkaOptions::default()
        })
        .expect_err(name);
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.contains(name), "{err}");
    }
    let mut extra = BTreeMap::new();
    extra.insert("no.such.property".to_owned(), "1".to_owned());
    let err = KafkaSink::new(KafkaOptions {
        extra,
        ..KafkaOptions::default()
    })
    .expect_err("unknown property");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains("no.such.property"), "{err}");
}

#[tokio::test]
async fn a_full_local_queue_is_waited_out_in_order() {
    let (cluster, topic) = mock_with_topic(2);
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let mut opts = kafka_support::options(&bootstrap);
    opts.extra.insert("queue.buffering.max.messages".into(), "10".into());
    let sink = KafkaSink::new(opts).expect("a sink");
    let events = keyed(300, |seq| format!("k{}", seq % 7));
    let outcomes = sink.publish(&route(&topic), &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let consumed = reader.read_until(&ids(&events), ARRIVAL_TIMEOUT).await;
    assert_eq!(kafka_support::assert_complete_and_ordered(&events, &consumed), 0);
    sink.close().await;
}

#[tokio::test]
async fn a_queue_that_stays_full_fails_the_rest_transiently_within_the_timeout() {
    let (cluster, topic) = mock_with_topic(1);
    let mut opts = kafka_support::options(&cluster.bootstrap_servers());
    opts.extra.insert("queue.buffering.max.messages".into(), "5".into());
    opts.publish_timeout = Duration::from_secs(1);
    let sink = KafkaSink::new(opts).expect("a sink");
    cluster.broker_down(-1).expect("every broker down");
    let events = keyed(20, |seq| format!("k{}", seq % 3));
    let outcomes = tokio::time::timeout(Duration::from_secs(10), sink.publish(&route(&topic), &events))
        .await
        .expect("bounded by publish_timeout and the delivery grace");
    // The first five fill the queue and expire; space they free at expiry
    // may admit a few more, but never all fifteen.
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "");
    }
    expect_err(&outcomes[19], ErrorKind::Transient, "queue stayed full");
    cluster.broker_up(-1).expect("brokers up");
    sink.close().await;
}

/// rdkafka is built without the `ssl` and `sasl` features: TLS and SCRAM
/// fail when the sink is created, with librdkafka's reason, not at publish.
#[test]
fn what_this_librdkafka_build_cannot_do_is_refused_at_creation() {
    let cases = [
        (vec![("security.protocol", "ssl")], "OpenSSL not available"),
        (
            vec![
                ("security.protocol", "sasl_plaintext"),
                ("sasl.mechanism", "SCRAM-SHA-512"),
            ],
            "SCRAM-SHA-512",
        ),
    ];
    for (properties, reason) in cases {
        let extra = properties.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let err = KafkaSink::new(KafkaOptions {
            extra,
            ..KafkaOptions::default()
        })
        .expect_err(reason);
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.contains(reason), "{err}");
    }
    let extra = [
        ("security.protocol", "sasl_plaintext"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", "ferry"),
        ("sasl.password", "secret"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    KafkaSink::new(KafkaOptions {
        extra,
        ..KafkaOptions::default()
    })
    .expect("SASL/PLAIN is built in");
}
