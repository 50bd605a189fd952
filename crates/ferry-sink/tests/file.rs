//! The file sink, writing into a temporary directory and read back.
#![cfg(feature = "file")]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, Sink, StoredEvent};
use ferry_sink::file::{FileOptions, FileSink};
use ferry_testkit::sink_suite::{self, ReceivedMessage, SinkHarness, event};
use serde_json::{Value, json};

fn route(destination: &Path) -> Route {
    Route {
        name: "audit".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "files".into(),
        destination: destination.to_string_lossy().into_owned(),
        routing_key: None,
    }
}

fn sink(max_file_bytes: u64) -> FileSink {
    FileSink::new(FileOptions { max_file_bytes }).unwrap()
}

/// The files of `base` (`<dir>/<name>`) in write order: rotated ones by
/// timestamp and number, then the current file.
fn files(base: &Path) -> Vec<PathBuf> {
    let name = base.file_name().unwrap().to_string_lossy().into_owned();
    let mut rotated: Vec<(String, u64, PathBuf)> = Vec::new();
    let mut current = None;
    for entry in fs::read_dir(base.parent().unwrap()).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if file == name {
            current = Some(path);
        } else if let Some(rest) = file.strip_prefix(&format!("{name}.")) {
            let (stamp, n) = rest.split_once('.').expect("<timestamp>.<n>");
            assert_eq!(stamp.len(), 16, "a UTC timestamp such as 20261130T082231Z: {file}");
            rotated.push((stamp.to_owned(), n.parse().expect("a number"), path));
        }
    }
    rotated.sort();
    rotated.into_iter().map(|(_, _, p)| p).chain(current).collect()
}

/// Every line of every file of `base`, in order; panics on a partial line.
fn lines(base: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    for file in files(base) {
        let text = fs::read_to_string(&file).unwrap();
        assert!(text.is_empty() || text.ends_with('\n'), "a partial line in {file:?}");
        for line in text.lines() {
            out.push(serde_json::from_str(line).unwrap_or_else(|e| panic!("{file:?}: {e}: {line}")));
        }
    }
    out
}

fn expect_err(outcome: &PublishOutcome, kind: ErrorKind, text: &str) {
    match outcome {
        Ok(()) => panic!("reported written; expected a {kind} error mentioning {text:?}"),
        Err(e) => {
            assert_eq!(e.kind, kind, "{e}");
            assert!(e.message.contains(text), "{e} should mention {text:?}");
        }
    }
}

struct Harness {
    base: PathBuf,
    missing: PathBuf,
    read: Mutex<usize>,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route(&self.base)
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route(&self.missing))
    }
    async fn received(&self, n: usize, _timeout: Duration) -> Vec<ReceivedMessage> {
        // publish() returns after the sync, so everything is already there.
        let all = if self.base.exists() {
            lines(&self.base)
        } else {
            Vec::new()
        };
        let mut read = self.read.lock().unwrap();
        let new: Vec<ReceivedMessage> = all[*read..]
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
    let dir = tempfile::tempdir().unwrap();
    let harness = Harness {
        base: dir.path().join("events.jsonl"),
        missing: dir.path().join("no-such-dir").join("events.jsonl"),
        read: Mutex::new(0),
    };
    let sink = sink(64 * 1024);
    sink_suite::run(&sink, &harness).await;
    sink.close().await;
}

#[tokio::test]
async fn rotation_splits_files_between_lines_and_keeps_every_event_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("events.jsonl");
    let max = 4096;
    let sink = sink(max);
    let events: Vec<StoredEvent> = (0..600)
        .map(|seq| {
            let key = format!("k{}", seq % 7);
            // Varying sizes, so lines end at varying offsets.
            event(
                seq,
                "test.item.created",
                Some(&key),
                json!({ "seq": seq, "pad": "p".repeat((seq % 13) as usize * 20) }),
            )
        })
        .collect();
    for batch in events.chunks(45) {
        let outcomes = sink.publish(&route(&base), batch).await;
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    }
    let written = files(&base);
    assert!(written.len() >= 5, "only {} files", written.len());
    for file in &written {
        let size = fs::metadata(file).unwrap().len();
        assert!(size <= max, "{file:?} is {size} bytes, over {max}");
        assert!(size > 0, "{file:?} is empty");
    }
    let got: Vec<(String, i64)> = lines(&base)
        .iter()
        .map(|l| (l["id"].as_str().unwrap().to_owned(), l["data"]["seq"].as_i64().unwrap()))
        .collect();
    let want: Vec<(String, i64)> = events.iter().map(|e| (e.id.to_string(), e.seq)).collect();
    assert_eq!(got, want, "every event once, in order");
}

