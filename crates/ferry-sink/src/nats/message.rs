//! Turning a stored event into a JetStream message: the subject, the
//! `Nats-Msg-Id` dedup header and the CloudEvents 1.0 binary-mode headers.
//!
//! The event id travels in `ce-id`. `Nats-Msg-Id` is `<event id>:<subject>`
//! (see [`msg_id`]), not the bare event id, because JetStream deduplicates
//! by message id across a whole stream, whatever the subject.

use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use chrono::SecondsFormat;
use ferry_core::{EventId, Route, SinkError, StoredEvent, render_template, render_template_with};

/// JetStream drops a second message with the same id inside the stream's
/// duplicate window, so a re-publish after a crash is stored once. Its
/// value is [`msg_id`], not the event id, which is in `ce-id`.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// CloudEvents specification version written in `ce-specversion`.
pub const SPEC_VERSION: &str = "1.0";

const MSG_ID: HeaderName = HeaderName::from_static(MSG_ID_HEADER);
const CE_SPECVERSION: HeaderName = HeaderName::from_static("ce-specversion");
const CE_ID: HeaderName = HeaderName::from_static("ce-id");
const CE_TYPE: HeaderName = HeaderName::from_static("ce-type");
const CE_SOURCE: HeaderName = HeaderName::from_static("ce-source");
const CE_TIME: HeaderName = HeaderName::from_static("ce-time");
const CE_SUBJECT: HeaderName = HeaderName::from_static("ce-subject");
const CONTENT_TYPE: HeaderName = HeaderName::from_static("content-type");
/// The headers Ferry writes.
const OWN: [HeaderName; 7] = [
    CE_SPECVERSION,
    CE_ID,
    CE_TYPE,
    CE_SOURCE,
    CE_TIME,
    CE_SUBJECT,
    CONTENT_TYPE,
];

/// One event, ready for `HPUB`.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) subject: String,
    pub(crate) headers: HeaderMap,
    pub(crate) payload: Bytes,
}

impl Message {
    /// Renders the subject and builds the headers, refusing (permanently)
    /// what the server would reject: a payload over `max_message_bytes`, a
    /// message over the server's `max_payload` (`0` when not yet known), a
    /// subject that is not a valid publish subject, a header NATS cannot carry.
    pub(crate) fn prepare(
        route: &Route,
        event: &StoredEvent,
        source: &str,
        max_message_bytes: usize,
        server_max_payload: usize,
    ) -> Result<Self, SinkError> {
        crate::limits::check_payload_size(route, event, max_message_bytes)?;
        let subject = render_template(&route.destination, event);
        if let Err(why) = validate_subject(&subject) {
            // A fixed subject, or a template's own text, is the route's
            // fault; a subject only this event's values make invalid, the
            // event's.
            let template = route.destination.as_str();
            let fix = "fix routes[].destination";
            return Err(if !template.contains('{') {
                SinkError::config(format!("subject {subject:?} {why}; {fix}"))
            } else if let Err(why) = validate_template(template) {
                SinkError::config(format!(
                    "subject template {template:?} {why}, whatever the event; {fix}"
                ))
            } else {
                SinkError::permanent(format!("subject {subject:?} {why}; {fix}"))
            });
        }
        if let Some(refusal) = reserved_by_the_event(&route.destination, &subject) {
            return Err(refusal);
        }

        let mut headers = HeaderMap::new();
        for (name, value) in &event.headers {
            // JetStream acts on `Nats-*` headers: a producer's `Nats-Rollup`
            // would purge the subject's earlier messages, other events'
            // included, and a `Nats-Expected-*` would refuse the publish for
            // ever. They are the server's, not the event's: not sent.
            if name.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("nats-")) {
                continue;
            }
            // Nor Ferry's own, in any case: where Ferry writes none (a
            // keyless event's `ce-subject`), a producer's copy would stand
            // in for it, and a consumer would take it for the key.
            if OWN
                .iter()
                .any(|own| AsRef::<str>::as_ref(own).eq_ignore_ascii_case(name))
            {
                continue;
            }
            headers.insert(header_name(name)?, header_value(name, value)?);
        }
        // Inserted after the producer's headers so a producer cannot spoof
        // them. The names are constants (no parsing, no allocation); the id
        // and time are formatted here and cannot hold a line break.
        let id = event.id.to_string();
        let time = event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        headers.insert(MSG_ID, HeaderValue::from(msg_id(&id, &subject)));
        headers.insert(CE_SPECVERSION, HeaderValue::from(SPEC_VERSION));
        headers.insert(CE_ID, HeaderValue::from(id));
        headers.insert(CE_TYPE, header_value("ce-type", &event.event_type)?);
        headers.insert(CE_SOURCE, header_value("ce-source", source)?);
        headers.insert(CE_TIME, HeaderValue::from(time));
        headers.insert(CONTENT_TYPE, header_value("content-type", &event.content_type)?);
        if let Some(key) = &event.key {
            headers.insert(CE_SUBJECT, header_value("ce-subject", key)?);
        }

