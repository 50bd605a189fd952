//! The one log line per published batch.

use ferry_core::{PublishOutcome, Route, StoredEvent};

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
