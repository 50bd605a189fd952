//! The sinks scenario's destinations: a uniquely named Kafka topic, NATS
//! JetStream stream, Redis stream or in-process webhook receiver per run,
//! each able to say how many messages it holds, to take `n` confirmed
//! publishes from one plain client (the baseline), to hand the relay a sink
//! and a route destination, and to delete itself.
//!
//! Each is noted in the bench's [`Leftovers`] before it is created, so that
//! it is deleted after Ctrl-C too. Should the bench be killed before it
//! deletes them, the Kafka topic and the Redis stream stay (named
//! `ferry-bench-…`); the NATS stream is memory-backed and keeps at most an
//! hour of messages.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use async_trait::async_trait;
use bytes::Bytes;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
use futures::StreamExt;
use futures::future::join_all;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::latency::Arrivals;
use super::leftovers::{Leftover, Leftovers};
use super::{Ctx, progress, workload};

/// Partitions of the bench topic.
const KAFKA_PARTITIONS: i32 = 3;
/// How long a destination may take to show what it confirmed.
const SETTLE: Duration = Duration::from_secs(10);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests in flight in the webhook baseline: the webhook sink's default.
pub(crate) const WEBHOOK_CONCURRENCY: usize = 8;

/// The kinds the scenario measures, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Kafka,
    Nats,
    Redis,
    Webhook,
}

impl Kind {
    pub(crate) const ALL: [Kind; 4] = [Kind::Kafka, Kind::Nats, Kind::Redis, Kind::Webhook];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Kafka => "kafka",
            Kind::Nats => "nats",
            Kind::Redis => "redis",
            Kind::Webhook => "webhook",
        }
    }
}

/// Where the destinations live.
#[derive(Debug, Clone)]
pub(crate) struct Endpoints {
    pub kafka: String,
    pub nats: String,
    pub redis: String,
}

pub(crate) enum Dest {
    Kafka {
        bootstrap: String,
        admin: AdminClient<DefaultClientContext>,
        /// Records a consumer on every partition has read so far: tansu's
        /// end offsets do not always count records one by one.
        consumed: Arc<AtomicU64>,
        reader: Reader,
        topic: String,
    },
    Nats {
        url: String,
        client: async_nats::Client,
        stream: String,
        subject: String,
    },
    Redis {
        url: String,
        conn: redis::aio::MultiplexedConnection,
        key: String,
    },
    Webhook {
        url: String,
        received: Arc<AtomicU64>,
        server: JoinHandle<()>,
    },
}

/// The Kafka reader's task, aborted when dropped: a reader must not outlive
/// its destination (Ctrl-C drops it) to read a topic about to be deleted.
pub(crate) struct Reader(JoinHandle<()>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An idempotent Kafka producer that has delivered one message to `topic`:
/// connected, with the topic's metadata and a producer id, as the relay's
/// producer is after its start-up check. It lingers as the sink's producer
/// does: with librdkafka's default of 5 ms, each window of the baseline
/// waited out the linger.
async fn warm_producer(bootstrap: &str, topic: &str) -> anyhow::Result<FutureProducer> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("message.timeout.ms", "30000")
        .set("linger.ms", ferry_sink::kafka::DEFAULT_LINGER_MS)
        .create()
        .context("creating a Kafka producer")?;
    producer
        .send_result(FutureRecord::to(topic).key("warm-up").payload("{}"))
        .map_err(|(e, _)| anyhow!("enqueueing the Kafka warm-up message: {e}"))?
        .await
        .map_err(|_| anyhow!("the Kafka warm-up delivery report was dropped"))?
        .map_err(|(e, _)| anyhow!("Kafka refused the warm-up message: {e}"))?;
    Ok(producer)
}

fn unique(kind: Kind, phase: &str) -> String {
    format!("ferry-bench-{}-{phase}-{:08x}", kind.label(), rand::random::<u32>())
}

