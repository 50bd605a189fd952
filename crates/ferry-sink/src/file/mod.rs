//! The file sink: one JSON line per event appended to a file, synced to disk
//! before a batch is reported published, rotated by size.
//!
//! The line format is the stdout sink's: `{"id", "type", "key", "time",
//! "source", "route", "destination", "content_type", "headers", "data" |
//! "data_base64"}`, where `destination` is the rendered file path.
//!
//! ```no_run
//! use ferry_sink::file::{FileOptions, FileSink};
//!
//! let sink = FileSink::new(FileOptions {
//!     max_file_bytes: 10 * 1024 * 1024,
//! })?;
//! # Ok::<(), ferry_core::SinkError>(())
//! ```

mod lock;
mod rotate;
mod synced;
mod writer;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent, render_template};

use ferry_core::prepare_in_key_order;
use writer::{Line, Unwritten, Writer};

/// How a [`FileSink`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileOptions {
    /// A file is rotated before a line would take it past this size: it is
    /// renamed to `<name>.<UTC timestamp>.<n>` (e.g.
    /// `events.jsonl.20261130T082231Z.1`, `n` counting from 1 within the
    /// second) and a new file is started. A line is never split; an event
    /// whose line alone exceeds the limit is refused (permanent).
    /// Default 100 MiB.
    pub max_file_bytes: u64,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self {
            max_file_bytes: 100 * 1024 * 1024,
        }
    }
}

/// Appends events as JSON lines to the route's destination path (a template
/// such as `/var/log/ferry/{domain}.jsonl` is allowed).
///
/// A batch is written in order and each file it touched is synced
/// (`sync_data`, plus the directory when a file was created or rotated, or
/// is written by this sink for the first time) before its events are
/// reported published. Each file of a batch succeeds or fails alone: if a
/// write or a sync of one fails (a templated path whose directory is
/// missing, a full disk), that file is cut back to its length before the
/// batch and its events fail (transient), while the other files' events
/// are written. A path that no retry can write (a name too long, a
/// directory where the file should be, a file where a directory should be)
/// fails its events as permanent. Later events of a failed event's key are
/// held back; one already written to another file fails too, so its key is
/// retried in order. Lines in a file rotated away during the batch stay, so a retried
/// event can appear twice. Readers drop duplicates by `id`.
///
/// Several sinks, in this process or in other relays, may write one file: a
/// batch holds a `flock` on the directory of each file it writes until the
/// batch is synced or cut back. A batch waits for that lock at most 10 s:
/// held longer (a relay paused or stuck while it holds it), the batch's
/// events of that directory fail (transient), naming the directory.
pub struct FileSink {
    options: FileOptions,
    /// One batch at a time, so concurrent batches never interleave a file.
    /// Waited for asynchronously: batches behind one stuck in the writer
    /// (a hung disk) must not each hold a blocking-pool thread.
    writer: Arc<tokio::sync::Mutex<Writer>>,
}

impl FileSink {
    pub fn new(options: FileOptions) -> Result<Self, SinkError> {
        if options.max_file_bytes == 0 {
            return Err(SinkError::config(
                "max_file_bytes is 0; give a size such as 104857600 (100 MiB)",
            ));
        }
        Ok(Self {
            options,
            writer: Arc::new(tokio::sync::Mutex::new(Writer::new(lock::LOCK_WAIT))),
        })
    }

    /// The same sink, waiting `wait` for another writer's directory lock.
    #[cfg(test)]
    fn with_lock_wait(mut self, wait: std::time::Duration) -> Self {
        self.writer = Arc::new(tokio::sync::Mutex::new(Writer::new(wait)));
        self
    }

    pub fn options(&self) -> &FileOptions {
        &self.options
    }

    fn prepare(&self, route: &Route, event: &StoredEvent) -> Result<(PathBuf, Vec<u8>), SinkError> {
        let path = destination_path(route, event)?;
        let line = crate::line::render(route, event, &path.to_string_lossy());
        if line.len() as u64 > self.options.max_file_bytes {
            return Err(SinkError::permanent(format!(
                "the event's line is {} bytes, more than a whole file may hold ({} bytes, \
                 sinks.{}.max_file_bytes)",
                line.len(),
                self.options.max_file_bytes,
                route.sink
            )));
        }
        Ok((path, line))
    }
}

impl std::fmt::Debug for FileSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSink").field("options", &self.options).finish()
    }
}

