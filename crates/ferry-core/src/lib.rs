//! Ferry's pure core: no I/O lives here.
//!
//! - [`Event`] is what a producer writes; [`EventType`] validates its name and
//!   [`StoredEvent`] is the committed event as the relay reads it back.
//! - [`Route`] maps event types (by glob) to a sink and a destination.
//! - [`decide`] is the one lifecycle decision: given a delivery's attempts, the
//!   outcome of a publish and the [`RetryPolicy`], it returns the
//!   [`Transition`] the store applies (published, retry at a time, or dead).
//! - [`Sink`] is the trait every destination implements; [`Store`] is the trait
//!   every outbox database implements. Both classify their errors with
//!   [`ErrorKind`] so the relay branches on the kind, never on message text.
//! - [`Clock`] is injected so lease and retry logic is testable without sleeping.
//! - [`redact::url`] hides the credentials a URL may carry, for every message.
//! - `trace` (feature `otel`) carries W3C trace context in event headers.

mod clock;
mod error;
mod event;
mod lifecycle;
pub mod redact;
mod route;
mod sink;
mod store;
#[cfg(feature = "otel")]
pub mod trace;

pub use clock::{Clock, SystemClock};
pub use error::{ErrorKind, ValidationError};
pub use event::{
    Event, EventId, EventType, Headers, MAX_HEADER_BYTES, MAX_KEY_BYTES, MAX_PAYLOAD_BYTES, Payload, StoredEvent,
};
pub use lifecycle::{RetryPolicy, Transition, decide};
pub use route::{Glob, Route, render_template, render_template_with};
pub use sink::{PublishOutcome, Sink, SinkError, prepare_in_key_order};
pub use store::{
    Claimed, DeliveryState, DirectBatch, DirectOutcome, DirectRecord, NO_ROUTE, Ownership, Partition, Recorded,
    RelayId, RoutePlan, Store, StoreError, UnroutedEvent, Wake, WakeSource,
};
