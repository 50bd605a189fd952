//! The Kafka sink: an idempotent librdkafka producer with `acks=all`, the
//! event key as message key, and CloudEvents headers.
//!
//! An event is reported published only when its delivery report says the
//! partition leader and its in-sync replicas have it (`acks=all`). A batch is
//! enqueued whole, in order, then every delivery report is awaited.
//!
//! Per-key order: the key is the message key, so a key's events share a
//! partition, and with `enable.idempotence=true` and at most 5 requests in
//! flight librdkafka's internal retries cannot reorder (or duplicate) a
//! partition's messages. What it cannot undo: when the cluster stays away
//! longer than `publish_timeout`, a key's queued messages expire in order and
//! fail transiently; in the rare case that the cluster comes back between the
//! expiry of two messages of one key, the later one is delivered and the relay
//! counts an order break. Likewise when the broker refuses a record batch for
//! good (`INVALID_RECORD`, a policy violation) while later batches of its
//! partition are queued: librdkafka goes on with those. Its
//! `enable.gapless.guarantee` would stop there, but by stopping the producer,
//! which every route of the sink shares: one route's bad record would fail
//! the batches of all of them, so it is not set (and refused in `extra`). Retried events may arrive twice (a message whose
//! report timed out may have been written); consumers deduplicate on `ce_id`.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferry_sink::kafka::{KafkaOptions, KafkaSink};
//!
//! let sink = KafkaSink::new(KafkaOptions {
//!     bootstrap_servers: "kafka-1:9092,kafka-2:9092".into(),
//!     publish_timeout: Duration::from_secs(10),
//!     ..KafkaOptions::default()
//! })
//! .expect("valid options");
//! ```

mod check;
mod codes;
mod config;
mod message;
mod producer_id;
mod publish;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use tracing::{info, warn};

pub use codes::error_code_kind;
pub use config::DEFAULT_LINGER_MS;
pub use message::{CONTENT_TYPE_HEADER, SPEC_VERSION};

use crate::backoff::Backoff;
use crate::batch::log_published;
use ferry_core::prepare_in_key_order;
use message::{Limits, Record};

/// How a [`KafkaSink`] connects and publishes.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaOptions {
    /// `host:port[,host:port...]`. Default `127.0.0.1:9092`.
    pub bootstrap_servers: String,
    /// librdkafka's `message.timeout.ms`: how long a message may take from
    /// enqueue to acknowledgement, retries included; also bounds waiting
    /// for space in a full local queue and for metadata. Default 10 s.
    pub publish_timeout: Duration,
    /// Payloads larger than this are refused (permanently) before sending.
    /// librdkafka's `message.max.bytes` is set 64 KiB higher for the key,
    /// the headers and framing. Default 1,000,000 (librdkafka's default).
    pub max_message_bytes: usize,
    /// The CloudEvents `source` attribute. Default `"ferry"`.
    pub source: String,
    /// More librdkafka properties (`security.protocol`, `sasl.*`,
    /// `linger.ms` (Ferry's default is 1 ms, see [`DEFAULT_LINGER_MS`]),
    /// `compression.type`, ...). Properties the guarantees rest
    /// on (`acks`, `enable.idempotence`, ...), and a `partitioner` that
    /// does not hash the key, are refused by [`KafkaOptions::validate`].
    pub extra: BTreeMap<String, String>,
}

impl Default for KafkaOptions {
    fn default() -> Self {
        Self {
            bootstrap_servers: "127.0.0.1:9092".into(),
            publish_timeout: Duration::from_secs(10),
            max_message_bytes: 1_000_000,
            source: "ferry".into(),
            extra: BTreeMap::new(),
        }
    }
}

impl std::fmt::Debug for KafkaOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `extra` may hold SASL passwords and key material: values whose
        // name hints at a secret are hidden.
        let extra = ferry_core::redact::properties(&self.extra);
        f.debug_struct("KafkaOptions")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("publish_timeout", &self.publish_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("source", &self.source)
            .field("extra", &extra)
            .finish()
    }
}

