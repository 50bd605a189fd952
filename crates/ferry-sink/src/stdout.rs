//! The stdout sink: one JSON object per line per event, for development,
//! demos and piping into `jq` or another tool.
//!
//! ```
//! use ferry_sink::stdout::StdoutSink;
//! let sink = StdoutSink::new();
//! ```

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use chrono::SecondsFormat;
use ferry_core::{Headers, PublishOutcome, Route, Sink, SinkError, StoredEvent, render_template};
use serde::Serialize;

/// Writes each event as one JSON line and flushes after every batch.
///
/// A line reads `{"id", "type", "key", "time", "source", "route",
/// "destination", "content_type", "headers", "data" | "data_base64"}`:
/// `data` holds the payload when its content type is JSON and it parses,
/// `data_base64` holds the raw bytes otherwise.
pub struct StdoutSink {
    writer: Arc<Mutex<Box<dyn Write + Send>>>,
}

impl StdoutSink {
    /// A sink writing to the process's standard output.
    pub fn new() -> Self {
        Self::with_writer(Box::new(io::stdout()))
    }

    /// A sink writing to `writer`: a file, a pipe, or a buffer in tests.
    pub fn with_writer(writer: Box<dyn Write + Send>) -> Self {
        Self {
            writer: Arc::new(Mutex::new(writer)),
        }
    }
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for StdoutSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StdoutSink").finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct Line<'a> {
    id: String,
    #[serde(rename = "type")]
    event_type: &'a str,
    key: Option<&'a str>,
    time: String,
    source: &'static str,
    route: &'a str,
    destination: String,
    content_type: &'a str,
    headers: &'a Headers,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_base64: Option<String>,
}

fn render(route: &Route, event: &StoredEvent) -> Vec<u8> {
    let data = is_json(&event.content_type)
        .then(|| serde_json::from_slice::<serde_json::Value>(&event.payload).ok())
        .flatten();
    let line = Line {
        id: event.id.to_string(),
        event_type: &event.event_type,
        key: event.key.as_deref(),
        time: event.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true),
        source: "ferry",
        route: &route.name,
        destination: render_template(&route.destination, event),
        content_type: &event.content_type,
        headers: &event.headers,
        data_base64: data.is_none().then(|| base64(&event.payload)),
        data,
    };
    // Serialising strings, maps of strings and a parsed Value cannot fail;
    // compact output keeps the payload's own newlines escaped, one event a line.
    let mut bytes = serde_json::to_vec(&line).expect("a JSON line serialises");
    bytes.push(b'\n');
    bytes
}

/// `application/json`, or any `+json` type, ignoring parameters and case.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

/// Standard base64 with padding (RFC 4648 section 4).
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

/// Writes the lines, then flushes. An event counts as written only if its
/// line and everything before it reached the writer and the flush succeeded.
fn write_batch(writer: &mut dyn Write, lines: &[Vec<u8>]) -> Vec<PublishOutcome> {
    let mut written = 0;
    let mut failure = None;
    for line in lines {
        if let Err(e) = writer.write_all(line) {
            failure = Some(e);
            break;
        }
        written += 1;
    }
    if let Err(e) = writer.flush() {
        failure.get_or_insert(e);
        written = 0;
    }
    (0..lines.len())
        .map(|i| match &failure {
            Some(e) if i >= written => Err(SinkError::transient(format!("writing to stdout: {e}"))),
            _ => Ok(()),
        })
        .collect()
}

#[async_trait]
impl Sink for StdoutSink {
    fn kind(&self) -> &'static str {
        "stdout"
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let lines: Vec<Vec<u8>> = events.iter().map(|e| render(route, e)).collect();
        let writer = Arc::clone(&self.writer);
        // A blocked pipe must stall a blocking-pool thread, not the runtime.
        let written = tokio::task::spawn_blocking(move || {
            let mut writer = writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            write_batch(&mut **writer, &lines)
        })
        .await;
        written.unwrap_or_else(|e| {
            let err = SinkError::transient(format!("the stdout writer task failed: {e}"));
            events.iter().map(|_| Err(err.clone())).collect()
        })
    }

    async fn check(&self, _route: &Route) -> Result<(), SinkError> {
        Ok(())
    }

    async fn close(&self) {
        let writer = Arc::clone(&self.writer);
        let _ = tokio::task::spawn_blocking(move || {
            let mut writer = writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            writer.flush()
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/cloudevents+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonl"));
    }

    struct FailAfter(usize);

    impl Write for FailAfter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "closed"));
            }
            self.0 -= 1;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_write_fails_that_line_and_the_rest() {
        let lines = vec![b"a\n".to_vec(), b"b\n".to_vec(), b"c\n".to_vec()];
        let out = write_batch(&mut FailAfter(1), &lines);
        assert_eq!(out[0], Ok(()));
        assert!(out[1].as_ref().unwrap_err().is_transient());
        assert!(out[2].as_ref().unwrap_err().is_transient());
    }
}
