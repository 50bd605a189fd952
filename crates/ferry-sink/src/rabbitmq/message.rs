//! Turning a stored event into an AMQP message: addresses, properties and the
//! CloudEvents 1.0 binary-mode headers.

use bytes::Bytes;
use chrono::SecondsFormat;
use ferry_core::{Route, SinkError, StoredEvent, render_template};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// AMQP delivery mode 2: the broker writes the message to disk.
const PERSISTENT: u8 = 2;
/// The header carrying the event's aggregate key.
pub const KEY_HEADER: &str = "ferry-key";
/// RabbitMQ's default `frame_max`, the limit assumed (transiently) until a
/// connection negotiates one.
pub(crate) const DEFAULT_FRAME_MAX: usize = 131_072;
/// CloudEvents specification version written in `cloudEvents:specversion`.
pub const SPEC_VERSION: &str = "1.0";

/// One event, ready for `basic.publish`.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
    pub(crate) properties: BasicProperties,
    pub(crate) payload: Bytes,
}

impl Message {
    /// Renders the addresses and builds the properties, refusing (permanently)
    /// anything the broker would reject or the protocol cannot carry. AMQP
    /// short strings hold at most 255 bytes and lapin panics on longer ones,
    /// so every name derived from event data goes through `short`.
    pub(crate) fn prepare(
        route: &Route,
        event: &StoredEvent,
        source: &str,
        max_message_bytes: usize,
        frame_max: usize,
    ) -> Result<Self, SinkError> {
        crate::limits::check_payload_size(route, event, max_message_bytes)?;
        let exchange = render_template(&route.destination, event);
        let exchange = short("exchange name", "routes[].destination", exchange)?;
        let routing_key = render_template(route.routing_key.as_deref().unwrap_or("{type}"), event);
        let routing_key = short("routing key", "routes[].routing_key", routing_key)?;

        let (properties, size) = sized_properties(event, source)?;
        // The properties travel in one content header frame, which RabbitMQ
        // refuses (closing the connection) when it passes the negotiated
        // frame_max: a refusal every retry would meet again.
        // Not connected yet (0), the broker's frame size is unknown: past
        // RabbitMQ's default, the event waits for a connection to tell.
        let limit = if frame_max == 0 { DEFAULT_FRAME_MAX } else { frame_max };
        if size > limit {
            let message = format!(
                "the message's properties, mostly the event's headers, come to about {size} bytes; AMQP carries \
                 them in one frame, at most {limit} bytes (the broker's frame_max{}): send less in the event's \
                 headers and more in its payload",
                if frame_max == 0 {
                    ", RabbitMQ's default until connected"
                } else {
                    ""
                }
            );
            return Err(if frame_max == 0 {
                SinkError::transient(message)
            } else {
                SinkError::permanent(message)
            });
        }
        Ok(Self {
            exchange,
            routing_key,
            properties,
            payload: event.payload.clone(),
        })
    }
}

/// The AMQP properties an event is published with: message id, content
/// type, type, timestamp, persistent delivery, the producer's headers and the
/// CloudEvents 1.0 binary-mode headers (`source` is their `source`).
/// Refused (permanently) when a value does not fit an AMQP short string.
pub fn properties(event: &StoredEvent, source: &str) -> Result<BasicProperties, SinkError> {
    sized_properties(event, source).map(|(properties, _)| properties)
}

/// [`properties`], and about how many bytes their frame takes, generously.
fn sized_properties(event: &StoredEvent, source: &str) -> Result<(BasicProperties, usize), SinkError> {
    let mut headers = FieldTable::default();
    // Fixed fields, the CloudEvents headers and the content header frame's
    // own framing, generously: the producer's headers are what varies.
    let mut size = 1024 + event.content_type.len() + event.event_type.len() * 2 + source.len();
    size += event.key.as_ref().map_or(0, |k| 2 * k.len());
    for (name, value) in &event.headers {
        // Ferry's own names, whatever their case: a producer's copy would
        // stand in for them where Ferry writes none (a keyless event has no
        // `ferry-key`, which a consumer would take for its key).
        let lower = name.to_ascii_lowercase();
        if lower == KEY_HEADER || lower.starts_with("cloudevents:") {
            continue;
        }
        let name = short("header name", "the producer's headers", name.clone())?;
        // A short-string name, a type tag and a long-string value.
        size += 1 + name.as_str().len() + 1 + 4 + value.len();
        headers.insert(name, long(value));
    }
    // Inserted after the producer's headers so a producer cannot spoof them.
    let id = event.id.to_string();
    let time = event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    headers.insert("cloudEvents:specversion".into(), long(SPEC_VERSION));
    headers.insert("cloudEvents:id".into(), long(&id));
    headers.insert("cloudEvents:type".into(), long(&event.event_type));
    headers.insert("cloudEvents:source".into(), long(source));
    headers.insert("cloudEvents:time".into(), long(&time));
    if let Some(key) = &event.key {
        headers.insert("cloudEvents:subject".into(), long(key));
        headers.insert(KEY_HEADER.into(), long(key));
    }

    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_content_type(short(
            "content type",
            "the event's content_type",
            event.content_type.clone(),
        )?)
        .with_type(short("event type", "the event's type", event.event_type.clone())?)
        .with_timestamp(u64::try_from(event.created_at.timestamp()).unwrap_or(0))
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers);
    Ok((properties, size))
}

fn long(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes()))
}