struct Slot {
    producer: Option<FutureProducer>,
    /// The `batch.size` cap the producer was made with: the smallest
    /// `max.message.bytes` of the topics known then.
    batch_cap: Option<usize>,
    /// Paces replacements of producers that fail fatally before delivering.
    backoff: Backoff,
    /// Whether the producer delivered since it was made: the first fatal
    /// error after that is replaced at once, so the batch that finds it
    /// goes out on the new producer; only a replacement that fails again
    /// before it delivers waits out the backoff.
    delivered: bool,
    /// Counts the producers made, so that a batch finishing on a replaced
    /// one does not vouch for its successor.
    generation: u64,
    /// The last fatal error, classified as `check` reports it: while a
    /// replacement waits out the backoff, a refused producer id (a missing
    /// IdempotentWrite permission) is what check fails with and, as a
    /// transient error, what the events fail with: their cause, not a
    /// pause.
    fatal: Option<SinkError>,
}

/// Why [`KafkaSink::producer`] has no producer to give.
#[derive(Debug)]
enum NoProducer {
    /// The last producer failed fatally and its replacement waits out the
    /// backoff for `wait`; `cause` is the fatal error (see `Slot::fatal`),
    /// or says that a replacement is pending.
    Waiting { cause: SinkError, wait: Duration },
    /// A producer could not be made.
    Failed(SinkError),
}

impl NoProducer {
    /// As `check` reports it: a refused producer id is a configuration
    /// error, which start-up and `ferry check` refuse with the fix.
    fn in_check(self) -> SinkError {
        match self {
            Self::Waiting { cause, .. } | Self::Failed(cause) => cause,
        }
    }

    /// As a publish reports it: the cause, transient (see
    /// `codes::fatal_error_in_publish`), retried no sooner than the
    /// replacement may be made.
    fn in_publish(self) -> SinkError {
        match self {
            Self::Waiting { cause, wait } => codes::fatal_error_in_publish(cause.with_retry_after(wait)),
            Self::Failed(err) => err,
        }
    }
}

/// Publishes to Kafka topics through one idempotent producer shared by all
/// routes. The route's `destination` is the topic, possibly a template such
/// as `events.{domain}`; routes take no `routing_key`.
pub struct KafkaSink {
    options: KafkaOptions,
    slot: Mutex<Slot>,
    /// `max.message.bytes` of the topics routed to, as far as read.
    topic_limits: Arc<Mutex<TopicLimits>>,
    /// The producer compresses record batches (`extra`), read once.
    compresses: bool,
    /// Whether a producer of this sink's options gets a producer id, as
    /// far as known: checks (one per route, and the health probe's) ask
    /// the cluster once, not each.
    producer_ids: Arc<producer_id::ProducerIds>,
}

/// How long a topic's `max.message.bytes`, or its being unreadable, stands
/// before it is read again.
const TOPIC_LIMIT_TTL: Duration = Duration::from_secs(600);
/// At most this many topics are read and remembered (a template such as
/// `events.{key}` may name a topic per key); beyond them the broker alone
/// judges a message's size.
const MAX_TOPICS_READ: usize = 1024;

/// The topics' limits, read by `check` at start-up and, in the background,
/// when a publish first names a topic (a template's, or one `check` could
/// not read), and again after [`TOPIC_LIMIT_TTL`].
#[derive(Default)]
struct TopicLimits {
    limits: HashMap<String, usize>,
    /// When each topic read (or being read) may be read again.
    due: HashMap<String, Instant>,
}

impl TopicLimits {
    fn record(&mut self, topic: &str, limit: Option<usize>) {
        self.due.insert(topic.to_owned(), Instant::now() + TOPIC_LIMIT_TTL);
        // Unread now, a limit read before still stands.
        if let Some(limit) = limit {
            self.limits.insert(topic.to_owned(), limit);
        }
    }

    /// Of `topics`, those to read now; marked as being read.
    fn claim<'a>(&mut self, topics: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let now = Instant::now();
        let mut claimed = Vec::new();
        for topic in topics {
            let due = match self.due.get(topic) {
                Some(due) => *due <= now,
                None => self.due.len() < MAX_TOPICS_READ,
            };
            if due {
                self.due.insert(topic.to_owned(), now + TOPIC_LIMIT_TTL);
                claimed.push(topic.to_owned());
            }
        }
        claimed
    }

    /// The smallest limit known: the producer's record batches stay under it.
    fn batch_cap(&self) -> Option<usize> {
        self.limits.values().copied().min()
    }
}

