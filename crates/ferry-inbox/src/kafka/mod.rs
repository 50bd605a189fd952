//! A Kafka consumer that drives the [`Inbox`]: a member of a consumer group
//! whose offsets are committed only after the inbox commit, one record at a
//! time, so each partition is handled in order; dead and malformed records
//! go to a dead-letter topic before their offset is committed.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_inbox::Inbox;
//! use ferry_inbox::kafka::{KafkaConsumer, KafkaConsumerOptions};
//! let options = KafkaConsumerOptions::new("127.0.0.1:9092", "orders", "billing", "orders.dead");
//! let consumer = KafkaConsumer::new(Inbox::new(pool, "billing")?, options)?;
//! consumer
//!     .run(async |tx, event| {
//!         sqlx::query("INSERT INTO paid (id) VALUES ($1)").bind(event.id.0).execute(tx).await?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! A record whose handler fails is retried in place after its backoff:
//! Kafka has no per-record redelivery, and skipping ahead would break the
//! partition's order. While it waits, the records behind it in its
//! partition wait too, that partition paused; the member's other
//! partitions go on, and the consumer goes on polling the group, so a
//! backoff longer than `max.poll.interval.ms` does not cost it its
//! membership. When the wait is over the partition is sought back to the
//! record and resumed. After the inbox's last attempt the record is
//! dead-lettered and the partition moves on. (A single handler run must still end within
//! `max.poll.interval.ms`, 300 s unless `extra` says otherwise.)
//!
//! Offsets are committed without waiting for the group's coordinator: a
//! coordinator that is away holds back no record (a commit waiting for it
//! took up to `session.timeout.ms` per record, on a runtime thread). A
//! commit that fails is logged and made again with the next one. A consumer
//! that dies, or a partition that moves to another member before its offset
//! is committed, is read again from the last committed offset, and the inbox
//! skips what was done.
//!
//! A committed offset that fell out of its partition's log (records deleted
//! by retention or `kafka-delete-records` before the group read them) is
//! moved by librdkafka to `auto.offset.reset`, which only librdkafka's log
//! says: the consumer reads it there, logs an error and counts the records
//! skipped in [`metrics::LOST`].

mod dead_letter;
mod decode;
mod reset;

use std::collections::{BTreeMap, HashSet};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use sqlx::PgConnection;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

pub use decode::decode;

use crate::runner::{Counters, Reconnect, check_inbox, stopped_by_inbox};
use crate::{ConsumerError, ConsumerReport, HandlerError, Inbox, InboxError, Outcome, ReceivedEvent, metrics};

/// Header of a dead-lettered record: why it was given up on.
pub const DEAD_REASON_HEADER: &str = "ferry-dead-reason";
/// Header of a dead-lettered record: the consumer group that gave up on it.
pub const DEAD_GROUP_HEADER: &str = "ferry-dead-group";
/// Header of a dead-lettered record: topic, partition and offset it came from.
pub const DEAD_SOURCE_HEADER: &str = "ferry-dead-source";

/// How a [`KafkaConsumer`] connects, what it reads, and where dead records go.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConsumerOptions {
    /// `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    pub topic: String,
    /// The consumer group (`group.id`).
    pub group: String,
    /// Where dead and malformed records are produced (acks from all
    /// replicas, idempotent) before their offset is committed.
    pub dead_letter_topic: String,
    /// Bounds each dead-letter produce and each seek back to a record set
    /// aside during a retry. Default 10 s.
    pub timeout: Duration,
    /// The longest pause between reconnection attempts. Default 10 s.
    pub reconnect_max_delay: Duration,
    /// How long a record waits before it is tried again when the inbox's
    /// database cannot be reached. Default 1 s.
    pub database_retry_delay: Duration,
    /// More librdkafka consumer properties (`security.protocol`, `sasl.*`,
    /// `auto.offset.reset`, ...); `enable.auto.commit` is refused.
    pub extra: BTreeMap<String, String>,
}

/// The dead-letter producer's local limit on a request, unless `extra`
/// sets `message.max.bytes`: librdkafka's default of 1,000,000 bytes is
/// below what a topic may hold with a reason added.
const DEAD_LETTER_MAX_BYTES: &str = "16777216";

