//! Turning a stored event into an HTTP request: the URL, the CloudEvents 1.0
//! structured-mode JSON body, and the headers that do not change per attempt.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use chrono::SecondsFormat;
use ferry_core::{Route, SinkError, StoredEvent, redact, render_template_with};
use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

/// The body's media type: CloudEvents in structured content mode.
pub const CONTENT_TYPE: &str = "application/cloudevents+json";
/// CloudEvents specification version written in `specversion`.
pub const SPEC_VERSION: &str = "1.0";

/// Producer headers that would corrupt the HTTP framing, the body's
/// decoding or the signature; they are left out rather than failing the
/// event.
const RESERVED: &[&str] = &[
    "connection",
    "content-encoding",
    "content-length",
    "content-type",
    "expect",
    "host",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "webhook-id",
    "webhook-signature",
    "webhook-timestamp",
];

/// One event, ready to be signed and sent.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) url: Url,
    pub(crate) id: String,
    pub(crate) body: Bytes,
    /// Producer and configured headers; the signature headers come per attempt.
    pub(crate) headers: HeaderMap,
}

impl Request {
    pub(crate) fn prepare(
        destination: &Destination<'_>,
        event: &StoredEvent,
        source: &str,
        extra_headers: &HeaderMap,
        max_body_bytes: usize,
    ) -> Result<Self, SinkError> {
        let route = destination.route;
        let url = destination.url(event)?;
        let body = body(event, source);
        if body.len() > max_body_bytes {
            return Err(SinkError::permanent(format!(
                "request body too large: {} bytes (a payload of {} bytes in its CloudEvents envelope), \
                 limit {max_body_bytes} (sinks.{}.max_body_bytes)",
                body.len(),
                event.payload.len(),
                route.sink
            )));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &event.headers {
            let lower = name.to_ascii_lowercase();
            if RESERVED.contains(&lower.as_str()) {
                continue;
            }
            let (name, value) = header(name, value).map_err(|problem| {
                SinkError::permanent(format!(
                    "the event's header {name:?} cannot be sent over HTTP: {problem}; \
                     fix the producer's headers"
                ))
            })?;
            headers.insert(name, value);
        }
        // After the producer's, so a producer cannot replace an operator's
        // Authorization header.
        for (name, value) in extra_headers {
            headers.insert(name.clone(), value.clone());
        }
        headers.insert(reqwest::header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
        Ok(Self {
            url,
            id: event.id.to_string(),
            body: Bytes::from(body),
            headers,
        })
    }
}

/// Where a route's requests go. A fixed destination is parsed once, for a
/// whole batch; a template is rendered and parsed for each event.
pub(crate) struct Destination<'r> {
    route: &'r Route,
    fixed: Option<Result<Url, SinkError>>,
}

impl<'r> Destination<'r> {
    pub(crate) fn new(route: &'r Route) -> Self {
        let fixed = (!route.destination.contains('{')).then(|| checked_url(route, &route.destination));
        Self { route, fixed }
    }

    pub(crate) fn route(&self) -> &'r Route {
        self.route
    }

    /// The event's URL, checked to be an absolute http(s) URL. A fixed
    /// destination that is wrong is the route's fault (config); a template
    /// that renders wrong for one event fails that event (permanent).
    pub(crate) fn url(&self, event: &StoredEvent) -> Result<Url, SinkError> {
        match &self.fixed {
            Some(url) => url.clone(),
            None => {
                // Percent-encoded, a key cannot add a path segment, a query
                // or a fragment; "." and ".." (which URL parsing resolves,
                // encoded or not) cannot be a segment of their own.
                if matches!(event.key.as_deref(), Some("." | "..")) && self.route.destination.contains("{key}") {
                    return Err(SinkError::permanent(format!(
                        "route {:?}: the key {:?} cannot be placed in the URL {:?}: URL parsing would resolve it \
                         as a path step",
                        self.route.name,
                        event.key.as_deref().unwrap_or_default(),
                        redact::url(&self.route.destination)
                    )));
                }
                checked_url(
                    self.route,
                    &render_template_with(&self.route.destination, event, percent_encoded),
                )
            }
        }
    }
}

