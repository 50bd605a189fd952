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
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent, render_template};

use crate::line;

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
        let lines: Vec<Vec<u8>> = events
            .iter()
            .map(|e| line::render(route, e, &render_template(&route.destination, e)))
            .collect();
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
