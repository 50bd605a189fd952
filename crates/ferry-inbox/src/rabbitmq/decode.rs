//! Ferry's AMQP envelope back into a [`ReceivedEvent`]: the CloudEvents
//! binary-mode headers, falling back to the AMQP properties.

use ferry_core::Headers;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use crate::envelope::{check_spec_version, checked, parse_id, parse_time, parse_type};
use crate::{DecodeError, ReceivedEvent};

/// The header the RabbitMQ sink writes the aggregate key to.
const KEY_HEADER: &str = "ferry-key";
/// Prefix of the CloudEvents attributes in AMQP binary mode.
const CE: &str = "cloudEvents:";

/// Decodes one message's properties and body.
pub fn decode(properties: &BasicProperties, body: &[u8]) -> Result<ReceivedEvent, DecodeError> {
    let empty = FieldTable::default();
    let table = properties.headers().as_ref().unwrap_or(&empty);
    let text = |name: &str| -> Result<Option<String>, DecodeError> {
        match table.inner().get(name) {
            None => Ok(None),
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec())
                .map(Some)
                .map_err(|_| DecodeError::new(name, "is not UTF-8")),
            Some(AMQPValue::ShortString(s)) => Ok(Some(s.to_string())),
            Some(other) => Err(DecodeError::new(name, format!("is {other:?}, not a string"))),
        }
    };
    check_spec_version("cloudEvents:specversion", text("cloudEvents:specversion")?.as_deref())?;
    let id = match text("cloudEvents:id")? {
        Some(id) => parse_id("cloudEvents:id", Some(&id))?,
        None => parse_id("message_id", properties.message_id().as_ref().map(|s| s.as_str()))?,
    };
    let event_type = match text("cloudEvents:type")? {
        Some(t) => parse_type("cloudEvents:type", Some(&t))?,
        None => parse_type("type", properties.kind().as_ref().map(|s| s.as_str()))?,
    };
    let key = match text(KEY_HEADER)? {
        Some(key) => Some(key),
        None => text("cloudEvents:subject")?,
    };
    let mut headers = Headers::new();
    for (name, value) in table.inner() {
        let name = name.as_str();
        // The envelope's own attributes and the broker's (x-death, ...) are
        // not the producer's headers; a producer's own `x-` ones are.
        if name.starts_with(CE) || name == KEY_HEADER || BROKER_HEADERS.iter().any(|b| name.starts_with(b)) {
            continue;
        }
        if let AMQPValue::LongString(_) | AMQPValue::ShortString(_) = value
            && let Some(v) = text(name)?
        {
            headers.insert(name.to_owned(), v);
        }
    }
    checked(ReceivedEvent {
        id,
        event_type,
        key,
        source: text("cloudEvents:source")?,
        time: parse_time("cloudEvents:time", text("cloudEvents:time")?.as_deref())?,
        content_type: properties
            .content_type()
            .as_ref()
            .map_or_else(|| "application/octet-stream".to_owned(), |c| c.to_string()),
        headers,
        payload: body.to_vec().into(),
    })
}

/// Headers RabbitMQ (or a shovel or federation link) adds to a message:
/// dead-lettering's history, a quorum queue's delivery count.
const BROKER_HEADERS: [&str; 5] = [
    "x-death",
    "x-first-death-",
    "x-last-death-",
    "x-delivery-count",
    "x-received-from",
];

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::EventId;
    use lapin::types::LongString;

    fn long(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v.as_bytes()))
    }

    fn ferry_message(id: EventId) -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert("cloudEvents:specversion".into(), long("1.0"));
        h.insert("cloudEvents:id".into(), long(&id.to_string()));
        h.insert("cloudEvents:type".into(), long("order.item.created"));
        h.insert("cloudEvents:source".into(), long("shop"));
        h.insert("cloudEvents:time".into(), long("2026-01-02T03:04:05Z"));
        h.insert("cloudEvents:subject".into(), long("o-1"));
        h.insert("ferry-key".into(), long("o-1"));
        h.insert("traceparent".into(), long("00-abc-01"));
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        h.insert("x-first-death-reason".into(), long("rejected"));
        h.insert("x-tenant".into(), long("acme"));
        BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_content_type("application/json".into())
            .with_headers(h)
    }

    #[test]
    fn reads_what_the_sink_writes() {
        let id = EventId::new();
        let e = decode(&ferry_message(id), b"{}").unwrap();
        assert_eq!(e.id, id);
        assert_eq!(e.event_type, "order.item.created");
        assert_eq!(e.key.as_deref(), Some("o-1"));
        assert_eq!(e.source.as_deref(), Some("shop"));
        assert_eq!(e.time.unwrap().to_rfc3339(), "2026-01-02T03:04:05+00:00");
        assert_eq!(e.content_type, "application/json");
        // The producer's own `x-` header stays; the broker's go.
        assert_eq!(
            e.headers,
            [
                ("traceparent".to_owned(), "00-abc-01".to_owned()),
                ("x-tenant".to_owned(), "acme".to_owned())
            ]
            .into()
        );
        assert_eq!(&e.payload[..], b"{}");
    }

    #[test]
    fn plain_amqp_properties_are_enough() {
        let id = EventId::new();
        let p = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_type("order.paid".into());
        let e = decode(&p, b"x").unwrap();
        assert_eq!((e.id, e.event_type.as_str(), e.key), (id, "order.paid", None));
    }

    #[test]
    fn refusals_name_the_field() {
        let err = decode(&BasicProperties::default(), b"").unwrap_err();
        assert_eq!(err.field, "message_id");
        let p = BasicProperties::default().with_message_id("42".into());
        assert_eq!(decode(&p, b"").unwrap_err().field, "message_id");
        let p = BasicProperties::default().with_message_id(EventId::new().to_string().into());
        assert_eq!(decode(&p, b"").unwrap_err().field, "type");
        let mut h = FieldTable::default();
        h.insert("cloudEvents:id".into(), AMQPValue::LongLongInt(7));
        let p = BasicProperties::default().with_headers(h);
        assert_eq!(decode(&p, b"").unwrap_err().field, "cloudEvents:id");
    }
}
