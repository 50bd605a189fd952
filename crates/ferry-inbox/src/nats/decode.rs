//! Ferry's JetStream envelope back into a [`ReceivedEvent`]: the `ce-*`
//! CloudEvents headers, `Nats-Msg-Id`, and `content-type`.

use async_nats::HeaderMap;
use ferry_core::Headers;

use crate::envelope::{check_spec_version, checked, parse_id, parse_time, parse_type};
use crate::{DecodeError, ReceivedEvent};

/// The dedup header the NATS sink sets to the event id.
const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Decodes one message's headers and payload.
pub fn decode(headers: Option<&HeaderMap>, payload: &[u8]) -> Result<ReceivedEvent, DecodeError> {
    let empty = HeaderMap::new();
    let headers = headers.unwrap_or(&empty);
    let get = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
    check_spec_version("ce-specversion", get("ce-specversion").as_deref())?;
    let id = match get("ce-id") {
        Some(id) => parse_id("ce-id", Some(&id))?,
        None => parse_id(MSG_ID_HEADER, get(MSG_ID_HEADER).as_deref())?,
    };
    let mut own = Headers::new();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        let lower = name.to_ascii_lowercase();
        if lower.starts_with("ce-") || lower.starts_with("nats-") || lower == "content-type" {
            continue;
        }
        if let Some(value) = values.last() {
            own.insert(name.to_owned(), value.as_str().to_owned());
        }
    }
    checked(ReceivedEvent {
        id,
        event_type: parse_type("ce-type", get("ce-type").as_deref())?,
        key: get("ce-subject"),
        source: get("ce-source"),
        time: parse_time("ce-time", get("ce-time").as_deref())?,
        content_type: get("content-type").unwrap_or_else(|| "application/octet-stream".into()),
        headers: own,
        payload: payload.to_vec().into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::EventId;

    #[test]
    fn reads_what_the_sink_writes() {
        let id = EventId::new().to_string();
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("Nats-Msg-Id", id.as_str()),
            ("ce-specversion", "1.0"),
            ("ce-id", id.as_str()),
            ("ce-type", "order.item.created"),
            ("ce-source", "ferry"),
            ("ce-time", "2026-01-02T03:04:05Z"),
            ("ce-subject", "o-1"),
            ("content-type", "application/json"),
            ("traceparent", "00-abc-01"),
        ] {
            h.insert(name, value);
        }
        let e = decode(Some(&h), b"{}").unwrap();
        assert_eq!(e.id.to_string(), id);
        assert_eq!(
            (e.event_type.as_str(), e.key.as_deref()),
            ("order.item.created", Some("o-1"))
        );
        assert_eq!(e.content_type, "application/json");
        assert_eq!(e.headers, [("traceparent".to_owned(), "00-abc-01".to_owned())].into());
    }

    #[test]
    fn refusals_name_the_field() {
        assert_eq!(decode(None, b"").unwrap_err().field, MSG_ID_HEADER);
        let mut h = HeaderMap::new();
        h.insert("ce-id", "nope");
        assert_eq!(decode(Some(&h), b"").unwrap_err().field, "ce-id");
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", EventId::new().to_string().as_str());
        assert_eq!(decode(Some(&h), b"").unwrap_err().field, "ce-type");
    }
}
