//! Ferry's destinations, one module per kind behind one trait,
//! [`ferry_core::Sink`].
//!
//! - [`rabbitmq::RabbitMqSink`] (feature `rabbitmq`): publishes to exchanges
//!   with publisher confirms and `mandatory` set, so an unroutable message is
//!   a failure, never a success. Configured by [`rabbitmq::RabbitMqOptions`].
//! - [`kafka::KafkaSink`] (feature `kafka`): an idempotent librdkafka
//!   producer (`acks=all`) to existing topics, keyed by the event key.
//!   Configured by [`kafka::KafkaOptions`].
//! - [`nats::NatsSink`] (feature `nats`): JetStream publishes, delivered only
//!   on a PubAck, with `Nats-Msg-Id` (event id and subject) for the
//!   stream's duplicate window.
//!   Configured by [`nats::NatsOptions`].
//! - [`redis::RedisSink`] (feature `redis`): `XADD` to Redis streams, a batch
//!   per pipeline, with optional `MAXLEN ~` trimming per route. Configured by
//!   [`redis::RedisOptions`].
//! - [`webhook::WebhookSink`] (feature `webhook`): signed HTTP POSTs of
//!   CloudEvents in structured mode (Standard Webhooks signatures).
//!   Configured by [`webhook::WebhookOptions`].
//! - [`file::FileSink`] (feature `file`): JSON lines appended to files,
//!   synced before a batch counts as published, rotated by size. Configured
//!   by [`file::FileOptions`].
//! - [`stdout::StdoutSink`] (feature `stdout`): one JSON line per event, for
//!   development and piping into other tools.
//!
//! Every sink carries the event id as the message id (NATS: in `ce-id`, its
//! `Nats-Msg-Id` adds the subject) and the CloudEvents 1.0
//! attributes (in the destination's binary content mode where it has
//! headers; webhooks use structured mode), reports one outcome per event in
//! input order, and classifies failures as transient, permanent or
//! configuration errors so the relay never parses error text.
//!
//! Adding a sink means one module, one feature, and one test that runs
//! `ferry_testkit::sink_suite::run` against the real destination.

// Shared by the connection-holding sinks; unused when only stdout is built.
#[cfg_attr(
    not(any(
        feature = "rabbitmq",
        feature = "kafka",
        feature = "nats",
        feature = "redis",
        feature = "webhook"
    )),
    allow(dead_code)
)]
mod backoff;
#[cfg_attr(
    not(any(
        feature = "rabbitmq",
        feature = "kafka",
        feature = "nats",
        feature = "redis",
        feature = "webhook"
    )),
    allow(dead_code)
)]
mod batch;
#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "nats", feature = "redis")),
    allow(dead_code)
)]
mod limits;

#[cfg(feature = "file")]
pub mod file;
#[cfg(any(feature = "webhook", feature = "rabbitmq"))]
mod http;

/// Connections (Kafka: producers) a sink opened, per kind. One per sink is
/// the start; each more is a reconnect after the old one failed.
pub const CONNECTIONS_METRIC: &str = "ferry_sink_connections_total";

#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "kafka", feature = "nats", feature = "redis")),
    allow(dead_code)
)]
fn connected(kind: &'static str) {
    metrics::counter!(CONNECTIONS_METRIC, "kind" => kind).increment(1);
}
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(any(feature = "stdout", feature = "file"))]
mod line;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "stdout")]
pub mod stdout;
#[cfg(feature = "webhook")]
pub mod webhook;
