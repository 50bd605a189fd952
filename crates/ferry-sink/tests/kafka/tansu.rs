//! End to end against a real Kafka-protocol broker: tansu on
//! 127.0.0.1:19092, or whatever `FERRY_TEST_KAFKA_URL` names. `scripts/test`
//! starts it; these tests fail (never skip) when it is not running.

use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_testkit::kafka::broker;
use ferry_testkit::sink_suite::{self, event};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use serde_json::json;

use crate::kafka_support::{Harness, TopicReader, route, sink_at, unique};

/// A topic created with the admin API, deleted on [`TestTopic::delete`].
struct TestTopic {
    admin: AdminClient<DefaultClientContext>,
    name: String,
}

impl TestTopic {
    async fn create(bootstrap: &str, prefix: &str, partitions: i32, config: &[(&str, &str)]) -> Self {
        Self::create_named(bootstrap, unique(prefix), partitions, config).await
    }

    async fn create_named(bootstrap: &str, name: String, partitions: i32, config: &[(&str, &str)]) -> Self {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .expect("an admin client");
        let mut new = NewTopic::new(&name, partitions, TopicReplication::Fixed(1));
        for (k, v) in config {
            new = new.set(k, v);
        }
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = admin.create_topics([&new], &options).await.expect("CreateTopics");
        for r in results {
            r.unwrap_or_else(|(topic, code)| panic!("creating {topic}: {code}"));
        }
        Self { admin, name }
    }

    async fn delete(self) {
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self.admin.delete_topics(&[&self.name], &options).await;
        if let Err(e) = results.map(|r| r.into_iter().collect::<Result<Vec<_>, _>>()) {
            eprintln!("could not delete {}: {e:?}", self.name);
        }
    }
}

#[tokio::test]
async fn passes_the_sink_conformance_suite_on_tansu() {
    let bootstrap = broker();
    let topic = TestTopic::create(&bootstrap, "suite", 3, &[]).await;
    let harness = Harness {
        reader: TopicReader::new(&bootstrap, &topic.name).await,
        missing: unique("missing"),
        topic: topic.name.clone(),
    };
    let sink = sink_at(&bootstrap);
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
    topic.delete().await;
}

#[tokio::test]
async fn check_reads_the_topic_message_limit_on_tansu() {
    let bootstrap = broker();
    let topic = TestTopic::create(&bootstrap, "limit", 1, &[("max.message.bytes", "4096")]).await;
    let sink = sink_at(&bootstrap);
    let big = event(0, "test.item.created", Some("k"), json!("x".repeat(8000)));
    let to = route(&topic.name);
    assert_eq!(sink.admit(&to, &big), Ok(()), "under the sink's own limit");
    sink.check(&to).await.expect("the topic exists");
    let err = sink.admit(&to, &big).expect_err("over the topic's limit");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(err.message.contains("max.message.bytes is 4096"), "{err}");
    let small = event(1, "test.item.created", Some("k"), json!({ "n": 1 }));
    assert_eq!(sink.admit(&to, &small), Ok(()));
    sink.close().await;
    topic.delete().await;
}

/// A topic named by a template is known only once an event names it, so
/// `check` cannot read its limit: the first publish to it reads it, in the
/// background, and from then on an event over it is refused before sending,
/// permanently and with the reason, instead of sinking the record batch it
/// would share with its neighbours.
#[tokio::test]
async fn a_templated_topics_message_limit_is_read_when_it_is_first_published_to() {
    let bootstrap = broker();
    let base = unique("tlimit");
    let name = format!("{base}.test");
    let topic = TestTopic::create_named(&bootstrap, name, 1, &[("max.message.bytes", "4096")]).await;
    let sink = sink_at(&bootstrap);
    // `test.item.created` events go to `<base>.test`; a key of their own
    // each, so none is held back behind another.
    let to = route(&format!("{base}.{{domain}}"));
    let big = |seq: i64| {
        event(
            seq,
            "test.item.created",
            Some(&format!("k{seq}")),
            json!("x".repeat(8000)),
        )
    };
    let small = |seq: i64| event(seq, "test.item.created", Some(&format!("k{seq}")), json!({ "n": seq }));
    sink.check(&to).await.expect("the cluster is reachable");
    assert_eq!(
        sink.admit(&to, &big(0)),
        Ok(()),
        "no limit known before a publish names the topic"
    );
    let first = sink.publish(&to, &[small(1)]).await;
    assert!(first[0].is_ok(), "{first:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sink.admit(&to, &big(0)).is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the topic's limit was never read"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let batch = [small(2), big(3), small(4)];
    let outcomes = sink.publish(&to, &batch).await;
    assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
    let err = outcomes[1].as_ref().expect_err("over the topic's limit");
    assert_eq!(err.kind, ErrorKind::Permanent);
    assert!(err.message.contains("max.message.bytes is 4096"), "{err}");
    let reader = TopicReader::new(&bootstrap, &topic.name).await;
    let got = reader.read(3, Duration::from_secs(10)).await;
    let bodies: Vec<String> = got
        .iter()
        .map(|c| String::from_utf8_lossy(&c.body).into_owned())
        .collect();
    assert_eq!(bodies, [r#"{"n":1}"#, r#"{"n":2}"#, r#"{"n":4}"#]);
    sink.close().await;
    topic.delete().await;
}

#[tokio::test]
async fn wire_format_round_trips_through_tansu() {
    let bootstrap = broker();
    let topic = TestTopic::create(&bootstrap, "wire", 1, &[]).await;
    crate::assert_wire_format(&bootstrap, &topic.name).await;
    topic.delete().await;
}
