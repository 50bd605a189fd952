//! Appending a batch's lines to their files: rotation by size, then one
//! `sync_data` per file touched. Each file succeeds or fails on its own: a
//! file that fails is rolled back, cut back to its length before the batch,
//! so a half-written line (a full disk) never has the retry's line glued to
//! it, and its lines fail; the other files' lines are written. A line whose
//! key failed earlier in the batch is not written, so a key's lines never
//! land in a file after a failed one of the same key. Blocking; runs on
//! tokio's blocking pool.
//!
//! A batch holds an exclusive lock on the directory of every file it writes
//! from before it opens them until it has synced or rolled them back. Two
//! writers of one file (two relays, or two sinks of one relay, naming the
//! same path) therefore take turns: neither cuts back lines the other has
//! synced and reported written, their lines never interleave, and two
//! rotations in one second cannot pick the same name. A directory named by
//! several paths (a symlink, `a/../a`) is locked once: a second `flock` on
//! it from this process would wait for ever. The locks are taken in the
//! order of the directories' canonical paths, the same for every writer
//! that sees one file tree (and for plain paths the order of earlier
//! releases), so batches writing several directories cannot deadlock. One
//! directory reached by writers through different mounts (a bind mount, a
//! volume mounted at different paths) has different canonical paths to
//! them: give such writers one path. A lock another writer holds past
//! [`LOCK_WAIT`](super::lock::LOCK_WAIT) fails the batch's lines of that
//! directory, to be retried.
//!
//! A file's directory is synced the first time a [`Writer`] writes to it,
//! not only when it creates it: a file left by a writer that died before
//! syncing its directory, or made by `logrotate`'s `create`, may not
//! survive a power cut otherwise, and with it every line appended since.
//! A file is told from one made later at its path, even one given its
//! freed inode, as [`super::synced`] says.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use tracing::warn;

#[cfg(test)]
use super::lock::LOCK_WAIT;
use super::lock::lock_dirs;
use super::rotate::rotated_name;
use super::synced::{FileId, Synced, file_id};

/// An open destination file and how many bytes it holds.
struct Open {
    writer: BufWriter<File>,
    size: u64,
    /// Its length before this batch wrote to it: where a failure cuts it back.
    start: u64,
    /// What it was when opened, when the platform tells.
    id: Option<FileId>,
}

impl Open {
    /// Opens `path` for appending. A file that ends in part of a line, left
    /// by a writer killed mid-write (or whose cut-back failed), is first cut
    /// back to its last whole line: those bytes were never reported
    /// written, and the retry's line would otherwise be glued to them.
    fn append(path: &Path, created: &mut BTreeSet<PathBuf>) -> io::Result<Self> {
        if !path.exists() {
            created.insert(parent(path).to_owned());
        }
        let mut file = options().create(true).open(path)?;
        let meta = file.metadata()?;
        let id = file_id(&meta);
        let mut size = meta.len();
        let whole = whole_lines_len(&mut file, size)?;
        if whole < size {
            file.set_len(whole)?;
            warn!(
                path = %path.display(),
                bytes = size - whole,
                "cut a partial line off the end of the file, left by an interrupted write; its event is written again"
            );
            size = whole;
        }
        Ok(Self {
            writer: BufWriter::with_capacity(64 * 1024, file),
            size,
            start: size,
            id,
        })
    }

    /// Cuts the file back to its length before this batch. The buffered
    /// bytes are discarded first: a `BufWriter` flushes on drop, which would
    /// append them again after the cut.
    fn roll_back(self) -> io::Result<()> {
        let (file, _unwritten) = self.writer.into_parts();
        file.set_len(self.start)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.writer.flush()?;
        self.writer.get_ref().sync_data()
    }

    /// What it is now, after this batch's writes.
    fn left(&self) -> Option<FileId> {
        file_id(&self.writer.get_ref().metadata().ok()?)
    }
}

