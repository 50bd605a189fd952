//! The stdout sink, writing into a captured buffer.
#![cfg(feature = "stdout")]

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Glob, Route, Sink};
use ferry_sink::stdout::StdoutSink;
use ferry_testkit::sink_suite::{self, ReceivedMessage, SinkHarness, event};
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn lines(&self) -> Vec<Value> {
        let bytes = self.0.lock().unwrap().clone();
        let text = String::from_utf8(bytes).expect("UTF-8 output");
        assert!(text.is_empty() || text.ends_with('\n'), "a partial line: {text:?}");
        text.lines()
            .map(|l| serde_json::from_str(l).expect("each line is JSON"))
            .collect()
    }
}

fn route() -> Route {
    Route {
        name: "audit".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "out".into(),
        destination: "events.{domain}".into(),
        routing_key: None,
    }
}

struct Harness {
    capture: Capture,
    read: Mutex<usize>,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route()
    }
    fn missing_route(&self) -> Option<Route> {
        None
    }
    async fn received(&self, n: usize, _timeout: Duration) -> Vec<ReceivedMessage> {
        // publish() returns after the flush, so everything is already here.
        let lines = self.capture.lines();
        let mut read = self.read.lock().unwrap();
        let new: Vec<ReceivedMessage> = lines[*read..]
            .iter()
            .take(n)
            .map(|line| ReceivedMessage {
                id: line["id"].as_str().expect("an id").to_owned(),
                key: line["key"].as_str().map(str::to_owned),
                body: serde_json::to_vec(&line["data"]).unwrap(),
            })
            .collect();
        *read += new.len();
        new
    }
}

#[tokio::test]
async fn passes_the_sink_conformance_suite() {
    let capture = Capture::default();
    let sink = StdoutSink::with_writer(Box::new(capture.clone()));
    sink_suite::run(
        &sink,
        &Harness {
            capture,
            read: Mutex::new(0),
        },
    )
    .await;
}

#[tokio::test]
async fn writes_one_json_line_per_event() {
    let capture = Capture::default();
    let sink = StdoutSink::with_writer(Box::new(capture.clone()));
    let mut json_event = event(
        1,
        "order.item.created",
        Some("o-1"),
        json!({ "n": 1, "text": "two\nlines" }),
    );
    json_event.headers.insert("traceparent".into(), "00-abc-01".into());
    let mut bytes_event = event(2, "order.item.archived", None, json!(null));
    bytes_event.payload = bytes::Bytes::from_static(b"\xff\x00raw");
    bytes_event.content_type = "application/octet-stream".into();
    let mut broken_json = event(3, "order.item.noted", None, json!(null));
    broken_json.payload = bytes::Bytes::from_static(b"{not json");

    let events = [json_event, bytes_event, broken_json];
    assert_eq!(sink.publish(&route(), &events).await, vec![Ok(()), Ok(()), Ok(())]);
    sink.check(&route()).await.expect("stdout is always reachable");
    sink.close().await;

    let lines = capture.lines();
    assert_eq!(lines.len(), 3);
    let first = &lines[0];
    assert_eq!(first["id"], events[0].id.to_string());
    assert_eq!(first["type"], "order.item.created");
    assert_eq!(first["key"], "o-1");
    assert_eq!(first["source"], "ferry");
    assert_eq!(first["route"], "audit");
    assert_eq!(first["destination"], "events.order");
    assert_eq!(first["content_type"], "application/json");
    assert_eq!(first["headers"], json!({ "traceparent": "00-abc-01" }));
    assert_eq!(first["data"], json!({ "n": 1, "text": "two\nlines" }));
    assert!(first.get("data_base64").is_none());
    let time = chrono::DateTime::parse_from_rfc3339(first["time"].as_str().unwrap()).unwrap();
    assert_eq!(time, events[0].created_at);

    assert_eq!(lines[1]["key"], Value::Null);
    assert_eq!(lines[1]["data_base64"], "/wByYXc=");
    assert!(lines[1].get("data").is_none());
    assert_eq!(lines[2]["data_base64"], "e25vdCBqc29u");
}

struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::new(io::ErrorKind::BrokenPipe, "reader went away"))
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_write_error_is_transient() {
    let sink = StdoutSink::with_writer(Box::new(Broken));
    let events = [event(1, "a.b", None, json!(1)), event(2, "a.b", None, json!(2))];
    for outcome in sink.publish(&route(), &events).await {
        let err = outcome.expect_err("nothing was written");
        assert_eq!(err.kind, ErrorKind::Transient);
        assert!(err.message.contains("reader went away"), "{err}");
    }
}

/// A pipe nobody reads: every write waits for a go from the channel.
struct Stalled(std::sync::mpsc::Receiver<()>);

impl Write for Stalled {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = self.0.recv();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A reader that stopped reading stalled one batch's write, and every
/// batch after it parked a blocking-pool thread on the sink's lock until
/// the pool was full: nothing else that needs one ran, and the threads
/// piled up for as long as the reader stalled.
#[test]
fn batches_behind_a_stalled_write_hold_no_blocking_thread() {
    // A rendezvous: each go is taken by one write.
    let (release, stalled) = std::sync::mpsc::sync_channel(0);
    let sink = StdoutSink::with_writer(Box::new(Stalled(stalled)));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let events: Vec<_> = (0..4).map(|seq| event(seq, "a.b", None, json!(seq))).collect();
    let route = route();
    let (free, outcomes) = runtime.block_on(async {
        let mut batches: Vec<_> = events
            .iter()
            .map(|e| Box::pin(sink.publish(&route, std::slice::from_ref(e))))
            .collect();
        // Each goes as far as it can: the first into the stalled write.
        for batch in &mut batches {
            assert!(futures::poll!(batch.as_mut()).is_pending());
        }
        let probe = tokio::task::spawn_blocking(|| ());
        let free = tokio::time::timeout(Duration::from_secs(10), probe).await.is_ok();
        // The reader reads again: one line per batch, then the flushes.
        std::thread::spawn(move || while release.send(()).is_ok() {});
        (free, futures::future::join_all(batches).await)
    });
    assert!(
        free,
        "the blocking pool was full of batches waiting behind the stalled one"
    );
    for outcome in outcomes {
        assert_eq!(outcome, [Ok(())]);
    }
}
