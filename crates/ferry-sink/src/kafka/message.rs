//! Turning a stored event into a Kafka record: the topic, the key, and the
//! CloudEvents 1.0 binary-mode headers of the Kafka protocol binding.

use bytes::Bytes;
use chrono::SecondsFormat;
use ferry_core::{Route, SinkError, StoredEvent, render_template};

/// CloudEvents specification version written in `ce_specversion`.
pub const SPEC_VERSION: &str = "1.0";
/// The header carrying the payload's media type (CloudEvents `datacontenttype`).
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// Headers Ferry sets itself; a producer header of the same name is dropped
/// so it cannot spoof the event id or type.
const RESERVED: [&str; 7] = [
    "ce_specversion",
    "ce_id",
    "ce_type",
    "ce_source",
    "ce_time",
    "ce_subject",
    CONTENT_TYPE_HEADER,
];
/// The longest topic name Kafka accepts.
const MAX_TOPIC_BYTES: usize = 249;
/// The fixed header of a record batch, which a topic's `max.message.bytes`
/// also counts.
pub(crate) const BATCH_OVERHEAD: usize = 61;

/// Bytes of `value` as Kafka's zigzag varint.
fn varint_len(value: i64) -> usize {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    let mut len = 1;
    while zigzag >= 0x80 {
        zigzag >>= 7;
        len += 1;
    }
    len
}

/// One event, ready for the producer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Record {
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Bytes,
    /// In the order they are written: the producer's, then Ferry's.
    pub(crate) headers: Vec<(String, String)>,
    /// `CreateTime`, in milliseconds since the epoch.
    pub(crate) timestamp_ms: i64,
}

/// The limits a record is checked against before it is sent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// `KafkaOptions::max_message_bytes`: the largest payload.
    pub(crate) max_payload: usize,
    /// librdkafka's `message.max.bytes`: the largest record on the wire.
    pub(crate) max_record: usize,
    /// The topic's `max.message.bytes`, when `check` could read it.
    pub(crate) topic_max: Option<usize>,
}

impl Record {
    /// Renders the topic and builds the headers, refusing (permanently) what
    /// Kafka would reject: an invalid topic name or a message too large.
    pub(crate) fn prepare(route: &Route, event: &StoredEvent, source: &str) -> Result<Self, SinkError> {
        let topic = render_template(&route.destination, event);
        validate_topic(&topic).map_err(|why| {
            SinkError::permanent(format!(
                "topic {topic:?} rendered from routes[].destination {:?} {why}",
                route.destination
            ))
        })?;
        let mut headers: Vec<(String, String)> = event
            .headers
            .iter()
            .filter(|(name, _)| !RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name)))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let time = event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        headers.push(("ce_specversion".into(), SPEC_VERSION.into()));
        headers.push(("ce_id".into(), event.id.to_string()));
        headers.push(("ce_type".into(), event.event_type.clone()));
        headers.push(("ce_source".into(), source.to_owned()));
        headers.push(("ce_time".into(), time));
        if let Some(key) = &event.key {
            headers.push(("ce_subject".into(), key.clone()));
        }
        headers.push((CONTENT_TYPE_HEADER.into(), event.content_type.clone()));
        Ok(Self {
            topic,
            key: event.key.clone(),
            payload: event.payload.clone(),
            headers,
            timestamp_ms: event.created_at.timestamp_millis(),
        })
    }

    /// The record's size in a v2 record batch of its own, the size a
    /// topic's `max.message.bytes` is measured against (with the batch's
    /// header): its length, attributes, timestamp and offset deltas (zero,
    /// alone in its batch), then key, value and headers, each behind its
    /// length as a zigzag varint. An estimate rounded up would refuse, for
    /// good, records the broker takes.
    pub(crate) fn wire_bytes(&self) -> usize {
        let sized = |len: usize| varint_len(len as i64) + len;
        let key = self.key.as_ref().map_or(varint_len(-1), |k| sized(k.len()));
        let headers: usize = self.headers.iter().map(|(n, v)| sized(n.len()) + sized(v.len())).sum();
        let body = 3 + key + sized(self.payload.len()) + varint_len(self.headers.len() as i64) + headers;
        varint_len(body as i64) + body
    }

    /// Refuses (permanently) a record over any of `limits`, naming the limit.
    pub(crate) fn admit(&self, sink: &str, limits: Limits) -> Result<(), SinkError> {
        let payload = self.payload.len();
        if payload > limits.max_payload {
            return Err(SinkError::permanent(format!(
                "payload too large: {payload} bytes, limit {} (sinks.{sink}.max_message_bytes)",
                limits.max_payload
            )));
        }
        let wire = self.wire_bytes();
        if wire > limits.max_record {
            return Err(SinkError::permanent(format!(
                "message too large: {wire} bytes with its key and headers, librdkafka's \
                 message.max.bytes is {} (sinks.{sink}.max_message_bytes plus headroom)",
                limits.max_record
            )));
        }
        if let Some(topic_max) = limits.topic_max
            && wire + BATCH_OVERHEAD > topic_max
        {
            return Err(SinkError::permanent(format!(
                "message too large for topic {:?}: {} bytes as a record batch, the topic's \
                 max.message.bytes is {topic_max}",
                self.topic,
                wire + BATCH_OVERHEAD
            )));
        }
        Ok(())
    }
}

