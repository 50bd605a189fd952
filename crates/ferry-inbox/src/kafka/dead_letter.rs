//! The dead-letter topic. A record is dead-lettered before its offset is
//! committed, so a record that cannot be holds its partition where it is:
//! the topic is checked before the consumer joins its group, and again when
//! a dead-letter produce fails, to say so rather than rejoin for ever.

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;

use super::{DEAD_GROUP_HEADER, DEAD_REASON_HEADER, DEAD_SOURCE_HEADER, Failure, KafkaConsumerOptions};

/// Whether the dead-letter topic exists, asked with a consumer client (which
/// does not create topics); an error when the cluster cannot say.
pub(super) async fn topic_exists(o: &KafkaConsumerOptions) -> Result<bool, String> {
    let config = o.consumer_config();
    let (topic, timeout) = (o.dead_letter_topic.clone(), o.timeout);
    // librdkafka's metadata call blocks.
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config
            .create()
            .map_err(|e| format!("creating the Kafka client: {}", super::kafka_config_error(&e)))?;
        let metadata = client
            .fetch_metadata(Some(&topic), timeout)
            .map_err(|e| format!("fetching the metadata of dead_letter_topic {topic:?}: {e}"))?;
        match metadata.topics().iter().find(|t| t.name() == topic) {
            None => Ok(false),
            Some(t) => match t.error() {
                None => Ok(!t.partitions().is_empty()),
                Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => Ok(false),
                Some(e) => Err(format!("the metadata of dead_letter_topic {topic:?} says {e:?}")),
            },
        }
    })
    .await
    .map_err(|e| format!("checking dead_letter_topic: {e}"))?
}

/// The refusal for a missing dead-letter topic.
pub(super) fn missing(o: &KafkaConsumerOptions) -> String {
    format!(
        "dead_letter_topic {:?} does not exist: a record given up on could not be set aside and its partition \
         would stop at it; create the topic (kafka-topics.sh --create --topic {}) or name one that exists",
        o.dead_letter_topic, o.dead_letter_topic
    )
}

/// Produces a copy of the record, with its reason, to the dead-letter
/// topic; an error ends the session before the offset is committed, so the
/// record is read (and dead-lettered) again rather than lost. If the topic
/// is gone, the consumer stops, saying so.
pub(super) async fn produce(
    o: &KafkaConsumerOptions,
    producer: &FutureProducer,
    message: &BorrowedMessage<'_>,
    reason: &str,
) -> Result<(), Failure> {
    let mut headers = OwnedHeaders::new();
    if let Some(original) = message.headers() {
        for h in original.iter() {
            headers = headers.insert(h);
        }
    }
    let source = format!("{} {} {}", message.topic(), message.partition(), message.offset());
    let reason = crate::runner::bounded_reason(reason);
    for (key, value) in [
        (DEAD_REASON_HEADER, reason),
        (DEAD_GROUP_HEADER, o.group.as_str()),
        (DEAD_SOURCE_HEADER, source.as_str()),
    ] {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    let mut record = FutureRecord::to(&o.dead_letter_topic)
        .payload(message.payload().unwrap_or_default())
        .headers(headers);
    if let Some(key) = message.key() {
        record = record.key(key);
    }
    let Err((e, _)) = producer.send(record, o.timeout).await else {
        return Ok(());
    };
    let failed = format!("dead-lettering {source} to {:?}: {e}", o.dead_letter_topic);
    // Refused for good: sent again it would be refused again, and the
    // consumer would rejoin for ever with its partition stopped.
    if let Some(code) = e.rdkafka_error_code().filter(|code| refused_for_good(*code)) {
        return Err(Failure::Refused(format!(
            "{failed}; the dead-letter topic refuses this record for good ({code:?}): raise the topic's \
             max.message.bytes, or grant the consumer's user Write on it; the record stays uncommitted until then"
        )));
    }
    match topic_exists(o).await {
        Ok(false) => Err(Failure::Refused(format!(
            "{failed}; {}; the record stays uncommitted until then",
            missing(o)
        ))),
        _ => Err(Failure::Lost(failed)),
    }
}

/// Whether a produce refused with `code` would be refused again.
fn refused_for_good(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
    )
}