/// What the dead-letter producer sets itself, or must not take from the
/// consumer's `extra`: an idempotent producer with `acks=all` refuses to be
/// created with more than 5 requests in flight, say, and a consumer that
/// could never dead-letter would never start.
const DEAD_LETTER_OWN: [&str; 13] = [
    "bootstrap.servers",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "transactional.id",
    "enable.gapless.guarantee",
    // Without a report for what it delivered, a dead letter would wait for
    // ever.
    "delivery.report.only.error",
    "retries",
    "message.send.max.retries",
];

impl KafkaConsumerOptions {
    pub fn new(
        bootstrap_servers: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
        dead_letter_topic: impl Into<String>,
    ) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            topic: topic.into(),
            group: group.into(),
            dead_letter_topic: dead_letter_topic.into(),
            timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(10),
            database_retry_delay: Duration::from_secs(1),
            extra: BTreeMap::new(),
        }
    }

    /// The value of `extra."auto.offset.reset"` if it sends a partition
    /// without a usable committed offset to the end of its log.
    fn resets_to_end(&self) -> Option<&str> {
        self.extra
            .get("auto.offset.reset")
            .map(String::as_str)
            .filter(|v| ["latest", "largest", "end"].contains(&v.trim().to_ascii_lowercase().as_str()))
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        for (field, value) in [
            ("bootstrap_servers", &self.bootstrap_servers),
            ("topic", &self.topic),
            ("group", &self.group),
            ("dead_letter_topic", &self.dead_letter_topic),
        ] {
            if value.trim().is_empty() {
                return Err(ConsumerError::Config(format!("{field} is empty; name it")));
            }
        }
        if self.dead_letter_topic == self.topic {
            return Err(ConsumerError::Config(
                "dead_letter_topic is the topic read; use a topic of its own".into(),
            ));
        }
        for key in ["enable.auto.commit", "enable.auto.offset.store", "group.id"] {
            if self.extra.contains_key(key) {
                return Err(ConsumerError::Config(format!(
                    "extra.{key} is set; the consumer sets it itself (offsets are committed only after the inbox commit), remove it"
                )));
            }
        }
        crate::runner::check_timeouts(self.timeout, self.reconnect_max_delay)
    }

    fn consumer(&self) -> Result<Member, String> {
        let mut config = self.consumer_config();
        // librdkafka reports an offset reset only as a warning in its log
        // (see `reset`), and rdkafka sets its log level from the `log`
        // crate's: an application that logs errors only, or none, would
        // hide it.
        if (config.log_level as i32) < RDKafkaLogLevel::Warning as i32 {
            config.set_log_level(RDKafkaLogLevel::Warning);
        }
        config
            .create_with_context(MemberContext::default())
            .map_err(|e| format!("creating the Kafka consumer: {}", kafka_config_error(&e)))
    }

    fn consumer_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap_servers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest");
        for (k, v) in &self.extra {
            config.set(k, v);
        }
        config
    }

    /// The dead-letter producer: `extra` as the consumer has it (security,
    /// TLS verification, DNS and address family alike: a producer that
    /// cannot reach the cluster the consumer reads would leave a dead record
    /// stuck for ever), librdkafka ignoring the consumer's own properties,
    /// but for [`DEAD_LETTER_OWN`], then what a dead letter needs. A dead letter carries the record and a
    /// reason, so it may be larger than any record the consumer read: the
    /// local limit is raised (the topic's own still applies) unless `extra`
    /// sets one.
    fn producer(&self) -> Result<FutureProducer, String> {
        let mut config = ClientConfig::new();
        config.set("message.max.bytes", DEAD_LETTER_MAX_BYTES);
        for (k, v) in &self.extra {
            if !DEAD_LETTER_OWN.contains(&k.as_str()) {
                config.set(k, v);
            }
        }
        config
            .set("bootstrap.servers", &self.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", self.timeout.as_millis().to_string());
        config
            .create()
            .map_err(|e| format!("creating the dead-letter producer: {}", kafka_config_error(&e)))
    }
}

impl std::fmt::Debug for KafkaConsumerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `extra` may hold SASL passwords and key material: values whose
        // name hints at a secret are hidden.
        let extra = ferry_core::redact::properties(&self.extra);
        f.debug_struct("KafkaConsumerOptions")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("timeout", &self.timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("database_retry_delay", &self.database_retry_delay)
            .field("extra", &extra)
            .finish()
    }
}

