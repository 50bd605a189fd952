//! Size checks shared by the sinks, made before anything is sent.

use ferry_core::{Route, SinkError, StoredEvent};

/// Refuses (permanently) a payload over the sink's `max_message_bytes`,
/// naming the setting to change.
pub(crate) fn check_payload_size(
    route: &Route,
    event: &StoredEvent,
    max_message_bytes: usize,
) -> Result<(), SinkError> {
    if event.payload.len() > max_message_bytes {
        return Err(SinkError::permanent(format!(
            "payload too large: {} bytes, limit {max_message_bytes} (sinks.{}.max_message_bytes)",
            event.payload.len(),
            route.sink
        )));
    }
    Ok(())
}

/// Fixtures for the sinks' unit tests.
#[cfg(test)]
#[allow(dead_code)] // Each feature set uses some of them.
pub(crate) mod fixtures {
    use bytes::Bytes;
    use ferry_core::{EventId, Glob, Route, StoredEvent};

    /// A route named `orders` of sink `sink` to `destination`.
    pub(crate) fn route(sink: &str, destination: &str) -> Route {
        Route {
            name: "orders".into(),
            matcher: Glob::new("**").unwrap(),
            sink: sink.into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    /// An `order.item.created` event with a small JSON payload and a
    /// `traceparent` header.
    pub(crate) fn event(key: Option<&str>) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq: 7,
            event_type: "order.item.created".into(),
            key: key.map(str::to_owned),
            payload: Bytes::from_static(b"{\"n\":1}"),
            content_type: "application/json".into(),
            headers: [("traceparent".to_owned(), "00-abc-01".to_owned())].into(),
            created_at: chrono::Utc::now(),
        }
    }

    /// A W3C `traceparent` and a `tracestate` with the `,` and `=` its
    /// list syntax uses: every sink must forward both unchanged.
    pub(crate) const TRACE_CONTEXT: [(&str, &str); 2] = [
        ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
    ];

    /// [`event`] carrying [`TRACE_CONTEXT`].
    pub(crate) fn traced_event() -> StoredEvent {
        let mut e = event(Some("o-1"));
        for (name, value) in TRACE_CONTEXT {
            e.headers.insert(name.to_owned(), value.to_owned());
        }
        e
    }
}