/// The length of `file` up to and including its last newline.
fn whole_lines_len(file: &mut File, size: u64) -> io::Result<u64> {
    let mut buf = [0u8; 8192];
    let mut end = size;
    while end > 0 {
        // The last byte alone first: almost always a newline.
        let start = if end == size {
            end - 1
        } else {
            end.saturating_sub(buf.len() as u64)
        };
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        if let Some(at) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + at as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// One line of a batch: the file it goes to, its bytes (ending in a
/// newline) and its event's key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line<'a> {
    pub(crate) path: &'a Path,
    pub(crate) bytes: &'a [u8],
    pub(crate) key: Option<&'a str>,
}

/// Why a line is not reported written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unwritten {
    /// Its file failed; the text names the file and the error. What the
    /// batch wrote to the file was cut back, though a line in a file
    /// rotated away during the batch stays there.
    Failed(String),
    /// Its path cannot be written as it is named, whatever the retries:
    /// a name too long, a directory where the file should be, a file where
    /// a directory should be. The text names the file and the error.
    Refused(String),
    /// Not written: the line at this index, of the same key, failed first.
    HeldBack(usize),
    /// Written to its file, but the line at this index, of the same key
    /// and in another file, failed afterwards: it fails too, so the key
    /// is retried in order (a reader may see it twice).
    Behind(usize),
}

/// How the writer opens a destination file (with `create` when it may make
/// it); `check` opens an existing one the same way.
pub(crate) fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.read(true).append(true);
    options
}

/// What [`write_lines`] keeps between the batches of one sink: the files
/// whose directory entry it has synced, and how long it waits for another
/// writer's lock on a directory.
pub(crate) struct Writer {
    synced: Synced,
    /// How long a batch waits for another writer's lock on a directory.
    lock_wait: std::time::Duration,
}

impl Writer {
    pub(crate) fn new(lock_wait: std::time::Duration) -> Self {
        Self {
            synced: Synced::default(),
            lock_wait,
        }
    }
}

/// Appends `lines` in order, each to its file. A line never straddles two
/// files: when it would take a non-empty file past `max_file_bytes`, the file
/// is rotated first. Returns, per line, whether it is written: only once
/// its file is synced, and its directory if the file was created or
/// renamed, or if `writer` has not synced it for this file at this path.
///
/// A file that cannot be locked, opened, written, rotated or synced fails
/// alone: it is cut back to where the batch found it (a file rotated away
/// keeps its whole lines), so the retry starts on a line boundary, and its
/// lines fail. A line whose key failed before it is not written; one of a
/// key that failed in another file after it was written fails with it.
pub(crate) fn write_lines(
    lines: &[Line<'_>],
    max_file_bytes: u64,
    now: DateTime<Utc>,
    writer: &mut Writer,
) -> Vec<Result<(), Unwritten>> {
    let mut batch = Batch {
        results: vec![Ok(()); lines.len()],
        ..Batch::default()
    };
    let dirs: BTreeSet<&Path> = lines.iter().map(|l| parent(l.path)).collect();
    let (locks, unlocked) = lock_dirs(dirs, writer.lock_wait);
    let mut first_failed: HashMap<&str, usize> = HashMap::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(&first) = line.key.and_then(|k| first_failed.get(k)) {
            batch.results[i] = Err(Unwritten::HeldBack(first));
            continue;
        }
        let dir = parent(line.path);
        let failed = match unlocked.get(dir) {
            // Its text names the directory and the holder.
            Some(e) if e.kind() == io::ErrorKind::TimedOut => Some(Unwritten::Failed(failure(line.path, e))),
            Some(e) => Some(classify(
                e,
                format!(
                    "writing {}: its directory {} cannot be opened: {e}",
                    line.path.display(),
                    dir.display()
                ),
            )),
            None => batch.failed.get(line.path).cloned(),
        };
        let mut now_failed = Vec::new();
        if let Some(why) = failed {
            batch.results[i] = Err(why);
            now_failed.push(i);
        } else if let Err(e) = batch.append(line.path, line.bytes, max_file_bytes, now, &writer.synced) {
            let why = classify(&e, failure(line.path, &e));
            // The lines the failure cuts back count too: a later line of
            // their key must not be written after them.
            now_failed = batch.fail(line.path, why.clone());
            batch.results[i] = Err(why);
            now_failed.push(i);
        } else {
            batch.written.entry(line.path).or_default().push(i);
        }
        for j in now_failed {
            if let Some(key) = lines[j].key {
                first_failed.entry(key).and_modify(|f| *f = (*f).min(j)).or_insert(j);
            }
        }
    }
    batch.sync_all();
    // What is still open was synced, and its directory too where this
    // writer had not synced it before. Taken under the directory's lock:
    // another writer's lines cannot change it in between.
    writer
        .synced
        .remember(batch.open.iter().map(|(&path, file)| (path, file.left())));
    drop(locks);
    // A key that failed in one file after its later lines were written to
    // another: those fail too, to be retried behind it.
    let mut results = batch.results;
    let mut first_failed: HashMap<&str, usize> = HashMap::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(key) = line.key else { continue };
        match (&results[i], first_failed.get(key)) {
            (Err(_), None) => {
                first_failed.insert(key, i);
            }
            (Ok(()), Some(&first)) => results[i] = Err(Unwritten::Behind(first)),
            _ => {}
        }
    }
    results
}