/// A file that cannot be written fails its own events, not the batch: the
/// other files' events are written, and a later event of a failed event's
/// key is held back, whichever file it goes to. Before, one missing or
/// blocked file of a templated route failed every event of every batch it
/// was in, on every retry, until unrelated keys went dead.
#[tokio::test]
async fn a_failing_file_fails_only_its_events_and_holds_back_their_keys() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("events.jsonl");
    let sink = sink(1024 * 1024);
    let first: Vec<StoredEvent> = (0..3)
        .map(|seq| event(seq, "test.item.created", Some("k"), json!({ "seq": seq })))
        .collect();
    assert!(sink.publish(&route(&base), &first).await.iter().all(Result::is_ok));

    // Permissions do not stop root; a directory where the file should be
    // does, and so does a directory that does not exist.
    let templated = route(&dir.path().join("{domain}.jsonl"));
    fs::create_dir(dir.path().join("blocked.jsonl")).unwrap();
    let by_directory = route(&dir.path().join("{domain}").join("events.jsonl"));
    fs::create_dir(dir.path().join("fine")).unwrap();
    // A directory in the way stays in the way on every retry: permanent.
    // A missing directory may yet be created: transient.
    for (route, blocked, kind, why) in [
        (
            &templated,
            dir.path().join("blocked.jsonl"),
            ErrorKind::Permanent,
            "retrying cannot help",
        ),
        (
            &by_directory,
            dir.path().join("blocked").join("events.jsonl"),
            ErrorKind::Transient,
            "not reported written",
        ),
    ] {
        let batch = vec![
            event(10, "fine.item.created", Some("a"), json!({ "seq": 10 })),
            event(11, "blocked.item.created", Some("b"), json!({ "seq": 11 })),
            event(12, "fine.item.created", Some("c"), json!({ "seq": 12 })),
            event(13, "fine.item.created", Some("b"), json!({ "seq": 13 })),
        ];
        let outcomes = sink.publish(route, &batch).await;
        assert_eq!(outcomes.len(), 4);
        assert_eq!(outcomes[0], Ok(()));
        expect_err(&outcomes[1], kind, &blocked.display().to_string());
        expect_err(&outcomes[1], kind, why);
        assert_eq!(outcomes[2], Ok(()));
        expect_err(&outcomes[3], ErrorKind::Transient, "held back");
        assert!(outcomes[3].as_ref().unwrap_err().held_back);
    }
    let err = sink.check(&route(&dir.path().join("blocked.jsonl"))).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains("is a directory"), "{err}");

    // Once the path is free again the failed event (requeued) and the one
    // held back behind it go through, in order.
    fs::remove_dir(dir.path().join("blocked.jsonl")).unwrap();
    let retried = vec![
        event(11, "blocked.item.created", Some("b"), json!({ "seq": 11 })),
        event(13, "fine.item.created", Some("b"), json!({ "seq": 13 })),
    ];
    assert!(sink.publish(&templated, &retried).await.iter().all(Result::is_ok));
    let fine: Vec<i64> = lines(&dir.path().join("fine.jsonl"))
        .iter()
        .map(|l| l["data"]["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(fine, [10, 12, 13]);
    let blocked = lines(&dir.path().join("blocked.jsonl"));
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0]["data"]["seq"], 11);
    assert_eq!(lines(&base).len(), 3, "the first file was untouched");
}

#[tokio::test]
async fn check_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let sink = sink(1024);
    sink.check(&route(&dir.path().join("events.jsonl")))
        .await
        .expect("a writable directory");
    sink.check(&route(&dir.path().join("{domain}.jsonl")))
        .await
        .expect("a template in the name");
    sink.check(&route(Path::new("relative-{domain}.jsonl")))
        .await
        .expect("the current directory");
    let missing = dir.path().join("nope");
    let err = sink.check(&route(&missing.join("events.jsonl"))).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(
        err.message.contains(&format!("{} does not exist", missing.display())),
        "{err}"
    );
    assert!(err.message.contains("routes[].destination"), "{err}");
    let leftovers: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
    assert!(leftovers.is_empty(), "check() left files behind: {leftovers:?}");
}

