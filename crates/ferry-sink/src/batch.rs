//! Per-key ordering inside one batch, for checks made before anything is sent.

use std::collections::HashMap;

use ferry_core::{PublishOutcome, Route, SinkError, StoredEvent};

/// Prepares every event in slice order. Once an event of some key fails to
/// prepare (too large, an invalid name), later events of that key in the same
/// batch are not prepared but held back ([`SinkError::held_back()`]): sending them
/// would deliver a key's events out of order, since the failed one will only
/// reach the destination after an operator fixes and requeues it.
///
/// Events without a key have no order to keep and are never held back.
pub(crate) fn prepare_in_key_order<T>(
    events: &[StoredEvent],
    mut prepare: impl FnMut(&StoredEvent) -> Result<T, SinkError>,
) -> Vec<Result<T, SinkError>> {
    let mut failed: HashMap<&str, &StoredEvent> = HashMap::new();
    events
        .iter()
        .map(|event| {
            if let Some(key) = event.key.as_deref()
                && let Some(first) = failed.get(key)
            {
                return Err(SinkError::held_back(format!(
                    "held back: event {} of key {key:?} earlier in this batch failed",
                    first.id
                )));
            }
            let prepared = prepare(event);
            if let (Err(_), Some(key)) = (&prepared, event.key.as_deref()) {
                failed.insert(key, event);
            }
            prepared
        })
        .collect()
}

/// The one line per published batch: the route and the counts, and for a
/// batch with failures the first failed event, so that its id leads to the
/// relay's own line about it.
pub(crate) fn log_published(sink: &str, route: &Route, events: &[StoredEvent], outcomes: &[PublishOutcome]) {
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    let first_failure = events
        .iter()
        .zip(outcomes)
        .find_map(|(event, outcome)| outcome.as_ref().err().map(|error| (event, error)));
    match first_failure {
        None => tracing::debug!(route = %route.name, events = events.len(), "published batch to {sink}"),
        Some((event, error)) => tracing::debug!(
            route = %route.name,
            events = events.len(),
            failed,
            event_id = %event.id,
            key = event.key.as_deref(),
            %error,
            "published batch to {sink}; {failed} failed, the first shown"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{ErrorKind, EventId};

    fn ev(seq: i64, key: Option<&str>) -> StoredEvent {
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
