//! The names a file sink's file is rotated to: `<name>.<UTC timestamp>.<n>`
//! beside it, in write order.

use std::fs;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};

use super::writer::parent;

/// `<name>.<UTC timestamp>.<n>` beside `path`, sorting after every file
/// already rotated from it, so that timestamp-then-`n` order is write order:
/// the stamp is `now`'s, or the newest rotated file's when that is later (a
/// writer whose clock is behind, or that read it before waiting its turn for
/// the lock), and `n` follows the highest taken under that stamp.
pub(crate) fn rotated_name(path: &Path, now: DateTime<Utc>) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let mut stamp = now.format(STAMP).to_string();
    let mut n = 1;
    if let Some((newest, last)) = newest_rotated(path, &name)
        && newest >= stamp
    {
        n = last + 1;
        stamp = newest;
    }
    (n..)
        .map(|n| path.with_file_name(format!("{name}.{stamp}.{n}")))
        .find(|candidate| !candidate.exists())
        .expect("some suffix is free")
}

const STAMP: &str = "%Y%m%dT%H%M%SZ";

/// The latest `(stamp, n)` among the files rotated from `path` (named
/// `name`); none when the directory cannot be read.
fn newest_rotated(path: &Path, name: &str) -> Option<(String, u64)> {
    let prefix = format!("{name}.");
    fs::read_dir(parent(path))
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?.file_name();
            let (stamp, n) = entry.to_str()?.strip_prefix(&prefix)?.split_once('.')?;
            let n: u64 = n.parse().ok()?;
            chrono::NaiveDateTime::parse_from_str(stamp, STAMP).ok()?;
            Some((stamp.to_owned(), n))
        })
        .max()
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
    fn a_rotated_name_sorts_after_every_file_rotated_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let now = DateTime::parse_from_rfc3339("2026-11-30T08:22:31Z").unwrap().to_utc();
        // Another writer, whose clock is ahead or who took the lock first,
        // rotated at 08:22:40; the first of its files was archived since.
        fs::write(dir.path().join("events.jsonl.20261130T082240Z.2"), b"").unwrap();
        fs::write(dir.path().join("events.jsonl.20261130T082239Z.7"), b"").unwrap();
        fs::write(dir.path().join("events.jsonl.notes"), b"").unwrap();
        assert_eq!(
            rotated_name(&path, now),
            dir.path().join("events.jsonl.20261130T082240Z.3")
        );
        let later = DateTime::parse_from_rfc3339("2026-11-30T08:23:00Z").unwrap().to_utc();
        assert_eq!(
            rotated_name(&path, later),
            dir.path().join("events.jsonl.20261130T082300Z.1")
        );
    }
}
