//! Ferry: a transactional outbox for Rust services.
//!
//! Write an event in the same database transaction as the business change
//! that caused it; Ferry's relay (`ferry run`) delivers it to RabbitMQ (Kafka,
//! NATS, Redis and webhooks to come) at least once, in order per key, with
//! every failure visible and recoverable.
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

pub use ferry_core::{
    ErrorKind, Event, EventId, EventType, Glob, Headers, Payload, RetryPolicy, Route, Sink, SinkError, Store,
    StoredEvent, SystemClock, ValidationError,
};

#[cfg(feature = "postgres")]
pub use ferry_store::postgres::{EnqueueError, Enqueued, PgStore, enqueue, enqueue_batch, migrate};

#[cfg(feature = "relay")]
pub use ferry_relay as relay;
#[cfg(feature = "relay")]
pub use ferry_sink as sink;