/// `value` with every byte outside RFC 3986's unreserved characters
/// percent-encoded, so that it stays inside the URL component it is put in.
fn percent_encoded(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for &b in value.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn checked_url(route: &Route, rendered: &str) -> Result<Url, SinkError> {
    parse_url(rendered).map_err(|problem| {
        let message = format!(
            "route {:?}: destination {:?} {problem}; routes[].destination must be an http:// or \
             https:// URL",
            route.name,
            redact::url(rendered)
        );
        if route.destination.contains('{') {
            SinkError::permanent(message)
        } else {
            SinkError::config(message)
        }
    })
}

pub(crate) fn parse_url(text: &str) -> Result<Url, String> {
    let url = Url::parse(text).map_err(|e| format!("is not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("has the scheme {:?}", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    Ok(url)
}

/// Validates the configured headers once, naming the offending entry.
pub(crate) fn configured_headers(headers: &BTreeMap<String, String>) -> Result<HeaderMap, SinkError> {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if RESERVED.contains(&lower.as_str()) {
            return Err(SinkError::config(format!(
                "headers.{name}: this header is set by the sink itself; remove it"
            )));
        }
        let (name, value) =
            header(name, value).map_err(|problem| SinkError::config(format!("headers.{name}: {problem}")))?;
        map.insert(name, value);
    }
    Ok(map)
}

fn header(name: &str, value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| "not a valid HTTP header name".to_owned())?;
    // As bytes: a UTF-8 value (a name, a city) goes as it is, where
    // `from_str` would refuse anything beyond ASCII. Control characters are
    // refused either way, and by the producer already.
    let value =
        HeaderValue::from_bytes(value.as_bytes()).map_err(|_| "the value holds a control character".to_owned())?;
    Ok((name, value))
}

/// The CloudEvents structured-mode body. `data` carries the payload bytes
/// verbatim when they are JSON, `data_base64` carries them otherwise.
fn body(event: &StoredEvent, source: &str) -> Vec<u8> {
    // `IgnoredAny` skips strings without checking their UTF-8: a payload
    // holding invalid UTF-8 would make the body invalid JSON.
    let json = is_json(&event.content_type)
        && std::str::from_utf8(&event.payload).is_ok()
        && serde_json::from_slice::<serde::de::IgnoredAny>(&event.payload).is_ok();
    let mut out = Vec::with_capacity(event.payload.len() * if json { 1 } else { 2 } + 256);
    field(&mut out, "id", &event.id.to_string());
    field(&mut out, "type", &event.event_type);
    field(&mut out, "source", source);
    let time = event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    field(&mut out, "time", &time);
    if let Some(key) = &event.key {
        field(&mut out, "subject", key);
    }
    field(&mut out, "specversion", SPEC_VERSION);
    field(&mut out, "datacontenttype", &event.content_type);
    if json {
        out.extend_from_slice(b",\"data\":");
        out.extend_from_slice(&event.payload);
    } else {
        field(&mut out, "data_base64", &STANDARD.encode(&event.payload));
    }
    out.push(b'}');
    out
}

fn field(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(if out.is_empty() { b'{' } else { b',' });
    string(out, name);
    out.push(b':');
    string(out, value);
}

fn string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(out, s).expect("writing a string to a Vec cannot fail");
}

