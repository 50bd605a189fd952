//! Ferry: a transactional outbox for Rust services.
//!
//! Write an event in the same database transaction as the business change
//! that caused it; Ferry's relay (`ferry run`) delivers it to RabbitMQ, Kafka,
//! NATS JetStream, Redis Streams, webhooks or files at least once, in order
//! per key, with every failure visible and recoverable.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use ferry::Event;
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42").execute(&mut *tx).await?;
//! ferry::enqueue(&mut *tx, Event::new("order.paid", serde_json::json!({"id": 42})).key("order-42")).await?;
//! tx.commit().await?; // the event commits with the update, or neither does
//! # Ok(()) }
//! ```
//!
//! - [`enqueue`] and [`enqueue_batch`] join the caller's transaction and refuse
//!   to run outside one.
//! - [`migrate`] creates the `ferry` schema (the `ferry migrate` command does
//!   the same); it also installs `ferry.enqueue(...)` for producers in any
//!   language.
//! - With the `relay` feature, [`relay`] and [`sink`] embed the relay.
//! - With the `otel` feature, `enqueue` puts the current span's W3C
//!   `traceparent` and `tracestate` into the event's headers (see `trace`).
//! - With the `wal` feature, [`wal`] writes tableless events and feeds an
//!   embedded relay from a logical replication slot.
//! - With the `inbox` feature, [`inbox`] is the consuming side: exactly-once
//!   effects from at-least-once delivery, and consumer runners
//!   (`inbox-rabbitmq`, `inbox-redis`, `inbox-nats`, `inbox-kafka`).

pub use ferry_core::{
    ErrorKind, Event, EventId, EventType, Glob, Headers, Payload, RetryPolicy, Route, Sink, SinkError, Store,
    StoredEvent, SystemClock, ValidationError,
};

pub use ferry_store::{EnqueueError, Enqueued};

#[cfg(feature = "otel")]
pub use ferry_core::trace;

#[cfg(feature = "postgres")]
pub use ferry_store::postgres::{PgStore, enqueue, enqueue_batch, migrate};

/// Table capture on PostgreSQL: triggers that write an event for every
/// insert, update and delete of a table, in the writer's transaction (the
/// library side of `ferry capture`).
#[cfg(feature = "postgres")]
pub use ferry_store::postgres::capture;

/// WAL streaming mode (`wal` feature): [`wal::emit`] writes a tableless
/// event (a logical decoding message, no outbox row) in the caller's
/// transaction, and [`wal::WalSource`] is what an embedded relay streams
/// from (`Relay::with_wal`).
#[cfg(feature = "wal")]
pub use ferry_store::postgres::wal;

/// The embedded SQLite store (`sqlite` feature): `ferry::sqlite::SqliteStore`,
/// `ferry::sqlite::enqueue` and `ferry::sqlite::migrate`, for a service that
/// runs with no database server. One relay per database file.
#[cfg(feature = "sqlite")]
pub use ferry_store::sqlite;

#[cfg(feature = "inbox")]
pub use ferry_inbox as inbox;
#[cfg(feature = "relay")]
pub use ferry_relay as relay;
#[cfg(feature = "relay")]
pub use ferry_sink as sink;
