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

/// The database server's clock: `clock_timestamp()`, the moment the
/// statement runs (`now()` is its transaction's start). Lease expiry and
/// `ferry cancel`'s "due or in flight" test run on this clock, the relay's
/// retry times and claim cutoffs on its host's: compare the two, allowing
/// for the round trip, to see a skew between them.
pub async fn database_clock(
    conn: impl sqlx::PgExecutor<'_>,
) -> Result<chrono::DateTime<chrono::Utc>, ferry_core::StoreError> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(conn)
        .await
        .map_err(store_error)
}
