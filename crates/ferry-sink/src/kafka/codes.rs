//! librdkafka and Kafka protocol error codes, classified once so the rest of
//! the sink branches on an [`ErrorKind`] instead of on text.

use RDKafkaErrorCode as C;
use ferry_core::{ErrorKind, SinkError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// How a failure carrying this error code should be handled.
///
/// Codes Kafka itself calls retriable (leader moves, under-replication,
/// timeouts, lost connections) are transient; librdkafka has usually retried
/// them already by the time they reach a delivery report, and the relay's own
/// retry policy bounds what is left. Only faults retrying cannot cure are
/// permanent (this message is unacceptable) or configuration errors (the
/// route or the credentials are wrong).
///
/// `UnknownTopicOrPartition` (3) and librdkafka's local `UnknownTopic`
/// (-188) are transient, though they usually mean that the route names a
/// topic that does not exist (Ferry never auto-creates topics; `ferry
/// check` and the relay's start refuse such a route as a configuration
/// error). librdkafka's grace for a topic's metadata to propagate
/// (`topic.metadata.propagation.max.ms`) covers only a topic it has not
/// seen yet: one metadata answer from a broker out of sync that leaves out
/// a topic in use fails every message to it at once, and a configuration
/// error would make each of them dead on its first attempt. Retried, a
/// topic that is really gone still ends dead after `max_attempts`, with
/// the fix in its reason.
///
/// librdkafka's local `BadMessage` (-199, "Bad message format") is
/// transient too: a producer meets it when it cannot parse the broker's
/// answer to a produce request, and marks the records it sent possibly
/// persisted. The events are not at fault; retried, a fault that persists
/// still ends dead after `max_attempts`.
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::kafka::error_code_kind;
/// use rdkafka::error::RDKafkaErrorCode;
/// assert_eq!(error_code_kind(RDKafkaErrorCode::MessageSizeTooLarge), ErrorKind::Permanent);
/// assert_eq!(error_code_kind(RDKafkaErrorCode::NotEnoughReplicas), ErrorKind::Transient);
/// ```
pub fn error_code_kind(code: RDKafkaErrorCode) -> ErrorKind {
    match code {
        // The message itself is unacceptable; sending it again changes nothing.
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::MessageBatchTooLarge
        | C::InvalidRecord
        | C::InvalidTimestamp
        | C::InvalidTopic
        | C::PolicyViolation
        | C::UnsupportedForMessageFormat => ErrorKind::Permanent,
        // The route, the credentials or the cluster do not fit the sink.
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState
        | C::Authentication
        | C::SecurityDisabled
        | C::InvalidRequiredAcks
        | C::UnsupportedFeature => ErrorKind::Config,
        // MessageTimedOut, BrokerTransportFailure, AllBrokersDown,
        // NotEnoughReplicas(AfterAppend), LeaderNotAvailable, BadMessage,
        // NotLeaderForPartition, RequestTimedOut, BrokerNotAvailable,
        // NetworkException, KafkaStorageError, UnknownPartition, QueueFull,
        // Purge* and Fatal (an event failed by the producer's fatal error
        // carries that error instead, see `fatal_error`), the idempotence
        // sequence errors, and codes this table does not know.
        _ => ErrorKind::Transient,
    }
}

/// Classifies an rdkafka error; errors without a code (a cancelled delivery
/// future, a client that could not be created) are transient.
pub(crate) fn from_kafka(context: &str, err: &KafkaError) -> SinkError {
    let kind = err.rdkafka_error_code().map_or(ErrorKind::Transient, error_code_kind);
    with_kind(kind, format!("{context}: {err}"))
}

/// The outcome of a failed delivery to `topic`; a missing topic says how to
/// fix it.
pub(crate) fn delivery_error(topic: &str, err: &KafkaError) -> SinkError {
    match err.rdkafka_error_code() {
        // The broker refuses a whole record batch, and librdkafka does not
        // split one it refused: every event packed with an oversized one, or
        // into a batch over the topic's limit, gets this. Events over a
        // limit the sink knows are refused before sending; these are
        // retried (alone or in smaller company, they may pass) and dead
        // after max_attempts.
        Some(C::MessageSizeTooLarge | C::MessageBatchTooLarge) => SinkError::transient(format!(
            "delivering to {topic:?}: the broker refused the record batch carrying this event as too \
             large ({err}); librdkafka refuses a whole batch, so this event or another sent with it is \
             over the topic's max.message.bytes: retried, and dead after max_attempts if it is this \
             event; keep sinks.<kafka>.extra.\"batch.size\" below the topic's max.message.bytes"
        )),
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => missing_topic(topic, err),
        _ => from_kafka(&format!("delivering to {topic:?}"), err),
    }
}

/// The outcome of a record librdkafka refused as it was enqueued. Once its
/// wait for a new topic's metadata (`topic.metadata.propagation.max.ms`)
/// is over, librdkafka refuses a record to a topic the cluster says is
/// missing here, at once, instead of in a delivery report: the same fix
/// applies.
pub(crate) fn enqueue_error(topic: &str, err: &KafkaError) -> SinkError {
    match err.rdkafka_error_code() {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => missing_topic(topic, err),
        _ => from_kafka(&format!("enqueueing for {topic:?}"), err),
    }
}

fn missing_topic(topic: &str, err: &KafkaError) -> SinkError {
    SinkError::transient(format!(
        "topic {topic:?} does not exist, as the cluster tells it now ({err}): retried, since a broker out \
         of sync can say so of a topic in use, and dead after max_attempts; if it persists, create the \
         topic or fix routes[].destination"
    ))
}

/// Whether a failed record's error is what librdkafka gives every record a
/// producer held when it failed fatally (or was handed afterwards): the
/// producer's fatal error, not this code, is the cause.
pub(crate) fn follows_fatal(err: &KafkaError) -> bool {
    matches!(
        err.rdkafka_error_code(),
        Some(C::Fatal | C::PurgeQueue | C::PurgeInflight)
    )
}

/// A fatal error of the idempotent producer (`rd_kafka_fatal_error`),
/// classified with its fix, as `check` reports it. Without a producer id
/// the producer sends nothing: a principal without the IdempotentWrite
/// permission, or a cluster without idempotence, is a configuration error
/// that start-up and `ferry check` refuse. A fenced producer, or one that
/// lost its sequence, is replaced and the event retried. A publish reports
/// every fatal error through [`fatal_error_in_publish`].
pub(crate) fn fatal_error(code: RDKafkaErrorCode, reason: &str) -> SinkError {
    match code {
        C::ClusterAuthorizationFailed => SinkError::config(format!(
            "the Kafka producer got no producer id ({reason}): Ferry's producer is idempotent, which \
             per-key order rests on, and its principal lacks the IdempotentWrite permission on the \
             cluster; grant it (kafka-acls.sh --add --allow-principal User:<name> --operation \
             IdempotentWrite --cluster; on Kafka 3.0 and later WRITE on a topic implies it), or fix the \
             principal in sinks.<kafka>.extra (sasl.username)"
        )),
        C::UnsupportedFeature | C::UnsupportedVersion => SinkError::config(format!(
            "the Kafka producer got no producer id ({reason}): the cluster does not support the \
             idempotent producer, which Ferry's per-key order rests on; use brokers that support \
             InitProducerId (Kafka 0.11 or later, or a compatible server that implements it)"
        )),
        C::Fenced | C::ProducerFenced | C::InvalidProducerEpoch => SinkError::transient(format!(
            "the Kafka producer was fenced ({reason}); it is replaced by a new one and the event retried"
        )),
        _ => with_kind(
            error_code_kind(code),
            format!("the Kafka producer failed fatally ({code}: {reason}); it is replaced by a new one"),
        ),
    }
}

/// A fatal error (see [`fatal_error`]) as a publish reports it: transient,
/// with the same cause and fix. The error is the producer's, never the
/// event's, and a refusal met while running may pass (an ACL revoked for a
/// moment, an authorizer not ready after a broker restart): failing the
/// events as a configuration error would send each of them dead at its
/// first attempt, to be requeued by hand. Retried, they go dead only after
/// `relay.max_attempts`, with the cause as their last error.
pub(crate) fn fatal_error_in_publish(fatal: SinkError) -> SinkError {
    if fatal.is_transient() {
        return fatal;
    }
    let mut err = SinkError::transient(format!(
        "{}; the event is retried, and dead after relay.max_attempts",
        fatal.message
    ));
    err.retry_after = fatal.retry_after;
    err
}

pub(crate) fn with_kind(kind: ErrorKind, message: String) -> SinkError {
    match kind {
        ErrorKind::Permanent => SinkError::permanent(message),
        ErrorKind::Config => SinkError::config(message),
        _ => SinkError::transient(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_itself_is_refused_permanently() {
        for code in [
            C::MessageSizeTooLarge,
            C::InvalidMessageSize,
            C::MessageBatchTooLarge,
            C::InvalidRecord,
            C::InvalidTimestamp,
            C::InvalidTopic,
            C::PolicyViolation,
            C::UnsupportedForMessageFormat,
        ] {
            assert_eq!(error_code_kind(code), ErrorKind::Permanent, "{code:?}");
        }
    }

    /// librdkafka gives `BadMessage` to records whose produce response it
    /// could not parse, marking them possibly persisted: the answer is at
    /// fault, not the events.
    #[test]
    fn an_unparsable_produce_response_is_transient() {
        assert_eq!(error_code_kind(C::BadMessage), ErrorKind::Transient);
        let err = delivery_error("orders", &KafkaError::MessageProduction(C::BadMessage));
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    }

    #[test]
    fn misconfiguration_is_a_config_error() {
        for code in [
            C::TopicAuthorizationFailed,
            C::ClusterAuthorizationFailed,
            C::TransactionalIdAuthorizationFailed,
            C::SaslAuthenticationFailed,
            C::UnsupportedSASLMechanism,
            C::IllegalSASLState,
            C::Authentication,
            C::SecurityDisabled,
            C::InvalidRequiredAcks,
            C::UnsupportedFeature,
        ] {
            assert_eq!(error_code_kind(code), ErrorKind::Config, "{code:?}");
        }
    }

    #[test]
    fn outages_and_leader_moves_are_transient() {
        for code in [
            C::MessageTimedOut,
            C::BrokerTransportFailure,
            C::AllBrokersDown,
            C::NotEnoughReplicas,
            C::NotEnoughReplicasAfterAppend,
            C::LeaderNotAvailable,
            C::NotLeaderForPartition,
            C::RequestTimedOut,
            C::BrokerNotAvailable,
            C::NetworkException,
            C::KafkaStorageError,
            C::UnknownPartition,
            C::QueueFull,
            C::PurgeQueue,
            C::PurgeInflight,
            C::Fatal,
            C::OutOfOrderSequenceNumber,
            C::UnknownProducerId,
            C::InvalidProducerEpoch,
            C::ThrottlingQuotaExceeded,
            C::InvalidMessage,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::Unknown,
        ] {
            assert_eq!(error_code_kind(code), ErrorKind::Transient, "{code:?}");
        }
    }

    #[test]
    fn kafka_errors_keep_their_context() {
        let err = from_kafka(
            "delivering to \"orders\"",
            &KafkaError::MessageProduction(C::MessageSizeTooLarge),
        );
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.starts_with("delivering to \"orders\": "), "{}", err.message);
        assert_eq!(
            from_kafka("x", &KafkaError::MessageProduction(C::UnknownTopic)).kind,
            ErrorKind::Transient
        );
        assert_eq!(from_kafka("x", &KafkaError::Canceled).kind, ErrorKind::Transient);
        let err = delivery_error("orders", &KafkaError::MessageProduction(C::UnknownTopicOrPartition));
        assert_eq!(err.kind, ErrorKind::Transient);
        assert!(
            err.message.contains("topic \"orders\" does not exist"),
            "{}",
            err.message
        );
        assert!(err.message.contains("routes[].destination"), "{}", err.message);
        let err = delivery_error("orders", &KafkaError::MessageProduction(C::MessageTimedOut));
        assert_eq!(err.kind, ErrorKind::Transient);
        assert!(err.message.starts_with("delivering to \"orders\""), "{}", err.message);
    }

    #[test]
    fn a_topic_refused_as_missing_on_enqueue_names_the_fix() {
        for code in [C::UnknownTopic, C::UnknownTopicOrPartition] {
            let err = enqueue_error("orders", &KafkaError::MessageProduction(code));
            assert_eq!(err.kind, ErrorKind::Transient, "{code:?}");
            assert!(
                err.message.contains("topic \"orders\" does not exist"),
                "{}",
                err.message
            );
            assert!(err.message.contains("routes[].destination"), "{}", err.message);
        }
        let err = enqueue_error("orders", &KafkaError::MessageProduction(C::MessageSizeTooLarge));
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(
            err.message.starts_with("enqueueing for \"orders\": "),
            "{}",
            err.message
        );
    }

    /// `check` refuses a producer id the cluster will not give; a publish
    /// retries it, with the same cause and fix.
    #[test]
    fn a_refused_producer_id_fails_check_as_config_and_a_publish_as_transient_with_its_cause() {
        let pid = "Failed to acquire idempotence PID";
        let refused = [
            (
                fatal_error(C::ClusterAuthorizationFailed, pid),
                [pid, "IdempotentWrite", "kafka-acls.sh"],
            ),
            (
                fatal_error(C::UnsupportedFeature, "not supported"),
                ["not supported", "idempotent producer", "InitProducerId"],
            ),
        ];
        for (err, texts) in refused {
            assert_eq!(err.kind, ErrorKind::Config, "{err}");
            let wait = std::time::Duration::from_millis(800);
            let published = fatal_error_in_publish(err.clone().with_retry_after(wait));
            assert_eq!(published.kind, ErrorKind::Transient, "{published}");
            assert_eq!(published.retry_after, Some(wait));
            assert!(published.message.starts_with(&err.message), "{published}");
            assert!(published.message.contains("relay.max_attempts"), "{published}");
            for text in texts {
                assert!(err.message.contains(text), "{text}: {err}");
            }
        }
    }

    #[test]
    fn a_fenced_producer_or_a_lost_sequence_is_retried_everywhere() {
        for code in [C::Fenced, C::ProducerFenced, C::OutOfOrderSequenceNumber] {
            let err = fatal_error(code, "why");
            assert_eq!(err.kind, ErrorKind::Transient, "{code:?}");
            assert!(
                err.message.contains("why") && err.message.contains("replaced"),
                "{}",
                err.message
            );
            assert_eq!(fatal_error_in_publish(err.clone()), err);
        }
        assert!(follows_fatal(&KafkaError::MessageProduction(C::PurgeQueue)));
        assert!(!follows_fatal(&KafkaError::MessageProduction(C::MessageTimedOut)));
    }
}
