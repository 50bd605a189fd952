//! Retention: deleting settled events once their window has passed, in small
//! batches, optionally archiving each batch first.
//!
//! A store implements [`Retention`]: it finds expired events in outbox order
//! and hands them over as an [`ExpiredBatch`], read without holding a lock.
//! [`purge`] drives any such store the same way: take a batch, read it whole
//! and archive it and make the archive durable (when archiving), then delete
//! what of it is still due and unchanged, then pause so the relay always gets
//! the database back quickly. No lock is held while the archive is written,
//! so a slow archive disk never keeps an operator's command or another run
//! waiting.
//!
//! An event goes only when every one of its deliveries is settled: published
//! before the published window, or dead or cancelled before the (longer)
//! settled window. Its deliveries, failure history and the operators'
//! requeues and cancellations of it go with it (into the archive, when
//! there is one). A published delivery deleted while an older delivery of its
//! key is kept leaves an order mark (`purged_order`), so that requeueing
//! that older one is still refused as out of order.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use chrono::{DateTime, Utc};
use ferry_core::StoreError;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use uuid::Uuid;

/// When events may go, and how much goes at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionRules {
    /// An event whose deliveries are all published goes this long after its
    /// last publish.
    pub published: Duration,
    /// An event with a dead or cancelled delivery goes this long after that
    /// delivery settled; `None` keeps it until an operator acts.
    pub settled: Option<Duration>,
    /// Events per batch: one short transaction each. A batch being archived
    /// also stops at [`ARCHIVE_BATCH_BYTES`] of payload.
    pub batch_size: usize,
    /// Rest between batches, so the relay's own statements never queue
    /// behind a long run of deletes.
    pub pause: Duration,
}

impl RetentionRules {
    /// Deliveries published before this may go.
    pub fn published_cutoff(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        now - chrono::Duration::from_std(self.published).unwrap_or(chrono::Duration::MAX)
    }

    /// Dead or cancelled deliveries settled before this may go.
    pub fn settled_cutoff(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.settled
            .map(|d| now - chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX))
    }
}

/// A batch being archived reads its events' payloads into memory: it stops
/// once they add up to this many bytes (64 MiB), whatever the batch size,
/// though it always takes at least one event.
pub const ARCHIVE_BATCH_BYTES: u64 = 64 * 1024 * 1024;

/// An event as it is archived: everything needed to inspect or replay it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchivedEvent {
    /// Outbox position, for ordering archived events.
    pub seq: i64,
    pub id: Uuid,
    #[serde(rename = "type")]
    pub event_type: String,
    pub key: Option<String>,
    pub content_type: String,
    pub headers: serde_json::Value,
    /// The payload as JSON when it is JSON, otherwise absent (see
    /// `payload_base64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
    /// Any payload that is not JSON, base64-encoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    pub dispatch_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub deliveries: Vec<ArchivedDelivery>,
}

impl ArchivedEvent {
    /// Sets `payload` or `payload_base64`, whichever keeps the bytes exactly.
    pub fn set_payload(&mut self, bytes: &[u8]) {
        let json = self.content_type.contains("json");
        match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(v) if json && serde_json::to_vec(&v).is_ok_and(|b| b == bytes) => self.payload = Some(v),
            _ => self.payload_base64 = Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
        }
    }

    /// The payload bytes, from whichever field holds them.
    pub fn payload_bytes(&self) -> Option<Vec<u8>> {
        match (&self.payload, &self.payload_base64) {
            (Some(v), _) => serde_json::to_vec(v).ok(),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).ok(),
            (None, None) => None,
        }
    }
}

/// One route's delivery of an archived event, with its failed attempts and
/// what operators did to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchivedDelivery {
    pub route: String,
    pub state: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub published_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
    pub failures: Vec<ArchivedFailure>,
    /// Requeues and cancellations, oldest first, as `ferry show` lists
    /// them. Absent from archives written before they were kept.
    #[serde(default)]
    pub actions: Vec<ArchivedAction>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchivedFailure {
    pub attempt: i32,
    pub at: DateTime<Utc>,
    pub dead: bool,
    pub error: String,
}