impl Dest {
    /// Creates a fresh destination of `kind` for `phase` (`baseline`, `drain`…),
    /// noting it in `left` first.
    pub(crate) async fn create(kind: Kind, phase: &str, at: &Endpoints, left: &Leftovers) -> anyhow::Result<Self> {
        let note = |at: &str, name: &str| {
            left.add(Leftover::Dest {
                kind,
                at: at.to_owned(),
                name: name.to_owned(),
            });
        };
        match kind {
            Kind::Kafka => {
                let admin = kafka_admin(&at.kafka)?;
                let topic = unique(kind, phase);
                note(&at.kafka, &topic);
                let new = NewTopic::new(&topic, KAFKA_PARTITIONS, TopicReplication::Fixed(1));
                let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
                let results = admin
                    .create_topics([&new], &options)
                    .await
                    .with_context(|| format!("creating Kafka topic {topic} at {}", at.kafka))?;
                for r in results {
                    r.map_err(|(t, code)| anyhow!("creating Kafka topic {t}: {code}"))?;
                }
                let consumer: StreamConsumer = ClientConfig::new()
                    .set("bootstrap.servers", &at.kafka)
                    .set("group.id", format!("{topic}-reader"))
                    .set("enable.auto.commit", "false")
                    .set("enable.partition.eof", "false")
                    .create()
                    .context("creating a Kafka consumer")?;
                let mut assignment = TopicPartitionList::new();
                for p in 0..KAFKA_PARTITIONS {
                    assignment.add_partition_offset(&topic, p, Offset::Beginning)?;
                }
                consumer.assign(&assignment).context("assigning the bench topic")?;
                let consumed = Arc::new(AtomicU64::new(0));
                let counter = Arc::clone(&consumed);
                let reader = tokio::spawn(async move {
                    loop {
                        match consumer.recv().await {
                            Ok(_) => {
                                counter.fetch_add(1, Ordering::Relaxed);
                            }
                            // Mostly "unknown partition" until the new topic's
                            // metadata arrives; the consumer retries by itself.
                            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        }
                    }
                });
                left.track(reader.abort_handle());
                Ok(Dest::Kafka {
                    bootstrap: at.kafka.clone(),
                    admin,
                    consumed,
                    reader: Reader(reader),
                    topic,
                })
            }
            Kind::Nats => {
                let client = async_nats::connect(&at.nats)
                    .await
                    .with_context(|| format!("cannot connect to NATS at {}", at.nats))?;
                let stream = unique(kind, phase).replace('-', "_").to_uppercase();
                let subject = unique(kind, phase).replace('-', ".");
                let config = json!({
                    "name": stream,
                    "subjects": [subject],
                    "storage": "memory",
                    "retention": "limits",
                    "discard": "old",
                    "num_replicas": 1,
                    "max_age": 3_600_000_000_000u64,
                    "duplicate_window": 600_000_000_000u64,
                });
                note(&at.nats, &stream);
                let answer = js_api(&client, &format!("$JS.API.STREAM.CREATE.{stream}"), Some(config)).await?;
                if let Some(error) = answer.get("error") {
                    bail!("creating NATS stream {stream}: {error}");
                }
                Ok(Dest::Nats {
                    url: at.nats.clone(),
                    client,
                    stream,
                    subject,
                })
            }
            Kind::Redis => {
                let client = redis::Client::open(at.redis.as_str()).context("the Redis URL")?;
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .with_context(|| format!("cannot connect to Redis at {}", at.redis))?;
                // The stream and its reader's group exist before the relay
                // starts, as the Redis sink's destination check requires.
                let key = unique(kind, phase);
                note(&at.redis, &key);
                let mut setup = conn.clone();
                let _: () = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&key)
                    .arg("bench-reader")
                    .arg("$")
                    .arg("MKSTREAM")
                    .query_async(&mut setup)
                    .await
                    .with_context(|| format!("creating Redis stream {key} and its group"))?;
                Ok(Dest::Redis {
                    url: at.redis.clone(),
                    conn,
                    key,
                })
            }
            Kind::Webhook => {
                let received = Arc::new(AtomicU64::new(0));
                let counter = Arc::clone(&received);
                let app = axum::Router::new().route(
                    "/hook",
                    axum::routing::post(move |_body: axum::body::Bytes| {
                        let counter = Arc::clone(&counter);
                        async move {
                            counter.fetch_add(1, Ordering::Relaxed);
                            axum::http::StatusCode::NO_CONTENT
                        }
                    }),
                );
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .context("binding the webhook receiver")?;
                let addr = listener.local_addr()?;
                let server = tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        eprintln!("warning: the webhook receiver failed: {e}");
                    }
                });
                Ok(Dest::Webhook {
                    url: format!("http://{addr}/hook"),
                    received,
                    server,
                })
            }
        }
    }

    pub(crate) fn kind(&self) -> Kind {
        match self {
            Dest::Kafka { .. } => Kind::Kafka,
            Dest::Nats { .. } => Kind::Nats,
            Dest::Redis { .. } => Kind::Redis,
            Dest::Webhook { .. } => Kind::Webhook,
        }
    }

    /// The route destination the sink publishes to.
    pub(crate) fn destination(&self) -> &str {
        match self {
            Dest::Kafka { topic, .. } => topic,
            Dest::Nats { subject, .. } => subject,
            Dest::Redis { key, .. } => key,
            Dest::Webhook { url, .. } => url,
        }
    }

    /// A production sink for this destination, built as `ferry run` would.
    pub(crate) fn sink(&self) -> anyhow::Result<Arc<dyn Sink>> {
        Ok(match self {
            Dest::Kafka { bootstrap, .. } => {
                use ferry_sink::kafka::{KafkaOptions, KafkaSink};
                Arc::new(
                    KafkaSink::new(KafkaOptions {
                        bootstrap_servers: bootstrap.clone(),
                        ..KafkaOptions::default()
                    })
                    .map_err(|e| anyhow!("the Kafka sink: {e}"))?,
                )
            }
            Dest::Nats { url, .. } => {
                use ferry_sink::nats::{NatsOptions, NatsSink};
                Arc::new(NatsSink::new(NatsOptions {
                    url: url.clone(),
                    ..NatsOptions::default()
                }))
            }
            Dest::Redis { url, .. } => {
                use ferry_sink::redis::{RedisOptions, RedisSink};
                Arc::new(RedisSink::new(RedisOptions {
                    url: url.clone(),
                    ..RedisOptions::default()
                }))
            }
            Dest::Webhook { .. } => {
                use ferry_sink::webhook::{WebhookOptions, WebhookSink};
                Arc::new(
                    WebhookSink::new(WebhookOptions {
                        concurrency: WEBHOOK_CONCURRENCY,
                        ..WebhookOptions::default()
                    })
                    .map_err(|e| anyhow!("the webhook sink: {e}"))?,
                )
            }
        })
    }

    /// Messages the destination holds (requests received, for the webhook).
    pub(crate) async fn count(&self) -> anyhow::Result<u64> {
        match self {
            Dest::Kafka { consumed, .. } => Ok(consumed.load(Ordering::Relaxed)),
            Dest::Nats { client, stream, .. } => {
                let info = js_api(client, &format!("$JS.API.STREAM.INFO.{stream}"), None).await?;
                info["state"]["messages"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("NATS stream info for {stream} has no message count: {info}"))
            }
            Dest::Redis { conn, key, .. } => {
                let mut conn = conn.clone();
                let len: u64 = redis::cmd("XLEN")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .with_context(|| format!("XLEN {key}"))?;
                Ok(len)
            }
            Dest::Webhook { received, .. } => Ok(received.load(Ordering::Relaxed)),
        }
    }

    /// `events` confirmed publishes from one client, in windows of `window`
    /// (the webhook: `WEBHOOK_CONCURRENCY` requests in flight). Returns how
    /// long they took; checks the destination then holds them all.
    pub(crate) async fn baseline(&self, events: u64, window: usize, keys: u64) -> anyhow::Result<Duration> {
        let label = format!("{} base", self.kind().label());
        let bar = progress::bar(events, &label);
        let window = window.max(1) as u64;
        // The bodies are built before the clock starts, as the relay's come
        // ready-made from the database: the clock times the client alone.
        let messages = workload::Messages::build(events, keys);
        let mut started = Instant::now();
        match self {
            Dest::Kafka { bootstrap, topic, .. } => {
                let producer = warm_producer(bootstrap, topic).await?;
                // The relay's producer is connected by its start-up check.
                started = Instant::now();
                let mut sent = 0;
                while sent < events {
                    let n = (events - sent).min(window);
                    let mut deliveries = Vec::with_capacity(n as usize);
                    for seq in sent..sent + n {
                        let payload = messages.body(seq);
                        let record = FutureRecord::to(topic).key(messages.key(seq)).payload(payload.as_ref());
                        let delivery = producer
                            .send_result(record)
                            .map_err(|(e, _)| anyhow!("enqueueing a Kafka message: {e}"))?;
                        deliveries.push(delivery);
                    }
                    for delivery in deliveries {
                        delivery
                            .await
                            .map_err(|_| anyhow!("a Kafka delivery report was dropped"))?
                            .map_err(|(e, _)| anyhow!("Kafka refused a message: {e}"))?;
                    }
                    sent += n;
                    bar.set_position(sent);
                }
            }
            Dest::Nats { client, subject, .. } => {
                let mut sent = 0;
                while sent < events {
                    let n = (events - sent).min(window);
                    let mut acks = Vec::with_capacity(n as usize);
                    for seq in sent..sent + n {
                        let payload = messages.body(seq);
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string().as_str());
                        acks.push(client.request_with_headers(subject.clone(), headers, payload));
                    }
                    for ack in join_all(acks).await {
                        let ack = ack.context("awaiting a JetStream PubAck")?;
                        let ack: Value = serde_json::from_slice(&ack.payload).context("a JetStream PubAck")?;
                        if let Some(error) = ack.get("error") {
                            bail!("JetStream refused a message: {error}");
                        }
                    }
                    sent += n;
                    bar.set_position(sent);
                }
            }
            Dest::Redis { conn, key, .. } => {
                let mut conn = conn.clone();
                let mut sent = 0;
                while sent < events {
                    let n = (events - sent).min(window);
                    let mut pipe = redis::pipe();
                    for seq in sent..sent + n {
                        let payload = messages.body(seq);
                        let id = uuid::Uuid::now_v7().to_string();
                        pipe.xadd(
                            key,
                            "*",
                            &[
                                ("id", id.as_bytes()),
                                ("type", workload::EVENT_TYPE.as_bytes()),
                                ("key", messages.key(seq).as_bytes()),
                                ("payload", payload.as_ref()),
                            ],
                        );
                    }
                    let ids: Vec<String> = pipe.query_async(&mut conn).await.context("pipelined XADD")?;
                    anyhow::ensure!(ids.len() as u64 == n, "Redis answered {} of {n} XADDs", ids.len());
                    sent += n;
                    bar.set_position(sent);
                }
            }
            Dest::Webhook { url, .. } => {
                let client = http_client()?;
                started = Instant::now();
                let posted = futures::stream::iter(0..events)
                    .map(|seq| {
                        let client = client.clone();
                        let payload = messages.body(seq);
                        async move {
                            let response = client
                                .post(url.as_str())
                                .header("content-type", "application/json")
                                .header("webhook-id", uuid::Uuid::now_v7().to_string())
                                .body(payload)
                                .send()
                                .await
                                .context("POST to the webhook receiver")?;
                            anyhow::ensure!(
                                response.status().is_success(),
                                "the webhook receiver answered {}",
                                response.status()
                            );
                            anyhow::Ok(())
                        }
                    })
                    .buffer_unordered(WEBHOOK_CONCURRENCY);
                futures::pin_mut!(posted);
                let mut sent = 0;
                while let Some(result) = posted.next().await {
                    result?;
                    sent += 1;
                    if sent % window == 0 {
                        bar.set_position(sent);
                    }
                }
            }
        }
        let elapsed = started.elapsed();
        progress::done(
            &bar,
            format!(
                "sinks: {} baseline: {events} confirmed publishes in {:.1} s: {:.0}/s",
                self.kind().label(),
                elapsed.as_secs_f64(),
                super::broker::per_second(events, elapsed)
            ),
        );
        // A destination may report what it stored a moment late (Kafka's
        // end offsets); the figure stands, but every message must be there
        // (Kafka's topic also holds the producer's warm-up message).
        let deadline = Instant::now() + SETTLE;
        let mut held = self.count().await?;
        while held < events && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            held = self.count().await?;
        }
        anyhow::ensure!(
            held >= events,
            "the {} destination holds {held} messages, expected {events}",
            self.kind().label()
        );
        Ok(elapsed)
    }

    /// Deletes the topic, stream or key and forgets it in `left`, or stops
    /// the receiver.
    pub(crate) async fn delete(self, left: &Leftovers) -> anyhow::Result<()> {
        match self {
            Dest::Kafka {
                admin, topic, reader, ..
            } => {
                drop(reader);
                delete_topic(&admin, &topic).await?;
                left.remove(&topic);
            }
            Dest::Nats { client, stream, .. } => {
                delete_stream(&client, &stream).await?;
                left.remove(&stream);
            }
            Dest::Redis { mut conn, key, .. } => {
                delete_key(&mut conn, &key).await?;
                left.remove(&key);
            }
            Dest::Webhook { server, .. } => server.abort(),
        }
        Ok(())
    }
}

