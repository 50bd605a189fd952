//! Helpers for the Kafka tests: sinks, a reader that consumes a topic from
//! the beginning, and the conformance harness.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, StoredEvent};
use ferry_sink::kafka::{KafkaOptions, KafkaSink};
use ferry_testkit::sink_suite::{ReceivedMessage, SinkHarness, event};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;
use tokio::time::Instant;

/// The payload limit the test sinks are configured with.
pub const LIMIT: usize = 64 * 1024;

pub fn unique(prefix: &str) -> String {
    format!("ferry-test.{prefix}.{}", uuid::Uuid::now_v7().simple())
}

pub fn options(bootstrap: &str) -> KafkaOptions {
    let mut extra = BTreeMap::new();
    // A missing topic fails after 1 s instead of librdkafka's 30 s wait for
    // a new topic to propagate.
    extra.insert("topic.metadata.propagation.max.ms".into(), "1000".into());
    KafkaOptions {
        bootstrap_servers: bootstrap.into(),
        publish_timeout: Duration::from_secs(10),
        max_message_bytes: LIMIT,
        extra,
        ..KafkaOptions::default()
    }
}

pub fn sink_at(bootstrap: &str) -> KafkaSink {
    KafkaSink::new(options(bootstrap)).expect("valid options")
}

pub fn route(destination: &str) -> Route {
    Route {
        name: "test".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "kafka".into(),
        destination: destination.into(),
        routing_key: None,
    }
}

/// `n` JSON events of type `test.item.created`, keyed by `key(seq)`.
pub fn keyed(n: i64, key: impl Fn(i64) -> String) -> Vec<StoredEvent> {
    (0..n)
        .map(|seq| event(seq, "test.item.created", Some(&key(seq)), json!({ "seq": seq })))
        .collect()
}

pub fn ids(events: &[StoredEvent]) -> HashSet<String> {
    events.iter().map(|e| e.id.to_string()).collect()
}

/// `outcome` is an error of `kind` whose message contains `text`.
pub fn expect_err(outcome: &PublishOutcome, kind: ErrorKind, text: &str) {
    match outcome {
        Ok(()) => panic!("reported published; expected a {kind} error mentioning {text:?}"),
        Err(e) => {
            assert_eq!(e.kind, kind, "{e}");
            assert!(e.message.contains(text), "{e} should mention {text:?}");
        }
    }
}

/// A record as a consumer read it back.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub body: Vec<u8>,
    pub timestamp: Option<i64>,
    /// In wire order; a name may repeat.
    pub headers: Vec<(String, String)>,
}

impl Consumed {
    pub fn header(&self, name: &str) -> Option<&str> {
        let mut found = self.headers.iter().filter(|(n, _)| n == name);
        let value = found.next().map(|(_, v)| v.as_str());
        assert!(found.next().is_none(), "header {name} appears twice");
        value
    }

    pub fn id(&self) -> String {
        self.header("ce_id").expect("a ce_id header").to_owned()
    }
}

/// Reads every partition of one topic from the beginning.
pub struct TopicReader {
    consumer: StreamConsumer,
    topic: String,
    partitions: Vec<i32>,
}