#[tokio::test]
async fn a_key_that_would_leave_the_directory_is_refused_and_holds_back_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let sink = sink(1024 * 1024);
    let templated = route(&dir.path().join("by-key-{key}.jsonl"));
    let batch = vec![
        event(0, "test.item.created", Some("../escape"), json!({ "seq": 0 })),
        event(1, "test.item.created", Some("../escape"), json!({ "seq": 1 })),
        event(2, "test.item.created", Some("fine"), json!({ "seq": 2 })),
    ];
    let outcomes = sink.publish(&templated, &batch).await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "adds a directory");
    expect_err(&outcomes[1], ErrorKind::Transient, "held back");
    assert_eq!(outcomes[2], Ok(()));
    assert_eq!(lines(&dir.path().join("by-key-fine.jsonl")).len(), 1);
    assert!(!dir.path().parent().unwrap().join("escape.jsonl").exists());
}

/// Parsing a JSON payload into a value and printing it again changed it:
/// big integers were rounded, `1.10` became `1.1`, keys were sorted and
/// duplicate keys collapsed. The line carries the payload's own bytes.
#[tokio::test]
async fn a_json_payload_is_written_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("events.jsonl");
    let sink = sink(1024 * 1024);
    let payload: &[u8] = br#"{"z":12345678901234567890123,"price":1.10,"a":[1e2,-0.0],"dup":1,"dup":2}"#;
    let mut compact = event(0, "test.item.created", Some("k"), json!(null));
    compact.payload = bytes::Bytes::from_static(payload);
    // Line breaks between tokens would split the line: they become spaces.
    let mut spread = event(1, "test.item.created", Some("k"), json!(null));
    spread.payload = bytes::Bytes::from_static(b"{\r\n  \"n\": 1.10,\n  \"s\": \"a\\nb\"\n}\n");
    // A raw line break inside a string is not JSON: it goes as base64.
    let mut broken = event(2, "test.item.created", Some("k"), json!(null));
    broken.payload = bytes::Bytes::from_static(b"{\"s\":\"a\nb\"}");
    // Nor is a lone surrogate escape, which a reader of the line refuses.
    let mut surrogate = event(3, "test.item.created", Some("k"), json!(null));
    surrogate.payload = bytes::Bytes::from_static(br#"{"s":"\ud800"}"#);
    let outcomes = sink.publish(&route(&base), &[compact, spread, broken, surrogate]).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let text = fs::read(&base).unwrap();
    let written: Vec<&[u8]> = text.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    assert_eq!(written.len(), 4, "{}", String::from_utf8_lossy(&text));
    let mut data = b",\"data\":".to_vec();
    data.extend_from_slice(payload);
    data.push(b'}');
    assert!(
        written[0].ends_with(&data),
        "the payload is not carried byte for byte: {}",
        String::from_utf8_lossy(written[0])
    );
    assert!(
        written[1].ends_with(b",\"data\":{    \"n\": 1.10,   \"s\": \"a\\nb\" } }"),
        "{}",
        String::from_utf8_lossy(written[1])
    );
    let all = lines(&base);
    assert_eq!(all[1]["data"]["s"], "a\nb");
    assert!(all[2].get("data").is_none());
    assert_eq!(all[2]["data_base64"], "eyJzIjoiYQpiIn0=");
    assert!(all[3].get("data").is_none(), "{}", all[3]);
    assert!(all[3]["data_base64"].is_string());
}

/// Two paths naming one directory (a symlink, `a/../a`) in one batch: the
/// second `flock` on it, from the same process, waited for ever, holding
/// the sink's lock, and every later batch with it.
#[test]
fn two_paths_to_one_directory_in_a_batch_do_not_wait_for_ever() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("a")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("a"), dir.path().join("b")).unwrap();
    let by_domain = route(&dir.path().join("{domain}").join("{key}.jsonl"));
    let (tx, rx) = std::sync::mpsc::channel();
    // Not a tokio test: a runtime waits for a hung blocking task as it
    // shuts down, so the test would hang instead of failing.
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let batch = [
            event(0, "a.item.created", Some("x"), json!({ "seq": 0 })),
            event(1, "b.item.created", Some("y"), json!({ "seq": 1 })),
        ];
        let sink = sink(1024 * 1024);
        let outcomes = runtime.block_on(sink.publish(&by_domain, &batch));
        let _ = tx.send(outcomes);
    });
    let outcomes = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the batch waited for ever on a directory it had locked itself");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(lines(&dir.path().join("a").join("x.jsonl")).len(), 1);
    assert_eq!(lines(&dir.path().join("a").join("y.jsonl")).len(), 1);
}

