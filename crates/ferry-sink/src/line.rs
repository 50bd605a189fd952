//! The JSON line written per event by the stdout and file sinks: the same
//! fields in the same order, so tools reading either read both.

use chrono::SecondsFormat;
use ferry_core::{Headers, Route, StoredEvent};
use serde::Serialize;

#[derive(Serialize)]
struct Line<'a> {
    id: String,
    #[serde(rename = "type")]
    event_type: &'a str,
    key: Option<&'a str>,
    time: String,
    source: &'static str,
    route: &'a str,
    destination: &'a str,
    content_type: &'a str,
    headers: &'a Headers,
    /// `data`, the payload's own bytes, is spliced in after this.
    #[serde(skip_serializing_if = "Option::is_none")]
    data_base64: Option<String>,
}

/// One event as a JSON line ending in `\n`; `destination` is the rendered path.
///
/// A JSON payload is carried as its own bytes, never parsed into a value and
/// printed again: that would round big integers (`12345678901234567890123`
/// becoming `1.2345678901234568e22`), rewrite `1.10` as `1.1`, sort the keys
/// and collapse duplicate ones.
pub(crate) fn render(route: &Route, event: &StoredEvent, destination: &str) -> Vec<u8> {
    // Parsed only to be checked, as strictly as a reader of the line will:
    // `IgnoredAny` would pass invalid UTF-8 and lone surrogate escapes
    // (`"\ud800"`), and a line holding them would be refused whole.
    let json = is_json(&event.content_type) && serde_json::from_slice::<serde_json::Value>(&event.payload).is_ok();
    let line = Line {
        id: event.id.to_string(),
        event_type: &event.event_type,
        key: event.key.as_deref(),
        time: event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true),
        source: "ferry",
        route: &route.name,
        destination,
        content_type: &event.content_type,
        headers: &event.headers,
        data_base64: (!json).then(|| base64(&event.payload)),
    };
    let mut bytes = Vec::with_capacity(event.payload.len() + 512);
    serde_json::to_writer(&mut bytes, &line).expect("a JSON line serialises");
    if json {
        let close = bytes.pop();
        debug_assert_eq!(close, Some(b'}'));
        bytes.extend_from_slice(b",\"data\":");
        // One event, one line. A JSON string cannot hold a raw line break
        // (the parser above refuses one), so any in the payload is
        // whitespace between tokens: a space in its place changes no value.
        bytes.extend(event.payload.iter().map(|&b| match b {
            b'\n' | b'\r' => b' ',
            b => b,
        }));
        bytes.push(b'}');
    }
    bytes.push(b'\n');
    bytes
}

/// `application/json`, or any `+json` type, ignoring parameters and case.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

/// Standard base64 with padding (RFC 4648 section 4); the stdout and file
/// features carry no base64 dependency.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use ferry_core::{EventId, Glob};

    fn route(destination: &str) -> Route {
        Route {
            name: "audit".into(),
            matcher: Glob::new("**").unwrap(),
            sink: "out".into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    fn event(payload: &'static [u8], content_type: &str) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq: 1,
            event_type: "order.item.created".into(),
            key: Some("o-1".into()),
            payload: Bytes::from_static(payload),
            content_type: content_type.into(),
            headers: [("tenant".to_owned(), "acme".to_owned())].into(),
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain}");
        }
    }

    #[test]
    fn one_line_per_event_with_data_or_data_base64() {
        let e = event(b"{\"note\":\"two\\nlines\"}", "application/json");
        let line = render(&route("/x"), &e, "/x");
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["data"]["note"], "two\nlines");
        assert_eq!(v["destination"], "/x");
        let v: serde_json::Value = serde_json::from_slice(&render(
            &route("/x"),
            &event(b"\x00raw", "application/octet-stream"),
            "/x",
        ))
        .unwrap();
        assert_eq!(v["data_base64"], "AHJhdw==");
        assert!(v.get("data").is_none());
    }

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/cloudevents+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonl"));
    }
}