/// An operator's requeue or cancel of an archived delivery.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchivedAction {
    pub at: DateTime<Utc>,
    pub actor: String,
    /// `requeue` or `cancel`.
    pub action: String,
    /// The delivery's state and attempt count before the action.
    pub from_state: String,
    pub attempts: i32,
    /// A cancellation's reason.
    pub reason: Option<String>,
}

/// A store's side of retention.
///
/// ```no_run
/// # async fn demo(store: &ferry_store::postgres::PgStore) -> Result<(), ferry_store::PurgeError> {
/// use std::time::Duration;
/// use ferry_store::{PurgeOptions, RetentionRules, purge};
/// let rules = RetentionRules {
///     published: Duration::from_secs(7 * 86_400),
///     settled: Some(Duration::from_secs(30 * 86_400)),
///     batch_size: 1_000,
///     pause: Duration::from_millis(50),
/// };
/// let report = purge(store, &rules, &PurgeOptions::default(), chrono::Utc::now()).await?;
/// println!("deleted {} events", report.events);
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Retention: Send + Sync {
    /// The first and last outbox positions stored now; `None` when empty.
    /// A run walks this range once, so events committed during the run wait
    /// for the next one.
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, StoreError>;

    /// Up to `rules.batch_size` expired events after position `after` and
    /// not past `upto`, in outbox order, read without their payloads and
    /// deliveries and without taking a lock. Scans a bounded stretch from
    /// the first stored event after `after` (seqs may leave wide gaps), so
    /// a batch may be empty before the range is done: continue from
    /// [`ExpiredBatch::scanned_to`].
    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, StoreError>;
}

/// Expired events, read without a lock; dropping the batch deletes nothing.
#[async_trait]
pub trait ExpiredBatch: Send {
    /// The events, without payloads or deliveries until
    /// [`read_whole`](ExpiredBatch::read_whole).
    fn events(&self) -> &[ArchivedEvent];
    /// Where the next batch starts; at or past `upto` the run is done.
    fn scanned_to(&self) -> i64;
    /// Reads the events whole, as the archive keeps them (payloads, and
    /// deliveries with their failures and operators' actions), only the
    /// longest run of them whose payloads add up to at most
    /// `max_payload_bytes` (always at least one): the rest is left for the
    /// next batch, and [`scanned_to`](ExpiredBatch::scanned_to) moves back
    /// to the last event kept. Events no longer due leave the batch.
    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), StoreError>;
    /// Deletes [`events`](ExpiredBatch::events) that are still due, with
    /// their deliveries, failures and operators' actions, and commits. The
    /// batch was read without a lock: if any of its events was requeued,
    /// retried, or deleted by another run since it was read (or its rows
    /// stay locked by someone else), nothing of the batch is deleted and
    /// the delete says so ([`Deleted::changed`]), so that the archive,
    /// written before the delete, can be cut back to what was deleted.
    /// Returns what was deleted.
    async fn delete(self: Box<Self>) -> Result<Deleted, DeleteFailed>;
}

/// What one [`ExpiredBatch::delete`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub events: u64,
    pub deliveries: u64,
    /// The batch changed since it was read (an event requeued, a delivery
    /// retried, deleted by another run) or its rows were locked: nothing was
    /// deleted, and a later run takes what is still due.
    pub changed: bool,
}

/// A delete that failed, and whether its rows may be gone all the same.
#[derive(Debug)]
pub struct DeleteFailed {
    pub source: StoreError,
    /// The commit was sent and no answer came back (the connection broke):
    /// the database may have committed it.
    pub maybe_deleted: bool,
}

impl DeleteFailed {
    /// Failed before the commit was sent: nothing was deleted.
    pub fn before_commit(source: StoreError) -> Self {
        Self {
            source,
            maybe_deleted: false,
        }
    }

