//! Fatal errors of the idempotent producer: the cluster refuses it a
//! producer id. `check` refuses the sink with the cause and the fix, and
//! every event a publish fails carries them, not librdkafka's
//! "Purged in queue", as a transient error: retried, not dead at once.
//! A failed check is not repeated for every route.

use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_sink::kafka::KafkaSink;
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::kafka_support::{expect_err, keyed, options, route, sink_at, unique};

/// A cluster that answers every InitProducerId (until `answers` are used
/// up) with `error`, and a topic.
fn failing_producer_ids(
    error: RDKafkaRespErr,
    answers: usize,
) -> (MockCluster<'static, rdkafka::producer::DefaultProducerContext>, String) {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    let topic = unique("fatal");
    cluster.create_topic(&topic, 1, 1).expect("a topic");
    cluster.request_errors(RDKafkaApiKey::InitProducerId, &vec![error; answers]);
    (cluster, topic)
}

/// A cluster that refuses every InitProducerId (until `refusals` are used
/// up) as a principal without the IdempotentWrite permission, and a topic.
fn refusing_producer_ids(refusals: usize) -> (MockCluster<'static, rdkafka::producer::DefaultProducerContext>, String) {
    failing_producer_ids(RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED, refusals)
}

#[tokio::test]
async fn check_refuses_a_producer_without_the_idempotent_write_permission() {
    let (cluster, topic) = refusing_producer_ids(50);
    let sink = sink_at(&cluster.bootstrap_servers());
    for checked in [route(&topic), route("events.{domain}")] {
        let err = sink.check(&checked).await.expect_err("no producer id");
        assert_eq!(err.kind, ErrorKind::Config, "{err}");
        assert!(err.message.contains("Cluster authorization failed"), "{err}");
        assert!(err.message.contains("IdempotentWrite"), "{err}");
        assert!(err.message.contains("kafka-acls.sh"), "{err}");
    }
    cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
    sink.close().await;
}

/// A refusal met while running may pass (an ACL revoked for a moment, an
/// authorizer not ready after a broker restart): the events are retried,
/// not dead at their first attempt, and each carries the cause and the fix.
#[tokio::test]
async fn every_event_a_fatal_error_fails_names_its_cause_and_fix_and_is_retried() {
    let (cluster, topic) = refusing_producer_ids(50);
    let sink = sink_at(&cluster.bootstrap_servers());
    let mut paced = false;
    // Each publish finds the producer that failed fatally before it, makes
    // a new one (or waits to), and that one is refused too.
    for _ in 0..4 {
        for outcome in sink.publish(&route(&topic), &keyed(3, |s| format!("k{s}"))).await {
            expect_err(&outcome, ErrorKind::Transient, "IdempotentWrite");
            expect_err(&outcome, ErrorKind::Transient, "Cluster authorization failed");
            expect_err(&outcome, ErrorKind::Transient, "max_attempts");
            // While the replacement waits out its backoff, the events are
            // retried no sooner than it may be made.
            paced |= outcome.as_ref().is_err_and(|e| e.retry_after.is_some());
        }
    }
    assert!(paced, "no publish met the replacement's backoff");
    cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
    sink.close().await;
}

/// How long the second route's check may take: it does not probe again, so
/// it takes a metadata round trip, well under the probe's
/// `publish_timeout`.
const CACHED_CHECK_BOUND: Duration = Duration::from_secs(3);

/// `ferry run` checks its routes one after another: a probe that failed,
/// refused or unanswered, is not repeated for the next route, which gets
/// its error at once.
#[tokio::test]
async fn a_failed_producer_id_probe_is_not_repeated_for_the_next_route() {
    for (error, kind) in [
        (
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED,
            ErrorKind::Config,
        ),
        // Retried by librdkafka: the probe waits out publish_timeout.
        (
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE,
            ErrorKind::Transient,
        ),
    ] {
        let (cluster, topic) = failing_producer_ids(error, 10_000);
        let sink = KafkaSink::new(kafka_options(&cluster.bootstrap_servers())).expect("valid options");
        let first = sink.check(&route(&topic)).await.expect_err("no producer id");
        assert_eq!(first.kind, kind, "{first}");
        let second = tokio::time::timeout(CACHED_CHECK_BOUND, sink.check(&route("events.{domain}")))
            .await
            .unwrap_or_else(|_| panic!("{error:?}: the second route's check probed again"))
            .expect_err("no producer id");
        assert_eq!(second.kind, first.kind, "{second}");
        assert_eq!(second.message, first.message, "{error:?}");
        cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
        sink.close().await;
    }
}

/// The health probe cuts a check short (after 4 s, less than a probe may
/// take): the probe a check started runs on, and its outcome answers a
/// later check, where each check starting its own probe never got one.
#[tokio::test]
async fn checks_cut_short_leave_their_probes_outcome_for_the_next() {
    let (cluster, topic) = failing_producer_ids(RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_NOT_AVAILABLE, 10_000);
    let options = kafka_options(&cluster.bootstrap_servers());
    let deadline = tokio::time::Instant::now() + options.publish_timeout + CACHED_CHECK_BOUND;
    let sink = KafkaSink::new(options).expect("valid options");
    let err = loop {
        match tokio::time::timeout(Duration::from_millis(500), sink.check(&route(&topic))).await {
            Ok(outcome) => break outcome.expect_err("no producer id"),
            Err(_) if tokio::time::Instant::now() < deadline => {}
            Err(_) => panic!("every check cut short started a probe of its own"),
        }
    };
    assert!(
        err.message.contains("gave the idempotent producer no producer id"),
        "{err}"
    );
    cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
    sink.close().await;
}

/// A delivery by the sink's own producer proves a producer id: checks after
/// it do not probe, and a cluster that would keep a new producer waiting
/// does not fail them.
#[tokio::test]
async fn a_delivery_proves_the_producer_id() {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    let topic = unique("proven");
    cluster.create_topic(&topic, 1, 1).expect("a topic");
    let sink = KafkaSink::new(kafka_options(&cluster.bootstrap_servers())).expect("valid options");
    for outcome in sink.publish(&route(&topic), &keyed(2, |s| format!("k{s}"))).await {
        outcome.expect("delivered");
    }
    cluster.request_errors(
        RDKafkaApiKey::InitProducerId,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED; 1000],
    );
    sink.check(&route(&topic)).await.expect("proven by the delivery");
    cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
    sink.close().await;
}

/// The test sinks' options, with a probe that gives up sooner.
fn kafka_options(bootstrap: &str) -> ferry_sink::kafka::KafkaOptions {
    ferry_sink::kafka::KafkaOptions {
        publish_timeout: Duration::from_secs(6),
        ..options(bootstrap)
    }
}
