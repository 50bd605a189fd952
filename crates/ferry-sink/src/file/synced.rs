//! What a [`Writer`](super::writer::Writer) remembers of the directory
//! entries it has synced, so that it syncs a file's directory once rather
//! than on every batch.
//!
//! The memory is kept by path, and holds which file was at the path: its
//! (device, inode) and when it was made. An inode alone does not tell a
//! file: once a file is deleted its inode is free for the next one made.
//! `logrotate` deletes the oldest rotated file and `create` then makes a
//! new one, which ext4 tends to give the inode just freed; a memory of
//! inodes took that new file for one whose entry was synced, and a power
//! cut could take it and the lines reported written in it. A file made
//! later at a remembered path differs from the one remembered there in its
//! inode or, when it was given the same inode, in its birth time.
//!
//! Where the file system records no birth time, the file's change time as
//! the writer last left it stands in: a file another process wrote since
//! costs a directory sync, never a lost entry.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How many paths a writer remembers; past it, it forgets them all (a
/// templated path may name a file per key), and syncs each directory once
/// more.
const REMEMBERED_FILES: usize = 10_000;

/// What tells the file at a path from one made there later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileId {
    dev: u64,
    ino: u64,
    made: Made,
}

/// When a file was made, or as near as the file system tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// Its birth time.
    Born(SystemTime),
    /// No birth time recorded: its change time (seconds, nanoseconds),
    /// which the writer's own appends move too, so it is taken after them.
    Changed(i64, i64),
}

/// What the file `meta` describes is, when the platform tells.
#[cfg(unix)]
pub(super) fn file_id(meta: &fs::Metadata) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    let made = match meta.created() {
        Ok(at) => Made::Born(at),
        Err(_) => Made::Changed(meta.ctime(), meta.ctime_nsec()),
    };
    Some(FileId {
        dev: meta.dev(),
        ino: meta.ino(),
        made,
    })
}

#[cfg(not(unix))]
pub(super) fn file_id(_meta: &fs::Metadata) -> Option<FileId> {
    None
}

/// The files whose directory entry a writer has synced, each by the path
/// it was written at.
#[derive(Debug, Default)]
pub(super) struct Synced {
    at: HashMap<PathBuf, FileId>,
}

impl Synced {
    /// Whether the entry of `found`, the file now at `path`, is known
    /// synced: it is the very file remembered there. A file that cannot be
    /// told (`None`) never is.
    pub(super) fn holds(&self, path: &Path, found: Option<&FileId>) -> bool {
        found.is_some_and(|found| self.at.get(path) == Some(found))
    }

    /// Remembers a batch's files, each at its path, as the batch left them
    /// once their directories were synced. A file that cannot be told is
    /// forgotten.
    pub(super) fn remember<'p>(&mut self, files: impl IntoIterator<Item = (&'p Path, Option<FileId>)>) {
        let files: Vec<_> = files.into_iter().collect();
        if self.at.len() + files.len() > REMEMBERED_FILES {
            self.at.clear();
        }
        for (path, id) in files {
            match id {
                Some(id) => self.at.insert(path.to_owned(), id),
                None => self.at.remove(path),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn id(ino: u64, born: u64) -> FileId {
        FileId {
            dev: 1,
            ino,
            made: Made::Born(SystemTime::UNIX_EPOCH + Duration::from_secs(born)),
        }
    }

    /// The decision the writer makes, where the file system cannot be
    /// relied on to hand a freed inode to the next file: a file given the
    /// inode of one synced before, at its path or another, is new.
    #[test]
    fn a_file_given_the_inode_of_a_synced_one_is_not_taken_for_it() {
        let path = Path::new("/logs/out.jsonl");
        let mut synced = Synced::default();
        synced.remember([
            (Path::new("/logs/out.jsonl.2"), Some(id(7, 100))),
            (path, Some(id(8, 200))),
        ]);
        assert!(synced.holds(path, Some(&id(8, 200))), "the file synced there");
        // The oldest deleted and a file made at `path` with its inode.
        assert!(!synced.holds(path, Some(&id(7, 100))), "another path's file");
        assert!(!synced.holds(path, Some(&id(7, 300))));
        // The file at `path` deleted and made again with its inode.
        assert!(!synced.holds(path, Some(&id(8, 300))), "born later");
        let changed = |secs| FileId {
            made: Made::Changed(secs, 0),
            ..id(8, 0)
        };
        synced.remember([(path, Some(changed(400)))]);
        assert!(synced.holds(path, Some(&changed(400))));
        assert!(!synced.holds(path, Some(&changed(401))), "changed since");
        assert!(!synced.holds(path, None), "a file that cannot be told");
        synced.remember([(path, None)]);
        assert!(!synced.holds(path, Some(&changed(400))), "forgotten");
    }

    #[test]
    fn the_memory_is_bounded() {
        let paths: Vec<PathBuf> = (0..=REMEMBERED_FILES).map(|i| PathBuf::from(format!("/{i}"))).collect();
        let mut synced = Synced::default();
        synced.remember(paths[..REMEMBERED_FILES].iter().map(|p| (p.as_path(), Some(id(1, 1)))));
        assert_eq!(synced.at.len(), REMEMBERED_FILES);
        synced.remember([(paths[REMEMBERED_FILES].as_path(), Some(id(1, 1)))]);
        assert_eq!(synced.at.len(), 1);
        assert!(synced.holds(&paths[REMEMBERED_FILES], Some(&id(1, 1))));
    }
}
