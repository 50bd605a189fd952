//! A JetStream stream per test, created and read through the JetStream API
//! with a plain NATS client (the stream is memory-backed, with direct get).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use async_nats::Client;
use bytes::Bytes;
use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, StoredEvent};
use ferry_sink::nats::{NatsOptions, NatsSink};
use ferry_testkit::sink_suite::event;
use serde_json::{Value, json};
use tokio::time::Instant;

/// The payload limit the test sinks are configured with.
pub const LIMIT: usize = 64 * 1024;

pub fn nats_url() -> String {
    std::env::var("FERRY_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
}

pub fn sink_at(url: String) -> NatsSink {
    NatsSink::new(NatsOptions {
        url,
        max_message_bytes: LIMIT,
        ..NatsOptions::default()
    })
}

pub fn route(subject: &str) -> Route {
    Route {
        name: "test".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "nats".into(),
        destination: subject.into(),
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

/// A message read back from the stream.
#[derive(Debug, Clone)]
pub struct Stored {
    pub subject: String,
    pub headers: BTreeMap<String, String>,
    pub payload: Bytes,
}

impl Stored {
    /// The event id, as consumers read it (`Nats-Msg-Id` adds the subject).
    pub fn id(&self) -> String {
        self.headers.get("ce-id").cloned().unwrap_or_default()
    }
}

/// A uniquely named stream capturing `<subject>` and `<subject>.>`.
pub struct TestStream {
    pub client: Client,
    pub name: String,
    pub subject: String,
    next_seq: tokio::sync::Mutex<u64>,
}

impl TestStream {
    pub async fn create(prefix: &str) -> Self {
        Self::create_with(prefix, json!({})).await
    }

    /// Creates the stream with `extra` merged into its config.
    pub async fn create_with(prefix: &str, extra: Value) -> Self {
        let client = async_nats::connect(nats_url()).await.expect("connect to NATS");
        let name = unique(&format!("FERRY_TEST_{prefix}"));
        let subject = unique(&format!("ferry.test.{prefix}")).replace('_', ".");
        let mut config = json!({
            "name": name,
            "subjects": [subject, format!("{subject}.>")],
            "storage": "memory",
            "retention": "limits",
            "discard": "old",
            "num_replicas": 1,
            "duplicate_window": 600_000_000_000u64,
            "allow_direct": true,
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let answer = api(&client, &format!("$JS.API.STREAM.CREATE.{name}"), config).await;
        assert!(answer.get("error").is_none(), "creating stream {name}: {answer}");
        Self {
            client,
            name,
            subject,
            next_seq: tokio::sync::Mutex::new(1),
        }
    }

    /// Adds a durable pull consumer named `name`.
    pub async fn add_consumer(&self, name: &str) {
        self.add_consumer_with(name, json!({})).await;
    }

    /// Adds a durable pull consumer named `name`, with `extra` (a
    /// `filter_subject`, say) merged into its config.
    pub async fn add_consumer_with(&self, name: &str, extra: Value) {
        let mut consumer = json!({ "durable_name": name, "ack_policy": "explicit" });
        for (k, v) in extra.as_object().unwrap() {
            consumer[k] = v.clone();
        }
        let config = json!({ "stream_name": self.name, "config": consumer });
        let answer = api(
            &self.client,
            &format!("$JS.API.CONSUMER.CREATE.{}.{name}", self.name),
            config,
        )
        .await;
        assert!(answer.get("error").is_none(), "creating consumer {name}: {answer}");
    }

    /// Messages the stream holds.
    pub async fn count(&self) -> u64 {
        let info = api(&self.client, &format!("$JS.API.STREAM.INFO.{}", self.name), json!({})).await;
        info["state"]["messages"].as_u64().expect("stream state")
    }

    /// The message at `seq`, if the stream has one.
    pub async fn get(&self, seq: u64) -> Option<Stored> {
        let request = Bytes::from(json!({ "seq": seq }).to_string());
        let answer = self
            .client
            .request(format!("$JS.API.DIRECT.GET.{}", self.name), request)
            .await
            .expect("direct get");
        if answer.status.is_some_and(|s| s.as_u16() == 404) {
            return None;
        }
        assert!(answer.status.is_none(), "direct get {seq}: {:?}", answer.status);
        let headers = answer.headers.expect("direct get returns headers");
        let headers: BTreeMap<String, String> = headers
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    v.first().map(|v| v.as_str().to_owned()).unwrap_or_default(),
                )
            })
            .collect();
        Some(Stored {
            subject: headers.get("Nats-Subject").cloned().unwrap_or_default(),
            headers,
            payload: answer.payload,
        })
    }

    /// Waits until `n` more messages are stored or `timeout` passed; returns
    /// them in stream order, each once.
    pub async fn receive(&self, n: usize, timeout: Duration) -> Vec<Stored> {
        let deadline = Instant::now() + timeout;
        let mut next = self.next_seq.lock().await;
        let mut out = Vec::new();
        while out.len() < n {
            match self.get(*next).await {
                Some(stored) => {
                    out.push(stored);
                    *next += 1;
                }
                None if Instant::now() >= deadline => break,
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        out
    }

    /// Every message the stream holds, in order.
    pub async fn all(&self) -> Vec<Stored> {
        let mut out = Vec::new();
        let mut seq = 1;
        while let Some(stored) = self.get(seq).await {
            out.push(stored);
            seq += 1;
        }
        out
    }

    pub async fn delete(&self) {
        api(&self.client, &format!("$JS.API.STREAM.DELETE.{}", self.name), json!({})).await;
    }
}

pub async fn api(client: &Client, subject: &str, body: Value) -> Value {
    let body = if body == json!({}) {
        Bytes::new()
    } else {
        Bytes::from(body.to_string())
    };
    let answer = client.request(subject.to_owned(), body).await.expect(subject);
    serde_json::from_slice(&answer.payload).expect("JSON answer")
}

pub fn sink_with(url: String, max_message_bytes: usize) -> NatsSink {
    NatsSink::new(NatsOptions {
        url,
        max_message_bytes,
        ..NatsOptions::default()
    })
}

impl TestStream {
    /// A second handle on the same stream, with its own connection, for a
    /// task that watches it while the test reads through the first.
    pub async fn watch(other: &TestStream) -> TestStream {
        TestStream {
            client: async_nats::connect(nats_url()).await.expect("connect to NATS"),
            name: other.name.clone(),
            subject: other.subject.clone(),
            next_seq: tokio::sync::Mutex::new(1),
        }
    }
}
