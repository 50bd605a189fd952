//! Ferry's relay engine, generic over a [`ferry_core::Store`] and a
//! [`ferry_core::Clock`], publishing through [`ferry_core::Sink`]s.
//!
//! [`Relay::run`] starts four kinds of task and returns when `shutdown`
//! resolves and they have stopped:
//!
//! - the **lease keeper** heartbeats, renews this relay's partition leases,
//!   hands back partitions above its fair share (after the workers have
//!   quiesced) and takes free or expired ones;
//! - the **router** reads committed, unrouted events of the leased partitions
//!   and publishes them directly to every matching route, then settles their
//!   delivery rows (a dead `no route` one for an event that matches none);
//!   an event whose key waits in the table on a route is parked behind it;
//! - one **worker per route** works the table path: it claims due deliveries
//!   (retries, parked events, requeues) in outbox order, publishes them as
//!   one pipelined batch, decides each outcome with [`ferry_core::decide`]
//!   and records it, fenced by the lease;
//! - the **listener** turns commit notifications into wake-ups.
//!
//! With the `wal` feature and [`Relay::with_wal`], a **streamer** takes the
//! router's place: it reads committed events from a logical replication slot
//! in commit order and publishes them at once, leaving retries to the route
//! workers' table path (see the `wal` module).
//!
//! Each batch is published inside a `ferry.publish` span (route, count);
//! with the `otel` feature the span links to every event's `traceparent`.
//!
//! Every store call is bounded in time (one `relay.lease`, the lease
//! keeper's renewals more tightly): a connection gone silent fails the call,
//! which is retried, instead of holding a task on it.
//!
//! Deciding is split from doing: routing is [`plan_routes`], outcomes are
//! [`ferry_core::decide`]; the tasks only move data between store and sinks.

mod batch;
mod bounded;
mod direct;
mod engine;
mod lease;
pub mod metrics;
mod router;
mod settings;
#[cfg(feature = "wal")]
pub mod wal;
mod worker;

pub use engine::{Progress, Relay, RelayError, RunReport};
pub use router::plan_routes;
pub use settings::RelaySettings;
#[cfg(feature = "wal")]
pub use wal::{Wal, WalOptions};