/// A client that could not be made, without the property's value, which
/// librdkafka's own text quotes: `extra` may hold a SASL password under a
/// misspelt name.
fn kafka_config_error(err: &rdkafka::error::KafkaError) -> String {
    match err {
        rdkafka::error::KafkaError::ClientConfig(_, description, property, _value) => {
            format!("{description} (property {property:?}; its value is not shown)")
        }
        other => other.to_string(),
    }
}

/// Consumes one topic, as one member of a group, into one [`Inbox`].
#[derive(Debug, Clone)]
pub struct KafkaConsumer {
    inbox: Inbox,
    options: KafkaConsumerOptions,
    counters: Arc<Counters>,
}

/// The group member: a consumer whose offset commits report back.
type Member = StreamConsumer<MemberContext>;

/// What the member keeps beside its consumer: it logs offset commits that
/// failed (commits are asynchronous; their results come back while the
/// consumer polls), picks the offset resets out of librdkafka's log for the
/// session to report ([`reset`]), and tracks which partitions may hand out
/// replays.
///
/// Kafka says nothing of a record delivered before, so after each
/// assignment of a partition every record read from it may be one whose
/// attempt a process died in (read again from the committed offset), and
/// the inbox marks its attempt's start ([`Inbox::process_redelivered`]),
/// until the first record the inbox processes anew: the partition is read
/// in order, and a member handles no record before the one before it is
/// done, so what follows that one was never handled, and is not marked.
#[derive(Default)]
struct MemberContext {
    /// Partitions that had a record processed anew since their assignment.
    settled: Mutex<HashSet<(String, i32)>>,
    resets: reset::Resets,
}

impl MemberContext {
    fn may_replay(&self, topic: &str, partition: i32) -> bool {
        let settled = self.settled.lock().unwrap_or_else(|e| e.into_inner());
        !settled.contains(&(topic.to_owned(), partition))
    }

    fn settle(&self, topic: &str, partition: i32) {
        let mut settled = self.settled.lock().unwrap_or_else(|e| e.into_inner());
        settled.insert((topic.to_owned(), partition));
    }
}

impl ClientContext for MemberContext {
    /// Forwards librdkafka's log as rdkafka does by default (to `tracing`
    /// here), keeping the offset resets it reports.
    fn log(&self, level: RDKafkaLogLevel, fac: &str, line: &str) {
        use RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => error!(target: "librdkafka", "librdkafka: {fac} {line}"),
            L::Warning => warn!(target: "librdkafka", "librdkafka: {fac} {line}"),
            L::Notice | L::Info => info!(target: "librdkafka", "librdkafka: {fac} {line}"),
            L::Debug => debug!(target: "librdkafka", "librdkafka: {fac} {line}"),
        }
        // Resets librdkafka made for an error are warnings; a group's first
        // start, without a committed offset, is a debug line.
        if fac == "OFFSET"
            && (level as i32) <= L::Warning as i32
            && let Some(reset) = reset::parse(line)
        {
            self.resets.push(reset);
        }
    }
}

impl ConsumerContext for MemberContext {
    /// A partition assigned (again) or taken away is read from its
    /// committed offset next: replays may come first.
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(partitions) | Rebalance::Revoke(partitions) = rebalance {
            let mut settled = self.settled.lock().unwrap_or_else(|e| e.into_inner());
            for p in partitions.elements() {
                settled.remove(&(p.topic().to_owned(), p.partition()));
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                let offsets: Vec<String> = offsets
                    .elements()
                    .iter()
                    .map(|p| format!("{}/{}@{:?}", p.topic(), p.partition(), p.offset()))
                    .collect();
                warn!(error = %e, offsets = %offsets.join(","), "offset commit failed; the next commit makes it again, and until one lands these records are read again after a restart or rebalance (the inbox skips them)");
            }
        }
    }
}

/// Why a session ended, other than by shutdown.
enum Failure {
    /// The cluster could not be reached or a call failed: join again.
    Lost(String),
    /// The dead-letter topic does not exist: do not go on.
    Refused(String),
    /// The inbox cannot use its table: do not go on.
    Inbox(InboxError),
}

impl From<String> for Failure {
    fn from(error: String) -> Self {
        Failure::Lost(error)
    }
}

impl KafkaConsumer {
    /// Checks the options; connects only in [`KafkaConsumer::run`].
    pub fn new(inbox: Inbox, options: KafkaConsumerOptions) -> Result<Self, ConsumerError> {
        options.validate()?;
        Ok(Self {
            inbox,
            options,
            counters: Arc::default(),
        })
    }