impl KafkaSink {
    /// Validates the options and creates the producer. librdkafka connects
    /// in the background and reconnects on its own, so the sink can be
    /// created while the cluster is down.
    pub fn new(options: KafkaOptions) -> Result<Self, SinkError> {
        options.validate()?;
        let producer = create_producer(&options, None)?;
        Ok(Self {
            slot: Mutex::new(Slot {
                producer: Some(producer),
                batch_cap: None,
                backoff: Backoff::new(Duration::from_secs(30)),
                delivered: true,
                generation: 0,
                fatal: None,
            }),
            compresses: options.compresses(),
            producer_ids: Arc::new(producer_id::ProducerIds::new()),
            options,
            topic_limits: Arc::new(Mutex::new(TopicLimits::default())),
        })
    }

    pub fn options(&self) -> &KafkaOptions {
        &self.options
    }

    /// The producer, replaced first if librdkafka raised a fatal error
    /// (possible with idempotence, e.g. after an unrecoverable sequence gap):
    /// a producer in that state refuses everything until it is recreated.
    /// With it, its generation.
    fn producer(&self) -> Result<(FutureProducer, u64), NoProducer> {
        let batch_cap = self
            .topic_limits
            .lock()
            .expect("the topic limits are never poisoned")
            .batch_cap();
        let mut slot = self.slot.lock().expect("the producer slot is never poisoned");
        // The broker refuses a whole record batch over the topic's limit,
        // every event in it: the producer must not build one.
        if let Some(cap) = batch_cap
            && slot.batch_cap.is_none_or(|made| cap < made)
            && let Some(old) = slot.producer.take()
        {
            info!(
                limit = cap,
                "remaking the Kafka producer to keep its batches under a topic's max.message.bytes"
            );
            // Publishes in flight hold their own handle.
            drop_client(old);
        }
        if let Some(producer) = &slot.producer {
            match producer.client().fatal_error() {
                None => return Ok((producer.clone(), slot.generation)),
                Some((code, reason)) => {
                    warn!(%code, %reason, "Kafka producer hit a fatal error; replacing it");
                    if let Some(failed) = slot.producer.take() {
                        drop_client(failed);
                    }
                    if !std::mem::replace(&mut slot.delivered, false) {
                        slot.backoff
                            .failed(Instant::now(), format!("fatal producer error {code}: {reason}"));
                    }
                    let fatal = codes::fatal_error(code, &reason);
                    if !fatal.is_transient() {
                        // The health probe's check reports it, not an older proof.
                        self.producer_ids.refused(fatal.clone(), Instant::now());
                    }
                    slot.fatal = Some(fatal);
                }
            }
        }
        if let Err(wait) = slot.backoff.ready(Instant::now()) {
            let cause = match slot.fatal.as_ref().filter(|e| !e.is_transient()) {
                Some(fatal) => fatal.clone(),
                None => SinkError::transient(format!(
                    "the Kafka producer is being replaced; next attempt in {wait:?} (last error: {})",
                    slot.backoff.last_error().unwrap_or("none")
                )),
            };
            return Err(NoProducer::Waiting { cause, wait });
        }
        let producer = create_producer(&self.options, batch_cap).map_err(NoProducer::Failed)?;
        slot.batch_cap = batch_cap;
        info!(bootstrap = %self.options.bootstrap_servers, "created a new Kafka producer");
        crate::connected("kafka");
        slot.producer = Some(producer.clone());
        slot.generation += 1;
        Ok((producer, slot.generation))
    }

    /// Fails with the cause and the fix when the cluster will not give this
    /// sink's producer a producer id (see `check::producer_id`). Asked until
    /// a probe or a delivery proves it; a failure stands for
    /// `producer_id::FAILED_PROBE_TTL`, and checks meanwhile (the next
    /// route's, the health probe's) return it at once.
    async fn check_producer_id(&self) -> Result<(), SinkError> {
        let mut settled = match self.producer_ids.next(Instant::now()) {
            producer_id::Next::Known(outcome) => return outcome,
            producer_id::Next::Wait(settled) => settled,
            producer_id::Next::Probe(send) => {
                let settled = send.subscribe();
                let options = self.options.clone();
                let known = self.producer_ids.clone();
                // Apart from the caller: a check cut short (the health
                // probe's limit) still leaves the outcome for the next one.
                tokio::spawn(async move {
                    let outcome = check::producer_id(&options).await;
                    known.settle(&outcome, Instant::now());
                    send.send_replace(Some(outcome));
                });
                settled
            }
        };
        match settled.wait_for(Option::is_some).await {
            Ok(outcome) => outcome.clone().expect("waited for an outcome"),
            Err(_) => Err(SinkError::transient(
                "the Kafka producer-id check ended without an outcome; it is asked again at the next check",
            )),
        }
    }

