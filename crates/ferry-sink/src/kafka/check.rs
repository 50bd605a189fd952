//! `check(route)`: the topic exists (asked through metadata, which never
//! creates it) and, when the cluster says, how large a message it takes.

use std::time::Duration;

use ferry_core::{ErrorKind, SinkError};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, Producer};
use tracing::debug;

use super::codes;

/// The longest the second metadata request (see `topic_exists`) may take.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Fetches metadata for `topic` (or, with `None`, for the cluster: a
/// connectivity check) and fails if the topic does not exist.
pub(super) async fn topic_exists(
    producer: &FutureProducer,
    route: &str,
    topic: Option<&str>,
    bootstrap: &str,
    timeout: Duration,
) -> Result<(), SinkError> {
    let client = producer.clone();
    let wanted = topic.map(str::to_owned);
    // fetch_metadata blocks its thread until the broker answers. Asked
    // twice: the first answer comes over the bootstrap connection, which
    // librdkafka closes once it knows the brokers; the second comes from a
    // broker the producer keeps, and a metadata answer from a connected
    // broker is what makes the idempotent producer ask for its producer id
    // at once. With one fetch it asked on its next half-second retry, and
    // a relay's first batch after start-up could wait for that.
    let fetched = tokio::task::spawn_blocking(move || {
        let first = client.client().fetch_metadata(wanted.as_deref(), timeout)?;
        // Best effort: the first answer already settled the check.
        let readying = timeout.min(READY_TIMEOUT);
        Ok(client
            .client()
            .fetch_metadata(wanted.as_deref(), readying)
            .unwrap_or(first))
    })
    .await
    .map_err(|e| SinkError::transient(format!("fetching Kafka metadata: {e}")))?;
    let metadata = fetched.map_err(|e| {
        let err = codes::from_kafka(&format!("fetching metadata from Kafka at {bootstrap}"), &e);
        if err.kind == ErrorKind::Transient {
            SinkError::transient(format!("{} (waited {timeout:?})", err.message))
        } else {
            err
        }
    })?;
    let Some(topic) = topic else {
        return Ok(());
    };
    let missing = || {
        SinkError::config(format!(
            "route {route:?}: topic {topic:?} does not exist on the Kafka cluster at {bootstrap}; \
             create it (e.g. kafka-topics.sh --create --topic {topic}) or fix routes[].destination \
             (Ferry never relies on broker-side topic auto-creation)"
        ))
    };
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Err(missing());
    };
    match found.error().map(RDKafkaErrorCode::from) {
        None if found.partitions().is_empty() => Err(missing()),
        None => Ok(()),
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => Err(missing()),
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => Err(SinkError::config(format!(
            "route {route:?}: not authorized to access topic {topic:?}; grant the producer's \
             principal WRITE and DESCRIBE on it"
        ))),
        Some(code) => Err(codes::with_kind(
            codes::error_code_kind(code),
            format!("route {route:?}: metadata for topic {topic:?} reports {code}"),
        )),
    }
}

/// The longest a read of a topic's configuration waits. Brokers without
/// DescribeConfigs (librdkafka's mock cluster, some Kafka-compatible
/// servers) never answer, and the limit is only an early warning.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The topic's `max.message.bytes`, if the cluster answers DescribeConfigs.
/// Best effort: a cluster that does not (or a principal without
/// DESCRIBE_CONFIGS) leaves the check to the broker at publish time, which
/// refuses the record batch carrying an oversized message with
/// `MessageSizeTooLarge` (retried, see `codes::delivery_error`).
pub(super) async fn topic_max_message_bytes(config: &ClientConfig, topic: &str, timeout: Duration) -> Option<usize> {
    let admin: AdminClient<DefaultClientContext> = match config.create() {
        Ok(admin) => admin,
        Err(e) => {
            debug!(error = %super::config_error(&e), "no admin client to read the topic's max.message.bytes");
            return None;
        }
    };
    let limit = describe_max_message_bytes(&admin, topic, timeout.min(DESCRIBE_TIMEOUT)).await;
    // Dropping a client joins its threads: not on the runtime's.
    tokio::task::spawn_blocking(move || drop(admin));
    limit
}

async fn describe_max_message_bytes(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
    timeout: Duration,
) -> Option<usize> {
    let options = AdminOptions::new().request_timeout(Some(timeout));
    let resource = ResourceSpecifier::Topic(topic);
    let describe = admin.describe_configs([&resource], &options);
    let results = match tokio::time::timeout(timeout, describe).await {
        Ok(Ok(results)) => results,
        Ok(Err(e)) => {
            debug!(error = %e, topic, "could not read the topic's configuration");
            return None;
        }
        Err(_) => {
            debug!(topic, "no answer to DescribeConfigs within {timeout:?}");
            return None;
        }
    };
    let resource = match results.into_iter().next()? {
        Ok(resource) => resource,
        Err(code) => {
            debug!(%code, topic, "could not read the topic's configuration");
            return None;
        }
    };
    let value = resource.get("max.message.bytes")?.value.as_deref()?;
    value.parse().ok()
}