/// Kafka's rule for topic names: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn validate_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("is empty".into());
    }
    if topic.len() > MAX_TOPIC_BYTES {
        return Err(format!(
            "is {} bytes, Kafka allows at most {MAX_TOPIC_BYTES}",
            topic.len()
        ));
    }
    if topic == "." || topic == ".." {
        return Err("is not a valid Kafka topic name".into());
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "contains {c:?}; Kafka topic names use only letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures::{self, event};
    use ferry_core::ErrorKind;

    fn route(destination: &str) -> Route {
        fixtures::route("kafka", destination)
    }

    fn header<'a>(r: &'a Record, name: &str) -> Option<&'a str> {
        let mut found = r.headers.iter().filter(|(n, _)| n == name);
        let value = found.next().map(|(_, v)| v.as_str());
        assert!(found.next().is_none(), "{name} appears twice");
        value
    }

    const ROOMY: Limits = Limits {
        max_payload: 100,
        max_record: 1000,
        topic_max: None,
    };

    #[test]
    fn the_topic_is_rendered_and_the_key_is_the_event_key() {
        let e = event(Some("o-1"));
        let r = Record::prepare(&route("events.{domain}"), &e, "ferry").unwrap();
        assert_eq!(r.topic, "events.order");
        assert_eq!(r.key.as_deref(), Some("o-1"));
        assert_eq!(r.timestamp_ms, e.created_at.timestamp_millis());
        assert_eq!(&r.payload[..], b"{\"n\":1}");
        let r = Record::prepare(&route("plain"), &event(None), "ferry").unwrap();
        assert_eq!((r.topic.as_str(), r.key), ("plain", None));
    }

    #[test]
    fn cloudevents_headers_and_the_producers_own() {
        let e = event(Some("o-1"));
        let r = Record::prepare(&route("t"), &e, "shop").unwrap();
        assert_eq!(header(&r, "ce_specversion"), Some("1.0"));
        assert_eq!(header(&r, "ce_id"), Some(e.id.to_string().as_str()));
        assert_eq!(header(&r, "ce_type"), Some("order.item.created"));
        assert_eq!(header(&r, "ce_source"), Some("shop"));
        assert_eq!(header(&r, "ce_subject"), Some("o-1"));
        assert_eq!(header(&r, "content-type"), Some("application/json"));
        assert_eq!(header(&r, "traceparent"), Some("00-abc-01"));
        let time = header(&r, "ce_time").unwrap();
        assert_eq!(chrono::DateTime::parse_from_rfc3339(time).unwrap(), e.created_at);

        let r = Record::prepare(&route("t"), &event(None), "shop").unwrap();
        assert_eq!(header(&r, "ce_subject"), None);
    }

    #[test]
    fn producer_headers_cannot_spoof_reserved_ones() {
        let mut e = event(None);
        e.headers.insert("ce_id".into(), "forged".into());
        e.headers.insert("Content-Type".into(), "text/forged".into());
        let r = Record::prepare(&route("t"), &e, "ferry").unwrap();
        assert_eq!(header(&r, "ce_id"), Some(e.id.to_string().as_str()));
        assert_eq!(header(&r, "Content-Type"), None);
        assert_eq!(header(&r, "content-type"), Some("application/json"));
    }

    #[test]
    fn invalid_topic_names_are_permanent_and_name_the_field() {
        for (destination, key) in [("t.{key}", "a b"), ("{key}", ".."), ("x{key}", "é")] {
            let err = Record::prepare(&route(destination), &event(Some(key)), "ferry").unwrap_err();
            assert_eq!(err.kind, ErrorKind::Permanent, "{destination} {key}");
            assert!(err.message.contains("routes[].destination"), "{}", err.message);
        }
        let long = "t".repeat(250);
        let err = Record::prepare(&route(&long), &event(None), "ferry").unwrap_err();
        assert!(err.message.contains("at most 249"), "{}", err.message);
        assert!(validate_topic("Orders_v2.created-x").is_ok());
        assert!(validate_topic("").is_err());
    }

    #[test]
    fn size_limits_name_what_was_exceeded() {
        let r = Record::prepare(&route("t"), &event(Some("k")), "ferry").unwrap();
        assert_eq!(r.admit("kafka", ROOMY), Ok(()));

        let err = r
            .admit(
                "kafka",
                Limits {
                    max_payload: 6,
                    ..ROOMY
                },
            )
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert_eq!(
            err.message,
            "payload too large: 7 bytes, limit 6 (sinks.kafka.max_message_bytes)"
        );
        assert_eq!(
            r.admit(
                "kafka",
                Limits {
                    max_payload: 7,
                    ..ROOMY
                }
            ),
            Ok(())
        );

        let wire = r.wire_bytes();
        assert!(wire > r.payload.len() + 100, "headers count: {wire}");
        let headers: usize = r.headers.iter().map(|(n, v)| 2 + n.len() + v.len()).sum();
        // Attributes, two deltas, the key's and value's lengths, the header
        // count, and the record's length (two bytes past 127).
        assert_eq!(
            wire,
            2 + 1 + 1 + 1 + 1 + r.key.as_ref().map_or(0, String::len) + 1 + r.payload.len() + 1 + headers,
            "{r:?}"
        );
        let err = r
            .admit(
                "kafka",
                Limits {
                    max_record: wire - 1,
                    ..ROOMY
                },
            )
            .unwrap_err();
        assert!(err.message.contains("message.max.bytes"), "{}", err.message);

        let tight = Limits {
            topic_max: Some(wire + BATCH_OVERHEAD - 1),
            ..ROOMY
        };
        let err = r.admit("kafka", tight).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("topic \"t\""), "{}", err.message);
        let fits = Limits {
            topic_max: Some(wire + BATCH_OVERHEAD),
            ..ROOMY
        };
        assert_eq!(r.admit("kafka", fits), Ok(()));
    }

    #[test]
    fn varints_are_counted_as_kafka_writes_them() {
        for (value, len) in [
            (0, 1),
            (-1, 1),
            (63, 1),
            (64, 2),
            (-64, 1),
            (-65, 2),
            (8191, 2),
            (8192, 3),
        ] {
            assert_eq!(varint_len(value), len, "{value}");
        }
        assert_eq!(varint_len(1_000_000), 3);
    }

    #[test]
    fn the_w3c_trace_context_is_forwarded_unchanged() {
        let e = fixtures::traced_event();
        let r = Record::prepare(&route("t"), &e, "ferry").unwrap();
        for (name, value) in fixtures::TRACE_CONTEXT {
            assert_eq!(header(&r, name), Some(value), "{name}");
        }
    }
}