fn failure(path: &Path, error: &io::Error) -> String {
    format!("writing {}: {error}", path.display())
}

/// A failure that retrying cannot mend is [`Unwritten::Refused`]: the path
/// stays the same on every attempt, and so does what is wrong with it.
fn classify(error: &io::Error, why: String) -> Unwritten {
    use io::ErrorKind::{InvalidFilename, IsADirectory, NotADirectory};
    let what = match error.kind() {
        InvalidFilename => "a name in the path is too long for the file system",
        IsADirectory => "a directory is where the file should be",
        NotADirectory => "a file is where a directory of the path should be",
        _ => return Unwritten::Failed(why),
    };
    Unwritten::Refused(format!("{why}: {what}"))
}

/// A batch being written: its open files, which lines went to each, and
/// the files that failed.
#[derive(Default)]
struct Batch<'a> {
    open: HashMap<&'a Path, Open>,
    written: HashMap<&'a Path, Vec<usize>>,
    /// Why each failed file failed: a later line of it fails the same way.
    failed: HashMap<&'a Path, Unwritten>,
    /// Directories whose entries changed (a file created or renamed) or
    /// may not be synced yet (a file this writer had not written).
    dirs: BTreeSet<PathBuf>,
    results: Vec<Result<(), Unwritten>>,
}

impl<'a> Batch<'a> {
    /// `synced`: the files whose directory is known synced.
    fn append(
        &mut self,
        path: &'a Path,
        line: &[u8],
        max_file_bytes: u64,
        now: DateTime<Utc>,
        synced: &Synced,
    ) -> io::Result<()> {
        if !self.open.contains_key(path) {
            let file = Open::append(path, &mut self.dirs)?;
            // Made by a writer that may have died before it synced the
            // directory (this one's predecessor, `logrotate`): synced now.
            if !synced.holds(path, file.id.as_ref()) {
                self.dirs.insert(parent(path).to_owned());
            }
            self.open.insert(path, file);
        }
        let file = self.open.get_mut(path).expect("opened above");
        #[cfg(test)]
        if line == tests::FAILS {
            return Err(io::Error::other("a write failure the test asked for"));
        }
        let len = line.len() as u64;
        if file.size > 0 && file.size + len > max_file_bytes {
            file.sync()?;
            fs::rename(path, rotated_name(path, now))?;
            self.dirs.insert(parent(path).to_owned());
            *file = Open::append(path, &mut self.dirs)?;
        }
        file.writer.write_all(line)?;
        file.size += len;
        Ok(())
    }

    /// Cuts `path` back and fails every line the batch wrote to it, which
    /// it returns. Those lines were written: they fail as [`Unwritten::Failed`],
    /// to be written again, whatever `why` the file failed.
    fn fail(&mut self, path: &'a Path, why: Unwritten) -> Vec<usize> {
        if let Some(file) = self.open.remove(path)
            && let Err(e) = file.roll_back()
        {
            warn!(
                path = %path.display(),
                error = %e,
                "could not cut the file back after a failed write; the next batch to open it cuts any partial line"
            );
        }
        let lines = self.written.remove(path).unwrap_or_default();
        let cut_back = match &why {
            Unwritten::Failed(text) | Unwritten::Refused(text) => text.clone(),
            Unwritten::HeldBack(_) | Unwritten::Behind(_) => unreachable!("a file fails for an error"),
        };
        for &i in &lines {
            self.results[i] = Err(Unwritten::Failed(cut_back.clone()));
        }
        self.failed.insert(path, why);
        lines
    }

