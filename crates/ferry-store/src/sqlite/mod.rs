//! The SQLite store: Ferry with no server, for development, demos and
//! single-machine services.
//!
//! It mirrors [`crate::postgres`]: [`SqliteStore`] for the relay, [`enqueue`]
//! and [`enqueue_batch`] inside the caller's transaction, [`migrate`], and
//! [`SqliteStore::status`]. Tables are prefixed `ferry_` (SQLite has no
//! schemas); SQL lives in `sql/` and `migrations/` beside this file.
//!
//! One relay per database file: the first [`ferry_core::Store::tick`] of a
//! store takes an exclusive lock on a file beside the database (the database
//! path with `.relay-lock` appended) and holds it for the store's life, so a
//! second relay process on the same file is refused with an error naming
//! both. To run several relays, use PostgreSQL.
//!
//! Commits are noticed by polling `PRAGMA data_version` on a dedicated
//! connection (see [`ferry_core::Store::listen`]): it changes when another
//! connection commits and costs no table reads.

/// SQLite's own clock in microseconds since the Unix epoch, as SQL.
macro_rules! now_us {
    () => {
        "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
    };
}

mod admin;
mod enqueue;
mod error;
mod gauges;
mod listen;
mod lock;
mod migrate;
mod retention;
mod status;
mod store;

pub use crate::enqueue::{EnqueueError, Enqueued};
pub use enqueue::{enqueue, enqueue_batch, partition_of};
pub use error::store_error;
pub use migrate::{MIGRATIONS, MigrateError, migrate};
pub use store::{SqliteStore, connect_options};

/// Partitions in the outbox; fixed by the first migration.
pub const PARTITIONS: u32 = 32;
