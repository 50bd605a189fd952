//! `check(route)`: the topic exists (asked through metadata, which never
//! creates it), the cluster gives the idempotent producer a producer id,
//! and, when the cluster says, how large a message the topic takes.

use std::time::Duration;

use ferry_core::{ErrorKind, SinkError};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use tokio::sync::watch;
use tracing::debug;

use super::{KafkaOptions, OffRuntime, codes};

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

/// How often the producer-id probe reports its state, in milliseconds.
const PROBE_STATS_INTERVAL_MS: &str = "20";

/// Whether a producer like the sink's gets a producer id, which the
/// idempotent producer needs before it sends anything. librdkafka asks for
/// one in the background; when the cluster refuses (no IdempotentWrite
/// permission, no idempotence support) it raises a fatal error, which the
/// sink's producer would meet only at its first publish, failing every
/// message with "Purged in queue". librdkafka tells the idempotence state
/// only in its statistics, so the probe is a producer of its own that
/// reports them often, and lives only for the check. However the check
/// ends, a timeout or a caller that gives up included, the probe is
/// destroyed on a blocking thread: destroying a client blocks.
pub(super) async fn producer_id(options: &KafkaOptions) -> Result<(), SinkError> {
    let timeout = options.publish_timeout;
    let bootstrap = options.bootstrap_servers.clone();
    let (state, mut changes) = watch::channel(None);
    let mut config = options.producer_config(None);
    config.set("statistics.interval.ms", PROBE_STATS_INTERVAL_MS);
    let probe: FutureProducer<PidProbe> = config.create_with_context(PidProbe { state }).map_err(|e| {
        SinkError::config(format!(
            "creating the Kafka producer (check sinks.<kafka>.extra): {}",
            super::config_error(&e)
        ))
    })?;
    let probe = OffRuntime::new(probe);
    // A producer connects only when it needs a broker: asking for metadata
    // (twice, see `topic_exists`) leaves it one to ask for its id.
    let client = probe.clone();
    let connected = tokio::task::spawn_blocking(move || {
        client.client().fetch_metadata(None, timeout)?;
        let _ = client.client().fetch_metadata(None, timeout.min(READY_TIMEOUT));
        Ok::<_, KafkaError>(())
    })
    .await;
    match connected {
        Err(e) => Err(SinkError::transient(format!("fetching Kafka metadata: {e}"))),
        Ok(Err(e)) => Err(SinkError::transient(format!(
            "fetching metadata from Kafka at {bootstrap}: {e} (waited {timeout:?})"
        ))),
        Ok(Ok(())) => {
            let settled = |s: &Option<String>| matches!(s.as_deref(), Some("Assigned" | "FatalError"));
            let _ = tokio::time::timeout(timeout, changes.wait_for(settled)).await;
            let last = changes.borrow().clone();
            match (last.as_deref(), probe.client().fatal_error()) {
                (_, Some((code, reason))) => Err(codes::fatal_error(code, &reason)),
                (Some("Assigned"), None) => Ok(()),
                (last, None) => Err(SinkError::transient(format!(
                    "the Kafka cluster at {bootstrap} gave the idempotent producer no producer id within \
                     {timeout:?} (its state: {}); Ferry's producer sends nothing without one: check that \
                     the brokers answer InitProducerId",
                    last.unwrap_or("unknown")
                ))),
            }
        }
    }
}

/// The probe's context: passes on the idempotent producer's state
/// (`eos.idemp_state` in librdkafka's statistics).
struct PidProbe {
    state: watch::Sender<Option<String>>,
}

impl ClientContext for PidProbe {
    fn stats_raw(&self, statistics: &[u8]) {
        let Ok(stats) = serde_json::from_slice::<serde_json::Value>(statistics) else {
            return;
        };
        if let Some(now) = stats["eos"]["idemp_state"].as_str() {
            self.state.send_if_modified(|state| {
                let changed = state.as_deref() != Some(now);
                if changed {
                    *state = Some(now.to_owned());
                }
                changed
            });
        }
    }

    /// The check reports a fatal error; librdkafka's other errors (a
    /// broker not reachable yet) are the metadata fetch's to report.
    fn error(&self, error: KafkaError, reason: &str) {
        debug!(%error, reason, "producer-id probe");
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
    let admin: OffRuntime<AdminClient<DefaultClientContext>> = match config.create() {
        Ok(admin) => OffRuntime::new(admin),
        Err(e) => {
            debug!(error = %super::config_error(&e), "no admin client to read the topic's max.message.bytes");
            return None;
        }
    };
    // Dropped on a blocking thread, a check cut short included: destroying
    // a client joins its threads.
    describe_max_message_bytes(&admin, topic, timeout.min(DESCRIBE_TIMEOUT)).await
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
