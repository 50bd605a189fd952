use std::ffi::OsString;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ferry_core::StoreError;

/// One relay per database file. SQLite has no leases that another host could
/// see, and its single writer gains nothing from a second relay, so a second
/// relay on the same file is refused rather than left to contend.
///
/// The lock is an advisory exclusive lock on a file beside the database,
/// taken once and held until the store is dropped; the operating system
/// releases it when the process dies, so a crashed relay never blocks the
/// next one.
#[derive(Debug)]
pub(super) struct RelayLock {
    database: PathBuf,
    /// `None` for an in-memory database, which no other process can open.
    path: Option<PathBuf>,
    held: Mutex<Option<File>>,
}

impl RelayLock {
    pub(super) fn for_database(database: &Path) -> Self {
        let name = database.to_string_lossy();
        let in_memory = name.is_empty() || name == ":memory:" || name.starts_with("file:");
        let path = (!in_memory).then(|| {
            let mut p = OsString::from(database.as_os_str());
            p.push(".relay-lock");
            PathBuf::from(p)
        });
        Self {
            database: database.to_owned(),
            path,
            held: Mutex::new(None),
        }
    }

    /// Takes the lock unless this store already holds it.
    pub(super) fn acquire(&self) -> Result<(), StoreError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_some() {
            return Ok(());
        }
        let db = self.database.display();
        let lock = path.display();
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| {
                StoreError::config(format!(
                    "cannot open the relay lock file {lock} beside the SQLite database {db}: {e}; \
                     give the relay write access to the database's directory"
                ))
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => String::new(),
                    pid => format!(" (process {pid})"),
                };
                return Err(StoreError::config(format!(
                    "another relay{holder} is already running on the SQLite database {db} (it holds {lock}); \
                     SQLite takes one relay per database file: stop the other relay, \
                     or use PostgreSQL to run several relays"
                )));
            }
            Err(TryLockError::Error(e)) => {
                return Err(StoreError::config(format!(
                    "cannot lock {lock} beside the SQLite database {db}: {e}; \
                     put the database on a local file system that supports file locks"
                )));
            }
        }
        // Who holds it, for the next relay's error message; best effort.
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = write!(file, "{}", std::process::id());
        *held = Some(file);
        Ok(())
    }
}