        let size = wire_len(&headers) + event.payload.len();
        if server_max_payload > 0 && size > server_max_payload {
            return Err(SinkError::permanent(format!(
                "message too large: {size} bytes with headers, the NATS server's max_payload is \
                 {server_max_payload}"
            )));
        }
        Ok(Self {
            subject,
            headers,
            payload: event.payload.clone(),
        })
    }
}

/// The `Nats-Msg-Id` of an event published to `subject`: one per event and
/// subject. JetStream deduplicates by message id across the whole stream, so
/// with the bare event id, two routes sending one event to two subjects of
/// the same stream would see the second publish acknowledged as a duplicate
/// and never stored. A re-publish to the same subject (after a crash) still
/// carries the same id and is dropped by the duplicate window; two routes to
/// the same subject store one copy, which is all that subject's readers need.
///
/// ```
/// assert_eq!(
///     ferry_sink::nats::msg_id("0190a1b2-0000-7000-8000-000000000001", "orders.created"),
///     "0190a1b2-0000-7000-8000-000000000001:orders.created"
/// );
/// ```
pub fn msg_id(event_id: &str, subject: &str) -> String {
    format!("{event_id}:{subject}")
}

/// The size of the headers block as written on the wire.
fn wire_len(headers: &HeaderMap) -> usize {
    let fields: usize = headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n".len() + fields + 2
}

/// `Err(why)` unless `subject` is a valid subject to publish to: non-empty
/// dot-separated tokens, no whitespace, no wildcards.
pub(crate) fn validate_subject(subject: &str) -> Result<(), &'static str> {
    if subject.is_empty() {
        return Err("is empty");
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("contains whitespace");
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err("has an empty token");
        }
        if token == "*" || token == ">" {
            return Err("contains a wildcard, which cannot be published to");
        }
    }
    Ok(())
}

/// Whether NATS keeps subjects starting with `token` for itself: `$JS`
/// (the JetStream API), `$SYS`, `$KV`, `$O` and every other `$` prefix,
/// `_INBOX` (the replies to requests, PubAcks included) and `_R_` (the
/// replies to requests across a service import).
pub(crate) fn is_reserved(token: &str) -> bool {
    token.starts_with('$') || RESERVED_TOKENS.contains(&token)
}

/// The first tokens NATS keeps for replies.
const RESERVED_TOKENS: [&str; 2] = ["_INBOX", "_R_"];

/// Whether the event's key may make the first token of `template` one
/// NATS reserves: the key is the producer's to choose, any text with dots
/// in it, so `{key}.x` may render `$JS.API.…` or `_INBOX.…` (and
/// `_{key}`, `_R_.…`). The other placeholders cannot: an event type (so
/// its `{domain}`) starts with a lowercase letter or a digit and `{id}` is
/// a UUID, so `{domain}.{key}` is safe, as is `v{key}`; and a first token
/// the route's own text starts with `$` is the user's choice.
pub(crate) fn key_makes_first_token(template: &str) -> bool {
    let first = template.split('.').next().unwrap_or_default();
    let Some(at) = first.find("{key}") else {
        return false;
    };
    let before = &first[..at];
    placeholders_in(before).is_empty()
        && (before.is_empty()
            || RESERVED_TOKENS
                .iter()
                .any(|token| token.len() > before.len() && token.starts_with(before)))
}

/// Refuses (permanently) a `subject` whose first token NATS reserves when
/// the event's key put it there: a key `$JS.API.STREAM.PURGE.EVENTS` under
/// a `{key}` template would be a JetStream API request, sent again on every
/// attempt, and one `_INBOX.…` or `_R_.…` a reply to another client's
/// request. A route whose own text starts so (`$KV.orders.{key}`) is the
/// user's choice and is published as written.
fn reserved_by_the_event(template: &str, subject: &str) -> Option<SinkError> {
    let first = subject.split('.').next().unwrap_or_default();
    (is_reserved(first) && key_makes_first_token(template)).then(|| {
        SinkError::permanent(format!(
            "subject {subject:?} starts with {first:?}, which NATS reserves for its API, system and \
             reply subjects, and the event's key ({{key}}) put it there (template {template:?}): not \
             sent, as it could act on the server or answer another client's request; keep such keys \
             out of the route's events, or start routes[].destination with a fixed token"
        ))
    })
}

