//! Ferry's outbox stores.
//!
//! Each store implements [`ferry_core::Store`] for the relay, offers the
//! producer API (`enqueue` inside the caller's transaction), its migrations and
//! the operator's view ([`Admin`]: status, list, show, requeue, cancel and the
//! outcomes `ferry tail` follows). Stores sit behind features:
//!
//! - `postgres` (default): [`postgres::PgStore`], [`postgres::enqueue`],
//!   [`postgres::migrate`].
//! - `sqlite`: [`sqlite::SqliteStore`], [`sqlite::enqueue`],
//!   [`sqlite::migrate`]; embedded, no server, one relay per database file.
//!
//! Both producer APIs return [`Enqueued`] and [`EnqueueError`].
//!
//! Operations, store-neutral too: [`Retention`] (driven by [`purge`], which
//! archives each batch durably before deleting it) and [`Gauges`], the cheap
//! depth and age readings behind the metrics.
//!
//! Every store passes the conformance suite in `ferry-testkit`.

mod admin;
mod enqueue;
mod gauges;
mod retention;
mod status;

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use admin::{
    Action, ActionRecord, Admin, AdminState, Applied, Attempt, Change, Cursor, DeliverySummary, DeliveryView,
    EventView, Filter, ListPage, Page, Plan, Refusal, Target,
};
pub use enqueue::{EnqueueError, Enqueued};

pub use gauges::{GaugeReport, Gauges, RouteGauges};
pub use retention::{
    ArchivedAction, ArchivedDelivery, ArchivedEvent, ArchivedFailure, DeleteFailed, Deleted, ExpiredBatch, PurgeError,
    PurgeOptions, PurgeReport, Retention, RetentionRules, purge, read_archive,
};
pub use status::{BlockedKeys, DeadReason, LeaseInfo, RouteStatus, StatusReport};
