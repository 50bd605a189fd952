//! The PostgreSQL store.
//!
//! SQL lives in `sql/` and `migrations/` beside this file. Everything is in the
//! `ferry` schema, created by [`migrate`].

mod admin;
pub mod capture;
mod direct;
mod enqueue;
mod error;
mod gauges;
mod listen;
mod migrate;
mod retention;
mod status;
mod store;
#[cfg(feature = "wal")]
pub mod wal;

pub use enqueue::{EnqueueError, Enqueued, enqueue, enqueue_batch};
pub use error::store_error;
pub use migrate::{MIGRATIONS, MigrateError, migrate};
pub use store::PgStore;

/// Partitions in the outbox; fixed by the first migration.
pub const PARTITIONS: u32 = 32;