/// The placeholders `token` holds, of those the event fills in.
pub(crate) fn placeholders_in(token: &str) -> Vec<&'static str> {
    if !holds_placeholder(token) {
        return Vec::new();
    }
    ["{key}", "{type}", "{domain}", "{id}"]
        .into_iter()
        .filter(|name| token.contains(name))
        .collect()
}

/// Whether `token` holds a placeholder the event fills in.
fn holds_placeholder(token: &str) -> bool {
    render_template_with(token, &any_event(), |_| "\0".to_owned()).contains('\0')
}

/// `Err(why)` unless a subject template's own text is valid: with each
/// placeholder standing for a valid token, what is left to fail is the
/// template itself (a wildcard, an empty token, whitespace), which no
/// event can mend. A subject without placeholders is checked as it is.
pub(crate) fn validate_template(template: &str) -> Result<(), &'static str> {
    validate_subject(&render_template_with(template, &any_event(), |_| "x".to_owned()))
}

/// The subjects `template` may render, as a subject filter that matches
/// every one of them (and maybe more): a token holding `{domain}` or `{id}`,
/// one token whatever the event, becomes `*`; a token holding any other
/// placeholder (`{type}` has dots in it, so may `{key}`) ends the filter
/// with `>`. A stream whose subjects overlap no part of it captures none
/// of the template's subjects.
pub(crate) fn template_filter(template: &str) -> String {
    let mut filter = Vec::new();
    for token in template.split('.') {
        if !holds_placeholder(token) {
            filter.push(token);
        } else if holds_placeholder(&token.replace("{domain}", "").replace("{id}", "")) {
            filter.push(">");
            break;
        } else {
            filter.push("*");
        }
    }
    filter.join(".")
}

/// An event to render a template with when its values do not matter.
fn any_event() -> StoredEvent {
    StoredEvent {
        id: EventId::new(),
        seq: 0,
        event_type: String::new(),
        key: None,
        payload: Bytes::new(),
        content_type: String::new(),
        headers: Default::default(),
        created_at: chrono::DateTime::UNIX_EPOCH,
    }
}

