//! The PostgreSQL store.
//!
//! SQL lives in `sql/` and `migrations/` beside this file. Everything is in the
//! `ferry` schema, created by [`migrate`].

mod enqueue;
mod error;
mod listen;
mod migrate;
mod status;
mod store;

pub use enqueue::{EnqueueError, Enqueued, enqueue, enqueue_batch};
pub use error::store_error;
pub use migrate::{MIGRATIONS, MigrateError, migrate};
pub use store::PgStore;

/// Partitions in the outbox; fixed by the first migration.
pub const PARTITIONS: u32 = 32;