    fn prepare(&self, route: &Route, event: &StoredEvent) -> Result<Record, SinkError> {
        let record = Record::prepare(route, event, &self.options.source)?;
        // A topic's max.message.bytes is checked against the record batch
        // as it is sent, compressed if the producer compresses: a record
        // over it may fit once compressed, so it is left to the broker.
        // `batch.size` stays capped at the limit, so such a record goes
        // in a batch of its own, and a refusal fails it alone.
        let topic_max = if self.compresses {
            None
        } else {
            self.topic_limits
                .lock()
                .expect("the topic limits are never poisoned")
                .limits
                .get(&record.topic)
                .copied()
        };
        let limits = Limits {
            max_payload: self.options.max_message_bytes,
            max_record: self.options.max_record_bytes(),
            topic_max,
        };
        record.admit(&route.sink, limits)?;
        Ok(record)
    }

    /// Reads, in the background, the limits of the topics `records` go to
    /// that are not known or not fresh. A broker that does not answer
    /// DescribeConfigs would hold a publish for seconds: until a topic's
    /// limit is known, the broker's refusal of an oversized record (retried)
    /// is the check, and the retry finds it refused before sending.
    fn learn_limits(&self, records: &[Result<Record, SinkError>]) {
        let topics: BTreeSet<&str> = records.iter().flatten().map(|r| r.topic.as_str()).collect();
        let claimed = self
            .topic_limits
            .lock()
            .expect("the topic limits are never poisoned")
            .claim(topics);
        if claimed.is_empty() {
            return;
        }
        let config = self.options.client_config();
        let timeout = self.options.publish_timeout;
        let limits = self.topic_limits.clone();
        tokio::spawn(async move {
            for topic in claimed {
                let limit = check::topic_max_message_bytes(&config, &topic, timeout).await;
                limits
                    .lock()
                    .expect("the topic limits are never poisoned")
                    .record(&topic, limit);
            }
        });
    }
}

/// Drops a librdkafka client where its destruction, which purges, flushes
/// for up to half a second and joins its threads, blocks no runtime worker:
/// on a blocking thread when in a runtime.
fn drop_client<T: Send + 'static>(client: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(client))),
        Err(_) => drop(client),
    }
}

/// A librdkafka client dropped with [`drop_client`] however its holder ends,
/// a future cut short included.
struct OffRuntime<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> OffRuntime<T> {
    fn new(client: T) -> Self {
        Self(Some(client))
    }
}

impl<T: Send + 'static> std::ops::Deref for OffRuntime<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("held until dropped")
    }
}

impl<T: Send + 'static> Drop for OffRuntime<T> {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop_client(client);
        }
    }
}

fn create_producer(options: &KafkaOptions, batch_cap: Option<usize>) -> Result<FutureProducer, SinkError> {
    options.producer_config(batch_cap).create().map_err(|e| {
        SinkError::config(format!(
            "creating the Kafka producer (check sinks.<kafka>.extra): {}",
            config_error(&e)
        ))
    })
}