    /// The counts so far, across every run of this consumer.
    pub fn report(&self) -> ConsumerReport {
        self.counters.snapshot()
    }

    /// Consumes until `shutdown` resolves, running `handler` for each event
    /// inside the inbox's transaction. A record waiting out a retry when
    /// `shutdown` resolves is left uncommitted, for the group to read again.
    pub async fn run(
        &self,
        handler: impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerReport, ConsumerError> {
        let mut shutdown = pin!(shutdown);
        let mut reconnect = Reconnect::new(self.options.reconnect_max_delay);
        let what = format!("Kafka topic {}", self.options.topic);
        check_inbox(&self.inbox, &what).await?;
        if let Some(latest) = self.options.resets_to_end() {
            warn!(
                topic = %self.options.topic,
                group = %self.options.group,
                "extra.auto.offset.reset is {latest:?}: a new group starts at the end of the topic, and so does \
                 a group whose committed offset falls out of the log (retention or kafka-delete-records removed \
                 records before it read them), skipping every record still retained; each such jump is logged \
                 and counted in ferry_inbox_lost_total{{reason=\"offset_reset\"}}; remove the setting (earliest) \
                 once the group has committed offsets"
            );
        }
        loop {
            let mut started = false;
            let error = match self.session(&handler, shutdown.as_mut(), &mut started).await {
                Ok(()) => break,
                Err(Failure::Lost(e)) => e,
                Err(Failure::Refused(why)) => {
                    error!(topic = %self.options.topic, group = %self.options.group, "consumer stops: {why}");
                    return Err(ConsumerError::Config(why));
                }
                Err(Failure::Inbox(e)) => return Err(stopped_by_inbox(&self.inbox, &what, e)),
            };
            if !reconnect
                .after_loss(started, &self.counters, &what, &error, shutdown.as_mut())
                .await
            {
                break;
            }
        }
        info!(topic = %self.options.topic, "consumer stopped");
        Ok(self.report())
    }

    /// One group membership; `Ok` on shutdown. Sets `started` once it got
    /// as far as consuming: a session that then lasted long enough starts
    /// the reconnect pause over.
    async fn session(
        &self,
        handler: &impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        shutdown: Pin<&mut impl Future<Output = ()>>,
        started: &mut bool,
    ) -> Result<(), Failure> {
        let o = &self.options;
        if !dead_letter::topic_exists(o).await? {
            return Err(Failure::Refused(dead_letter::missing(o)));
        }
        let consumer = o.consumer()?;
        let producer = o.producer()?;
        consumer
            .subscribe(&[o.topic.as_str()])
            .map_err(|e| format!("subscribing to {:?}: {e}", o.topic))?;
        *started = true;
        let result = self.consume(handler, &consumer, &producer, shutdown).await;
        // Offer again what failed to commit before; it goes out as the
        // consumer leaves the group.
        commit_stored(&consumer);
        // Leave the group now rather than when the coordinator's session
        // timeout expires, so the partitions move on at once.
        consumer.unsubscribe();
        // Closing waits for the commits in flight (for as long as
        // `session.timeout.ms` with the coordinator away): off the runtime.
        if let Err(e) = tokio::task::spawn_blocking(move || drop(consumer)).await {
            warn!(error = %e, "closing the Kafka consumer failed");
        }
        result
    }

    async fn consume(
        &self,
        handler: &impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        consumer: &Member,
        producer: &FutureProducer,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<(), Failure> {
        let mut waiting = Waiting::default();
        loop {
            let next_due = waiting.next_due();
            let message = tokio::select! {
                biased;
                () = shutdown.as_mut() => break,
                () = consumer.context().resets.noticed() => {
                    // Beside the loop: its watermark reads can take the
                    // options' timeout each, while the member must go on
                    // polling and shutdown must not wait for them.
                    let (options, name) = (self.options.clone(), self.inbox.consumer().to_owned());
                    let resets = consumer.context().resets.take();
                    tokio::spawn(async move { reset::report(&options, &name, resets).await });
                    continue;
                }
                () = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now)), if next_due.is_some() => {
                    self.release(consumer, &mut waiting)?;
                    continue;
                }
                m = consumer.recv() => match received(m)? {
                    Some(message) => message,
                    None => continue,
                },
            };
            let at = (message.topic().to_owned(), message.partition());
            if let Some(&(offset, _)) = waiting.records.get(&at) {
                if message.offset() > offset {
                    // Fetched past the waiting record before its partition
                    // was paused: read again once the record is.
                    pause(consumer, &at.0, at.1)?;
                    continue;
                }
                // Not expected: a partition a rebalance takes away and
                // gives back stays paused (librdkafka keeps an application's
                // pause) until `release`. Read from at or before the
                // waiting record, though, the partition needs no seek back.
                waiting.records.remove(&at);
            }
            match self.handle(handler, consumer, producer, &message).await? {
                Handled::Done => {}
                Handled::Retry(delay) => {
                    pause(consumer, &at.0, at.1)?;
                    waiting.records.insert(at, (message.offset(), Instant::now() + delay));
                }
            }
        }
        // What waits stays uncommitted, for whoever reads the partition next.
        Ok(())
    }