    /// The commit failed. The database answering with an error means it
    /// rolled back; any other failure leaves the outcome unknown.
    pub fn at_commit(e: sqlx::Error, classify: impl FnOnce(sqlx::Error) -> StoreError) -> Self {
        Self {
            maybe_deleted: e.as_database_error().is_none(),
            source: classify(e),
        }
    }
}

/// How [`purge`] runs.
#[derive(Debug, Clone, Default)]
pub struct PurgeOptions {
    /// Count what would go; delete and archive nothing.
    pub dry_run: bool,
    /// Write each batch here before deleting it.
    pub archive_dir: Option<PathBuf>,
    /// Set to `true` to stop after the current batch.
    pub stop: Option<watch::Receiver<bool>>,
}

/// What one run did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PurgeReport {
    pub dry_run: bool,
    /// Events deleted (dry: that would be).
    pub events: u64,
    /// Deliveries deleted with them (dry: not counted).
    pub deliveries: u64,
    pub batches: u64,
    /// Events written to the archive.
    pub archived: u64,
    /// The archive file of this run, if anything was archived.
    pub archive_file: Option<PathBuf>,
}

/// Why a run stopped early. What was done before is in `done`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PurgeError {
    #[error("retention: {source}")]
    Store { source: StoreError, done: PurgeReport },
    /// Nothing of the batch being archived was deleted.
    #[error("retention: cannot write the archive {}: {source}; nothing more was deleted", path.display())]
    Archive {
        path: PathBuf,
        source: std::io::Error,
        done: PurgeReport,
    },
}

impl PurgeError {
    /// What the run did before it stopped.
    pub fn done(&self) -> &PurgeReport {
        match self {
            PurgeError::Store { done, .. } | PurgeError::Archive { done, .. } => done,
        }
    }
}

/// Runs retention once over the events stored now: batch by batch, archive
/// (when configured) and make it durable, then delete.
pub async fn purge<R: Retention + ?Sized>(
    store: &R,
    rules: &RetentionRules,
    options: &PurgeOptions,
    now: DateTime<Utc>,
) -> Result<PurgeReport, PurgeError> {
    let mut report = PurgeReport {
        dry_run: options.dry_run,
        ..PurgeReport::default()
    };
    let range = store.retention_range().await;
    let Some((first, last)) = range.map_err(|source| PurgeError::Store {
        source,
        done: report.clone(),
    })?
    else {
        return Ok(report);
    };
    let mut archive: Option<ArchiveFile> = None;
    let mut after = first - 1;
    while after < last {
        if options.stop.as_ref().is_some_and(|s| *s.borrow()) {
            break;
        }
        let mut batch = match store.take_expired(rules, after, last, now).await {
            Ok(b) => b,
            Err(source) => return Err(PurgeError::Store { source, done: report }),
        };
        // Payloads are read only to be archived, and then only so many.
        let archiving = options.archive_dir.is_some() && !options.dry_run;
        if archiving
            && !batch.events().is_empty()
            && let Err(source) = batch.read_whole(ARCHIVE_BATCH_BYTES).await
        {
            return Err(PurgeError::Store { source, done: report });
        }
        after = batch.scanned_to().max(after + 1);
        let events = batch.events().len() as u64;
        if events == 0 {
            continue;
        }
        report.batches += 1;
        if options.dry_run {
            report.events += events;
            drop(batch);
            continue;
        }
        let mut undo = None;
        if let Some(dir) = &options.archive_dir {
            // A failed write drops the batch: nothing of it is deleted.
            match append_archive(&mut archive, dir, batch, now).await {
                Ok((b, previous_len)) => {
                    batch = b;
                    undo = Some(previous_len);
                }
                Err((path, source)) => {
                    return Err(PurgeError::Archive {
                        path,
                        source,
                        done: report,
                    });
                }
            }
        }
        match batch.delete().await {
            Ok(deleted) if deleted.changed => {
                // Nothing was deleted: the batch comes out of the archive
                // again, which holds exactly what is gone.
                if let (Some(len), Some(mut a)) = (undo, archive.take()) {
                    let path = a.path.clone();
                    // A file this batch began is removed rather than left
                    // empty.
                    let cut = tokio::task::spawn_blocking(move || {
                        if len == 0 {
                            std::fs::remove_file(&a.path).map(|()| None)
                        } else {
                            a.cut_back(len).map(|()| Some(a))
                        }
                    })
                    .await;
                    match cut {
                        Ok(Ok(a)) => archive = a,
                        Ok(Err(source)) => {
                            return Err(PurgeError::Archive {
                                path,
                                source,
                                done: report,
                            });
                        }
                        Err(e) => {
                            return Err(PurgeError::Archive {
                                path,
                                source: std::io::Error::other(e),
                                done: report,
                            });
                        }
                    }
                }
            }
            Ok(deleted) => {
                report.events += deleted.events;
                report.deliveries += deleted.deliveries;
                if undo.is_some() {
                    report.archived += events;
                    report.archive_file = archive.as_ref().map(|a| a.path.clone());
                }
            }
            Err(DeleteFailed { source, maybe_deleted }) => {
                // Take the batch back out of the archive so it holds exactly
                // what was deleted, but only when nothing was: a commit whose
                // answer was lost may have deleted the batch, and then the
                // archive is the only copy left. Kept, or if cutting fails,
                // the events still in the table appear again in a later
                // archive: twice, never missing.
                if let (Some(len), Some(a), false) = (undo, archive.take(), maybe_deleted) {
                    let _ = tokio::task::spawn_blocking(move || a.truncate(len)).await;
                }
                return Err(PurgeError::Store { source, done: report });
            }
        }
        if !rules.pause.is_zero() {
            pause(rules.pause, options.stop.clone()).await;
        }
    }
    Ok(report)
}