/// Runs `body` with a fresh destination and deletes it afterwards, whatever
/// `body` returned.
pub(crate) async fn with_dest<T, F>(
    ctx: &Ctx<'_>,
    kind: Kind,
    phase: &str,
    at: &Endpoints,
    body: F,
) -> anyhow::Result<T>
where
    F: AsyncFnOnce(&Dest) -> anyhow::Result<T>,
{
    let dest = Dest::create(kind, phase, at, ctx.left).await?;
    let result = body(&dest).await;
    let deleted = dest.delete(ctx.left).await;
    let value = result?;
    deleted?;
    Ok(value)
}

/// Deletes the topic, stream or key `name` a scenario left at `at`, over a
/// connection of its own; one that was never made counts as deleted.
pub(crate) async fn delete_named(kind: Kind, at: &str, name: &str) -> anyhow::Result<()> {
    match kind {
        Kind::Kafka => delete_topic(&kafka_admin(at)?, name).await,
        Kind::Nats => {
            let client = async_nats::connect(at)
                .await
                .with_context(|| format!("cannot connect to NATS at {at}"))?;
            delete_stream(&client, name).await
        }
        Kind::Redis => {
            let client = redis::Client::open(at).context("the Redis URL")?;
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .with_context(|| format!("cannot connect to Redis at {at}"))?;
            delete_key(&mut conn, name).await
        }
        Kind::Webhook => Ok(()),
    }
}

