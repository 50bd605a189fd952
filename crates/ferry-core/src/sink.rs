use std::collections::HashMap;
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
    /// An event held back because `first`, an earlier event of its key in
    /// the same batch, failed.
    pub fn held_back_behind(first: &StoredEvent) -> Self {
        Self::held_back(format!(
            "held back: event {} of key {:?} earlier in this batch failed",
            first.id,
            first.key.as_deref().unwrap_or_default()
        ))
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
    /// prepared once per attempt instead of twice ([`prepare_in_key_order`]
    /// does the hold-back). Default `false`: the relay calls `admit` first.
    fn admits_in_publish(&self) -> bool {
        false
    }

    /// Publishes `events` to `route`'s destination; one outcome per event.
    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome>;

    /// Verifies that the route's destination exists and is reachable.
    async fn check(&self, route: &Route) -> Result<(), SinkError>;

    /// [`check`](Sink::check), and what it could not verify: each caveat is
    /// a sentence for the operator, such as bindings the broker would not
    /// show, which `ferry check` prints on the route's line. A passing
    /// check with caveats is still a pass. The default verifies everything
    /// `check` does.
    async fn check_with_caveats(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        self.check(route).await.map(|()| Vec::new())
    }

    /// Closes connections after the last confirm has been awaited.
    async fn close(&self) {}
}

/// Prepares every event in order, as `Sink::publish` must before it sends
/// any of a batch, and as the relay admits a batch for a sink that does not. Once an event of some key fails to
/// prepare (too large, an invalid name), later events of that key in the same
/// batch are not prepared but held back ([`SinkError::held_back()`]): sending them
/// would deliver a key's events out of order, since the failed one will only
/// reach the destination after an operator fixes and requeues it.
///
/// Events without a key have no order to keep and are never held back.
pub fn prepare_in_key_order<'a, T>(
    events: impl IntoIterator<Item = &'a StoredEvent>,
    mut prepare: impl FnMut(&'a StoredEvent) -> Result<T, SinkError>,
) -> Vec<Result<T, SinkError>> {
    let mut failed: HashMap<&str, &StoredEvent> = HashMap::new();
    events
        .into_iter()
        .map(|event| {
            if let Some(key) = event.key.as_deref()
                && let Some(first) = failed.get(key)
            {
                return Err(SinkError::held_back_behind(first));
            }
            let prepared = prepare(event);
            if let (Err(_), Some(key)) = (&prepared, event.key.as_deref()) {
                failed.insert(key, event);
            }
            prepared
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::EventId;

    pub(crate) fn ev(seq: i64, key: Option<&str>) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq,
            event_type: "test.item.created".into(),
            key: key.map(str::to_owned),
            payload: Default::default(),
            content_type: "application/json".into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn a_failure_holds_back_only_its_own_key() {
        let events = [
            ev(1, Some("a")),
            ev(2, Some("a")),
            ev(3, Some("b")),
            ev(4, Some("a")),
            ev(5, None),
            ev(6, None),
        ];
        let out = prepare_in_key_order(&events, |e| {
            if e.seq == 2 || e.seq == 5 {
                Err(SinkError::permanent("bad"))
            } else {
                Ok(e.seq)
            }
        });
        assert_eq!(out[0], Ok(1));
        assert_eq!(out[1].as_ref().unwrap_err().kind, ErrorKind::Permanent);
        assert_eq!(out[2], Ok(3));
        let held = out[3].as_ref().unwrap_err();
        assert_eq!(held.kind, ErrorKind::Transient);
        assert!(held.held_back, "marked as not sent: {held:?}");
        assert!(
            !out[1].as_ref().unwrap_err().held_back,
            "the refused event itself is not held back"
        );
        assert!(held.message.contains(&events[1].id.to_string()), "{}", held.message);
        assert_eq!(out[4].as_ref().unwrap_err().kind, ErrorKind::Permanent);
        assert_eq!(out[5], Ok(6));
    }
}
