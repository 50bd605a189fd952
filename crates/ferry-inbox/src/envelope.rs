//! What a consumer receives: Ferry's envelope decoded from any broker into
//! one [`ReceivedEvent`].
//!
//! Every sink carries the event id, the type, the key and the CloudEvents 1.0
//! attributes in its own binary content mode; each runner's `decode` reads
//! its broker's form and refuses, with a [`DecodeError`] naming the field,
//! anything it cannot trust. A message without a readable id cannot be
//! deduplicated, so it is never handled: runners dead-letter it. So is one
//! no Ferry producer could have written: an event type outside Ferry's
//! grammar, or a NUL byte in a text attribute (the producer refuses both,
//! and PostgreSQL cannot store a NUL in text, so a handler recording it
//! would fail on every attempt).

// The parsers serve the runners; without one only the type remains.
#![cfg_attr(
    not(any(feature = "rabbitmq", feature = "redis", feature = "nats", feature = "kafka")),
    allow(dead_code)
)]

use bytes::Bytes;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, EventType, Headers};
use serde::de::DeserializeOwned;

/// One event as a consumer sees it, whatever broker it came through.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ReceivedEvent {
    /// The outbox's event id: the deduplication key.
    pub id: EventId,
    /// `<domain>.<entity>.<verb>`.
    pub event_type: String,
    /// The aggregate key, when the producer gave one.
    pub key: Option<String>,
    /// The CloudEvents `source` attribute.
    pub source: Option<String>,
    /// When the producer committed the event.
    pub time: Option<DateTime<Utc>>,
    pub content_type: String,
    /// The producer's own headers (tenant, `traceparent`, ...), without the
    /// envelope's attributes.
    pub headers: Headers,
    pub payload: Bytes,
}

impl ReceivedEvent {
    /// A fresh event, for tests and for brokers whose messages a caller
    /// decodes itself.
    pub fn new(id: EventId, event_type: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            id,
            event_type: event_type.into(),
            key: None,
            source: None,
            time: None,
            content_type: "application/json".into(),
            headers: Headers::new(),
            payload: payload.into(),
        }
    }

    /// The payload parsed as JSON into `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// Why a message is not a Ferry event; it goes to the dead-letter
/// destination with this text, never back to the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed message: {field} {problem}")]
#[non_exhaustive]
pub struct DecodeError {
    /// The attribute, header or field that is missing or wrong.
    pub field: String,
    pub problem: String,
}

impl DecodeError {
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// Reads an event id, naming `field` when it is missing or not a UUID.
pub(crate) fn parse_id(field: &str, value: Option<&str>) -> Result<EventId, DecodeError> {
    let value = value.ok_or_else(|| DecodeError::new(field, "is missing; Ferry's sinks always set it"))?;
    value
        .trim()
        .parse()
        .map_err(|e| DecodeError::new(field, format!("{value:?} is not a UUID ({e})")))
}

/// Reads the event type, which every Ferry message carries, in the grammar
/// every Ferry producer enforces (`ferry_core::EventType`).
pub(crate) fn parse_type(field: &str, value: Option<&str>) -> Result<String, DecodeError> {
    match value {
        Some(t) if t.trim().is_empty() => Err(DecodeError::new(field, "is empty")),
        Some(t) => EventType::parse(t).map(String::from).map_err(|e| {
            DecodeError::new(
                field,
                format!("{}, not an event type a Ferry producer writes ({})", e.problem, e.fix),
            )
        }),
        None => Err(DecodeError::new(field, "is missing; Ferry's sinks always set it")),
    }
}

/// Refuses a decoded event with a NUL byte in its key, source, content type
/// or headers: Ferry's producer refuses one, and PostgreSQL cannot store it.
pub(crate) fn checked(event: ReceivedEvent) -> Result<ReceivedEvent, DecodeError> {
    let refuse = |field: String, value: &str| match value.find('\0') {
        None => Ok(()),
        Some(at) => Err(DecodeError::new(
            field,
            format!("{value:?} has a NUL byte at byte {at}, which no Ferry producer writes"),
        )),
    };
    if let Some(key) = &event.key {
        refuse("key".into(), key)?;
    }
    if let Some(source) = &event.source {
        refuse("source".into(), source)?;
    }
    refuse("content type".into(), &event.content_type)?;
    for (name, value) in &event.headers {
        refuse(format!("header name {name:?}"), name)?;
        refuse(format!("header {name:?}"), value)?;
    }
    Ok(event)
}

/// Reads an RFC 3339 time; an unreadable one is refused rather than dropped,
/// since it means the message did not come from a Ferry sink.
pub(crate) fn parse_time(field: &str, value: Option<&str>) -> Result<Option<DateTime<Utc>>, DecodeError> {
    value
        .map(|t| {
            DateTime::parse_from_rfc3339(t)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| DecodeError::new(field, format!("{t:?} is not an RFC 3339 time ({e})")))
        })
        .transpose()
}