async fn pause(d: Duration, stop: Option<watch::Receiver<bool>>) {
    match stop {
        Some(mut stop) => {
            tokio::select! {
                _ = tokio::time::sleep(d) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
        }
        None => tokio::time::sleep(d).await,
    }
}

/// Appends the batch's events to this run's archive file (created on first
/// use) and makes them durable, compressing and writing on a blocking
/// thread, never on the runtime's. Returns the batch and the file's length
/// before, to undo with.
async fn append_archive(
    archive: &mut Option<ArchiveFile>,
    dir: &Path,
    batch: Box<dyn ExpiredBatch>,
    now: DateTime<Utc>,
) -> Result<(Box<dyn ExpiredBatch>, u64), (PathBuf, std::io::Error)> {
    let path = match archive {
        Some(a) => a.path.clone(),
        None => dir.join(format!("ferry-{}.jsonl.gz", now.format("%Y%m%dT%H%M%S%.9fZ"))),
    };
    let file = archive.take();
    let dir = dir.to_owned();
    let task_path = path.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let member = gzip_lines(batch.events())?;
        let mut file = match file {
            Some(f) => f,
            None => ArchiveFile::create(&dir, task_path)?,
        };
        let before = file.append(&member)?;
        Ok::<_, std::io::Error>((file, batch, before))
    })
    .await
    .map_err(|e| (path.clone(), std::io::Error::other(e)))?;
    let (file, batch, before) = joined.map_err(|e| (path, e))?;
    *archive = Some(file);
    Ok((batch, before))
}

/// One gzip member of JSON lines. Members concatenate into a valid gzip
/// file, so each batch is appended whole, and `zcat` or a multi-member
/// decoder reads them all.
fn gzip_lines(events: &[ArchivedEvent]) -> std::io::Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    for e in events {
        serde_json::to_writer(&mut gz, e)?;
        gz.write_all(b"\n")?;
    }
    gz.finish()
}