fn header_name(name: &str) -> Result<HeaderName, SinkError> {
    HeaderName::from_str(name)
        .map_err(|e| SinkError::permanent(format!("header name {name:?} is invalid for NATS: {e}")))
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue, SinkError> {
    HeaderValue::from_str(value)
        .map_err(|e| SinkError::permanent(format!("the value of header {name:?} is invalid for NATS: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures::{self, event};
    use ferry_core::ErrorKind;

    fn route(destination: &str) -> Route {
        fixtures::route("nats", destination)
    }

    fn header(m: &Message, name: &str) -> Option<String> {
        m.headers.get(name).map(|v| v.as_str().to_owned())
    }

    #[test]
    fn subject_and_headers() {
        let e = event(Some("o-1"));
        let m = Message::prepare(&route("events.{domain}.{type}"), &e, "ferry-test", 100, 0).unwrap();
        assert_eq!(m.subject, "events.order.order.item.created");
        let id = e.id.to_string();
        let msg_id = format!("{id}:events.order.order.item.created");
        assert_eq!(header(&m, "Nats-Msg-Id"), Some(msg_id));
        assert_eq!(header(&m, "ce-id").as_deref(), Some(id.as_str()));
        assert_eq!(header(&m, "ce-specversion").as_deref(), Some("1.0"));
        assert_eq!(header(&m, "ce-type").as_deref(), Some("order.item.created"));
        assert_eq!(header(&m, "ce-source").as_deref(), Some("ferry-test"));
        assert_eq!(header(&m, "ce-subject").as_deref(), Some("o-1"));
        assert_eq!(header(&m, "content-type").as_deref(), Some("application/json"));
        assert_eq!(header(&m, "traceparent").as_deref(), Some("00-abc-01"));
        let time = chrono::DateTime::parse_from_rfc3339(&header(&m, "ce-time").unwrap()).unwrap();
        assert_eq!(time, e.created_at);
        assert_eq!(m.payload, e.payload);

        let m = Message::prepare(&route("events"), &event(None), "ferry", 100, 0).unwrap();
        assert_eq!(header(&m, "ce-subject"), None);
    }

    #[test]
    fn producers_cannot_send_jetstream_directives() {
        let mut e = event(None);
        for name in [
            "Nats-Rollup",
            "nats-expected-last-sequence",
            "NATS-Expected-Stream",
            "Nats-TTL",
        ] {
            e.headers.insert(name.into(), "1".into());
        }
        e.headers.insert("natsy".into(), "kept".into());
        let m = Message::prepare(&route("events"), &e, "ferry", 100, 0).unwrap();
        let mut names: Vec<String> = m.headers.iter().map(|(n, _)| n.to_string()).collect();
        names.retain(|n| n.to_ascii_lowercase().starts_with("nats"));
        names.sort();
        assert_eq!(names, ["Nats-Msg-Id", "natsy"]);
    }

    #[test]
    fn producers_cannot_spoof_the_message_id() {
        let mut e = event(None);
        e.headers.insert("Nats-Msg-Id".into(), "forged".into());
        e.headers.insert("ce-id".into(), "forged".into());
        e.headers.insert("CE-ID".into(), "forged".into());
        // The event has no key: no ce-subject may reach the consumer.
        e.headers.insert("ce-subject".into(), "forged".into());
        e.headers.insert("Ce-Subject".into(), "forged".into());
        let m = Message::prepare(&route("events"), &e, "ferry", 100, 0).unwrap();
        let id = e.id.to_string();
        assert_eq!(m.headers.get_all("Nats-Msg-Id").count(), 1);
        assert_eq!(header(&m, "Nats-Msg-Id"), Some(format!("{id}:events")));
        assert_eq!(header(&m, "ce-id").as_deref(), Some(id.as_str()));
        for name in ["CE-ID", "ce-subject", "Ce-Subject"] {
            assert_eq!(header(&m, name), None, "{name}");
        }
        assert_eq!(header(&m, "traceparent").as_deref(), Some("00-abc-01"));
    }

    #[test]
    fn the_message_id_differs_per_subject_and_not_per_publish() {
        let e = event(Some("o-1"));
        let prepare = |destination| Message::prepare(&route(destination), &e, "ferry", 100, 0).unwrap();
        let msg_id = |m: &Message| header(m, "Nats-Msg-Id").unwrap();
        // Two routes to two subjects of one stream: two ids, so both are stored.
        assert_ne!(msg_id(&prepare("orders")), msg_id(&prepare("audit")));
        // A re-publish to the same subject: the same id, dropped as a duplicate.
        assert_eq!(msg_id(&prepare("orders")), msg_id(&prepare("orders")));
        assert_eq!(header(&prepare("audit"), "ce-id"), Some(e.id.to_string()));
    }

    #[test]
    fn refusals() {
        let e = event(Some("o 1"));
        let err = Message::prepare(&route("events"), &e, "ferry", 3, 0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("sinks.nats.max_message_bytes"), "{err}");

        // The server's max_payload counts the headers too.
        let err = Message::prepare(&route("events"), &e, "ferry", 100, 50).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("max_payload is 50"), "{err}");
        assert!(Message::prepare(&route("events"), &e, "ferry", 100, 4096).is_ok());

        let err = Message::prepare(&route("events.{key}"), &e, "ferry", 100, 0).unwrap_err();
        assert_eq!(
            err.kind,
            ErrorKind::Permanent,
            "a rendered subject is the event's fault"
        );
        assert!(err.message.contains("whitespace"), "{err}");
        for bad in ["events.*", "events.>", "a..b", "", "a b"] {
            let err = Message::prepare(&route(bad), &e, "ferry", 100, 0).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config, "{bad:?}: {err}");
        }

        let mut e = event(None);
        e.headers.insert("bad:name".into(), "v".into());
        assert_eq!(
            Message::prepare(&route("events"), &e, "ferry", 100, 0)
                .unwrap_err()
                .kind,
            ErrorKind::Permanent
        );
        let mut e = event(None);
        e.headers.insert("x".into(), "line\r\nbreak".into());
        assert_eq!(
            Message::prepare(&route("events"), &e, "ferry", 100, 0)
                .unwrap_err()
                .kind,
            ErrorKind::Permanent
        );
    }

    /// A template's own text is checked without an event: a wildcard or an
    /// empty token in it fails every event, and is the route's fault.
    #[test]
    fn a_templates_own_text_is_validated() {
        for good in [
            "{type}",
            "events.{domain}.{type}",
            "events.{key}",
            "e.v{id}x",
            "events.{nope}",
        ] {
            assert_eq!(validate_template(good), Ok(()), "{good:?}");
        }
        for (bad, why) in [
            ("events.>.{type}", "wildcard"),
            ("events.*.{domain}", "wildcard"),
            ("events.{type}.", "empty token"),
            ("events..{domain}", "empty token"),
            (".{type}", "empty token"),
            ("events.{type} x", "whitespace"),
        ] {
            let err = validate_template(bad).expect_err(bad);
            assert!(err.contains(why), "{bad:?}: {err}");
            let err = Message::prepare(&route(bad), &event(Some("k")), "ferry", 100, 0).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config, "{bad:?}: {err}");
            assert!(err.message.contains("routes[].destination"), "{err}");
        }
    }

    /// An event's key cannot make a subject NATS keeps for itself; a
    /// route that names one on purpose keeps it.
    #[test]
    fn an_event_cannot_make_a_reserved_subject() {
        for (template, key) in [
            ("{key}", "$JS.API.STREAM.PURGE.EVENTS"),
            ("{key}", "$SYS.REQ.SERVER.PING"),
            ("{key}.x", "$KV"),
            ("{key}", "_INBOX.abc.1"),
            ("{key}", "_R_.abc.1"),
            ("_{key}", "R_.abc"),
            ("_IN{key}", "BOX.abc"),
            ("{key}", "$"),
            ("{key}{domain}", "$x"),
            ("{key}{id}", "_INBOX.x"),
        ] {
            let err = Message::prepare(&route(template), &event(Some(key)), "ferry", 100, 0).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Permanent, "{template:?} {key:?}: {err}");
            assert!(err.message.contains("{key}"), "{err}");
            assert!(err.message.contains("reserves"), "{err}");
        }
        for (template, key) in [
            ("events.{key}", "$JS.API.STREAM.PURGE.EVENTS"),
            ("$KV.orders.{key}", "o-1"),
            ("_INBOX.{key}", "o-1"),
            ("_R_.{key}", "o-1"),
            ("$JS.API.STREAM.INFO.EVENTS", "o-1"),
            ("{key}", "x$JS.API"),
            ("{key}", "_INBOXES.a"),
            ("{key}", "_R_x.a"),
            ("x{key}", "$JS.API"),
            ("{domain}{key}", "$JS.API"),
            ("${key}.x", "KV"),
        ] {
            let prepared = Message::prepare(&route(template), &event(Some(key)), "ferry", 100, 0);
            assert!(prepared.is_ok(), "{template:?} {key:?}: {prepared:?}");
        }
        assert!(key_makes_first_token("{key}"));
        assert!(key_makes_first_token("{key}{id}.x"));
        assert!(key_makes_first_token("_{key}.x"));
        assert!(!key_makes_first_token("v{key}.x"));
        assert!(!key_makes_first_token("{domain}.{key}"));
        assert!(!key_makes_first_token("{domain}{key}"));
        assert!(!key_makes_first_token("{type}"));
        assert!(!key_makes_first_token("{id}.x"));
        assert!(!key_makes_first_token("events.{key}"));
        assert!(!key_makes_first_token("_INBOX{key}"));
        assert!(!key_makes_first_token("{nope}.x"));
        assert_eq!(placeholders_in("v{key}{id}"), ["{key}", "{id}"]);
        assert!(placeholders_in("{nope}").is_empty());
    }

    #[test]
    fn a_templates_filter_matches_every_subject_it_renders() {
        for (template, filter) in [
            ("events", "events"),
            ("events.{domain}", "events.*"),
            ("events.{domain}.x{id}.created", "events.*.*.created"),
            ("events.{type}", "events.>"),
            ("events.{type}.v1", "events.>"),
            ("events.{domain}.{key}.tail", "events.*.>"),
            ("events.v{type}", "events.>"),
            ("{type}", ">"),
        ] {
            assert_eq!(template_filter(template), filter, "{template:?}");
        }
    }

    #[test]
    fn the_w3c_trace_context_is_forwarded_unchanged() {
        let e = fixtures::traced_event();
        let m = Message::prepare(&route("events"), &e, "ferry", 100, 0).unwrap();
        for (name, value) in fixtures::TRACE_CONTEXT {
            assert_eq!(header(&m, name).as_deref(), Some(value), "{name}");
        }
    }
}