/// Refuses a CloudEvents version other than 1.0; a missing one is accepted.
pub(crate) fn check_spec_version(field: &str, value: Option<&str>) -> Result<(), DecodeError> {
    match value {
        None | Some("1.0") => Ok(()),
        Some(other) => Err(DecodeError::new(
            field,
            format!("is {other:?}; this consumer reads CloudEvents 1.0"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_types_and_times_name_the_field() {
        let id = EventId::new();
        assert_eq!(parse_id("id", Some(&id.to_string())).unwrap(), id);
        let err = parse_id("cloudEvents:id", Some("nope")).unwrap_err();
        assert_eq!(err.field, "cloudEvents:id");
        assert!(
            err.to_string()
                .starts_with("malformed message: cloudEvents:id \"nope\""),
            "{err}"
        );
        assert_eq!(parse_id("id", None).unwrap_err().field, "id");
        assert_eq!(parse_type("type", Some(" ")).unwrap_err().problem, "is empty");
        assert!(parse_time("time", Some("yesterday")).is_err());
        assert_eq!(parse_time("time", None).unwrap(), None);
        let t = parse_time("time", Some("2026-01-02T03:04:05.123Z")).unwrap().unwrap();
        assert_eq!(t.timestamp_subsec_millis(), 123);
        assert!(check_spec_version("specversion", Some("0.3")).is_err());
        assert!(check_spec_version("specversion", None).is_ok());
    }

    #[test]
    fn a_type_outside_the_grammar_or_with_a_nul_is_refused() {
        assert_eq!(
            parse_type("type", Some("order.item.created")).unwrap(),
            "order.item.created"
        );
        for bad in ["order.item\0created", "Order.Created", "order", "order created.x"] {
            let err = parse_type("ce_type", Some(bad)).unwrap_err();
            assert_eq!(err.field, "ce_type", "{bad}");
            assert!(
                err.problem.contains("not an event type a Ferry producer writes"),
                "{err}"
            );
            assert!(
                !err.to_string().contains('\0'),
                "the reason itself is storable: {err:?}"
            );
        }
    }

    #[test]
    fn a_nul_in_a_text_attribute_is_refused() {
        let ok = ReceivedEvent::new(EventId::new(), "order.created", &b"{\"s\":\"\\u0000\"}"[..]);
        assert!(
            checked(ok.clone()).is_ok(),
            "a NUL escaped in a JSON payload is the payload's business"
        );
        let mut e = ok.clone();
        e.key = Some("o-\0-1".into());
        let err = checked(e).unwrap_err();
        assert_eq!(err.field, "key");
        assert!(err.problem.contains("NUL byte at byte 2"), "{err}");
        assert!(!err.to_string().contains('\0'), "{err:?}");
        let mut e = ok.clone();
        e.headers.insert("tenant".into(), "a\0".into());
        assert_eq!(checked(e).unwrap_err().field, "header \"tenant\"");
        let mut e = ok;
        e.headers.insert("ten\0ant".into(), "a".into());
        assert_eq!(checked(e).unwrap_err().field, "header name \"ten\\0ant\"");
    }

    #[test]
    fn json_payload() {
        let e = ReceivedEvent::new(EventId::new(), "order.created", &b"{\"n\":7}"[..]);
        let v: serde_json::Value = e.json().unwrap();
        assert_eq!(v["n"], 7);
    }
}
