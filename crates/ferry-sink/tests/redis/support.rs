//! A uniquely named stream key per test, read back with XRANGE.

use std::collections::BTreeMap;
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Value, streams::StreamRangeReply};
use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, StoredEvent};
use ferry_sink::redis::{RedisOptions, RedisSink};
use ferry_testkit::sink_suite::event;
use serde_json::json;
use tokio::time::Instant;

/// The payload limit the test sinks are configured with.
pub const LIMIT: usize = 64 * 1024;

pub fn redis_url() -> String {
    std::env::var("FERRY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn unique(prefix: &str) -> String {
    format!("ferry-test:{prefix}:{}", uuid::Uuid::now_v7().simple())
}

pub fn sink_with(options: RedisOptions) -> RedisSink {
    RedisSink::new(RedisOptions {
        max_message_bytes: LIMIT,
        ..options
    })
}

pub fn sink_at(url: String) -> RedisSink {
    sink_with(RedisOptions {
        url,
        ..RedisOptions::default()
    })
}

pub fn route(name: &str, key: &str) -> Route {
    Route {
        name: name.into(),
        matcher: Glob::new("**").unwrap(),
        sink: "redis".into(),
        destination: key.into(),
        routing_key: None,
    }
}

/// `n` JSON events of type `test.item.created`, keyed by `key(seq)`.
pub fn keyed(n: i64, key: impl Fn(i64) -> String) -> Vec<StoredEvent> {
    (0..n)
        .map(|seq| event(seq, "test.item.created", Some(&key(seq)), json!({ "seq": seq })))
        .collect()
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

pub async fn connect() -> MultiplexedConnection {
    ::redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to Redis")
}

/// One stream entry, its fields as text (the payload as bytes).
#[derive(Debug, Clone)]
pub struct Entry {
    pub fields: BTreeMap<String, Vec<u8>>,
}

impl Entry {
    pub fn text(&self, field: &str) -> Option<String> {
        self.fields.get(field).map(|v| String::from_utf8_lossy(v).into_owned())
    }
    pub fn id(&self) -> String {
        self.text("id").unwrap_or_default()
    }
}

pub struct TestStream {
    pub connection: MultiplexedConnection,
    pub key: String,
    last_id: tokio::sync::Mutex<String>,
}

impl TestStream {
    /// A new stream with a consumer group, as a consumer would leave it.
    pub async fn new(prefix: &str) -> Self {
        let stream = Self::at(unique(prefix)).await;
        let mut connection = stream.connection.clone();
        let _: () = ::redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream.key)
            .arg("readers")
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut connection)
            .await
            .expect("XGROUP CREATE");
        stream
    }

    pub async fn at(key: String) -> Self {
        Self {
            connection: connect().await,
            key,
            last_id: tokio::sync::Mutex::new("-".into()),
        }
    }

    /// Entries after `after` (exclusive; `-` for all), at most `count`.
    async fn range(&self, after: &str, count: usize) -> Vec<(String, Entry)> {
        let start = if after == "-" {
            "-".to_owned()
        } else {
            format!("({after}")
        };
        let reply: StreamRangeReply = ::redis::cmd("XRANGE")
            .arg(&self.key)
            .arg(start)
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.connection.clone())
            .await
            .expect("XRANGE");
        reply
            .ids
            .into_iter()
            .map(|sid| {
                let fields = sid
                    .map
                    .into_iter()
                    .map(|(k, v)| match v {
                        Value::BulkString(bytes) => (k, bytes),
                        other => panic!("field {k} is {other:?}"),
                    })
                    .collect();
                (sid.id, Entry { fields })
            })
            .collect()
    }

    /// Waits until `n` more entries arrived or `timeout` passed.
    pub async fn receive(&self, n: usize, timeout: Duration) -> Vec<Entry> {
        let deadline = Instant::now() + timeout;
        let mut last = self.last_id.lock().await;
        let mut out = Vec::new();
        loop {
            for (id, entry) in self.range(&last, n - out.len()).await {
                *last = id;
                out.push(entry);
            }
            if out.len() >= n || Instant::now() >= deadline {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Every entry, in stream order.
    pub async fn all(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut last = "-".to_owned();
        loop {
            let page = self.range(&last, 1000).await;
            if page.is_empty() {
                return out;
            }
            for (id, entry) in page {
                last = id;
                out.push(entry);
            }
        }
    }

    pub async fn len(&self) -> u64 {
        ::redis::cmd("XLEN")
            .arg(&self.key)
            .query_async(&mut self.connection.clone())
            .await
            .expect("XLEN")
    }

    pub async fn delete(&self) {
        let _: i64 = ::redis::cmd("DEL")
            .arg(&self.key)
            .query_async(&mut self.connection.clone())
            .await
            .expect("DEL");
    }
}
