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
        | C::UnsupportedForMessageFormat
        | C::BadMessage => ErrorKind::Permanent,
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
        // NotEnoughReplicas(AfterAppend), LeaderNotAvailable,
        // NotLeaderForPartition, RequestTimedOut, BrokerNotAvailable,
        // NetworkException, KafkaStorageError, UnknownPartition, QueueFull, Purge*, Fatal (the producer is replaced), the idempotence
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
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => SinkError::transient(format!(
            "topic {topic:?} does not exist, as the cluster tells it now ({err}): retried, since a broker out \
             of sync can say so of a topic in use, and dead after max_attempts; if it persists, create the \
             topic or fix routes[].destination"
        )),
        _ => from_kafka(&format!("delivering to {topic:?}"), err),
    }
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
            C::BadMessage,
        ] {
            assert_eq!(error_code_kind(code), ErrorKind::Permanent, "{code:?}");
        }
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
}
