//! Ferry's Kafka record back into a [`ReceivedEvent`]: the `ce_*` headers of
//! the CloudEvents Kafka binding, `content-type`, and the record key.

use ferry_core::Headers;

use crate::envelope::{check_spec_version, checked, parse_id, parse_time, parse_type};
use crate::{DecodeError, ReceivedEvent};

/// Decodes one record from its headers (in order, as Kafka keeps them), key
/// and payload.
pub fn decode<'a>(
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
    key: Option<&[u8]>,
    payload: &[u8],
) -> Result<ReceivedEvent, DecodeError> {
    let mut ce = Headers::new();
    let mut own = Headers::new();
    for (name, value) in headers {
        let value = String::from_utf8(value.unwrap_or_default().to_vec())
            .map_err(|_| DecodeError::new(name, "is not UTF-8"))?;
        if name.starts_with("ce_") || name.eq_ignore_ascii_case("content-type") {
            ce.insert(name.to_ascii_lowercase(), value);
        } else {
            own.insert(name.to_owned(), value);
        }
    }
    let get = |name: &str| ce.get(name).map(String::as_str);
    check_spec_version("ce_specversion", get("ce_specversion"))?;
    let key = match get("ce_subject") {
        Some(subject) => Some(subject.to_owned()),
        None => key
            .map(|k| String::from_utf8(k.to_vec()).map_err(|_| DecodeError::new("key", "is not UTF-8")))
            .transpose()?,
    };
    checked(ReceivedEvent {
        id: parse_id("ce_id", get("ce_id"))?,
        event_type: parse_type("ce_type", get("ce_type"))?,
        key,
        source: get("ce_source").map(str::to_owned),
        time: parse_time("ce_time", get("ce_time"))?,
        content_type: get("content-type").unwrap_or("application/octet-stream").to_owned(),
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
        let headers: Vec<(&str, Option<&[u8]>)> = vec![
            ("traceparent", Some(b"00-abc-01")),
            ("ce_specversion", Some(b"1.0")),
            ("ce_id", Some(id.as_bytes())),
            ("ce_type", Some(b"order.item.created")),
            ("ce_source", Some(b"ferry")),
            ("ce_time", Some(b"2026-01-02T03:04:05Z")),
            ("ce_subject", Some(b"o-1")),
            ("content-type", Some(b"application/json")),
        ];
        let e = decode(headers, Some(b"o-1"), b"{}").unwrap();
        assert_eq!(e.id.to_string(), id);
        assert_eq!(
            (e.event_type.as_str(), e.key.as_deref()),
            ("order.item.created", Some("o-1"))
        );
        assert_eq!(e.headers, [("traceparent".to_owned(), "00-abc-01".to_owned())].into());
        assert_eq!(e.content_type, "application/json");
    }

    #[test]
    fn refusals_name_the_field() {
        assert_eq!(decode(vec![], None, b"").unwrap_err().field, "ce_id");
        let id = EventId::new().to_string();
        let headers: Vec<(&str, Option<&[u8]>)> = vec![("ce_id", Some(id.as_bytes()))];
        assert_eq!(decode(headers, None, b"").unwrap_err().field, "ce_type");
        let headers: Vec<(&str, Option<&[u8]>)> = vec![("ce_id", Some(b"\xff"))];
        assert_eq!(decode(headers, None, b"").unwrap_err().field, "ce_id");
    }
}