/// This run's archive file, opened for appending.
struct ArchiveFile {
    path: PathBuf,
    file: std::fs::File,
    len: u64,
}

impl ArchiveFile {
    /// Creates the file (never overwrites one) and fsyncs the directory, so
    /// the file's name survives a crash as well as its contents.
    fn create(dir: &Path, path: PathBuf) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create_new(true).append(true).open(&path)?;
        std::fs::File::open(dir)?.sync_all()?;
        Ok(Self { path, file, len: 0 })
    }

    /// Writes and fsyncs; returns the length before.
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<u64> {
        let before = self.len;
        let written = self.file.write_all(bytes).and_then(|()| self.file.sync_data());
        if let Err(e) = written {
            let _ = self.truncate(before);
            return Err(e);
        }
        self.len += bytes.len() as u64;
        Ok(before)
    }

    fn truncate(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)?;
        self.file.sync_data()
    }

    /// Cuts the file back to `len` and goes on appending from there.
    fn cut_back(&mut self, len: u64) -> std::io::Result<()> {
        self.truncate(len)?;
        self.len = len;
        Ok(())
    }
}

/// Reads an archive file back: every event in it, in order.
///
/// A process that died while appending a batch leaves that batch cut short
/// at the end of the file. Its events were not deleted (a batch is deleted
/// only once its archive is durable), so the next run archives them again,
/// in a new file: every complete batch before the torn one is returned, and
/// the torn tail is logged as a warning. The same event can appear in two
/// archives (a batch archived, then not deleted): keep the last copy of
/// each `id`.
pub fn read_archive(path: &Path) -> std::io::Result<Vec<ArchivedEvent>> {
    let (events, torn_at) = read_batches(path)?;
    if let Some(at) = torn_at {
        tracing::warn!(
            file = %path.display(),
            offset = at,
            events = events.len(),
            "retention archive ends in a batch cut short (a crash while it was written); \
             its events were not deleted, and are archived again by a later run"
        );
    }
    Ok(events)
}

/// The events of every complete batch (gzip member) of an archive file,
/// and the offset of a torn batch at its end, if any.
fn read_batches(path: &Path) -> std::io::Result<(Vec<ArchivedEvent>, Option<u64>)> {
    use std::io::{BufRead, Read, Seek};
    let mut reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut events = Vec::new();
    loop {
        let start = reader.stream_position()?;
        if reader.fill_buf()?.is_empty() {
            return Ok((events, None));
        }
        let mut lines = Vec::new();
        // The bufread decoder stops at the end of its member, leaving the
        // reader at the next one.
        if flate2::bufread::GzDecoder::new(&mut reader)
            .read_to_end(&mut lines)
            .is_err()
        {
            // A torn batch is the last thing in its file: a whole batch
            // after a bad one means damage, and what follows it must not be
            // dropped unread.
            reader.seek(std::io::SeekFrom::Start(start))?;
            let mut rest = Vec::new();
            reader.read_to_end(&mut rest)?;
            if whole_member_after(&rest) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{}: the batch at byte {start} is damaged and whole batches follow it;                          `zcat` reads the batches before it",
                        path.display()
                    ),
                ));
            }
            return Ok((events, Some(start)));
        }
        for line in lines.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            events.push(serde_json::from_slice(line).map_err(std::io::Error::other)?);
        }
    }
}

/// The seqs of a batch, in order, whose payloads fit `max_bytes` together
/// (always the first, however big), from `(seq, payload bytes)` in seq
/// order; and, when some were left for the next batch, the last seq kept,
/// which the batch's scan then ends at.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn within_budget<N: Into<i64>>(
    sizes: impl IntoIterator<Item = (i64, Option<N>)>,
    max_bytes: u64,
) -> (Vec<i64>, Option<i64>) {
    let mut total = 0u64;
    let mut kept = Vec::new();
    for (seq, size) in sizes {
        total = total.saturating_add(size.map_or(0, Into::into).max(0) as u64);
        if total > max_bytes && !kept.is_empty() {
            let last = kept.last().copied();
            return (kept, last);
        }
        kept.push(seq);
    }
    (kept, None)
}

