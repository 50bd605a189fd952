//! Ferry's Redis Streams entry back into a [`ReceivedEvent`]: the fields the
//! sink writes (`id`, `type`, `key`, `payload`, `content-type`, `time`,
//! `source`, `specversion`, `headers`).

use std::collections::HashMap;

use ferry_core::Headers;
use redis::Value;

use crate::envelope::{check_spec_version, checked, parse_id, parse_time, parse_type};
use crate::{DecodeError, ReceivedEvent};

/// Decodes one entry's field map.
pub fn decode(fields: &HashMap<String, Value>) -> Result<ReceivedEvent, DecodeError> {
    let bytes = |name: &str| -> Result<Option<Vec<u8>>, DecodeError> {
        match fields.get(name) {
            None => Ok(None),
            Some(v) => redis::from_redis_value_ref::<Vec<u8>>(v)
                .map(Some)
                .map_err(|_| DecodeError::new(name, format!("is {v:?}, not a string"))),
        }
    };
    let text = |name: &str| -> Result<Option<String>, DecodeError> {
        bytes(name)?
            .map(|b| String::from_utf8(b).map_err(|_| DecodeError::new(name, "is not UTF-8")))
            .transpose()
    };
    check_spec_version("specversion", text("specversion")?.as_deref())?;
    let headers = match text("headers")? {
        None => Headers::new(),
        Some(json) => serde_json::from_str(&json)
            .map_err(|e| DecodeError::new("headers", format!("is not a JSON object of strings ({e})")))?,
    };
    checked(ReceivedEvent {
        id: parse_id("id", text("id")?.as_deref())?,
        event_type: parse_type("type", text("type")?.as_deref())?,
        key: text("key")?,
        source: text("source")?,
        time: parse_time("time", text("time")?.as_deref())?,
        content_type: text("content-type")?.unwrap_or_else(|| "application/octet-stream".into()),
        headers,
        payload: bytes("payload")?
            .ok_or_else(|| DecodeError::new("payload", "is missing"))?
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::EventId;

    fn s(v: &str) -> Value {
        Value::BulkString(v.as_bytes().to_vec())
    }

    #[test]
    fn reads_what_the_sink_writes() {
        let id = EventId::new();
        let fields: HashMap<String, Value> = [
            ("id", s(&id.to_string())),
            ("type", s("order.item.created")),
            ("key", s("o-1")),
            ("payload", s("{\"n\":1}")),
            ("content-type", s("application/json")),
            ("time", s("2026-01-02T03:04:05Z")),
            ("source", s("ferry")),
            ("specversion", s("1.0")),
            ("headers", s("{\"traceparent\":\"00-abc-01\"}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let e = decode(&fields).unwrap();
        assert_eq!(
            (e.id, e.event_type.as_str(), e.key.as_deref()),
            (id, "order.item.created", Some("o-1"))
        );
        assert_eq!(&e.payload[..], b"{\"n\":1}");
        assert_eq!(e.headers["traceparent"], "00-abc-01");
        assert_eq!(e.source.as_deref(), Some("ferry"));
        assert!(e.time.is_some());
    }

    #[test]
    fn refusals_name_the_field() {
        let mut fields = HashMap::new();
        assert_eq!(decode(&fields).unwrap_err().field, "id");
        fields.insert("id".to_owned(), s(&EventId::new().to_string()));
        fields.insert("type".to_owned(), s("order.created"));
        assert_eq!(decode(&fields).unwrap_err().field, "payload");
        fields.insert("payload".to_owned(), s("{}"));
        fields.insert("headers".to_owned(), s("[1]"));
        assert_eq!(decode(&fields).unwrap_err().field, "headers");
    }
}
