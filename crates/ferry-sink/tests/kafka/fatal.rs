//! Fatal errors of the idempotent producer: the cluster refuses it a
//! producer id. `check` refuses the sink with the cause and the fix, and
//! every event a publish fails carries them, not librdkafka's
//! "Purged in queue".

use ferry_core::{ErrorKind, Sink};
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::kafka_support::{expect_err, keyed, route, sink_at, unique};

/// A cluster that refuses every InitProducerId (until `refusals` are used
/// up) as a principal without the IdempotentWrite permission, and a topic.
fn refusing_producer_ids(refusals: usize) -> (MockCluster<'static, rdkafka::producer::DefaultProducerContext>, String) {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    let topic = unique("fatal");
    cluster.create_topic(&topic, 1, 1).expect("a topic");
    cluster.request_errors(
        RDKafkaApiKey::InitProducerId,
        &vec![RDKafkaRespErr::RD_KAFKA_RESP_ERR_CLUSTER_AUTHORIZATION_FAILED; refusals],
    );
    (cluster, topic)
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

#[tokio::test]
async fn every_event_a_fatal_error_fails_names_its_cause_and_fix() {
    let (cluster, topic) = refusing_producer_ids(50);
    let sink = sink_at(&cluster.bootstrap_servers());
    // Each publish finds the producer that failed fatally before it, makes
    // a new one (or waits to), and that one is refused too.
    for _ in 0..4 {
        for outcome in sink.publish(&route(&topic), &keyed(3, |s| format!("k{s}"))).await {
            expect_err(&outcome, ErrorKind::Config, "IdempotentWrite");
            expect_err(&outcome, ErrorKind::Config, "Cluster authorization failed");
        }
    }
    cluster.clear_request_errors(RDKafkaApiKey::InitProducerId);
    sink.close().await;
}