/// Whether a whole gzip member starts anywhere in `bytes` after its first.
fn whole_member_after(bytes: &[u8]) -> bool {
    use std::io::Read;
    (1..bytes.len().saturating_sub(2))
        .filter(|&at| bytes[at..].starts_with(&[0x1f, 0x8b, 0x08]))
        .any(|at| {
            flate2::bufread::GzDecoder::new(&bytes[at..])
                .read_to_end(&mut Vec::new())
                .is_ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: i64) -> ArchivedEvent {
        ArchivedEvent {
            seq,
            id: Uuid::from_u128(seq as u128),
            event_type: "order.created".into(),
            key: Some("k".into()),
            content_type: "application/json".into(),
            headers: serde_json::json!({}),
            payload: Some(serde_json::json!({ "n": seq })),
            payload_base64: None,
            dispatch_key: None,
            created_at: Utc::now(),
            deliveries: Vec::new(),
        }
    }

    /// A crash while the second batch was appended cuts the file inside
    /// it: the first batch, already deleted from the table, still reads
    /// back, and the torn tail is reported.
    #[test]
    fn a_torn_archive_tail_still_reads_back_the_batches_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let first: Vec<ArchivedEvent> = (1..=3).map(event).collect();
        let second: Vec<ArchivedEvent> = (4..=6).map(event).collect();
        let mut file = ArchiveFile::create(dir.path(), dir.path().join("a.jsonl.gz")).unwrap();
        file.append(&gzip_lines(&first).unwrap()).unwrap();
        let cut = file.append(&gzip_lines(&second).unwrap()).unwrap();
        assert_eq!(read_archive(&file.path).unwrap().len(), 6);
        for len in [file.len - 1, (cut + file.len) / 2, cut + 12, cut + 1] {
            file.cut_back(len).unwrap();
            assert_eq!(read_archive(&file.path).unwrap(), first, "cut at {len}");
            assert_eq!(read_batches(&file.path).unwrap().1, Some(cut), "cut at {len}");
        }
        file.cut_back(cut).unwrap();
        assert_eq!(read_batches(&file.path).unwrap(), (first, None));
    }

    #[test]
    fn a_batch_keeps_the_payloads_within_its_budget_and_always_its_first() {
        let sizes = |s: &[(i64, Option<i64>)]| s.to_vec();
        assert_eq!(
            within_budget(sizes(&[(1, Some(40)), (2, None), (3, Some(60)), (4, Some(1))]), 100),
            (vec![1, 2, 3], Some(3))
        );
        assert_eq!(
            within_budget(sizes(&[(7, Some(500)), (8, Some(1))]), 100),
            (vec![7], Some(7))
        );
        assert_eq!(
            within_budget(sizes(&[(1, Some(50)), (2, Some(50))]), 100),
            (vec![1, 2], None)
        );
    }

    #[test]
    fn damage_before_a_whole_batch_is_an_error_not_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let batches: Vec<Vec<ArchivedEvent>> = [1..=3, 4..=6, 7..=9]
            .into_iter()
            .map(|r| r.map(event).collect())
            .collect();
        let mut file = ArchiveFile::create(dir.path(), dir.path().join("a.jsonl.gz")).unwrap();
        let mut starts = Vec::new();
        for batch in &batches {
            starts.push(file.len);
            file.append(&gzip_lines(batch).unwrap()).unwrap();
        }
        let mut bytes = std::fs::read(&file.path).unwrap();
        // A byte of the second batch's compressed data, past its header.
        bytes[starts[1] as usize + 15] ^= 0xff;
        std::fs::write(&file.path, &bytes).unwrap();
        let err = read_archive(&file.path).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains(&format!("byte {}", starts[1])), "{err}");
    }
}
