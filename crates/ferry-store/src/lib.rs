//! Ferry's outbox stores.
//!
//! Each store implements [`ferry_core::Store`] for the relay, offers the
//! producer API (`enqueue` inside the caller's transaction), its migrations and
//! an admin view ([`StatusReport`]). Stores sit behind features:
//!
//! - `postgres` (default): [`postgres::PgStore`], [`postgres::enqueue`],
//!   [`postgres::migrate`].
//!
//! Every store passes the conformance suite in `ferry-testkit`.

mod status;

#[cfg(feature = "postgres")]
pub mod postgres;

pub use status::{BlockedKeys, DeadReason, LeaseInfo, RouteStatus, StatusReport};
