use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ValidationError;

/// The largest payload Ferry accepts into the outbox (1 MiB). Sinks may have
/// smaller limits of their own; those are checked before publishing.
pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// The longest aggregate key accepted.
pub const MAX_KEY_BYTES: usize = 512;
/// The longest content type accepted: RabbitMQ carries it in 255 bytes.
const MAX_CONTENT_TYPE_BYTES: usize = 255;
/// The most bytes an event's header names and values may take together.
/// RabbitMQ refuses message properties over its frame size (128 KiB by
/// default), and Kafka counts headers in a record's size: an event over
/// this would commit and then go dead at every destination.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
const MAX_TYPE_BYTES: usize = 255;

/// A unique, time-ordered event id (UUID v7). Sinks carry it as the message id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EventId(pub Uuid);

impl EventId {
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for EventId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

/// A validated event type: lowercase segments joined by dots, conventionally
/// `<domain>.<entity>.<verb>` (at least two segments).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EventType(String);

impl EventType {
    pub fn parse(s: impl Into<String>) -> Result<Self, ValidationError> {
        let s = s.into();
        const FIX: &str = "use lowercase segments of [a-z0-9_-] joined by dots, e.g. \"order.item.created\"";
        if s.len() > MAX_TYPE_BYTES {
            return Err(ValidationError::new(
                "type",
                format!("is {} bytes, the limit is {MAX_TYPE_BYTES}", s.len()),
                FIX,
            ));
        }
        let segments: Vec<&str> = s.split('.').collect();
        if segments.len() < 2 {
            return Err(ValidationError::new("type", format!("{s:?} has no dot"), FIX));
        }
        for seg in &segments {
            let valid_start = seg
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
            let valid_rest = seg
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
            if !valid_start || !valid_rest {
                return Err(ValidationError::new(
                    "type",
                    format!("{s:?} has an invalid segment {seg:?}"),
                    FIX,
                ));
            }
        }
        Ok(Self(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first segment, used by destination templates as `{domain}`.
    pub fn domain(&self) -> &str {
        self.0.split('.').next().unwrap_or_default()
    }
}

impl TryFrom<String> for EventType {
    type Error = ValidationError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(s)
    }
}

impl From<EventType> for String {
    fn from(t: EventType) -> Self {
        t.0
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Producer headers (tenant, `traceparent`, ...). Sorted for stable output.
pub type Headers = BTreeMap<String, String>;

/// An event's body: JSON, or bytes with their content type.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    Json(serde_json::Value),
    Bytes { data: Bytes, content_type: String },
}

impl Payload {
    pub fn content_type(&self) -> &str {
        match self {
            Payload::Json(_) => "application/json",
            Payload::Bytes { content_type, .. } => content_type,
        }
    }

    pub fn to_bytes(&self) -> Bytes {
        match self {
            Payload::Json(v) => Bytes::from(serde_json::to_vec(v).expect("a JSON value serialises")),
            Payload::Bytes { data, .. } => data.clone(),
        }
    }
}

impl From<serde_json::Value> for Payload {
    fn from(v: serde_json::Value) -> Self {
        Payload::Json(v)
    }
}

/// An event a producer writes inside its own transaction.
///
/// ```
/// use ferry_core::Event;
/// let event = Event::new("order.created", serde_json::json!({"id": 42}))
///     .key("order-42")
///     .header("tenant", "acme");
/// assert_eq!(event.event_type(), "order.created");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub(crate) id: EventId,
    pub(crate) event_type: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Payload,
    pub(crate) headers: Headers,
    pub(crate) dispatch_key: Option<String>,
}

impl Event {
    pub fn new(event_type: impl Into<String>, payload: impl Into<Payload>) -> Self {
        Self {
            id: EventId::new(),
            event_type: event_type.into(),
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
            dispatch_key: None,
        }
    }

    /// An event whose body is opaque bytes of the given content type.
    pub fn bytes(event_type: impl Into<String>, data: impl Into<Bytes>, content_type: impl Into<String>) -> Self {
        Self::new(
            event_type,
            Payload::Bytes {
                data: data.into(),
                content_type: content_type.into(),
            },
        )
    }

    /// The aggregate key: events with the same key are delivered in commit order.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Adds the current span's W3C `traceparent` and `tracestate` headers,
    /// unless the event already has a valid `traceparent` (its name in any
    /// case).
    /// The stores' `enqueue` and `emit` call this when their `otel` feature is
    /// on.
    #[cfg(feature = "otel")]
    pub fn with_current_trace_context(mut self) -> Self {
        crate::trace::inject(&crate::trace::current_context(), &mut self.headers);
        self
    }

    /// Producer idempotency: a second event with the same dispatch key is a no-op.
    pub fn dispatch_key(mut self, key: impl Into<String>) -> Self {
        self.dispatch_key = Some(key.into());
        self
    }

    pub fn id(&self) -> EventId {
        self.id
    }
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
    pub fn get_key(&self) -> Option<&str> {
        self.key.as_deref()
    }
    pub fn payload(&self) -> &Payload {
        &self.payload
    }
    pub fn headers(&self) -> &Headers {
        &self.headers
    }
    pub fn get_dispatch_key(&self) -> Option<&str> {
        self.dispatch_key.as_deref()
    }

    /// Checks every field against Ferry's limits, naming the field that fails.
    pub fn validate(&self) -> Result<(), ValidationError> {
        EventType::parse(self.event_type.clone())?;
        if let Some(key) = &self.key
            && (key.is_empty() || key.len() > MAX_KEY_BYTES)
        {
            return Err(ValidationError::new(
                "key",
                format!("is {} bytes", key.len()),
                "use a non-empty key of at most 512 bytes, or no key for unordered events",
            ));
        }
        if let Some(dk) = &self.dispatch_key
            && (dk.is_empty() || dk.len() > MAX_KEY_BYTES)
        {
            return Err(ValidationError::new(
                "dispatch_key",
                format!("is {} bytes", dk.len()),
                "use a non-empty dispatch key of at most 512 bytes",
            ));
        }
        // PostgreSQL's text refuses a NUL byte with an encoding error that
        // names no field, and SQLite would store what PostgreSQL refuses.
        if let Some(key) = &self.key {
            refuse_nul("key", "the key", key)?;
        }
        if let Some(dk) = &self.dispatch_key {
            refuse_nul("dispatch_key", "the dispatch key", dk)?;
        }
        if let Payload::Bytes { content_type, .. } = &self.payload {
            refuse_nul("content_type", "the content type", content_type)?;
        }
        for (name, value) in &self.headers {
            refuse_nul("headers", &format!("the header name {name:?}"), name)?;
            refuse_nul("headers", &format!("the value of header {name:?}"), value)?;
            // What a destination would refuse for ever, as below.
            if let Some(c) = name.chars().find(|&c| !is_token_char(c)) {
                return Err(ValidationError::new(
                    "headers",
                    format!("has the header name {name:?}, with {c:?} in it"),
                    "use header names of letters, digits and !#$%&'*+-.^_`|~ (an HTTP token), e.g. \"tenant-id\"",
                ));
            }
            if let Some(at) = value.find(|c: char| c.is_ascii_control() && c != '\t') {
                return Err(ValidationError::new(
                    "headers",
                    format!("has a control character in the value of header {name:?}, at byte {at}"),
                    "remove control characters (line breaks among them) from header values; a tab is allowed",
                ));
            }
        }
        // What a destination would refuse for ever (and the event go dead,
        // holding back its key) is refused here, at the producer: whichever
        // sink a route sends it to, now or after a configuration change.
        if let Some(key) = &self.key
            && let Some(at) = key.find(['\r', '\n'])
        {
            return Err(ValidationError::new(
                "key",
                format!("has a line break at byte {at}"),
                "remove CR and LF from the key: NATS and webhooks carry it in a header",
            ));
        }
        if let Payload::Bytes { content_type, .. } = &self.payload {
            if content_type.len() > MAX_CONTENT_TYPE_BYTES {
                return Err(ValidationError::new(
                    "content_type",
                    format!("is {} bytes", content_type.len()),
                    "use a media type of at most 255 bytes, e.g. \"application/octet-stream\"",
                ));
            }
            if let Some(at) = content_type.find(|c: char| c.is_control()) {
                return Err(ValidationError::new(
                    "content_type",
                    format!("has a control character at byte {at}"),
                    "use a media type such as \"application/octet-stream\", without control characters",
                ));
            }
        }
        let size = match &self.payload {
            Payload::Json(v) => serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX),
            Payload::Bytes { data, content_type } => {
                if content_type.is_empty() {
                    return Err(ValidationError::new(
                        "content_type",
                        "is empty",
                        "give the payload's media type, e.g. \"application/octet-stream\"",
                    ));
                }
                data.len()
            }
        };
        if size > MAX_PAYLOAD_BYTES {
            return Err(ValidationError::new(
                "payload",
                format!("is {size} bytes, the limit is {MAX_PAYLOAD_BYTES}"),
                "store large bodies elsewhere and put a reference in the event",
            ));
        }
        let header_bytes: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if header_bytes > MAX_HEADER_BYTES {
            return Err(ValidationError::new(
                "headers",
                format!("take {header_bytes} bytes (names and values), the limit is {MAX_HEADER_BYTES}"),
                "carry large values in the payload; keep headers to routing and tracing metadata",
            ));
        }
        for name in self.headers.keys() {
            if name.is_empty() || name.len() > 255 {
                return Err(ValidationError::new(
                    "headers",
                    format!("has a header name of {} bytes", name.len()),
                    "use header names of 1 to 255 bytes",
                ));
            }
        }
        Ok(())
    }
}

/// A character of an HTTP token (RFC 9110), which every destination takes
/// as a header name: NATS refuses `:`, spaces and non-ASCII, HTTP anything
/// else outside the set.
fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

/// Refuses a NUL byte in a text field; `what` says where it is.
fn refuse_nul(field: &'static str, what: &str, text: &str) -> Result<(), ValidationError> {
    match text.find('\0') {
        None => Ok(()),
        Some(at) => Err(ValidationError::new(
            field,
            format!("{what} has a NUL byte at byte {at}"),
            "remove the NUL byte (\\0): PostgreSQL cannot store it in text",
        )),
    }
}

/// A committed event as the relay reads it back from the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEvent {
    pub id: EventId,
    /// Position in the outbox; per key, seq order is commit order.
    pub seq: i64,
    pub event_type: String,
    pub key: Option<String>,
    #[serde(with = "bytes_as_vec")]
    pub payload: Bytes,
    pub content_type: String,
    pub headers: Headers,
    pub created_at: DateTime<Utc>,
}

mod bytes_as_vec {
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(b)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        Vec::<u8>::deserialize(d).map(Bytes::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn event_types() {
        for ok in ["order.created", "billing.subscription.updated", "a1.b_c.d-e"] {
            assert!(EventType::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "order",
            "Order.created",
            "order..created",
            ".order.x",
            "order.created.",
            "order created.x",
            "ordér.x",
        ] {
            let err = EventType::parse(bad).unwrap_err();
            assert_eq!(err.field, "type", "{bad}");
        }
        assert_eq!(EventType::parse("billing.sub.updated").unwrap().domain(), "billing");
    }

    #[test]
    fn validation_names_the_field() {
        let big = Event::bytes("a.b", vec![0u8; MAX_PAYLOAD_BYTES + 1], "application/octet-stream");
        assert_eq!(big.validate().unwrap_err().field, "payload");
        let e = Event::new("a.b", json!({})).key("");
        assert_eq!(e.validate().unwrap_err().field, "key");
        let e = Event::new("a.b", json!({})).dispatch_key("x".repeat(600));
        assert_eq!(e.validate().unwrap_err().field, "dispatch_key");
        let e = Event::bytes("a.b", vec![1u8], "");
        assert_eq!(e.validate().unwrap_err().field, "content_type");
        assert!(Event::new("a.b.c", json!({"x": 1})).key("k").validate().is_ok());
        // PostgreSQL refuses a NUL in text with an error that names no
        // field; `validate` names it first, for every store.
        let nul = "a\0b";
        for (event, field) in [
            (Event::new("a.b", json!({})).key(nul), "key"),
            (Event::new("a.b", json!({})).dispatch_key(nul), "dispatch_key"),
            (Event::new("a.b", json!({})).header(nul, "v"), "headers"),
            (Event::new("a.b", json!({})).header("tenant", nul), "headers"),
            (Event::bytes("a.b", vec![1u8], nul), "content_type"),
        ] {
            let err = event.validate().unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.to_string().contains("NUL"), "{err}");
        }
        // What a destination would refuse for ever.
        for (event, field, text) in [
            (Event::new("a.b", json!({})).key("k\r\n"), "key", "line break"),
            (
                Event::new("a.b", json!({})).header("Tenant ID", "v"),
                "headers",
                "HTTP token",
            ),
            (Event::new("a.b", json!({})).header("a:b", "v"), "headers", "HTTP token"),
            (Event::new("a.b", json!({})).header("a/b", "v"), "headers", "HTTP token"),
            (
                Event::new("a.b", json!({})).header("mandant-ü", "v"),
                "headers",
                "HTTP token",
            ),
            (
                Event::new("a.b", json!({})).header("x", "a\nb"),
                "headers",
                "control character",
            ),
            (
                Event::new("a.b", json!({})).header("x", "a\u{7f}"),
                "headers",
                "control character",
            ),
            (
                Event::bytes("a.b", vec![1u8], "x".repeat(256)),
                "content_type",
                "255 bytes",
            ),
            (
                Event::bytes("a.b", vec![1u8], "text/plain\r\nx: y"),
                "content_type",
                "control",
            ),
        ] {
            let err = event.validate().unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.to_string().contains(text), "{err}");
        }
        let fine = Event::bytes("a.b", vec![1u8], "x".repeat(255))
            .key("key\twith a tab, ünïcode")
            .header("x-A.b_c~|`^*+#$%&!'", "Müller\tand a tab")
            .header("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        assert!(fine.validate().is_ok(), "{:?}", fine.validate());
        // A NUL inside a JSON string is escaped (\u0000) in the payload's
        // bytes: nothing to refuse.
        assert!(Event::new("a.b", json!({"s": nul})).validate().is_ok());
    }

    #[test]
    fn headers_over_the_limit_are_refused_naming_the_field() {
        let at_limit = Event::new("a.b", json!({})).header("x", "a".repeat(MAX_HEADER_BYTES - 1));
        assert!(at_limit.validate().is_ok(), "{:?}", at_limit.validate());
        let err = Event::new("a.b", json!({}))
            .header("x", "a".repeat(MAX_HEADER_BYTES - 1))
            .header("y", "b")
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "headers");
        assert!(err.to_string().contains("the limit is 65536"), "{err}");
    }

    #[test]
    fn ids_are_v7_and_time_ordered() {
        let a = EventId::new();
        let b = EventId::new();
        assert_eq!(a.0.get_version_num(), 7);
        assert!(a < b);
    }
}