    async fn handle(
        &self,
        handler: &impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        consumer: &Member,
        producer: &FutureProducer,
        message: &BorrowedMessage<'_>,
    ) -> Result<Handled, Failure> {
        let name = self.inbox.consumer();
        let headers = message
            .headers()
            .map(|h| h.iter().map(|h| (h.key, h.value)).collect::<Vec<_>>())
            .unwrap_or_default();
        let payload = message.payload().unwrap_or_default();
        let event = match decode(headers, message.key(), payload) {
            Ok(event) => event,
            Err(e) => {
                Counters::bump(&self.counters.malformed);
                metrics::malformed(name);
                warn!(consumer = name, offset = message.offset(), error = %e, "malformed record");
                dead_letter::produce(&self.options, producer, message, &e.to_string()).await?;
                commit(consumer, message);
                return Ok(Handled::Done);
            }
        };
        let run = async |tx: &mut PgConnection, ev: &ReceivedEvent| handler(tx, ev).await;
        let (topic, partition) = (message.topic(), message.partition());
        let outcome = if consumer.context().may_replay(topic, partition) {
            self.inbox.process_redelivered(&event, run).await
        } else {
            self.inbox.process(&event, run).await
        };
        let wait = match outcome {
            Ok(Outcome::Processed) => {
                consumer.context().settle(topic, partition);
                Counters::bump(&self.counters.processed);
                commit(consumer, message);
                return Ok(Handled::Done);
            }
            Ok(Outcome::Duplicate) => {
                Counters::bump(&self.counters.duplicates);
                commit(consumer, message);
                return Ok(Handled::Done);
            }
            Ok(Outcome::Dead { reason, .. }) => {
                Counters::bump(&self.counters.dead);
                dead_letter::produce(&self.options, producer, message, &reason).await?;
                commit(consumer, message);
                return Ok(Handled::Done);
            }
            Ok(Outcome::Retry { delay, .. }) => {
                Counters::bump(&self.counters.retried);
                delay
            }
            // Another attempt holds the event (the member that had the
            // partition before a rebalance, stalled): tried again in place,
            // the partition paused meanwhile.
            Ok(Outcome::InProgress { delay }) => {
                Counters::bump(&self.counters.in_progress);
                delay
            }
            // Left uncommitted, for the group to read again once the table
            // is fixed.
            Err(e @ InboxError::Schema(_)) => return Err(Failure::Inbox(e)),
            Err(e) => {
                Counters::bump(&self.counters.inbox_unavailable);
                warn!(consumer = name, event = %event.id, error = %e, "inbox unavailable; the record waits");
                self.options.database_retry_delay
            }
        };
        Ok(Handled::Retry(wait))
    }

    /// Sends the partitions whose record's wait is over back to it, and
    /// resumes them. A partition a rebalance took away meanwhile is its new
    /// owner's to read, from the committed offset.
    fn release(&self, consumer: &Member, waiting: &mut Waiting) -> Result<(), Failure> {
        let now = Instant::now();
        let due: Vec<((String, i32), i64)> = waiting
            .records
            .iter()
            .filter(|(_, (_, due))| *due <= now)
            .map(|(at, (offset, _))| (at.clone(), *offset))
            .collect();
        let assigned = assignment(consumer)?;
        for ((topic, partition), offset) in due {
            waiting.records.remove(&(topic.clone(), partition));
            let mut one = TopicPartitionList::new();
            one.add_partition(&topic, partition);
            if assigned.find_partition(&topic, partition).is_none() {
                info!(
                    consumer = self.inbox.consumer(),
                    partition,
                    offset,
                    "the partition moved to another member during the retry wait; the record is left to it"
                );
                // librdkafka keeps the pause through a rebalance: lifted
                // now, the partition is read from its committed offset if
                // it comes back, instead of never again.
                if let Err(e) = consumer.resume(&one) {
                    warn!(partition, error = %e, "could not lift the pause of a partition no longer assigned");
                }
                continue;
            }
            consumer
                .seek(&topic, partition, Offset::Offset(offset), self.options.timeout)
                .map_err(|e| format!("seeking partition {partition} back to offset {offset}: {e}"))?;
            consumer
                .resume(&one)
                .map_err(|e| format!("resuming partition {partition}: {e}"))?;
        }
        Ok(())
    }
}

