//! Appending a batch's lines to their files: rotation by size, then one
//! `sync_data` per file touched. A batch that fails is rolled back: every
//! file it was appending to is cut back to its length before the batch, so
//! a half-written line (a full disk) never has the retry's line glued to it.
//! Blocking; runs on tokio's blocking pool.
//!
//! A batch holds an exclusive lock on the directory of every file it writes
//! from before it opens them until it has synced or rolled them back. Two
//! writers of one file (two relays, or two sinks of one relay, naming the
//! same path) therefore take turns: neither cuts back lines the other has
//! synced and reported written, their lines never interleave, and two
//! rotations in one second cannot pick the same name. The locks are taken in
//! path order, so batches writing several directories cannot deadlock.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use tracing::warn;

/// An open destination file and how many bytes it holds.
struct Open {
    writer: BufWriter<File>,
    size: u64,
    /// Its length before this batch wrote to it: where a failure cuts it back.
    start: u64,
}

impl Open {
    fn append(path: &Path, created: &mut BTreeSet<PathBuf>) -> io::Result<Self> {
        if !path.exists() {
            created.insert(parent(path).to_owned());
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(Self {
            writer: BufWriter::with_capacity(64 * 1024, file),
            size,
            start: size,
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
}

/// A failure, with the file it happened on.
#[derive(Debug)]
pub(crate) struct WriteError {
    pub(crate) path: PathBuf,
    pub(crate) error: io::Error,
}

/// Appends `lines` (each with its file) in order. A line never straddles two
/// files: when it would take a non-empty file past `max_file_bytes`, the file
/// is rotated first. Returns only once every touched file, and the directory
/// of every created or renamed one, is synced.
///
/// On an error, every file the batch appended to is cut back to where the
/// batch found it (a file rotated away keeps its whole lines), so the retry
/// starts on a line boundary.
pub(crate) fn write_lines(lines: &[(&Path, &[u8])], max_file_bytes: u64, now: DateTime<Utc>) -> Result<(), WriteError> {
    let dirs: BTreeSet<&Path> = lines.iter().map(|&(path, _)| parent(path)).collect();
    let mut locks = Vec::with_capacity(dirs.len());
    for dir in dirs {
        locks.push(lock_dir(dir).map_err(|error| WriteError {
            path: dir.to_owned(),
            error,
        })?);
    }
    let mut open: HashMap<&Path, Open> = HashMap::new();
    let written = append_and_sync(lines, max_file_bytes, now, &mut open);
    if written.is_err() {
        for (path, file) in open {
            if let Err(e) = file.roll_back() {
                warn!(
                    path = %path.display(),
                    error = %e,
                    "could not cut the file back after a failed batch; it may end in a partial line"
                );
            }
        }
    }
    drop(locks);
    written
}

fn append_and_sync<'a>(
    lines: &[(&'a Path, &[u8])],
    max_file_bytes: u64,
    now: DateTime<Utc>,
    open: &mut HashMap<&'a Path, Open>,
) -> Result<(), WriteError> {
    let mut dirs: BTreeSet<PathBuf> = BTreeSet::new();
    let at = |path: &Path| {
        let path = path.to_owned();
        move |error| WriteError { path, error }
    };
    for &(path, line) in lines {
        if !open.contains_key(path) {
            open.insert(path, Open::append(path, &mut dirs).map_err(at(path))?);
        }
        let file = open.get_mut(path).expect("opened above");
        let len = line.len() as u64;
        if file.size > 0 && file.size + len > max_file_bytes {
            file.sync().map_err(at(path))?;
            fs::rename(path, rotated_name(path, now)).map_err(at(path))?;
            dirs.insert(parent(path).to_owned());
            *file = Open::append(path, &mut dirs).map_err(at(path))?;
        }
        file.writer.write_all(line).map_err(at(path))?;
        file.size += len;
    }
    for (path, file) in open.iter_mut() {
        file.sync().map_err(at(path))?;
    }
    for dir in dirs {
        sync_dir(&dir).map_err(at(&dir))?;
    }
    Ok(())
}

/// Waits for the exclusive lock on `dir`; it is released when the returned
/// handle is dropped. The lock is `flock`'s: it is held per open handle, so
/// it excludes other handles in this process as well as other processes.
#[cfg(unix)]
fn lock_dir(dir: &Path) -> io::Result<File> {
    let handle = File::open(dir)?;
    handle.lock()?;
    Ok(handle)
}

#[cfg(not(unix))]
fn lock_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// `<name>.<UTC timestamp>.<n>` beside `path`, with the smallest `n` from 1
/// not yet taken.
pub(crate) fn rotated_name(path: &Path, now: DateTime<Utc>) -> PathBuf {
    let stamp = now.format("%Y%m%dT%H%M%SZ");
    let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
    (1u64..)
        .map(|n| path.with_file_name(format!("{name}.{stamp}.{n}")))
        .find(|candidate| !candidate.exists())
        .expect("some suffix is free")
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
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_names_take_the_next_free_number() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let now = DateTime::parse_from_rfc3339("2026-11-30T08:22:31Z").unwrap().to_utc();
        let first = rotated_name(&path, now);
        assert_eq!(first, dir.path().join("events.jsonl.20261130T082231Z.1"));
        fs::write(&first, b"").unwrap();
        assert_eq!(
            rotated_name(&path, now),
            dir.path().join("events.jsonl.20261130T082231Z.2")
        );
    }

    #[test]
    fn rotation_keeps_lines_whole_and_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let now = Utc::now();
        let lines: Vec<Vec<u8>> = (0..10).map(|i| format!("line-{i}\n").into_bytes()).collect();
        let batch: Vec<(&Path, &[u8])> = lines.iter().map(|l| (path.as_path(), l.as_slice())).collect();
        // Each line is 7 bytes: two fit in 15, a third would not.
        write_lines(&batch, 15, now).unwrap();
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
    fn a_batch_that_fails_part_way_leaves_the_files_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        fs::write(&path, b"before\n").unwrap();
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        // The first file takes a line, then the second cannot be opened.
        let batch: [(&Path, &[u8]); 3] = [
            (path.as_path(), b"line-1\n"),
            (blocked.as_path(), b"x\n"),
            (path.as_path(), b"line-2\n"),
        ];
        let err = write_lines(&batch, 1024, Utc::now()).unwrap_err();
        assert_eq!(err.path, blocked);
        assert_eq!(
            fs::read(&path).unwrap(),
            b"before\n",
            "the retry would write line-1 twice"
        );
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
        write_lines(&lines, 1024, Utc::now()).unwrap();
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
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        let now = Utc::now();
        let max = 64 * 1024;
        std::thread::scope(|s| {
            let failing = s.spawn(|| {
                // More than the write buffer, so part of it reaches the file
                // before the batch fails on the directory in its way.
                let line = format!("{{\"failing\":\"{}\"}}\n", "x".repeat(200)).into_bytes();
                for _ in 0..150 {
                    let mut batch: Vec<(&Path, &[u8])> = vec![(path.as_path(), line.as_slice()); 400];
                    batch.push((blocked.as_path(), b"x\n"));
                    assert!(write_lines(&batch, max, now).is_err());
                }
            });
            let mut written = 0u64;
            while !failing.is_finished() || written < 50 {
                let lines: Vec<Vec<u8>> = (written..written + 10)
                    .map(|i| format!("{{\"ok\":{i}}}\n").into_bytes())
                    .collect();
                let batch: Vec<(&Path, &[u8])> = lines.iter().map(|l| (path.as_path(), l.as_slice())).collect();
                write_lines(&batch, max, now).unwrap();
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

    #[test]
    fn a_directory_in_the_way_is_an_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("taken");
        fs::create_dir(&path).unwrap();
        let err = write_lines(&[(path.as_path(), b"x\n")], 100, Utc::now()).unwrap_err();
        assert_eq!(err.path, path);
    }
}
