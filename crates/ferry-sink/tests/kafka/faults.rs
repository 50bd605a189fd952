//! Faults injected by librdkafka's mock cluster while a few thousand events
//! drain in batches: failed produce requests and dropped connections (which
//! librdkafka retries internally), and a broker lost in the middle of a
//! batch (which the relay retries).

use std::collections::{BTreeMap, HashSet};
use std::pin::pin;
use std::time::Duration;

use ferry_core::{ErrorKind, PublishOutcome, Route, Sink, StoredEvent};
use ferry_sink::kafka::KafkaSink;
use ferry_testkit::sink_suite::ARRIVAL_TIMEOUT;
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::kafka_support::{
    TopicReader, assert_complete_and_ordered, explain_missing, ids, keyed, options, route, unique,
};

const EVENTS: i64 = 3000;
const BATCH: usize = 300;
const KEYS: i64 = 30;

/// Events of a key after a failed one of the same key that were still
/// confirmed in the same batch: they reached Kafka out of order.
fn order_breaks(batch: &[StoredEvent], outcomes: &[PublishOutcome]) -> usize {
    let mut failed = HashSet::new();
    let mut breaks = 0;
    for (e, o) in batch.iter().zip(outcomes) {
        let key = e.key.as_deref().expect("keyed");
        match o {
            Err(_) => {
                failed.insert(key);
            }
            Ok(()) if failed.contains(key) => breaks += 1,
            Ok(()) => {}
        }
    }
    breaks
}

#[tokio::test]
async fn internal_retries_of_failed_produce_requests_keep_every_key_in_order() {
    let cluster = MockCluster::new(3).expect("a mock cluster");
    let topic = unique("retries");
    cluster.create_topic(&topic, 6, 3).expect("a topic");
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let mut opts = options(&bootstrap);
    // One produce request per partition per batch: nothing leaves the
    // producer until 200 ms after the first record, far longer than
    // enqueueing a batch takes, so a failed request never has a follower of
    // its partition in flight. The mock cannot play that case: it checks
    // idempotent sequence numbers only for transactional producers, so it
    // appends a follower a broker would refuse (OUT_OF_ORDER_SEQUENCE_NUMBER),
    // and librdkafka, reading the follower's success as proof that the failed
    // request was stored, acks the failed request's records without their
    // ever being written ("IMPLICITACK ... implicitly acked by subsequent
    // batch success", rd_kafka_dr_implicit_ack). That is right against a
    // broker and loses records against the mock. The requests of the other
    // partitions led by the same broker are still in flight when __TRANSPORT
    // drops the connection.
    opts.extra.insert("linger.ms".into(), "200".into());
    // Retries through six injected errors take seconds on a loaded 2-core
    // host; the test is about their order, not their speed.
    opts.publish_timeout = Duration::from_secs(30);
    let sink = KafkaSink::new(opts).expect("a sink");
    let to = route(&topic);
    let events = keyed(EVENTS, |seq| format!("k{}", seq % KEYS));

    // Each error fails the next Produce request; __TRANSPORT makes the broker
    // drop the connection, failing every request in flight on it. The drain
    // makes more Produce requests than there are errors (one a partition per
    // batch, and the retries), so all of them are used up. Every event must arrive once, in its key's order.
    use RDKafkaRespErr::*;
    let errors = [
        RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
        RD_KAFKA_RESP_ERR__TRANSPORT,
        RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
        RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        RD_KAFKA_RESP_ERR__TRANSPORT,
        RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
    ];
    for (i, batch) in events.chunks(BATCH).enumerate() {
        if i % 2 == 1 {
            cluster.request_errors(RDKafkaApiKey::Produce, &errors);
        }
        let outcomes = sink.publish(&to, batch).await;
        for (e, o) in batch.iter().zip(&outcomes) {
            assert_eq!(o, &Ok(()), "event {}: librdkafka should have retried", e.seq);
        }
    }
    let consumed = reader.read_until(&ids(&events), ARRIVAL_TIMEOUT).await;
    explain_missing(&bootstrap, &topic, &events, &consumed).await;
    let duplicates = assert_complete_and_ordered(&events, &consumed);
    assert_eq!(duplicates, 0, "the idempotent producer wrote an event twice");
    sink.close().await;
}