/// The longest file or directory name most file systems take (`NAME_MAX`).
const MAX_NAME_BYTES: usize = 255;
/// The longest path Linux opens (`PATH_MAX`, less its NUL).
const MAX_PATH_BYTES: usize = 4095;
/// What rotation adds to a file's name: `.<UTC timestamp>.<n>`, with room
/// for `n` up to six digits.
const ROTATION_SUFFIX_BYTES: usize = ".20261130T082231Z.".len() + 6;

/// Renders the destination. A value substituted into a template may not add
/// path separators or `..`, so an event's key cannot write outside the
/// directory the operator chose; nor may it make a name of the path empty,
/// `.` or `..`, which would drop a level of it (`/var/f/{key}/x.jsonl` with
/// no key is `/var/f/x.jsonl`), nor too long for the file system.
fn destination_path(route: &Route, event: &StoredEvent) -> Result<PathBuf, SinkError> {
    let template = &route.destination;
    let rendered = render_template(template, event);
    let last = rendered.rsplit('/').next().unwrap_or_default();
    let problem = if matches!(last, "" | "." | "..") {
        Some("does not name a file".to_owned())
    } else if rendered.contains('\0') {
        Some("contains a NUL byte".to_owned())
    } else if rendered.matches('/').count() != template.matches('/').count() {
        Some("has a template value that adds a directory (a \"/\" in the event's type or key)".to_owned())
    } else if let Some(name) = template
        .split('/')
        .zip(rendered.split('/'))
        .find(|(t, r)| t != r && matches!(*r, "" | "." | ".."))
        .map(|(_, r)| r)
    {
        Some(if name.is_empty() {
            "has a template value that renders as an empty name, which would drop a directory of the path".to_owned()
        } else {
            format!("has a template value that renders as the name {name:?}, which would change the directory")
        })
    } else if let Some(name) = rendered.split('/').find(|name| name.len() > MAX_NAME_BYTES) {
        Some(format!(
            "has a name of {} bytes, more than the {MAX_NAME_BYTES} a file system takes",
            name.len()
        ))
    } else if last.len() > MAX_NAME_BYTES - ROTATION_SUFFIX_BYTES {
        Some(format!(
            "has a file name of {} bytes: with the {ROTATION_SUFFIX_BYTES} bytes rotation adds, more than the \
             {MAX_NAME_BYTES} a file system takes",
            last.len()
        ))
    } else if rendered.len() > MAX_PATH_BYTES {
        Some(format!(
            "is {} bytes, more than the {MAX_PATH_BYTES} a path may have",
            rendered.len()
        ))
    } else {
        None
    };
    let Some(problem) = problem else {
        return Ok(PathBuf::from(rendered));
    };
    if template.contains('{') {
        let key = event.key.as_deref().map_or_else(
            || "the event has no key".to_owned(),
            |key| format!("the event's key is {key:?}"),
        );
        Err(SinkError::permanent(format!(
            "route {:?}: the file path {rendered:?} {problem} ({key}); fix routes[].destination {template:?}",
            route.name
        )))
    } else {
        Err(SinkError::config(format!(
            "route {:?}: the file path {rendered:?} {problem}; fix routes[].destination",
            route.name
        )))
    }
}