/// `err` without the property's value, which librdkafka's own text quotes:
/// `extra` may hold a SASL password under a misspelt name.
pub fn config_error(err: &KafkaError) -> String {
    match err {
        KafkaError::ClientConfig(_, description, property, _value) => {
            format!("{description} (property {property:?}; its value is not shown)")
        }
        other => other.to_string(),
    }
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `extra` may hold SASL passwords: only its keys are shown.
        f.debug_struct("KafkaSink")
            .field("bootstrap_servers", &self.options.bootstrap_servers)
            .field("publish_timeout", &self.options.publish_timeout)
            .field("extra", &self.options.extra.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Sink for KafkaSink {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        self.prepare(route, event).map(drop)
    }

    /// `publish` prepares the batch in key order before it sends any of it.
    fn admits_in_publish(&self) -> bool {
        true
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let (producer, generation) = match self.producer() {
            Ok(made) => made,
            Err(no) => return vec![Err(no.in_publish()); events.len()],
        };
        // The relay admits events first; checking again keeps a direct caller
        // from sending what admit() would have refused, out of key order.
        let prepared = prepare_in_key_order(events, |event| self.prepare(route, event));
        self.learn_limits(&prepared);
        let outcomes = publish::publish_batch(&producer, events, prepared, self.options.publish_timeout).await;
        log_published("Kafka", route, events, &outcomes);
        if outcomes.iter().any(Result::is_ok) {
            // The idempotent producer delivers nothing without a producer
            // id: checks need not probe for one.
            self.producer_ids.proven();
            // A producer that delivers is healthy: a later fatal error is
            // replaced at once, and the backoff starts from its base again.
            let mut slot = self.slot.lock().expect("the producer slot is never poisoned");
            if slot.generation == generation {
                slot.delivered = true;
                slot.fatal = None;
                slot.backoff.succeeded();
            }
        }
        outcomes
    }

    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        if route.routing_key.is_some() {
            return Err(SinkError::config(format!(
                "route {:?}: Kafka routes take no routing_key (the message key is the event key); \
                 remove routes[].routing_key",
                route.name
            )));
        }
        let (producer, _) = self.producer().map_err(NoProducer::in_check)?;
        // The slot holds the producer, but a replacement may take it meanwhile.
        let producer = OffRuntime::new(producer);
        let opts = &self.options;
        let topic = route.destination.as_str();
        // A template names many topics, known only per event: connectivity
        // and the producer id are all there is to check.
        if topic.contains('{') {
            check::topic_exists(
                &producer,
                &route.name,
                None,
                &opts.bootstrap_servers,
                opts.publish_timeout,
            )
            .await?;
            return self.check_producer_id().await;
        }
        message::validate_topic(topic).map_err(|why| {
            SinkError::config(format!("route {:?}: routes[].destination {topic:?} {why}", route.name))
        })?;
        check::topic_exists(
            &producer,
            &route.name,
            Some(topic),
            &opts.bootstrap_servers,
            opts.publish_timeout,
        )
        .await?;
        self.check_producer_id().await?;
        let limit = check::topic_max_message_bytes(&opts.client_config(), topic, opts.publish_timeout).await;
        self.topic_limits
            .lock()
            .expect("the topic limits are never poisoned")
            .record(topic, limit);
        Ok(())
    }

    async fn close(&self) {
        let producer = self
            .slot
            .lock()
            .expect("the producer slot is never poisoned")
            .producer
            .clone();
        let Some(producer) = producer else { return };
        let timeout = self.options.publish_timeout;
        match tokio::task::spawn_blocking(move || producer.flush(timeout)).await {
            Ok(Ok(())) => info!("flushed the Kafka producer"),
            Ok(Err(e)) => warn!(error = %e, "messages were still unacknowledged when the Kafka sink closed"),
            Err(e) => warn!(error = %e, "flushing the Kafka producer"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_is_read_once_per_ttl_and_only_so_many_topics_are_read() {
        let mut limits = TopicLimits::default();
        let topics = |names: &[&'static str]| names.to_vec();
        assert_eq!(limits.claim(topics(&["a", "b"])), ["a", "b"]);
        assert!(limits.claim(topics(&["a", "b"])).is_empty(), "being read");
        limits.record("a", Some(4096));
        limits.record("b", None);
        assert!(limits.claim(topics(&["a", "b"])).is_empty(), "read lately");
        assert_eq!(limits.batch_cap(), Some(4096));
        // Due again: a failed read keeps the limit read before.
        limits.due.insert("a".into(), Instant::now());
        assert_eq!(limits.claim(topics(&["a"])), ["a"]);
        limits.record("a", None);
        assert_eq!(limits.limits.get("a"), Some(&4096));
        let many: BTreeSet<String> = (0..2 * MAX_TOPICS_READ).map(|i| format!("t{i:05}")).collect();
        assert_eq!(limits.claim(many.iter().map(String::as_str)).len(), MAX_TOPICS_READ - 2);
    }

    /// A topic's limit applies to the record batch as sent: compressed, a
    /// record larger than the limit may fit, and refusing it before sending
    /// sent it dead. Uncompressed, it is refused before sending, naming the
    /// topic's limit.
    #[test]
    fn a_topics_limit_refuses_a_record_before_sending_only_without_compression() {
        let route = Route {
            name: "big".into(),
            matcher: ferry_core::Glob::new("**").unwrap(),
            sink: "kafka".into(),
            destination: "big".into(),
            routing_key: None,
        };
        let payload = serde_json::json!({ "text": "a".repeat(1_500_000) });
        let event = ferry_testkit::sink_suite::event(1, "test.item.created", Some("k"), payload);
        for (compression, admitted) in [(None, false), (Some("none"), false), (Some("lz4"), true)] {
            let mut extra = BTreeMap::new();
            if let Some(codec) = compression {
                extra.insert("compression.type".to_owned(), codec.to_owned());
            }
            let sink = KafkaSink::new(KafkaOptions {
                bootstrap_servers: "127.0.0.1:1".into(),
                max_message_bytes: 2_000_000,
                extra,
                ..KafkaOptions::default()
            })
            .unwrap();
            sink.topic_limits.lock().unwrap().record("big", Some(1_048_588));
            match sink.admit(&route, &event) {
                Ok(()) => assert!(admitted, "{compression:?}: admitted"),
                Err(e) => {
                    assert!(!admitted, "{compression:?}: {e}");
                    assert!(e.message.contains("max.message.bytes is 1048588"), "{e}");
                }
            }
        }
    }

    /// Raises a fatal error in the sink's current producer, as librdkafka
    /// does after an unrecoverable idempotence failure.
    fn fail_fatally(sink: &KafkaSink) {
        let slot = sink.slot.lock().unwrap();
        let producer = slot.producer.as_ref().expect("a producer");
        let reason = c"injected by a test";
        // SAFETY: the client pointer is live while `producer` is borrowed,
        // and the reason is a NUL-terminated string.
        let raised = unsafe {
            rdkafka::bindings::rd_kafka_test_fatal_error(
                producer.client().native_ptr(),
                rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
                reason.as_ptr(),
            )
        };
        assert_eq!(raised, rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR);
        assert!(producer.client().fatal_error().is_some());
    }

    #[tokio::test]
    async fn a_fatal_error_is_replaced_at_once_and_a_replacement_failing_again_waits() {
        let cluster = rdkafka::mocking::MockCluster::new(1).expect("a mock cluster");
        cluster.create_topic("fatal", 1, 1).expect("a topic");
        let sink = KafkaSink::new(KafkaOptions {
            bootstrap_servers: cluster.bootstrap_servers(),
            ..KafkaOptions::default()
        })
        .unwrap();
        let route = Route {
            name: "fatal".into(),
            matcher: ferry_core::Glob::new("**").unwrap(),
            sink: "kafka".into(),
            destination: "fatal".into(),
            routing_key: None,
        };
        let events: Vec<StoredEvent> = (0..3)
            .map(|seq| {
                ferry_testkit::sink_suite::event(seq, "test.item.created", Some("k"), serde_json::json!({ "seq": seq }))
            })
            .collect();
        let delivered = |outcomes: Vec<PublishOutcome>| outcomes.iter().all(Result::is_ok);
        assert!(delivered(sink.publish(&route, &events).await));
        // A producer that delivered fails fatally: the batch that finds it
        // goes out on a new one, not refused for a pause.
        fail_fatally(&sink);
        assert!(delivered(sink.publish(&route, &events).await));
        fail_fatally(&sink);
        assert!(delivered(sink.publish(&route, &events).await));
        // A replacement that fails before it delivers is not remade at once
        // again: producers failing as they are made would loop.
        fail_fatally(&sink);
        drop(sink.producer().expect("replaced at once"));
        fail_fatally(&sink);
        let outcomes = sink.publish(&route, &events).await;
        for outcome in &outcomes {
            let err = outcome.as_ref().expect_err("waiting to replace");
            assert!(err.is_transient() && err.message.contains("being replaced"), "{err}");
        }
    }

    #[test]
    fn a_property_librdkafka_refuses_is_named_without_its_value() {
        let mut options = KafkaOptions::default();
        options.extra.insert("sasl.pasword".into(), "hunter2".into());
        let Err(err) = create_producer(&options, None) else {
            panic!("librdkafka took a property it does not have")
        };
        assert!(err.message.contains("sasl.pasword"), "{err}");
        assert!(!err.message.contains("hunter2"), "{err}");
    }

    #[test]
    fn debug_output_hides_secret_properties_and_shows_the_rest() {
        let mut options = KafkaOptions {
            bootstrap_servers: "kafka-host:9092".into(),
            ..KafkaOptions::default()
        };
        options.extra.insert("sasl.password".into(), "s3cr3t-pw".into());
        options
            .extra
            .insert("ssl.key.pem".into(), "-----BEGIN PRIVATE KEY-----".into());
        options.extra.insert("security.protocol".into(), "sasl_ssl".into());
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
        assert!(shown.contains("sasl.password"), "{shown}");
        assert!(shown.contains("sasl_ssl"), "{shown}");
        assert!(shown.contains("kafka-host:9092"), "{shown}");
    }
}