impl TopicReader {
    pub async fn new(bootstrap: &str, topic: &str) -> Self {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", unique("reader"))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()
            .expect("a consumer");
        let metadata = {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match consumer.fetch_metadata(Some(topic), Duration::from_secs(5)) {
                    Ok(m) if m.topics().first().is_some_and(|t| !t.partitions().is_empty()) => break m,
                    other => {
                        assert!(Instant::now() < deadline, "no metadata for {topic}: {other:?}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        };
        let mut assignment = TopicPartitionList::new();
        for p in metadata.topics()[0].partitions() {
            assignment
                .add_partition_offset(topic, p.id(), Offset::Beginning)
                .expect("a partition");
        }
        consumer.assign(&assignment).expect("assigned");
        let partitions = metadata.topics()[0].partitions().iter().map(|p| p.id()).collect();
        Self {
            consumer,
            topic: topic.to_owned(),
            partitions,
        }
    }

    /// Up to `n` records, waiting at most `timeout` for them.
    pub async fn read(&self, n: usize, timeout: Duration) -> Vec<Consumed> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < n {
            let message = match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Err(_) => break,
                // librdkafka reports connection trouble and keeps fetching.
                Ok(Err(e)) => {
                    eprintln!("consumer: {e}");
                    continue;
                }
                Ok(Ok(m)) => m,
            };
            let headers = message
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            let value = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                            (h.key.to_owned(), value.unwrap_or_default())
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Consumed {
                partition: message.partition(),
                offset: message.offset(),
                key: message.key().map(|k| String::from_utf8(k.to_vec()).expect("UTF-8 key")),
                body: message.payload().unwrap_or_default().to_vec(),
                timestamp: message.timestamp().to_millis(),
                headers,
            });
        }
        out
    }

    /// Reads until every id in `wanted` was seen or `timeout` passed, then
    /// on to the end of every partition as it is then; returns everything
    /// read, duplicates included (a copy written after the last first
    /// arrival too).
    pub async fn read_until(&self, wanted: &HashSet<String>, timeout: Duration) -> Vec<Consumed> {
        let deadline = Instant::now() + timeout;
        let mut seen = HashSet::new();
        let mut all = Vec::new();
        while !wanted.is_subset(&seen) && Instant::now() < deadline {
            for c in self.read(wanted.len(), deadline - Instant::now()).await {
                seen.insert(c.id());
                all.push(c);
            }
        }
        let mut next: HashMap<i32, i64> = HashMap::new();
        for c in &all {
            let at = next.entry(c.partition).or_default();
            *at = (*at).max(c.offset + 1);
        }
        let ends: Vec<(i32, i64)> = self
            .partitions
            .iter()
            .map(|&p| {
                let (_, high) = self
                    .consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(5))
                    .expect("the partition's high watermark");
                (p, high)
            })
            .collect();
        let behind = |next: &HashMap<i32, i64>| ends.iter().any(|(p, high)| next.get(p).copied().unwrap_or(0) < *high);
        while behind(&next) && Instant::now() < deadline {
            for c in self.read(1, deadline - Instant::now()).await {
                let at = next.entry(c.partition).or_default();
                *at = (*at).max(c.offset + 1);
                all.push(c);
            }
        }
        all
    }
}

/// The conformance harness over one existing topic.
pub struct Harness {
    pub topic: String,
    pub missing: String,
    pub reader: TopicReader,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route(&self.topic)
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route(&self.missing))
    }
    fn max_payload_bytes(&self) -> Option<usize> {
        Some(LIMIT)
    }
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
        self.reader
            .read(n, timeout)
            .await
            .into_iter()
            .map(|c| ReceivedMessage {
                id: c.id(),
                key: c.key,
                body: c.body,
            })
            .collect()
    }
}

/// Checks what a drain delivered: every event arrived, and per key the first
/// arrival of each event follows seq order, and each key kept to one
/// partition. Returns the number of duplicates.
pub fn assert_complete_and_ordered(events: &[StoredEvent], consumed: &[Consumed]) -> usize {
    let by_id: HashMap<String, &StoredEvent> = events.iter().map(|e| (e.id.to_string(), e)).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    let mut duplicates = 0;
    for c in consumed {
        if let Some(key) = &c.key {
            let p = *partition_of.entry(key.clone()).or_insert(c.partition);
            assert_eq!(
                p, c.partition,
                "key {key} was spread over partitions {p} and {}",
                c.partition
            );
        }
        let id = c.id();
        let event = by_id.get(&id).unwrap_or_else(|| panic!("unknown event {id}"));
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let key = event.key.as_deref().expect("keyed events");
        assert_eq!(c.key.as_deref(), Some(key), "the message key is the event key");
        if let Some(previous) = last.insert(key, event.seq) {
            assert!(
                previous < event.seq,
                "key {key}: seq {} first arrived after seq {previous}",
                event.seq
            );
        }
    }
    let lost = events.iter().filter(|e| !seen.contains(&e.id.to_string())).count();
    assert_eq!(lost, 0, "{lost} of {} events never arrived", events.len());
    duplicates
}

/// Panics if an event of `events` is missing from `consumed`, after asking a
/// fresh reader whether the topic has it: the message then tells a lost event
/// (the sink reported it published, the log lacks it) from a reader that
/// missed it.
pub async fn explain_missing(bootstrap: &str, topic: &str, events: &[StoredEvent], consumed: &[Consumed]) {
    let seen: HashSet<String> = consumed.iter().map(Consumed::id).collect();
    let missing: Vec<&StoredEvent> = events.iter().filter(|e| !seen.contains(&e.id.to_string())).collect();
    if missing.is_empty() {
        return;
    }
    let fresh = TopicReader::new(bootstrap, topic).await;
    let log: HashSet<String> = fresh
        .read(usize::MAX, Duration::from_secs(5))
        .await
        .iter()
        .map(Consumed::id)
        .collect();
    let report: Vec<String> = missing
        .iter()
        .map(|e| {
            let where_ = if log.contains(&e.id.to_string()) {
                "in the log"
            } else {
                "NOT in the log"
            };
            format!("seq {} key {:?}: {where_}", e.seq, e.key)
        })
        .collect();
    panic!(
        "{} of {} events never reached the reader: {report:?}",
        missing.len(),
        events.len()
    );
}