/// What became of a record.
enum Handled {
    /// Done with: processed, a duplicate, or dead-lettered.
    Done,
    /// To be tried again after this long.
    Retry(Duration),
}

/// Records waiting out a retry, one per partition at most (its partition is
/// paused until then): (topic, partition) to (offset, when it is due).
#[derive(Default)]
struct Waiting {
    records: BTreeMap<(String, i32), (i64, Instant)>,
}

impl Waiting {
    fn next_due(&self) -> Option<Instant> {
        self.records.values().map(|(_, due)| *due).min()
    }
}

fn pause(consumer: &Member, topic: &str, partition: i32) -> Result<(), Failure> {
    let mut one = TopicPartitionList::new();
    one.add_partition(topic, partition);
    consumer
        .pause(&one)
        .map_err(|e| Failure::Lost(format!("pausing partition {partition}: {e}")))
}

/// The partitions assigned to this member now.
fn assignment(consumer: &Member) -> Result<TopicPartitionList, Failure> {
    consumer
        .assignment()
        .map_err(|e| Failure::Lost(format!("reading the assignment: {e}")))
}

/// What the consumer read: a record; an error librdkafka recovers from
/// itself (a broker of the cluster disconnected or restarting, every broker
/// down for a while, a coordinator being looked up), logged and read past
/// with the partitions kept; or any other error (fatal, the poll interval
/// exceeded, a record batch that failed its checks, authorization), which
/// starts the session over from the committed offsets, so that nothing
/// librdkafka skipped past is skipped by the consumer. With
/// `auto.offset.reset` set to `error`, a partition without a usable
/// committed offset stops the consumer: a new session would meet it again.
fn received(read: KafkaResult<BorrowedMessage<'_>>) -> Result<Option<BorrowedMessage<'_>>, Failure> {
    use RDKafkaErrorCode as C;
    match read {
        Ok(message) => Ok(Some(message)),
        // Only with `extra."enable.partition.eof"`: nothing to act on.
        Err(KafkaError::PartitionEOF(_)) => Ok(None),
        Err(
            e @ KafkaError::MessageConsumption(
                C::BrokerTransportFailure
                | C::AllBrokersDown
                | C::Resolve
                | C::OperationTimedOut
                | C::TimedOutQueue
                | C::WaitingForCoordinator,
            ),
        ) => {
            warn!(error = %e, "reading: librdkafka reconnects by itself; the consumer keeps its partitions");
            Ok(None)
        }
        Err(KafkaError::MessageConsumption(C::AutoOffsetReset)) => Err(Failure::Refused(
            "a partition has no committed offset in its log (none yet, for a new group, or one that retention \
             or kafka-delete-records removed records past) and extra.auto.offset.reset is \"error\": set the \
             group's offsets (kafka-consumer-groups.sh --reset-offsets), or choose earliest or latest"
                .into(),
        )),
        Err(e) => Err(Failure::Lost(format!("reading: {e}"))),
    }
}

/// Stores the offset after `message` and commits it without waiting (see
/// [`MemberContext`]). A partition no longer assigned (a rebalance moved it while
/// the handler ran) cannot be committed: its new owner reads the record
/// again and the inbox finds it done.
fn commit(consumer: &Member, message: &BorrowedMessage<'_>) {
    match consumer.store_offset_from_message(message) {
        Ok(()) => commit_stored(consumer),
        Err(e) => {
            warn!(partition = message.partition(), offset = message.offset(), error = %e, "offset not stored; the record's new owner reads it again");
        }
    }
}

/// Commits every stored offset not yet committed, without waiting.
fn commit_stored(consumer: &Member) {
    // Its outcome, even "nothing to commit", comes back to [`MemberContext`].
    if let Err(e) = consumer.commit_consumer_state(CommitMode::Async) {
        warn!(error = %e, "offset commit not sent; the next commit makes it again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each zero duration is refused with its field's name and the fix,
    /// instead of a consumer that spins or never connects.
    #[test]
    fn zero_durations_are_refused_naming_the_field() {
        crate::runner::assert_zero_durations_refused(
            || KafkaConsumerOptions::new("127.0.0.1:9092", "orders", "billing", "orders.dead"),
            KafkaConsumerOptions::validate,
            &[
                ("timeout", |o| o.timeout = Duration::ZERO),
                ("reconnect_max_delay", |o| o.reconnect_max_delay = Duration::ZERO),
            ],
        );
    }

    /// The reconnect pause starts over only after a session that got as far
    /// as consuming; every Kafka session said it had not, so once grown
    /// the pause stayed at its longest, after hours of healthy consuming.
    #[tokio::test]
    async fn a_session_says_whether_it_got_as_far_as_consuming() {
        let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
        cluster.create_topic("orders", 1, 1).unwrap();
        // Never used: no record comes.
        let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1:1/none").unwrap();
        let mut options = KafkaConsumerOptions::new(cluster.bootstrap_servers(), "orders", "billing", "orders.dead");
        options.timeout = Duration::from_secs(5);
        let consumer = KafkaConsumer::new(Inbox::new(pool, "billing").unwrap(), options).unwrap();
        let handler = async |_: &mut PgConnection, _: &ReceivedEvent| Ok(());
        let mut started = false;
        let ended = consumer
            .session(&handler, pin!(std::future::pending()), &mut started)
            .await;
        assert!(matches!(ended, Err(Failure::Refused(_))), "no dead-letter topic");
        assert!(!started);
        cluster.create_topic("orders.dead", 1, 1).unwrap();
        let shutdown = pin!(tokio::time::sleep(Duration::from_millis(300)));
        let ended = consumer.session(&handler, shutdown, &mut started).await;
        assert!(ended.is_ok());
        assert!(started);
    }

    #[test]
    fn only_errors_librdkafka_recovers_from_are_read_past() {
        use RDKafkaErrorCode as C;
        for code in [
            C::BrokerTransportFailure,
            C::AllBrokersDown,
            C::Resolve,
            C::WaitingForCoordinator,
        ] {
            assert!(
                matches!(received(Err(KafkaError::MessageConsumption(code))), Ok(None)),
                "{code:?}"
            );
        }
        assert!(matches!(received(Err(KafkaError::PartitionEOF(2))), Ok(None)));
        // `auto.offset.reset` = error, and a partition without a usable
        // committed offset: a new session would meet it again.
        assert!(matches!(
            received(Err(KafkaError::MessageConsumption(C::AutoOffsetReset))),
            Err(Failure::Refused(_))
        ));
        // A batch that failed its CRC check, one in a format librdkafka does
        // not read (both skipped by librdkafka), a refusal, the poll
        // interval exceeded, and a fatal error: read again from the
        // committed offsets.
        for error in [
            KafkaError::MessageConsumption(C::BadMessage),
            KafkaError::MessageConsumption(C::NotImplemented),
            KafkaError::MessageConsumption(C::TopicAuthorizationFailed),
            KafkaError::MessageConsumption(C::PollExceeded),
            KafkaError::MessageConsumptionFatal(C::Fatal),
        ] {
            assert!(
                matches!(received(Err(error.clone())), Err(Failure::Lost(_))),
                "{error:?}"
            );
        }
    }

    #[test]
    fn debug_output_hides_secret_properties_and_shows_the_rest() {
        let mut options = KafkaConsumerOptions::new("kafka-host:9092", "orders", "billing", "orders.dead");
        options.extra.insert("sasl.password".into(), "s3cr3t-pw".into());
        options
            .extra
            .insert("sasl.jaas.config".into(), "password=\"jaas-pw\"".into());
        options.extra.insert("auto.offset.reset".into(), "latest".into());
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(!shown.contains("jaas-pw"), "{shown}");
        assert!(shown.contains("sasl.password"), "{shown}");
        assert!(shown.contains("latest"), "{shown}");
        assert!(shown.contains("kafka-host:9092"), "{shown}");
    }
}