    /// Syncs every file still open, then the directories whose entries
    /// changed; what fails is rolled back.
    fn sync_all(&mut self) {
        let mut paths: Vec<&'a Path> = self.open.keys().copied().collect();
        paths.sort();
        for path in paths {
            let synced = self.open.get_mut(path).expect("listed above").sync();
            if let Err(e) = synced {
                self.fail(path, Unwritten::Failed(failure(path, &e)));
            }
        }
        for dir in std::mem::take(&mut self.dirs) {
            if let Err(e) = sync_dir(&dir) {
                let why = failure(&dir, &e);
                let mut inside: Vec<&'a Path> = self.open.keys().copied().filter(|p| parent(p) == dir).collect();
                inside.sort();
                for path in inside {
                    self.fail(path, Unwritten::Failed(why.clone()));
                }
            }
        }
    }
}

pub(crate) fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Makes a created or renamed directory entry durable.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(test)]
    tests::DIRS_SYNCED.with_borrow_mut(|synced| synced.push(dir.to_owned()));
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line whose write fails, after the file's earlier lines were written.
    pub(super) const FAILS: &[u8] = b"<fails>\n";

    thread_local! {
        /// The directories this thread synced, in order.
        pub(super) static DIRS_SYNCED: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// One batch, by a writer that has written nothing before.
    fn write_lines(lines: &[Line<'_>], max_file_bytes: u64, now: DateTime<Utc>) -> Vec<Result<(), Unwritten>> {
        super::write_lines(lines, max_file_bytes, now, &mut Writer::new(LOCK_WAIT))
    }

    /// Lines without keys.
    fn unkeyed<'a>(batch: &[(&'a Path, &'a [u8])]) -> Vec<Line<'a>> {
        batch
            .iter()
            .map(|&(path, bytes)| Line { path, bytes, key: None })
            .collect()
    }

    fn all_written(results: &[Result<(), Unwritten>]) {
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }

    fn failed_naming(result: &Result<(), Unwritten>, path: &Path) {
        match result {
            Err(Unwritten::Failed(why) | Unwritten::Refused(why)) => {
                assert!(why.contains(&path.display().to_string()), "{why}")
            }
            other => panic!("{other:?}: expected a failure naming {}", path.display()),
        }
    }

    /// What a writer killed in the middle of a line leaves: the retry's
    /// line starts on a line of its own, and the whole lines stay.
    #[test]
    fn a_partial_line_left_by_a_crash_is_cut_before_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let mut long = vec![b'x'; 20_000];
        long.push(b'\n');
        let mut before = b"{\"a\":1}\n".to_vec();
        before.extend_from_slice(&long);
        let mut crashed = before.clone();
        crashed.extend_from_slice(&vec![b'y'; 10_000]);
        fs::write(&path, &crashed).unwrap();
        let lines: [(&Path, &[u8]); 1] = [(path.as_path(), b"{\"b\":2}\n")];
        all_written(&write_lines(&unkeyed(&lines), 1 << 20, Utc::now()));
        let mut expected = before.clone();
        expected.extend_from_slice(b"{\"b\":2}\n");
        assert_eq!(fs::read(&path).unwrap(), expected);
        // A file holding nothing but a partial line.
        fs::write(&path, b"{\"cut").unwrap();
        all_written(&write_lines(&unkeyed(&lines), 1 << 20, Utc::now()));
        assert_eq!(fs::read(&path).unwrap(), b"{\"b\":2}\n");
    }

    /// The directory was synced only when the batch created the file. One
    /// made by a writer that died before syncing its directory (or whose
    /// directory sync failed), or by `logrotate`'s `create`, was appended
    /// to and reported written for ever with its entry never synced: a
    /// power cut could take the file, and every line reported written.
    #[test]
    fn a_file_this_writer_did_not_make_has_its_directory_synced_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        fs::write(&path, b"left by a writer that died before it synced the directory\n").unwrap();
        let mut writer = Writer::new(LOCK_WAIT);
        let mut synced_by = |line: &[u8]| {
            DIRS_SYNCED.take();
            let lines: [(&Path, &[u8]); 1] = [(path.as_path(), line)];
            all_written(&super::write_lines(&unkeyed(&lines), 1024, Utc::now(), &mut writer));
            DIRS_SYNCED.take()
        };
        assert_eq!(
            synced_by(b"first\n"),
            [dir.path()],
            "the first write to a file that was there"
        );
        assert!(synced_by(b"second\n").is_empty(), "synced already");
        // logrotate's `create`: the file moved away, an empty one in its place.
        fs::rename(&path, dir.path().join("out.jsonl.1")).unwrap();
        fs::write(&path, b"").unwrap();
        assert_eq!(synced_by(b"third\n"), [dir.path()], "another file at the same path");
        assert!(synced_by(b"fourth\n").is_empty());
        assert_eq!(fs::read(&path).unwrap(), b"third\nfourth\n");
        // A writer of its own, in this process or the next, syncs it once more.
        DIRS_SYNCED.take();
        all_written(&write_lines(
            &unkeyed(&[(path.as_path(), b"fifth\n")]),
            1024,
            Utc::now(),
        ));
        assert_eq!(DIRS_SYNCED.take(), [dir.path()]);
    }

    /// `logrotate` deletes the oldest rotated file, then `create` makes a
    /// new one; ext4 gives the new file the inode just freed. A writer that
    /// remembered the files it had synced by inode alone took the new
    /// file's entry for one it had synced, and never synced it: a power cut
    /// could take the file, and the lines reported written in it.
    #[cfg(unix)]
    #[test]
    fn a_new_file_given_a_freed_inode_has_its_directory_synced() {
        use std::os::unix::fs::MetadataExt;
        let inode = |path: &Path| fs::metadata(path).unwrap().ino();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let oldest = dir.path().join("out.jsonl.2");
        let mut writer = Writer::new(LOCK_WAIT);
        let mut synced_by = |path: &Path, line: &[u8]| {
            DIRS_SYNCED.take();
            let lines: [(&Path, &[u8]); 1] = [(path, line)];
            all_written(&super::write_lines(&unkeyed(&lines), 1024, Utc::now(), &mut writer));
            DIRS_SYNCED.take()
        };
        assert_eq!(synced_by(&oldest, b"oldest\n"), [dir.path()]);
        assert_eq!(synced_by(&path, b"first\n"), [dir.path()]);
        // The oldest deleted, the file rotated, a new one created.
        let freed = inode(&oldest);
        fs::remove_file(&oldest).unwrap();
        fs::rename(&path, dir.path().join("out.jsonl.1")).unwrap();
        fs::write(&path, b"").unwrap();
        let mut reused = inode(&path) == freed;
        assert_eq!(synced_by(&path, b"second\n"), [dir.path()], "a new file at the path");
        assert!(synced_by(&path, b"third\n").is_empty(), "synced already");
        // The file deleted and made again at its own path.
        let freed = inode(&path);
        fs::remove_file(&path).unwrap();
        fs::write(&path, b"").unwrap();
        reused |= inode(&path) == freed;
        assert_eq!(synced_by(&path, b"fourth\n"), [dir.path()], "a new file at the path");
        assert!(synced_by(&path, b"fifth\n").is_empty(), "synced already");
        assert_eq!(fs::read(&path).unwrap(), b"fourth\nfifth\n");
        if !reused {
            eprintln!("this file system gave no new file a freed inode: the decision is tested alone in `synced`");
        }
    }

    #[test]
    fn rotation_keeps_lines_whole_and_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let now = Utc::now();
        let lines: Vec<Vec<u8>> = (0..10).map(|i| format!("line-{i}\n").into_bytes()).collect();
        let batch: Vec<(&Path, &[u8])> = lines.iter().map(|l| (path.as_path(), l.as_slice())).collect();
        // Each line is 7 bytes: two fit in 15, a third would not.
        all_written(&write_lines(&unkeyed(&batch), 15, now));
        let mut files: Vec<PathBuf> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort_by_key(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let n: u64 = name.rsplit('.').next().unwrap().parse().unwrap_or(u64::MAX);
            n
        });
        assert_eq!(files.len(), 5, "{files:?}");
        let all: String = files.iter().map(|f| fs::read_to_string(f).unwrap()).collect();
        let expected: String = lines.iter().map(|l| String::from_utf8_lossy(l).into_owned()).collect();
        assert_eq!(all, expected);
        for f in &files {
            assert!(fs::metadata(f).unwrap().len() <= 15, "{f:?}");
        }
    }

    #[test]
    fn a_file_that_fails_fails_alone_and_holds_back_its_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        fs::write(&path, b"before\n").unwrap();
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        let missing = dir.path().join("no-such-dir").join("x.jsonl");
        let line = |path, bytes, key| Line { path, bytes, key };
        let batch = [
            line(path.as_path(), b"line-1\n", Some("a")),
            // A directory where the file should be, and a missing directory.
            line(blocked.as_path(), b"x\n", Some("b")),
            line(missing.as_path(), b"y\n", Some("c")),
            line(path.as_path(), b"line-2\n", Some("b")),
            line(path.as_path(), b"line-3\n", Some("d")),
        ];
        let results = write_lines(&batch, 1024, Utc::now());
        assert_eq!(results[0], Ok(()));
        failed_naming(&results[1], &blocked);
        failed_naming(&results[2], &missing);
        assert_eq!(results[3], Err(Unwritten::HeldBack(1)), "behind its key's failure");
        assert_eq!(results[4], Ok(()));
        assert_eq!(fs::read(&path).unwrap(), b"before\nline-1\nline-3\n");
    }

    /// A file that fails after it took lines is cut back, and a line of
    /// their key already written to another file fails with them.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_cut_back_fails_its_lines_and_the_later_lines_of_their_keys() {
        let dir = tempfile::tempdir().unwrap();
        let full = dir.path().join("full.jsonl");
        // Opens and buffers like a file; its first flush fails (ENOSPC).
        std::os::unix::fs::symlink("/dev/full", &full).unwrap();
        let other = dir.path().join("other.jsonl");
        let big = vec![b'x'; 100 * 1024];
        let line = |path, bytes, key| Line { path, bytes, key };
        // Fails at its sync, after the other file was written.
        let batch = [
            line(full.as_path(), b"k1-first\n", Some("k1")),
            line(other.as_path(), b"k1-second\n", Some("k1")),
            line(other.as_path(), b"k2\n", Some("k2")),
        ];
        let results = write_lines(&batch, 1024 * 1024, Utc::now());
        failed_naming(&results[0], &full);
        assert_eq!(results[1], Err(Unwritten::Behind(0)));
        assert_eq!(results[2], Ok(()));
        // Fails in the middle of the batch, on a line too big to buffer.
        let batch = [
            line(full.as_path(), b"k3-first\n", Some("k3")),
            line(other.as_path(), b"k3-second\n", Some("k3")),
            line(full.as_path(), &big, Some("k4")),
            line(other.as_path(), b"k3-third\n", Some("k3")),
            line(other.as_path(), b"k4-later\n", Some("k4")),
        ];
        let results = write_lines(&batch, 1024 * 1024, Utc::now());
        failed_naming(&results[0], &full);
        assert_eq!(results[1], Err(Unwritten::Behind(0)));
        failed_naming(&results[2], &full);
        assert_eq!(results[3], Err(Unwritten::HeldBack(0)));
        assert_eq!(results[4], Err(Unwritten::HeldBack(2)));
        assert_eq!(fs::read(&other).unwrap(), b"k1-second\nk2\nk3-second\n");
    }

    #[test]
    fn rolling_back_drops_what_reached_the_file_and_what_was_still_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        fs::write(&path, b"whole\n").unwrap();
        let mut file = Open::append(&path, &mut BTreeSet::new()).unwrap();
        // What a write that failed on a full disk leaves: part of a line in
        // the file, the rest of the batch in the buffer.
        file.writer.get_mut().write_all(b"{\"half").unwrap();
        file.writer.write_all(b" of a line\n{\"next\"}\n").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"whole\n{\"half");
        file.roll_back().unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"whole\n");

        let lines: [(&Path, &[u8]); 1] = [(path.as_path(), b"retried\n")];
        all_written(&write_lines(&unkeyed(&lines), 1024, Utc::now()));
        assert_eq!(fs::read(&path).unwrap(), b"whole\nretried\n");
    }

    /// Two writers of one file, as two relays or two sinks naming one path
    /// are: one keeps failing after its lines reached the file (and cuts
    /// them back), the other keeps succeeding, and both rotate often. Every
    /// line the second was told is written must be in some file, whole.
    #[test]
    fn two_writers_of_one_file_never_cut_back_or_split_each_others_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.jsonl");
        let now = Utc::now();
        let max = 64 * 1024;
        std::thread::scope(|s| {
            let failing = s.spawn(|| {
                // More than the write buffer, so part of it reaches the file
                // before the batch fails.
                let line = format!("{{\"failing\":\"{}\"}}\n", "x".repeat(200)).into_bytes();
                for _ in 0..150 {
                    let mut batch: Vec<(&Path, &[u8])> = vec![(path.as_path(), line.as_slice()); 400];
                    // The last write fails: the file is cut back.
                    batch.push((path.as_path(), FAILS));
                    let results = write_lines(&unkeyed(&batch), max, now);
                    assert!(results.iter().all(Result::is_err));
                }
            });
            let mut written = 0u64;
            while !failing.is_finished() || written < 50 {
                let lines: Vec<Vec<u8>> = (written..written + 10)
                    .map(|i| format!("{{\"ok\":{i}}}\n").into_bytes())
                    .collect();
                let batch: Vec<(&Path, &[u8])> = lines.iter().map(|l| (path.as_path(), l.as_slice())).collect();
                all_written(&write_lines(&unkeyed(&batch), max, now));
                written += 10;
            }
            failing.join().unwrap();
            let mut found = std::collections::BTreeSet::new();
            for entry in fs::read_dir(dir.path()).unwrap() {
                let entry = entry.unwrap().path();
                if entry.is_dir() {
                    continue;
                }
                let text = fs::read_to_string(&entry).unwrap();
                assert!(
                    text.is_empty() || text.ends_with('\n'),
                    "{entry:?} ends in a partial line"
                );
                for line in text.lines() {
                    let value: serde_json::Value =
                        serde_json::from_str(line).unwrap_or_else(|e| panic!("{entry:?}: a split line {line:?}: {e}"));
                    if let Some(i) = value.get("ok") {
                        assert!(found.insert(i.as_u64().unwrap()), "line {i} twice");
                    }
                }
            }
            let missing: Vec<u64> = (0..written).filter(|i| !found.contains(i)).collect();
            assert!(
                missing.is_empty(),
                "{} of {written} written lines lost, from {:?}",
                missing.len(),
                &missing[..missing.len().min(20)]
            );
        });
    }

    /// A second `flock` on a directory this batch locked already, through
    /// another path to it, waited for ever.
    #[test]
    fn paths_naming_one_directory_lock_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        fs::create_dir(&a).unwrap();
        std::os::unix::fs::symlink(&a, dir.path().join("b")).unwrap();
        let paths = [
            a.join("x.jsonl"),
            dir.path().join("b").join("y.jsonl"),
            a.join("..").join("a").join("z.jsonl"),
            dir.path().join("a").join(".").join("w.jsonl"),
        ];
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let lines: Vec<Line<'_>> = paths
                .iter()
                .map(|path| Line {
                    path,
                    bytes: b"{}\n",
                    key: None,
                })
                .collect();
            let _ = tx.send(write_lines(&lines, 1024, Utc::now()));
        });
        let results = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the batch waited for ever on a directory it had locked itself");
        all_written(&results);
        for name in ["x", "y", "z", "w"] {
            assert_eq!(fs::read(a.join(format!("{name}.jsonl"))).unwrap(), b"{}\n", "{name}");
        }
    }

    /// What no retry can mend is refused, the rest fails to be retried.
    #[test]
    fn failures_that_retrying_cannot_mend_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let taken = dir.path().join("taken");
        fs::create_dir(&taken).unwrap();
        let file = dir.path().join("file");
        fs::write(&file, b"").unwrap();
        let under_a_file = file.join("x.jsonl");
        let long_name = dir.path().join("n".repeat(300));
        let long_dir = dir.path().join("d".repeat(300)).join("x.jsonl");
        let missing = dir.path().join("missing").join("x.jsonl");
        let line = |path| Line {
            path,
            bytes: b"x\n",
            key: None,
        };
        let batch = [
            line(taken.as_path()),
            line(under_a_file.as_path()),
            line(long_name.as_path()),
            line(long_dir.as_path()),
            line(missing.as_path()),
            // A second line of a refused file is refused as well.
            line(taken.as_path()),
        ];
        let results = write_lines(&batch, 1024, Utc::now());
        for (i, what) in [
            (0, "a directory is where the file should be"),
            (1, "a file is where a directory"),
            (2, "too long"),
            (3, "too long"),
            (5, "a directory is where the file should be"),
        ] {
            match &results[i] {
                Err(Unwritten::Refused(why)) => {
                    assert!(why.contains(&batch[i].path.display().to_string()), "{why}");
                    assert!(why.contains(what), "{why}");
                }
                other => panic!("line {i}: {other:?}, expected it refused"),
            }
        }
        assert!(matches!(&results[4], Err(Unwritten::Failed(_))), "{:?}", results[4]);
    }

    #[test]
    fn a_directory_in_the_way_is_an_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("taken");
        fs::create_dir(&path).unwrap();
        let results = write_lines(&unkeyed(&[(path.as_path(), b"x\n")]), 100, Utc::now());
        failed_naming(&results[0], &path);
    }
}