#[tokio::test]
async fn a_broker_lost_mid_batch_loses_nothing_and_keeps_every_key_in_order() {
    let cluster = MockCluster::new(3).expect("a mock cluster");
    let topic = unique("broker-down");
    cluster.create_topic(&topic, 6, 1).expect("a topic");
    for partition in 0..6 {
        cluster
            .partition_leader(&topic, partition, Some(partition % 3 + 1))
            .expect("a leader");
    }
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let mut opts = options(&bootstrap);
    opts.publish_timeout = Duration::from_secs(3);
    opts.extra.insert("reconnect.backoff.max.ms".into(), "500".into());
    // Nothing leaves the producer until 100 ms after the first message of a
    // batch, far longer than enqueueing one takes: broker 1 is down before
    // any of round 3 is sent to it.
    opts.extra.insert("linger.ms".into(), "100".into());
    let sink = KafkaSink::new(opts).expect("a sink");
    let to: Route = route(&topic);
    let events = keyed(EVENTS, |seq| format!("k{}", seq % KEYS));

    // The relay's loop: claim the oldest pending events, publish, keep the
    // failures pending for the next round.
    let mut pending: BTreeMap<i64, StoredEvent> = events.iter().map(|e| (e.seq, e.clone())).collect();
    let mut failures = 0;
    let mut breaks = 0;
    let mut round = 0;
    while !pending.is_empty() {
        round += 1;
        assert!(
            round < 60,
            "{} events still failing after {round} rounds",
            pending.len()
        );
        let batch: Vec<StoredEvent> = pending.values().take(BATCH).cloned().collect();
        let outcomes = if round == 3 {
            let mut publish = pin!(sink.publish(&to, &batch));
            // The first poll enqueues the whole batch; the broker goes away
            // before librdkafka has had a chance to send it.
            assert!(futures::poll!(publish.as_mut()).is_pending(), "delivered at once");
            cluster.broker_down(1).expect("broker 1 down");
            let outcomes = publish.await;
            let failed = outcomes.iter().filter(|o| o.is_err()).count();
            assert!(failed > 0, "losing broker 1 failed nothing");
            assert!(failed < batch.len(), "brokers 2 and 3 were up: {outcomes:?}");
            for o in outcomes.iter().filter(|o| o.is_err()) {
                crate::kafka_support::expect_err(o, ErrorKind::Transient, "");
            }
            cluster.broker_up(1).expect("broker 1 up");
            outcomes
        } else {
            sink.publish(&to, &batch).await
        };
        assert_eq!(outcomes.len(), batch.len());
        breaks += order_breaks(&batch, &outcomes);
        for (e, o) in batch.iter().zip(&outcomes) {
            match o {
                Ok(()) => {
                    pending.remove(&e.seq);
                }
                Err(err) => {
                    assert_eq!(err.kind, ErrorKind::Transient, "event {}: {err}", e.seq);
                    failures += 1;
                }
            }
        }
    }
    assert!(failures > 0, "the fault never hit");
    assert_eq!(
        breaks, 0,
        "events were confirmed after an earlier event of their key failed"
    );

    let consumed = reader.read_until(&ids(&events), ARRIVAL_TIMEOUT).await;
    explain_missing(&bootstrap, &topic, &events, &consumed).await;
    let duplicates = assert_complete_and_ordered(&events, &consumed);
    eprintln!("{failures} failed deliveries retried over {round} rounds; {duplicates} duplicates");
    sink.close().await;
}

#[tokio::test]
async fn a_record_batch_refused_as_too_large_is_retried_not_dead() {
    // The broker refuses a whole record batch over the topic's limit, and
    // librdkafka does not split it: every event packed with the one that
    // tipped it over gets MessageSizeTooLarge, small as each may be.
    let cluster = MockCluster::new(1).expect("a mock cluster");
    let topic = unique("batch-too-large");
    cluster.create_topic(&topic, 1, 1).expect("a topic");
    let bootstrap = cluster.bootstrap_servers();
    let reader = TopicReader::new(&bootstrap, &topic).await;
    let sink = KafkaSink::new(options(&bootstrap)).expect("a sink");
    let to = route(&topic);
    let events = keyed(20, |seq| format!("k{}", seq % 4));
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let outcomes = sink.publish(&to, &events).await;
    assert!(outcomes.iter().any(Result::is_err), "the injected error was not used");
    for (e, o) in events.iter().zip(&outcomes) {
        if let Err(err) = o {
            assert_eq!(err.kind, ErrorKind::Transient, "event {}: {err}", e.seq);
            assert!(err.message.contains("batch.size"), "{err}");
        }
    }
    // Sent again, as the relay does, they all go through.
    let failed: Vec<StoredEvent> = events
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| o.is_err())
        .map(|(e, _)| e.clone())
        .collect();
    for (e, o) in failed.iter().zip(sink.publish(&to, &failed).await) {
        assert_eq!(o, Ok(()), "event {}", e.seq);
    }
    let consumed = reader.read_until(&ids(&events), ARRIVAL_TIMEOUT).await;
    explain_missing(&bootstrap, &topic, &events, &consumed).await;
    sink.close().await;
}
