//! The stdout sink: one JSON object per line per event, for development,
//! demos and piping into `jq` or another tool.
//!
//! ```
//! use ferry_sink::stdout::StdoutSink;
//! let sink = StdoutSink::new();
//! ```

use std::io::{self, Write};
use std::sync::Arc;

use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent, render_template};

use crate::line;

/// Writes each event as one JSON line and flushes after every batch.
///
/// A line reads `{"id", "type", "key", "time", "source", "route",
/// "destination", "content_type", "headers", "data" | "data_base64"}`:
/// `data` holds the payload when its content type is JSON and it parses,
/// `data_base64` holds the raw bytes otherwise.
///
/// A reader that stops reading (a stalled pipe) stalls the publish: the
/// events stay in flight, unpublished, until it reads again or the relay
/// stops. Batches behind the stalled one wait their turn without taking a
/// thread of the blocking pool each.
pub struct StdoutSink {
    /// Waited for asynchronously: only the batch writing holds a thread.
    output: Arc<tokio::sync::Mutex<Output>>,
}

/// Where the lines go, and whether the last batch failed part-way through
/// a line.
struct Output {
    writer: Box<dyn Write + Send>,
    mid_line: bool,
}

impl StdoutSink {
    /// A sink writing to the process's standard output. Rust's handle
    /// reports a write to a closed standard output (`ferry run >&-`) as
    /// written: every event would count as published and go nowhere. So a
    /// closed one fails every write, naming the fix.
    pub fn new() -> Self {
        use std::os::fd::AsFd;
        match io::stdout().as_fd().try_clone_to_owned() {
            Ok(_open) => Self::with_writer(Box::new(io::stdout())),
            Err(e) => Self::with_writer(Box::new(Closed(e.to_string()))),
        }
    }

    /// A sink writing to `writer`: a file, a pipe, or a buffer in tests.
    pub fn with_writer(writer: Box<dyn Write + Send>) -> Self {
        Self {
            output: Arc::new(tokio::sync::Mutex::new(Output {
                writer,
                mid_line: false,
            })),
        }
    }
}

/// A standard output that is not open.
struct Closed(String);

impl Write for Closed {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::other(format!(
            "standard output is not open ({}): start ferry with its output connected, or route to another sink",
            self.0
        )))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
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

/// Writes `lines`; a batch after one that failed part-way starts with a
/// line break, so the retried lines do not continue the cut one.
fn write_batch(output: &mut Output, lines: &[Vec<u8>]) -> Vec<PublishOutcome> {
    let writer = &mut output.writer;
    let mut written = 0;
    let mut failure = None;
    if output.mid_line {
        match writer.write_all(b"\n") {
            Ok(()) => output.mid_line = false,
            Err(e) => failure = Some(e),
        }
    }
    for line in lines.iter().take_while(|_| failure.is_none()) {
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
    if failure.is_some() {
        output.mid_line = true;
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
        let mut output = Arc::clone(&self.output).lock_owned().await;
        // A blocked pipe must stall a blocking-pool thread, not the runtime.
        // The batch holds the sink's lock until its write ends, even if the
        // relay stops waiting for it, so no other batch writes meanwhile.
        let written = tokio::task::spawn_blocking(move || write_batch(&mut output, &lines)).await;
        written.unwrap_or_else(|e| {
            let err = SinkError::transient(format!("the stdout writer task failed: {e}"));
            events.iter().map(|_| Err(err.clone())).collect()
        })
    }

    async fn check(&self, _route: &Route) -> Result<(), SinkError> {
        Ok(())
    }

    async fn close(&self) {
        let mut output = Arc::clone(&self.output).lock_owned().await;
        let _ = tokio::task::spawn_blocking(move || output.writer.flush()).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

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

    fn output(writer: impl Write + Send + 'static) -> Output {
        Output {
            writer: Box::new(writer),
            mid_line: false,
        }
    }

    #[test]
    fn a_failed_write_fails_that_line_and_the_rest() {
        let lines = vec![b"a\n".to_vec(), b"b\n".to_vec(), b"c\n".to_vec()];
        let out = write_batch(&mut output(FailAfter(1)), &lines);
        assert_eq!(out[0], Ok(()));
        assert!(out[1].as_ref().unwrap_err().is_transient());
        assert!(out[2].as_ref().unwrap_err().is_transient());
    }

    /// Takes `room` bytes, then fails once (a full disk), then takes all.
    struct Cut {
        out: Arc<Mutex<Vec<u8>>>,
        room: Option<usize>,
    }

    impl Write for Cut {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            match self.room {
                Some(0) => {
                    self.room = None;
                    Err(io::Error::other("no space left on device"))
                }
                Some(room) => {
                    let n = room.min(buf.len());
                    self.room = Some(room - n);
                    self.out.lock().unwrap().extend_from_slice(&buf[..n]);
                    Ok(n)
                }
                None => {
                    self.out.lock().unwrap().extend_from_slice(buf);
                    Ok(buf.len())
                }
            }
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A line cut by a failed write is not continued by the retry: the
    /// retried line starts a line of its own, and reads back whole.
    #[test]
    fn a_retry_after_a_cut_line_starts_a_new_line() {
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut sink = output(Cut {
            out: out.clone(),
            room: Some(11),
        });
        let lines = vec![b"{\"a\":1}\n".to_vec(), b"{\"b\":2}\n".to_vec()];
        let first = write_batch(&mut sink, &lines);
        assert_eq!(first[0], Ok(()));
        assert!(first[1].is_err());
        let retried = write_batch(&mut sink, &lines[1..]);
        assert_eq!(retried, [Ok(())]);
        let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
        let whole: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with('{') && l.ends_with('}'))
            .collect();
        assert_eq!(whole, ["{\"a\":1}", "{\"b\":2}"], "{text:?}");
    }

    #[test]
    fn a_closed_standard_output_fails_every_write_naming_the_fix() {
        let out = write_batch(&mut output(Closed("Bad file descriptor".into())), &[b"a\n".to_vec()]);
        let e = out[0].as_ref().unwrap_err();
        assert!(
            e.is_transient() && e.message.contains("standard output is not open"),
            "{e}"
        );
    }
}
