use std::fmt;

use async_trait::async_trait;

use crate::{ErrorKind, Route, StoredEvent};

/// A failed publish, classified so the relay can decide without parsing text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkError {
    pub kind: ErrorKind,
    pub message: String,
    /// How long the destination asked to be left alone (an HTTP
    /// `Retry-After`, a broker's throttle time): the next attempt waits at
    /// least this long, up to the retry policy's longest delay.
    pub retry_after: Option<std::time::Duration>,
    /// The event was not sent because an earlier event of its key in the
    /// same batch failed or was refused: sending it would have broken the
    /// key's order. Always transient. The relay leaves such an event pending,
    /// without counting an attempt, behind the failure that stopped its key.
    pub held_back: bool,
}

impl SinkError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            retry_after: None,
            held_back: false,
        }
    }
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Transient, message)
    }
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Permanent, message)
    }
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }
    /// An event not sent to keep its key's order (the `held_back` field).
    pub fn held_back(message: impl Into<String>) -> Self {
        Self {
            held_back: true,
            ..Self::new(ErrorKind::Transient, message)
        }
    }
    /// The same error, asking the relay to wait at least `delay` before the
    /// next attempt.
    pub fn with_retry_after(mut self, delay: std::time::Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }
    pub fn is_transient(&self) -> bool {
        self.kind == ErrorKind::Transient
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.kind)
    }
}

impl std::error::Error for SinkError {}

/// The result of publishing one event.
pub type PublishOutcome = Result<(), SinkError>;

/// A destination kind: RabbitMQ, Kafka, stdout, ...
///
/// `publish` receives a batch for one route, in delivery order, and must put
/// the events on the wire in that order (pipelined is fine). It returns one
/// outcome per event, in the same order, and reports success only for events
/// the destination confirmed.
///
/// ```
/// use async_trait::async_trait;
/// use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
///
/// struct Discard;
///
/// #[async_trait]
/// impl Sink for Discard {
///     fn kind(&self) -> &'static str { "discard" }
///     async fn publish(&self, _route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
///         events.iter().map(|_| Ok(())).collect()
///     }
///     async fn check(&self, _route: &Route) -> Result<(), SinkError> { Ok(()) }
/// }
/// ```
#[async_trait]
pub trait Sink: Send + Sync + 'static {
    /// The `kind` name used in configuration.
    fn kind(&self) -> &'static str;

    /// Checks one event against the destination's limits (size, headers)
    /// before anything is sent. A rejected event is not sent, and neither are
    /// later events of its key in the same batch, so order holds.
    fn admit(&self, _route: &Route, _event: &StoredEvent) -> Result<(), SinkError> {
        Ok(())
    }

    /// Whether `publish` applies `admit` itself, before it sends anything:
    /// it refuses what `admit` refuses, reports the later events of that key
    /// in the batch as [`SinkError::held_back()`], and sends neither. The relay
    /// then skips its own `admit` pass over the batch, so each event is
    /// prepared once per attempt instead of twice. Default `false`: the
    /// relay calls `admit` first.
    fn admits_in_publish(&self) -> bool {
        false
    }

    /// Publishes `events` to `route`'s destination; one outcome per event.
    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome>;

    /// Verifies that the route's destination exists and is reachable.
    async fn check(&self, route: &Route) -> Result<(), SinkError>;

    /// Closes connections after the last confirm has been awaited.
    async fn close(&self) {}
}
