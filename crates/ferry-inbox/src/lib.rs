//! Ferry's consuming side: exactly-once effects from at-least-once delivery.
//!
//! - [`Inbox`] records `(consumer, event id)` in `ferry.inbox` in the same
//!   transaction as the handler's writes; a redelivered event finds its row
//!   and is skipped ([`Outcome::Duplicate`]). A failing handler rolls back
//!   and is retried with backoff; after the last attempt the event is
//!   recorded dead and goes to the consumer's dead-letter destination.
//! - [`ReceivedEvent`] is Ferry's envelope (event id, type, key, CloudEvents
//!   attributes, headers, payload) decoded from any broker.
//! - A handler is an async closure `async |tx, event| { ... }` that writes
//!   its effects through `tx`, the inbox's open transaction, and returns a
//!   [`HandlerError`] to roll back and retry (or give up, if permanent).
//! - A delivery that meets another attempt at the same event still holding
//!   its row (a consumer stalled with its transaction open) waits at most
//!   the inbox's lock timeout, then is [`Outcome::InProgress`]: not an
//!   attempt, left to the broker for later.
//! - An attempt the process dies in (killed, out of memory, aborted inside
//!   the handler) rolls its count back with its claim; so for a delivery
//!   that may be a replay, [`Inbox::process_redelivered`] first marks the
//!   attempt's start in a transaction of its own, and past the policy's
//!   attempts, finished or not, the event is dead without running again.
//!   The runners mark only what may be a replay.
//! - Runners, one per broker behind a feature, consume, decode, call the
//!   inbox and acknowledge only after its commit: `rabbitmq`, `redis`
//!   (Streams), `nats` (JetStream) and `kafka`. They drive the PostgreSQL
//!   [`Inbox`], and stop (`ConsumerError::Inbox`) rather than retry for
//!   ever when its table is missing, out of date or not the role's to use
//!   ([`Inbox::check`], asked before they consume).
//! - With the `sqlite` feature, [`sqlite::Inbox`] is the same inbox over an
//!   SQLite file (the `ferry_inbox` table), with the same outcomes and
//!   counters; a consumer calls its `process` from its own receive loop.
//!
//! There is no cache in front of the inbox table: the table is the only
//! authority on "already done", so no cache outage can be mistaken for it.
//!
//! What the inbox does not give (the README's "Retention, order and
//! outages" has the details):
//!
//! - Per-key order outside Kafka. Kafka keeps each partition's order: a failing
//!   record is retried in place. On RabbitMQ, NATS and Redis a failing
//!   message waits out its backoff while later ones are handled, so later
//!   events of its key are processed first, and several members interleave
//!   a key's events.
//! - Effects once across a purge: an event whose row `purge` removed is
//!   applied again if the broker hands it out again, as it does to a group,
//!   durable or stream group created anew.
//! - Immunity to broker delivery limits: while the inbox's database is
//!   down, deliveries are put back without counting an attempt, but the
//!   broker counts them (NATS `max_deliver`, a RabbitMQ quorum queue's
//!   `delivery-limit`, 20 by default on RabbitMQ 4) and drops a message
//!   past its limit. Leave NATS `max_deliver` unlimited and raise
//!   `delivery-limit` by policy.

mod envelope;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod handler;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod inbox;
pub mod metrics;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use envelope::{DecodeError, ReceivedEvent};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use handler::HandlerError;
#[cfg(feature = "postgres")]
pub use inbox::Inbox;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use inbox::{InboxError, InboxRecord, Outcome, after_failure};

#[cfg(any(feature = "rabbitmq", feature = "redis", feature = "nats", feature = "kafka"))]
mod runner;
#[cfg(any(feature = "rabbitmq", feature = "redis", feature = "nats", feature = "kafka"))]
pub use runner::{ConsumerError, ConsumerReport};

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