#[async_trait]
impl Sink for FileSink {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        self.prepare(route, event).map(drop)
    }

    /// `publish` prepares the batch in key order before it sends any of it.
    fn admits_in_publish(&self) -> bool {
        true
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let prepared = prepare_in_key_order(events, |event| self.prepare(route, event));
        // The events prepared, by index, with their lines.
        let mut sent: Vec<usize> = Vec::with_capacity(prepared.len());
        let mut lines: Vec<(PathBuf, Vec<u8>, Option<String>)> = Vec::with_capacity(prepared.len());
        let mut outcomes: Vec<PublishOutcome> = Vec::with_capacity(events.len());
        for (i, p) in prepared.into_iter().enumerate() {
            match p {
                Ok((path, line)) => {
                    sent.push(i);
                    lines.push((path, line, events[i].key.clone()));
                    outcomes.push(Ok(()));
                }
                Err(e) => outcomes.push(Err(e)),
            }
        }
        if lines.is_empty() {
            return outcomes;
        }
        let mut state = Arc::clone(&self.writer).lock_owned().await;
        let max = self.options.max_file_bytes;
        // A slow disk must stall a blocking-pool thread, not the runtime.
        // The batch holds the sink's lock until the thread is done, even
        // if the relay stops waiting for it.
        let task = tokio::task::spawn_blocking(move || {
            let refs: Vec<Line<'_>> = lines
                .iter()
                .map(|(path, bytes, key)| Line {
                    path,
                    bytes,
                    key: key.as_deref(),
                })
                .collect();
            writer::write_lines(&refs, max, chrono::Utc::now(), &mut state)
        });
        let written = match task.await {
            Ok(written) => written,
            Err(e) => vec![Err(Unwritten::Failed(format!("the file writer task failed: {e}"))); sent.len()],
        };
        for (&i, result) in sent.iter().zip(written) {
            outcomes[i] = result.map_err(|why| match why {
                Unwritten::Failed(message) => {
                    SinkError::transient(format!("{message}; the event is not reported written"))
                }
                Unwritten::Refused(message) => SinkError::permanent(format!(
                    "{message}; retrying cannot help: fix routes[].destination {:?} of route {:?} (or \
                     move what is in the way), then requeue the event",
                    route.destination, route.name
                )),
                Unwritten::HeldBack(first) => SinkError::held_back_behind(&events[sent[first]]),
                Unwritten::Behind(first) => SinkError::transient(format!(
                    "written, but event {} of its key, earlier in this batch, failed in another file: it is \
                     written again after that one (readers drop duplicates by id)",
                    events[sent[first]].id
                )),
            });
        }
        outcomes
    }

    /// The destination's directory exists and a file can be created in it,
    /// and the file, if it is there, opens as the writer opens it (to read
    /// and append). A template whose directory depends on the event is not
    /// checked, nor is a templated file name.
    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        let path = PathBuf::from(&route.destination);
        let dir = writer::parent(&path).to_owned();
        if dir.to_string_lossy().contains('{') {
            return Ok(());
        }
        let name = route.name.clone();
        let static_path = (!route.destination.contains('{')).then_some(path);
        tokio::task::spawn_blocking(move || check_dir(&name, &dir, static_path.as_deref()))
            .await
            .unwrap_or_else(|e| Err(SinkError::transient(format!("the file check task failed: {e}"))))
    }
}

fn check_dir(route: &str, dir: &Path, path: Option<&Path>) -> Result<(), SinkError> {
    let fix = "create it or fix routes[].destination";
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(SinkError::config(format!(
                "route {route:?}: {} is not a directory; {fix}",
                dir.display()
            )));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SinkError::config(format!(
                "route {route:?}: the directory {} does not exist; {fix}",
                dir.display()
            )));
        }
        Err(e) => return Err(io_error(route, dir, "cannot be read", &e)),
    }
    if let Some(path) = path
        && path.is_dir()
    {
        return Err(SinkError::config(format!(
            "route {route:?}: {} is a directory, not a file; {fix}",
            path.display()
        )));
    }
    // Permissions alone do not tell (root, ACLs, read-only mounts): try it.
    let probe = dir.join(format!(".ferry-check-{}-{}", std::process::id(), uuid_like()));
    let created = std::fs::OpenOptions::new().write(true).create_new(true).open(&probe);
    match created {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
        }
        Err(e) => return Err(io_error(route, dir, "is not writable", &e)),
    }
    // A file that is there but that the relay may not open (made by
    // another user, or read-only) fails every event, retried until dead.
    let Some(path) = path else { return Ok(()) };
    match writer::options().open(path) {
        Ok(_) => Ok(()),
        // Gone since: the writer makes it, as the probe showed it can.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            let message = format!(
                "route {route:?}: the file {} is there but cannot be opened to read and append ({e}); give the \
                 relay's user read and write access to it (chown or chmod), move it away, or fix \
                 routes[].destination",
                path.display()
            );
            // ENXIO: a socket, or a device with nothing behind it.
            if e.kind() == io::ErrorKind::PermissionDenied || matches!(e.raw_os_error(), Some(6 | 30)) {
                Err(SinkError::config(message))
            } else {
                Err(SinkError::transient(message))
            }
        }
    }
}

fn io_error(route: &str, dir: &Path, what: &str, e: &io::Error) -> SinkError {
    let message = format!(
        "route {route:?}: the directory {} {what} ({e}); fix its permissions or routes[].destination",
        dir.display()
    );
    if e.kind() == io::ErrorKind::PermissionDenied || e.raw_os_error() == Some(30) {
        SinkError::config(message)
    } else {
        SinkError::transient(message)
    }
}

