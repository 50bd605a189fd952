//! The relay against a real Kafka-protocol broker: tansu on 127.0.0.1:19092,
//! or whatever `FERRY_TEST_KAFKA_URL` names. `scripts/test` starts it; the
//! test fails (never skips) when it is not running.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use ferry_testkit::kafka::broker;
use ferry_testkit::rabbit::TestTopology;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::support::{PATIENCE, Stack, assert_interrupted, produce, published};

/// A relay killed with SIGKILL in the middle of a drain to Kafka, and a
/// second one that takes over: every event reaches the topic, each key's
/// first arrivals keep production order, and only what was in flight at
/// the kill comes twice.
#[tokio::test]
async fn a_relay_killed_mid_drain_to_kafka_loses_nothing_and_keeps_each_keys_order() {
    let bootstrap = broker();
    let s = Stack::new(TestTopology::create("e2e-kafka").await).await;
    let topic = format!("ferry-e2e-{}", rand::random::<u32>());
    let admin = create_topic(&bootstrap, &topic, 3).await;
    produce(&s.pool, 10_000, 100).await;
    let cfg = kafka_config(&s, &bootstrap, &topic);

    let check = s.ferry(&cfg, &["check"]);
    assert!(
        check.status.success(),
        "ferry check failed:\n{}\n{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    let first = s.spawn(&cfg, "relay-a");
    let left = s.unrouted_at_most(8_000, &first).await;
    first.kill();
    assert_interrupted(left, "kill");
    let second = s.spawn(&cfg, "relay-b");

    let records = read_topic(&bootstrap, &topic, 10_000).await;
    let mut seen = HashSet::new();
    let mut next: HashMap<String, u64> = HashMap::new();
    for r in &records {
        if !seen.insert(r.id.clone()) {
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        let key = body["key"].as_str().unwrap().to_owned();
        assert_eq!(r.key.as_deref(), Some(key.as_str()), "the record key is the event key");
        let n = body["n"].as_u64().unwrap();
        let expected = next.entry(key.clone()).or_insert(0);
        assert_eq!(n, *expected, "key {key}: got event {n} first, expected {expected}");
        *expected += 1;
    }
    assert_eq!(seen.len(), 10_000, "lost events; log:\n{}", second.log());
    assert_eq!(next.len(), 100);
    // In flight at the kill: the batch being settled and the one being
    // published, 500 each.
    let duplicates = records.len() - seen.len();
    assert!(duplicates <= 1_000, "{duplicates} duplicates");

    let log = second.log();
    assert!(second.terminate().success(), "SIGTERM must exit 0; log:\n{log}");
    assert_eq!(published(&s.status(&cfg).await, "orders"), (10_000, 0, 0));
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    if let Err(e) = admin.delete_topics(&[topic.as_str()], &options).await {
        eprintln!("could not delete {topic}: {e}");
    }
}

async fn create_topic(bootstrap: &str, name: &str, partitions: i32) -> AdminClient<DefaultClientContext> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("an admin client");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .create_topics([&NewTopic::new(name, partitions, TopicReplication::Fixed(1))], &options)
        .await
        .expect("CreateTopics");
    for r in results {
        r.unwrap_or_else(|(topic, code)| panic!("creating {topic}: {code}"));
    }
    admin
}

fn kafka_config(s: &Stack, bootstrap: &str, topic: &str) -> PathBuf {
    let text = format!(
        r#"
[database]
url = "{db}"
max_connections = 6

[relay]
batch_size = 500
lease = "3s"
backoff_base = "50ms"
backoff_max = "1s"
poll_interval = "30s"
shutdown_timeout = "10s"

[log]
level = "warn"

[sinks.kafka]
kind = "kafka"
bootstrap_servers = "{bootstrap}"
publish_timeout = "2s"

[[routes]]
name = "orders"
match = "order.**"
sink = "kafka"
destination = "{topic}"
"#,
        db = s.db.url(),
    );
    let path = s.dir.path().join("ferry-kafka.toml");
    std::fs::write(&path, text).unwrap();
    path
}

struct Record {
    id: String,
    key: Option<String>,
    body: Vec<u8>,
}

/// Every partition of `topic` from the beginning, in each partition's
/// order, until `unique` distinct event ids arrived and then to the end of
/// what is there (a duplicate may follow the last first arrival).
async fn read_topic(bootstrap: &str, topic: &str, unique: usize) -> Vec<Record> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("ferry-e2e-reader-{}", rand::random::<u32>()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("a consumer");
    let mut assignment = TopicPartitionList::new();
    for p in 0..3 {
        assignment.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&assignment).expect("assigned");

    let mut records = Vec::new();
    let mut ids = HashSet::new();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut quiet_until = None;
    loop {
        let until = match quiet_until {
            Some(at) => at,
            None => deadline,
        };
        let message = match tokio::time::timeout_at(until, consumer.recv()).await {
            Err(_) => break,
            Ok(Err(e)) => {
                // librdkafka reports connection trouble and keeps fetching.
                eprintln!("consumer: {e}");
                continue;
            }
            Ok(Ok(m)) => m,
        };
        let id = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "ce_id"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8(v.to_vec()).expect("a UTF-8 ce_id"))
            .expect("every record carries ce_id");
        ids.insert(id.clone());
        records.push(Record {
            id,
            key: message
                .key()
                .map(|k| String::from_utf8(k.to_vec()).expect("a UTF-8 key")),
            body: message.payload().unwrap_or_default().to_vec(),
        });
        if ids.len() >= unique && quiet_until.is_none() {
            quiet_until = Some(tokio::time::Instant::now() + Duration::from_secs(2));
        }
    }
    records
}
