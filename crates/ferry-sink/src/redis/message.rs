//! Turning a stored event into one `XADD`: the stream key, optional
//! approximate trimming, and the entry's fields.

use chrono::SecondsFormat;
use ferry_core::{Route, SinkError, StoredEvent, render_template};

/// The entry fields, in the order they are written.
pub const FIELDS: [&str; 9] = [
    "id",
    "type",
    "key",
    "payload",
    "content-type",
    "time",
    "source",
    "specversion",
    "headers",
];
/// Arguments of one XADD: the command, its key, `MAXLEN ~ n`, `*` and the
/// fields with their values.
const ENTRY_ARGS: usize = 6 + 2 * FIELDS.len();
/// Room for an entry's arguments beyond its key, type and payload: the field
/// names, id, time, source, content type and headers of a typical event.
const ENTRY_OVERHEAD_BYTES: usize = 320;
/// CloudEvents specification version written in the `specversion` field.
pub const SPEC_VERSION: &str = "1.0";

/// One event, ready to go into the batch's pipeline.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) stream_key: String,
    pub(crate) command: ::redis::Cmd,
}

impl Entry {
    /// Renders the stream key and builds `XADD key [MAXLEN ~ n] * field value ...`,
    /// refusing (permanently) a payload over `max_message_bytes`.
    pub(crate) fn prepare(
        route: &Route,
        event: &StoredEvent,
        source: &str,
        max_message_bytes: usize,
        maxlen: Option<u64>,
    ) -> Result<Self, SinkError> {
        crate::limits::check_payload_size(route, event, max_message_bytes)?;
        let stream_key = render_template(&route.destination, event);
        if stream_key.is_empty() {
            let message = "the stream key is empty; fix routes[].destination".to_owned();
            return Err(if route.destination.contains('{') {
                SinkError::permanent(message)
            } else {
                SinkError::config(message)
            });
        }
        // Sized once for every argument instead of growing (and copying) as
        // each one is appended.
        let mut command = ::redis::Cmd::with_capacity(
            ENTRY_ARGS,
            stream_key.len() + event.payload.len() + event.event_type.len() + ENTRY_OVERHEAD_BYTES,
        );
        command.arg("XADD").arg(&stream_key);
        if let Some(maxlen) = maxlen {
            if maxlen > i64::MAX as u64 {
                return Err(SinkError::config(format!(
                    "MAXLEN {maxlen} for route {:?} is above Redis's limit of {}; lower it in sinks.{}",
                    route.name,
                    i64::MAX,
                    route.sink
                )));
            }
            command.arg("MAXLEN").arg("~").arg(maxlen);
        }
        command.arg("*");
        let id = event.id.to_string();
        let time = event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        let headers = serde_json::to_string(&event.headers).expect("a string map serialises");
        command.arg("id").arg(&id).arg("type").arg(&event.event_type);
        if let Some(key) = &event.key {
            command.arg("key").arg(key);
        }
        command
            .arg("payload")
            .arg(event.payload.as_ref())
            .arg("content-type")
            .arg(&event.content_type)
            .arg("time")
            .arg(&time)
            .arg("source")
            .arg(source)
            .arg("specversion")
            .arg(SPEC_VERSION)
            .arg("headers")
            .arg(&headers);
        Ok(Self { stream_key, command })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures::{self, event};
    use ferry_core::ErrorKind;

    fn route(destination: &str) -> Route {
        fixtures::route("redis", destination)
    }

    fn args(entry: &Entry) -> Vec<String> {
        entry
            .command
            .args_iter()
            .map(|a| match a {
                ::redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<other>".into(),
            })
            .collect()
    }

    #[test]
    fn xadd_with_every_field() {
        let e = event(Some("o-1"));
        let entry = Entry::prepare(&route("events:{domain}"), &e, "ferry-test", 100, None).unwrap();
        assert_eq!(entry.stream_key, "events:order");
        let time = e.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        let id = e.id.to_string();
        let expected = [
            "XADD",
            "events:order",
            "*",
            "id",
            &id,
            "type",
            "order.item.created",
            "key",
            "o-1",
            "payload",
            "{\"n\":1}",
            "content-type",
            "application/json",
            "time",
            &time,
            "source",
            "ferry-test",
            "specversion",
            "1.0",
            "headers",
            "{\"traceparent\":\"00-abc-01\"}",
        ];
        assert_eq!(args(&entry), expected);
    }

    #[test]
    fn maxlen_trims_approximately_and_no_key_means_no_key_field() {
        let entry = Entry::prepare(&route("events"), &event(None), "ferry", 100, Some(1000)).unwrap();
        let args = args(&entry);
        assert_eq!(args[..6], ["XADD", "events", "MAXLEN", "~", "1000", "*"]);
        assert!(!args.contains(&"key".to_owned()));
    }

    #[test]
    fn refusals() {
        let err = Entry::prepare(&route("events"), &event(None), "ferry", 3, None).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("sinks.redis.max_message_bytes"), "{err}");
        let err = Entry::prepare(&route(""), &event(None), "ferry", 100, None).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
        let err = Entry::prepare(&route("{key}"), &event(None), "ferry", 100, None).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        let err = Entry::prepare(&route("events"), &event(None), "ferry", 100, Some(u64::MAX)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
    }

    #[test]
    fn the_w3c_trace_context_is_forwarded_unchanged() {
        let e = fixtures::traced_event();
        let entry = Entry::prepare(&route("events"), &e, "ferry", 100, None).unwrap();
        let args = args(&entry);
        let at = args.iter().position(|a| a == "headers").unwrap();
        let headers: std::collections::BTreeMap<String, String> = serde_json::from_str(&args[at + 1]).unwrap();
        for (name, value) in fixtures::TRACE_CONTEXT {
            assert_eq!(headers.get(name).map(String::as_str), Some(value), "{name}");
        }
    }
}