/// A name unlikely to collide with a concurrent check's probe.
fn uuid_like() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{ErrorKind, EventId, Glob};

    fn route(destination: &str) -> Route {
        Route {
            name: "audit".into(),
            matcher: Glob::new("**").unwrap(),
            sink: "files".into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    fn event(key: &str) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq: 1,
            event_type: "order.item.created".into(),
            key: Some(key.into()),
            payload: bytes::Bytes::from_static(b"{}"),
            content_type: "application/json".into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn templates_cannot_escape_their_directory() {
        let ok = destination_path(&route("/var/ferry/{domain}-{key}.jsonl"), &event("o-1")).unwrap();
        assert_eq!(ok, PathBuf::from("/var/ferry/order-o-1.jsonl"));
        assert!(destination_path(&route("../out/x.jsonl"), &event("k")).is_ok());
        for key in ["../../etc/passwd", "a/b", "..", "."] {
            let err = destination_path(&route("/var/ferry/{key}"), &event(key)).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Permanent, "{key}");
            assert!(err.message.contains("routes[].destination"), "{}", err.message);
        }
        let err = destination_path(&route("/var/ferry/"), &event("k")).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
    }

    /// A relay paused while it held the directory's lock (SIGSTOP, a
    /// debugger): the batch waited on `flock` for ever. It fails, transient,
    /// naming the directory, and the next batch goes through once the lock
    /// is let go.
    #[test]
    fn a_directory_lock_held_elsewhere_fails_the_batch_transiently() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let peer = std::fs::File::open(dir.path()).unwrap();
        peer.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let route = route(&path.to_string_lossy());
        // Not a tokio test: a runtime waits for a hung blocking task as it
        // shuts down, so the test would hang instead of failing.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let sink = FileSink::new(FileOptions::default())
                .unwrap()
                .with_lock_wait(std::time::Duration::from_millis(300));
            let first = runtime.block_on(sink.publish(&route, &[event("k")]));
            let _ = tx.send(first);
            // The second once the peer let go.
            let _ = tx.send(runtime.block_on(sink.publish(&route, &[event("k")])));
        });
        let outcomes = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the batch waited for the lock without a limit");
        let err = outcomes[0].as_ref().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(
            err.message
                .contains(&format!("holds the lock on {}", dir.path().display())),
            "{err}"
        );
        assert!(!path.exists(), "nothing written");
        drop(peer);
        let outcomes = rx.recv_timeout(std::time::Duration::from_secs(20)).unwrap();
        assert_eq!(outcomes, [Ok(())]);
    }

    /// Batches behind one stuck in the writer each parked a blocking-pool
    /// thread on the sink's lock until the pool was full: nothing else that
    /// needs one (the runtime's file and DNS work, other sinks) ran.
    #[test]
    fn batches_behind_a_stuck_one_hold_no_blocking_thread() {
        let dir = tempfile::tempdir().unwrap();
        let route = route(&dir.path().join("events.jsonl").to_string_lossy());
        let peer = std::fs::File::open(dir.path()).unwrap();
        peer.lock().unwrap();
        let sink = FileSink::new(FileOptions::default())
            .unwrap()
            .with_lock_wait(std::time::Duration::from_secs(120));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let events: Vec<StoredEvent> = (0..4).map(|i| event(&format!("k{i}"))).collect();
        let (free, outcomes) = runtime.block_on(async {
            let mut batches: Vec<_> = events
                .iter()
                .map(|e| Box::pin(sink.publish(&route, std::slice::from_ref(e))))
                .collect();
            // Each goes as far as it can: the first to the directory's lock.
            for batch in &mut batches {
                assert!(futures::poll!(batch.as_mut()).is_pending());
            }
            let probe = tokio::task::spawn_blocking(|| ());
            let free = tokio::time::timeout(std::time::Duration::from_secs(10), probe)
                .await
                .is_ok();
            drop(peer);
            (free, futures::future::join_all(batches).await)
        });
        assert!(
            free,
            "the blocking pool was full of batches waiting behind the stuck one"
        );
        for outcome in outcomes {
            assert_eq!(outcome, [Ok(())]);
        }
    }

    #[test]
    fn options_and_line_limits() {
        assert_eq!(
            FileSink::new(FileOptions { max_file_bytes: 0 }).unwrap_err().kind,
            ErrorKind::Config
        );
        let sink = FileSink::new(FileOptions { max_file_bytes: 50 }).unwrap();
        let err = sink.admit(&route("/tmp/x"), &event("k")).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("sinks.files.max_file_bytes"), "{}", err.message);
        assert!(
            FileSink::new(FileOptions::default())
                .unwrap()
                .admit(&route("/tmp/x"), &event("k"))
                .is_ok()
        );
    }
}