fn kafka_admin(bootstrap: &str) -> anyhow::Result<AdminClient<DefaultClientContext>> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .context("creating a Kafka admin client")
}

async fn delete_topic(admin: &AdminClient<DefaultClientContext>, topic: &str) -> anyhow::Result<()> {
    let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
    let results = admin
        .delete_topics(&[topic], &options)
        .await
        .with_context(|| format!("deleting Kafka topic {topic}"))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((t, code)) => bail!("deleting Kafka topic {t}: {code}"),
        }
    }
    Ok(())
}

/// JetStream's error code for a stream that does not exist.
const NATS_STREAM_NOT_FOUND: u64 = 10059;

async fn delete_stream(client: &async_nats::Client, stream: &str) -> anyhow::Result<()> {
    let answer = js_api(client, &format!("$JS.API.STREAM.DELETE.{stream}"), None).await?;
    match answer.get("error") {
        Some(error) if error["err_code"].as_u64() != Some(NATS_STREAM_NOT_FOUND) => {
            bail!("deleting NATS stream {stream}: {error}")
        }
        _ => Ok(()),
    }
}

async fn delete_key(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> anyhow::Result<()> {
    let _: u64 = redis::cmd("DEL")
        .arg(key)
        .query_async(conn)
        .await
        .with_context(|| format!("DEL {key}"))?;
    Ok(())
}

/// A JetStream API request; `None` sends an empty body.
pub(crate) async fn js_api(client: &async_nats::Client, subject: &str, body: Option<Value>) -> anyhow::Result<Value> {
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let answer = client
        .request(subject.to_owned(), body)
        .await
        .with_context(|| format!("NATS request {subject} (is JetStream enabled?)"))?;
    serde_json::from_slice(&answer.payload).with_context(|| format!("the answer to {subject}"))
}

/// A plain-HTTP client for the webhook baseline; rustls is configured with
/// the ring provider only because reqwest insists on a TLS backend.
fn http_client() -> anyhow::Result<reqwest::Client> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(Duration::from_secs(30))
        .build()
        .context("building the HTTP client")
}

/// Wraps a sink to count the events its destination confirmed, as the relay
/// sees them: a drain is timed to the last confirmation, like the baseline;
/// with `arrivals`, also notes when each event was confirmed (the sinks'
/// latency).
pub(crate) struct Confirming {
    pub inner: Arc<dyn Sink>,
    pub confirmed: Arc<AtomicU64>,
    pub arrivals: Option<Arc<Arrivals>>,
}

#[async_trait]
impl Sink for Confirming {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        self.inner.admit(route, event)
    }

    fn admits_in_publish(&self) -> bool {
        self.inner.admits_in_publish()
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        let outcomes = self.inner.publish(route, events).await;
        let ok = outcomes.iter().filter(|o| o.is_ok()).count() as u64;
        self.confirmed.fetch_add(ok, Ordering::Relaxed);
        if let Some(arrivals) = &self.arrivals {
            let at = Instant::now();
            for (event, outcome) in events.iter().zip(&outcomes) {
                if outcome.is_ok() {
                    arrivals.record(event.id.0, at);
                }
            }
        }
        outcomes
    }

    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        self.inner.check(route).await
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}