fn short(what: &str, field: &str, value: String) -> Result<ShortString, SinkError> {
    let len = value.len();
    ShortString::try_new(value).map_err(|_| {
        SinkError::permanent(format!(
            "{what} is {len} bytes, AMQP allows at most 255; shorten it in {field}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures::{self, event};
    use ferry_core::{ErrorKind, Glob};

    fn route(destination: &str, routing_key: Option<&str>) -> Route {
        Route {
            name: "orders".into(),
            matcher: Glob::new("**").unwrap(),
            sink: "rabbit".into(),
            destination: destination.into(),
            routing_key: routing_key.map(str::to_owned),
        }
    }

    fn header(m: &Message, name: &str) -> Option<String> {
        let headers = m.properties.headers().as_ref()?;
        match headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(s.to_string()),
            other => panic!("{name} is {other:?}"),
        }
    }

    #[test]
    fn addresses_default_to_the_event_type() {
        let e = event(Some("o-1"));
        let m = Message::prepare(&route("ex.{domain}", None), &e, "ferry", 100, DEFAULT_FRAME_MAX).unwrap();
        assert_eq!(m.exchange.as_str(), "ex.order");
        assert_eq!(m.routing_key.as_str(), "order.item.created");
        let m = Message::prepare(&route("ex", Some("{type}.{key}")), &e, "ferry", 100, DEFAULT_FRAME_MAX).unwrap();
        assert_eq!(m.routing_key.as_str(), "order.item.created.o-1");
    }

    #[test]
    fn properties_and_cloudevents_headers() {
        let e = event(Some("o-1"));
        let m = Message::prepare(&route("ex", None), &e, "shop", 100, DEFAULT_FRAME_MAX).unwrap();
        let p = &m.properties;
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), e.id.to_string());
        assert_eq!(p.content_type().as_ref().unwrap().as_str(), "application/json");
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.item.created");
        assert_eq!(*p.delivery_mode(), Some(2));
        assert_eq!(*p.timestamp(), Some(e.created_at.timestamp() as u64));
        assert_eq!(header(&m, "cloudEvents:specversion").as_deref(), Some("1.0"));
        assert_eq!(header(&m, "cloudEvents:id"), Some(e.id.to_string()));
        assert_eq!(header(&m, "cloudEvents:source").as_deref(), Some("shop"));
        assert_eq!(header(&m, "cloudEvents:subject").as_deref(), Some("o-1"));
        assert_eq!(header(&m, "ferry-key").as_deref(), Some("o-1"));
        assert_eq!(header(&m, "traceparent").as_deref(), Some("00-abc-01"));
        let time = header(&m, "cloudEvents:time").unwrap();
        assert_eq!(chrono::DateTime::parse_from_rfc3339(&time).unwrap(), e.created_at);
        assert_eq!(&m.payload[..], b"{\"n\":1}");

        let m = Message::prepare(&route("ex", None), &event(None), "shop", 100, DEFAULT_FRAME_MAX).unwrap();
        assert_eq!(header(&m, "cloudEvents:subject"), None);
        assert_eq!(header(&m, "ferry-key"), None);
    }

    #[test]
    fn producer_headers_cannot_spoof_the_id_or_the_key() {
        let mut e = event(None);
        e.headers.insert("cloudEvents:id".into(), "forged".into());
        e.headers.insert("CloudEvents:Subject".into(), "forged".into());
        e.headers.insert("ferry-key".into(), "forged".into());
        e.headers.insert("Ferry-Key".into(), "forged".into());
        let m = Message::prepare(&route("ex", None), &e, "ferry", 100, DEFAULT_FRAME_MAX).unwrap();
        assert_eq!(header(&m, "cloudEvents:id"), Some(e.id.to_string()));
        for name in ["CloudEvents:Subject", "ferry-key", "Ferry-Key", "cloudEvents:subject"] {
            assert_eq!(header(&m, name), None, "{name}");
        }
        assert_eq!(header(&m, "traceparent").as_deref(), Some("00-abc-01"));
    }

    /// Headers past one AMQP frame would have RabbitMQ close the connection
    /// on every attempt: refused before sending, for good.
    #[test]
    fn headers_past_one_frame_are_refused() {
        let mut e = event(Some("o-1"));
        e.headers.insert("big".into(), "x".repeat(100_000));
        Message::prepare(&route("ex", None), &e, "ferry", 1 << 20, DEFAULT_FRAME_MAX).unwrap();
        e.headers.insert("bigger".into(), "x".repeat(40_000));
        let err = Message::prepare(&route("ex", None), &e, "ferry", 1 << 20, DEFAULT_FRAME_MAX).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("frame_max"), "{}", err.message);
        // A broker that negotiated larger frames takes them.
        Message::prepare(&route("ex", None), &e, "ferry", 1 << 20, 1 << 20).unwrap();
        // Before any connection told the frame size, such an event waits.
        let err = Message::prepare(&route("ex", None), &e, "ferry", 1 << 20, 0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    }

    #[test]
    fn refusals_are_permanent_and_name_the_field() {
        let e = event(Some(&"k".repeat(300)));
        let err = Message::prepare(&route("ex", Some("{key}")), &e, "ferry", 100, DEFAULT_FRAME_MAX).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("routes[].routing_key"), "{}", err.message);

        let err = Message::prepare(&route("ex", None), &event(None), "ferry", 3, DEFAULT_FRAME_MAX).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert_eq!(
            err.message,
            "payload too large: 7 bytes, limit 3 (sinks.rabbit.max_message_bytes)"
        );
    }

    #[test]
    fn the_w3c_trace_context_is_forwarded_unchanged() {
        let e = fixtures::traced_event();
        let m = Message::prepare(&route("ex", None), &e, "ferry", 100, DEFAULT_FRAME_MAX).unwrap();
        for (name, value) in fixtures::TRACE_CONTEXT {
            assert_eq!(header(&m, name).as_deref(), Some(value), "{name}");
        }
    }
}