/// `application/json`, or any `+json` type, ignoring parameters and case.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures;
    use ferry_core::{ErrorKind, EventId, Glob};
    use serde_json::{Value, json};

    fn route(destination: &str) -> Route {
        Route {
            name: "hooks".into(),
            matcher: Glob::new("**").unwrap(),
            sink: "web".into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    fn event(key: Option<&str>, payload: &[u8], content_type: &str) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq: 3,
            event_type: "order.item.created".into(),
            key: key.map(str::to_owned),
            payload: Bytes::copy_from_slice(payload),
            content_type: content_type.into(),
            headers: [("traceparent".to_owned(), "00-abc-01".to_owned())].into(),
            created_at: chrono::Utc::now(),
        }
    }

    fn prepare(destination: &str, e: &StoredEvent) -> Result<Request, SinkError> {
        Request::prepare(
            &Destination::new(&route(destination)),
            e,
            "shop",
            &HeaderMap::new(),
            1 << 20,
        )
    }

    #[test]
    fn structured_cloudevent_with_the_payload_verbatim() {
        let e = event(
            Some("o-1"),
            br#"{"n": 1.50, "big": 123456789012345678901234567890}"#,
            "application/json",
        );
        let r = prepare("http://hooks.example/in", &e).unwrap();
        let text = std::str::from_utf8(&r.body).unwrap();
        assert!(
            text.ends_with(r#","data":{"n": 1.50, "big": 123456789012345678901234567890}}"#),
            "{text}"
        );
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["id"], e.id.to_string());
        assert_eq!(v["type"], "order.item.created");
        assert_eq!(v["source"], "shop");
        assert_eq!(v["subject"], "o-1");
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["datacontenttype"], "application/json");
        let time = v["time"].as_str().unwrap();
        assert_eq!(chrono::DateTime::parse_from_rfc3339(time).unwrap(), e.created_at);
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 8, "{keys:?}");
        assert_eq!(r.id, e.id.to_string());
        assert_eq!(r.headers["content-type"], CONTENT_TYPE);
        assert_eq!(r.headers["traceparent"], "00-abc-01");
    }

    #[test]
    fn bytes_and_broken_json_travel_as_data_base64_and_no_key_no_subject() {
        for (payload, ct) in [
            (&b"\x00\x01raw"[..], "application/octet-stream"),
            (b"{not json", "application/json"),
            // Well-formed but for a string that is not UTF-8.
            (b"{\"name\": \"caf\xe9\"}", "application/json"),
        ] {
            let r = prepare("https://hooks.example/in", &event(None, payload, ct)).unwrap();
            let v: Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["data_base64"], STANDARD.encode(payload));
            assert_eq!(v["datacontenttype"], ct);
            assert!(v.get("data").is_none() && v.get("subject").is_none(), "{v}");
        }
    }

    #[test]
    fn urls_are_rendered_and_must_be_http() {
        let e = event(Some("o-1"), b"{}", "application/json");
        let r = prepare("https://hooks.example/{domain}/{key}", &e).unwrap();
        assert_eq!(r.url.as_str(), "https://hooks.example/order/o-1");
        // A key stays inside its component: no extra path segment, query
        // or fragment, whatever it holds.
        for (key, url) in [
            (
                "a/../../admin",
                "https://hooks.example/order/a%2F..%2F..%2Fadmin?k=a%2F..%2F..%2Fadmin",
            ),
            (
                "x#y?z=1&w",
                "https://hooks.example/order/x%23y%3Fz%3D1%26w?k=x%23y%3Fz%3D1%26w",
            ),
            ("café 1", "https://hooks.example/order/caf%C3%A9%201?k=caf%C3%A9%201"),
        ] {
            let r = prepare(
                "https://hooks.example/{domain}/{key}?k={key}",
                &event(Some(key), b"{}", "application/json"),
            );
            assert_eq!(r.unwrap().url.as_str(), url, "{key}");
        }
        for key in [".", ".."] {
            let err = prepare(
                "https://hooks.example/{key}",
                &event(Some(key), b"{}", "application/json"),
            )
            .unwrap_err();
            assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
            assert!(err.message.contains("path step"), "{err}");
        }

        let err = prepare("ftp://hooks.example/x", &e).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.contains("scheme \"ftp\""), "{}", err.message);
        assert!(err.message.contains("routes[].destination"), "{}", err.message);
        assert_eq!(prepare("not a url", &e).unwrap_err().kind, ErrorKind::Config);
        // A template that renders wrong for one event fails only that event.
        let err = prepare("{key}://hooks.example/x", &e).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
    }

    #[test]
    fn oversized_bodies_are_permanent_and_name_the_option() {
        let e = event(
            None,
            &serde_json::to_vec(&json!("x".repeat(100))).unwrap(),
            "application/json",
        );
        let size = prepare("http://h/", &e).unwrap().body.len();
        assert!(
            Request::prepare(
                &Destination::new(&route("http://h/")),
                &e,
                "shop",
                &HeaderMap::new(),
                size
            )
            .is_ok()
        );
        let err = Request::prepare(
            &Destination::new(&route("http://h/")),
            &e,
            "shop",
            &HeaderMap::new(),
            size - 1,
        )
        .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("sinks.web.max_body_bytes"), "{}", err.message);
    }

    #[test]
    fn header_precedence_and_validation() {
        let mut e = event(None, b"{}", "application/json");
        e.headers.insert("authorization".into(), "forged".into());
        e.headers.insert("Content-Type".into(), "text/evil".into());
        e.headers.insert("webhook-id".into(), "forged".into());
        // The body is sent as it is: a receiver told it is gzip fails to read it.
        e.headers.insert("Content-Encoding".into(), "gzip".into());
        let configured = configured_headers(&[("Authorization".to_owned(), "Bearer t".to_owned())].into()).unwrap();
        let r = Request::prepare(&Destination::new(&route("http://h/")), &e, "s", &configured, 1 << 20).unwrap();
        assert_eq!(r.headers["authorization"], "Bearer t");
        assert_eq!(r.headers["content-type"], CONTENT_TYPE);
        assert!(r.headers.get("webhook-id").is_none());
        assert!(r.headers.get("content-encoding").is_none());

        // A producer's UTF-8 value goes as it is.
        e.headers.insert("x-customer".into(), "Müller".into());
        let r = Request::prepare(&Destination::new(&route("http://h/")), &e, "s", &configured, 1 << 20).unwrap();
        assert_eq!(r.headers["x-customer"].as_bytes(), "Müller".as_bytes());

        e.headers.insert("bad name".into(), "x".into());
        let err = Request::prepare(&Destination::new(&route("http://h/")), &e, "s", &configured, 1 << 20).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("\"bad name\""), "{}", err.message);

        let err = configured_headers(&[("x-tenant".to_owned(), "a\nb".to_owned())].into()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.starts_with("headers.x-tenant"), "{}", err.message);
        let err = configured_headers(&[("Webhook-Signature".to_owned(), "x".to_owned())].into()).unwrap_err();
        assert!(err.message.contains("set by the sink"), "{}", err.message);
    }

    #[test]
    fn the_w3c_trace_context_is_forwarded_unchanged() {
        let e = fixtures::traced_event();
        let r = prepare("http://hooks.example/in", &e).unwrap();
        for (name, value) in fixtures::TRACE_CONTEXT {
            assert_eq!(r.headers.get(name).map(|v| v.to_str().unwrap()), Some(value), "{name}");
        }
    }
}
