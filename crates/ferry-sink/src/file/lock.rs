//! The directory locks a batch holds while it writes (see the writer's
//! overview), waited for no longer than a deadline: a writer that holds one
//! and never lets go (a relay paused in a debugger or by SIGSTOP, a hung
//! mount) fails the batches behind it as transient, to be retried, instead
//! of stalling them, and the blocking-pool threads they run on, for ever.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a batch waits, in all, for the locks on its directories.
/// Well inside the relay's lease (30 s by default), so the batch's events
/// fail with a reason rather than being abandoned when the lease runs out.
pub(crate) const LOCK_WAIT: Duration = Duration::from_secs(10);

/// The longest pause between two tries for a lock: short, so a waiter
/// finds the lock in the gap between another writer's batches.
const MAX_PAUSE: Duration = Duration::from_millis(5);

/// Takes the exclusive lock on each directory of `dirs`, waiting up to
/// `wait` in all; they are released when the returned handles are dropped.
/// Returns the handles, and the error of each directory that could not be
/// opened or locked: one still held by another writer at the deadline
/// fails with [`io::ErrorKind::TimedOut`], its text naming the directory.
///
/// The lock is `flock`'s: it is held per open handle, so it excludes other
/// handles in this process as well as other processes, and a second handle
/// on a directory this batch already locked would never get it. So the
/// directories are told apart by what they are, (device, inode) of the open
/// handle, not by their paths, and each is locked once.
///
/// `flock` itself waits without a limit; a bounded wait is a loop of tries.
#[cfg(unix)]
pub(crate) fn lock_dirs(dirs: BTreeSet<&Path>, wait: Duration) -> (Vec<File>, HashMap<&Path, io::Error>) {
    use std::os::unix::fs::MetadataExt;
    let deadline = Instant::now() + wait;
    let mut unlocked = HashMap::new();
    let mut by_identity: BTreeMap<(u64, u64), (File, Vec<&Path>)> = BTreeMap::new();
    for dir in dirs {
        let opened = File::open(dir).and_then(|handle| {
            let meta = handle.metadata()?;
            Ok(((meta.dev(), meta.ino()), handle))
        });
        match opened {
            // A second path to a directory already opened: its handle is
            // closed unlocked, which leaves the first handle's lock alone.
            Ok((identity, handle)) => by_identity.entry(identity).or_insert((handle, Vec::new())).1.push(dir),
            Err(e) => {
                unlocked.insert(dir, e);
            }
        }
    }
    // Locked in the order of their canonical paths: one order for every
    // writer, whatever paths its batch names them by, and for plain paths
    // the order earlier releases lock in (by path), so that relays of both
    // kinds side by side during an upgrade never wait on each other in a
    // circle.
    let mut ordered: Vec<(PathBuf, File, Vec<&Path>)> = by_identity
        .into_values()
        .map(|(handle, paths)| {
            let key = fs::canonicalize(paths[0]).unwrap_or_else(|_| paths[0].to_path_buf());
            (key, handle, paths)
        })
        .collect();
    ordered.sort_by(|a, b| a.0.cmp(&b.0));
    let mut locks = Vec::with_capacity(ordered.len());
    for (_, handle, paths) in ordered {
        match lock_by(&handle, deadline) {
            Ok(()) => locks.push(handle),
            Err(e) => {
                let e = e.unwrap_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "another process (a relay, or another file sink of this one) holds the lock on {} \
                             and has not let it go in {wait:?}; it may be paused or stuck",
                            paths[0].display()
                        ),
                    )
                });
                for dir in paths {
                    unlocked.insert(dir, io::Error::new(e.kind(), e.to_string()));
                }
            }
        }
    }
    (locks, unlocked)
}

/// Tries for the lock on `handle` until `deadline`, at least once. `Err(None)`:
/// another handle held it all along.
#[cfg(unix)]
fn lock_by(handle: &File, deadline: Instant) -> Result<(), Option<io::Error>> {
    let mut pause = Duration::from_micros(100);
    loop {
        match handle.try_lock() {
            Ok(()) => return Ok(()),
            Err(TryLockError::Error(e)) => return Err(Some(e)),
            Err(TryLockError::WouldBlock) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(None);
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }
}

#[cfg(not(unix))]
pub(crate) fn lock_dirs(_dirs: BTreeSet<&Path>, _wait: Duration) -> (Vec<()>, HashMap<&Path, io::Error>) {
    (Vec::new(), HashMap::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer relay paused while it held a directory's lock: the batch
    /// waited on `flock` for ever, on a blocking-pool thread, and every
    /// batch after it behind the sink's lock. It gives up at the deadline,
    /// naming the directory, and still locks the directories that are free.
    #[test]
    fn a_lock_held_elsewhere_is_given_up_at_the_deadline_naming_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let held = dir.path().join("held");
        let free = dir.path().join("free");
        fs::create_dir(&held).unwrap();
        fs::create_dir(&free).unwrap();
        // Another handle excludes this one as another process's would.
        let peer = File::open(&held).unwrap();
        peer.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (held_path, free_path) = (held.clone(), free.clone());
        std::thread::spawn(move || {
            let dirs = BTreeSet::from([held_path.as_path(), free_path.as_path()]);
            let (locks, unlocked) = lock_dirs(dirs, Duration::from_millis(300));
            let errors: Vec<(PathBuf, io::ErrorKind, String)> = unlocked
                .into_iter()
                .map(|(dir, e)| (dir.to_owned(), e.kind(), e.to_string()))
                .collect();
            let _ = tx.send((locks.len(), errors));
        });
        let (locked, errors) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the lock held elsewhere was waited for without a limit");
        assert_eq!(locked, 1, "the free directory is locked: {errors:?}");
        let [(dir, kind, text)] = &errors[..] else {
            panic!("one directory not locked: {errors:?}")
        };
        assert_eq!(dir, &held);
        assert_eq!(*kind, io::ErrorKind::TimedOut);
        let says = format!(
            "another process (a relay, or another file sink of this one) holds the lock on {} and has not let \
             it go in 300ms",
            held.display()
        );
        assert!(text.contains(&says), "{text}");
        // Let go, it is taken at once.
        drop(peer);
        let (locks, unlocked) = lock_dirs(BTreeSet::from([held.as_path()]), Duration::from_millis(300));
        assert!(unlocked.is_empty(), "{unlocked:?}");
        assert_eq!(locks.len(), 1);
    }
}
