//! One pipelined batch: enqueue every record to the producer in order, then
//! await every delivery report.
//!
//! Order: librdkafka keeps a partition's messages in enqueue order, and the
//! idempotent producer (at most 5 requests in flight) keeps that order through
//! its internal retries: the broker accepts each partition's batches only in
//! sequence-number order, and librdkafka resends refused followers after the
//! retried batch. A key always maps to one partition, so per-key order is the
//! enqueue order, which is the batch order.

use std::collections::HashSet;
use std::time::Duration;

use ferry_core::{PublishOutcome, SinkError, StoredEvent};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio::time::{Instant, sleep, timeout_at};

use super::codes;
use super::message::Record;

/// How often a full local queue is retried while the producer drains it.
const QUEUE_FULL_POLL: Duration = Duration::from_millis(5);
/// librdkafka scans for expired messages about once a second; a delivery
/// report for a message that hit `message.timeout.ms` may come this much
/// later before the sink gives up on it.
pub(crate) const DELIVERY_GRACE: Duration = Duration::from_secs(5);

enum Fate {
    Decided(PublishOutcome),
    InFlight { topic: String, delivery: DeliveryFuture },
}

pub(super) async fn publish_batch(
    producer: &FutureProducer,
    events: &[StoredEvent],
    prepared: Vec<Result<Record, SinkError>>,
    publish_timeout: Duration,
) -> Vec<PublishOutcome> {
    let fates = enqueue(producer, events, prepared, publish_timeout).await;
    // Every report comes within message.timeout.ms of its enqueue; the
    // deadline only guards against a report that never comes.
    let deadline = Instant::now() + publish_timeout + DELIVERY_GRACE;
    let mut outcomes = Vec::with_capacity(fates.len());
    for fate in fates {
        let outcome = match fate {
            Fate::Decided(outcome) => outcome,
            // timeout_at polls the future before the clock, so reports that
            // are in already still count after the deadline.
            Fate::InFlight { topic, delivery } => match timeout_at(deadline, delivery).await {
                Ok(Ok(Ok(_delivery))) => Ok(()),
                Ok(Ok(Err((err, _message)))) => {
                    Err(fatal_cause(producer, &err).unwrap_or_else(|| codes::delivery_error(&topic, &err)))
                }
                Ok(Err(_canceled)) => Err(SinkError::transient(format!(
                    "delivering to {topic:?}: the producer was closed before the delivery report"
                ))),
                Err(_) => Err(SinkError::transient(format!(
                    "delivering to {topic:?}: no delivery report within {:?}",
                    publish_timeout + DELIVERY_GRACE
                ))),
            },
        };
        outcomes.push(outcome);
    }
    outcomes
}

/// Hands the records to librdkafka in slice order. A full local queue is
/// waited out (bounded by `publish_timeout`), never skipped: skipping would
/// let a later event of a key overtake the one that did not fit. A record
/// librdkafka refuses outright holds back the later events of its key.
async fn enqueue(
    producer: &FutureProducer,
    events: &[StoredEvent],
    prepared: Vec<Result<Record, SinkError>>,
    publish_timeout: Duration,
) -> Vec<Fate> {
    let deadline = Instant::now() + publish_timeout;
    let mut refused: HashSet<&str> = HashSet::new();
    let mut queue_full: Option<SinkError> = None;
    let mut fates = Vec::with_capacity(prepared.len());
    for (event, record) in events.iter().zip(prepared) {
        let key = event.key.as_deref();
        let record = match (record, &queue_full) {
            (Err(e), _) => {
                fates.push(Fate::Decided(Err(e)));
                continue;
            }
            (Ok(_), Some(err)) => {
                fates.push(Fate::Decided(Err(err.clone())));
                continue;
            }
            (Ok(_), None) if key.is_some_and(|k| refused.contains(k)) => {
                fates.push(Fate::Decided(Err(SinkError::held_back(format!(
                    "held back: an earlier event of key {:?} in this batch was refused by the producer",
                    key.unwrap_or_default()
                )))));
                continue;
            }
            (Ok(record), None) => record,
        };
        let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
        for (name, value) in &record.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut future_record = FutureRecord::<[u8], [u8]>::to(&record.topic)
            .payload(&record.payload[..])
            .headers(headers)
            .timestamp(record.timestamp_ms);
        if let Some(k) = &record.key {
            future_record = future_record.key(k.as_bytes());
        }
        let fate = loop {
            match producer.send_result(future_record) {
                Ok(delivery) => {
                    break Fate::InFlight {
                        topic: record.topic.clone(),
                        delivery,
                    };
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    future_record = back;
                    sleep(QUEUE_FULL_POLL).await;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    let err = SinkError::transient(format!(
                        "not sent: librdkafka's local queue stayed full for {publish_timeout:?} \
                         (queue.buffering.max.messages / queue.buffering.max.kbytes)"
                    ));
                    queue_full = Some(err.clone());
                    break Fate::Decided(Err(err));
                }
                Err((err, _)) => {
                    if let Some(k) = key {
                        refused.insert(k);
                    }
                    let err = fatal_cause(producer, &err).unwrap_or_else(|| codes::enqueue_error(&record.topic, &err));
                    break Fate::Decided(Err(err));
                }
            }
        };
        fates.push(fate);
    }
    fates
}

/// The cause of a record's failure when the producer failed fatally: its
/// records then fail `Purged in queue` or `Fatal`, which name no cause, and
/// without it an operator would see only those. Transient, as every fatal
/// error is in a publish (see `codes::fatal_error_in_publish`).
fn fatal_cause(producer: &FutureProducer, err: &KafkaError) -> Option<SinkError> {
    if !codes::follows_fatal(err) {
        return None;
    }
    let (code, reason) = producer.client().fatal_error()?;
    Some(codes::fatal_error_in_publish(codes::fatal_error(code, &reason)))
}