/// A path that no retry can write was retried until max_attempts, holding
/// its key back all along: it fails as permanent, naming the destination
/// and the fix. A name too long for the file system is refused before any
/// write, leaving room for the suffix rotation adds.
#[tokio::test]
async fn a_path_no_retry_can_write_is_permanent() {
    let dir = tempfile::tempdir().unwrap();
    let sink = sink(1024 * 1024);
    // A file where a directory of the path should be.
    fs::write(dir.path().join("order"), b"").unwrap();
    let by_directory = route(&dir.path().join("{domain}").join("events.jsonl"));
    let outcomes = sink
        .publish(
            &by_directory,
            &[event(0, "order.item.created", Some("k"), json!({ "seq": 0 }))],
        )
        .await;
    expect_err(&outcomes[0], ErrorKind::Permanent, "retrying cannot help");
    expect_err(&outcomes[0], ErrorKind::Permanent, "a file is where a directory");
    expect_err(&outcomes[0], ErrorKind::Permanent, &by_directory.destination);

    let by_key = route(&dir.path().join("{key}.jsonl"));
    for len in [250, 240] {
        let key = "k".repeat(len);
        let long = event(1, "test.item.created", Some(&key), json!({ "seq": 1 }));
        let err = sink.admit(&by_key, &long).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
        assert!(err.message.contains("a file system takes"), "{err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
        assert!(err.message.contains(&format!("the event's key is \"{key}\"")), "{err}");
        let outcomes = sink.publish(&by_key, &[long]).await;
        expect_err(&outcomes[0], ErrorKind::Permanent, "a file system takes");
    }
    let fits = "k".repeat(200);
    let outcomes = sink
        .publish(
            &by_key,
            &[event(2, "test.item.created", Some(&fits), json!({ "seq": 2 }))],
        )
        .await;
    assert_eq!(outcomes[0], Ok(()));
}

/// `/var/f/{key}/x.jsonl` with no key, or the key ".", is `/var/f/x.jsonl`:
/// the event landed a level up, among other routes' files.
#[tokio::test]
async fn a_key_that_would_drop_a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sink = sink(1024 * 1024);
    let by_key = route(&dir.path().join("{key}").join("x.jsonl"));
    // A literal `..` in the template does not let the key add one.
    let up_and_back = route(&dir.path().join("sub").join("..").join("{key}").join("x.jsonl"));
    fs::create_dir(dir.path().join("sub")).unwrap();
    for (route, key, says) in [
        (&by_key, None, "the event has no key"),
        (&by_key, Some(""), "the event's key is \"\""),
        (&by_key, Some("."), "the event's key is \".\""),
        (&by_key, Some(".."), "the event's key is \"..\""),
        (&up_and_back, Some(".."), "the event's key is \"..\""),
    ] {
        let outcomes = sink
            .publish(route, &[event(0, "test.item.created", key, json!({ "seq": 0 }))])
            .await;
        expect_err(&outcomes[0], ErrorKind::Permanent, says);
        expect_err(&outcomes[0], ErrorKind::Permanent, "routes[].destination");
    }
    let stray: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "sub")
        .collect();
    assert!(stray.is_empty(), "written outside a key's directory: {stray:?}");
    assert!(!dir.path().parent().unwrap().join("x.jsonl").exists());
}

/// `check` only tried making a new file in the directory; the writer opens
/// the file that is there, to read and append. One the relay may not open
/// (another user's, read-only) passed the check, then failed every event,
/// retried until dead. It is a configuration error naming the file.
#[tokio::test]
async fn check_refuses_a_file_that_is_there_but_cannot_be_opened() {
    let dir = tempfile::tempdir().unwrap();
    let sink = sink(1024);
    let expect_refused = |err: ferry_core::SinkError, path: &Path| {
        assert_eq!(err.kind, ErrorKind::Config, "{err}");
        let says = format!("the file {} is there but cannot be opened", path.display());
        assert!(err.message.contains(&says), "{err}");
        assert!(err.message.contains("read and write access"), "{err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
    };
    // Not a file at all: no user, root included, opens a socket.
    let socket = dir.path().join("socket.jsonl");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    expect_refused(sink.check(&route(&socket)).await.unwrap_err(), &socket);
    let existing = dir.path().join("existing.jsonl");
    fs::write(&existing, b"{}\n").unwrap();
    sink.check(&route(&existing))
        .await
        .expect("a file the relay may append to");

    use std::os::unix::fs::PermissionsExt;
    let read_only = dir.path().join("read-only.jsonl");
    fs::write(&read_only, b"{}\n").unwrap();
    fs::set_permissions(&read_only, fs::Permissions::from_mode(0o444)).unwrap();
    if fs::OpenOptions::new().append(true).open(&read_only).is_ok() {
        eprintln!("part skipped: running as root, a read-only file opens anyway");
        return;
    }
    expect_refused(sink.check(&route(&read_only)).await.unwrap_err(), &read_only);
}
