use std::ffi::OsString;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::PathBuf;

use ferry_core::StoreError;
use sqlx::SqlitePool;

use super::error::store_error;

/// One relay per database file. SQLite has no leases that another host could
/// see, and its single writer gains nothing from a second relay, so a second
/// relay on the same file is refused rather than left to contend.
///
/// The lock is an advisory exclusive lock on a file beside the database,
/// taken once and held until the store is dropped; the operating system
/// releases it when the process dies, so a crashed relay never blocks the
/// next one. Which file the database is comes from SQLite itself, not from
/// the URL, so every spelling of one file (a relative path, `sqlite://`,
/// a `file:` URI) takes the same lock.
#[derive(Debug, Default)]
pub(super) struct RelayLock {
    /// Held across the first acquisition's query, so that two ticks of one
    /// store never open the lock file twice (a second open file would find
    /// the first one's lock).
    held: tokio::sync::Mutex<Option<Held>>,
}

#[derive(Debug)]
enum Held {
    /// An in-memory database, which no other process can open.
    InMemory,
    /// The lock file, open: the lock lasts as long as it does.
    File(#[expect(dead_code, reason = "held for its lock, never read")] File),
}

impl RelayLock {
    /// Takes the lock unless this store already holds it.
    pub(super) async fn acquire(&self, pool: &SqlitePool) -> Result<(), StoreError> {
        let mut held = self.held.lock().await;
        if held.is_some() {
            return Ok(());
        }
        // Empty for an in-memory or temporary database; otherwise the
        // file's absolute path, however the URL named it. This is the
        // relay's first contact with a lazily opened pool: a file that
        // cannot be opened is a configuration error here (see
        // `store_error`), not a busy moment to retry for ever.
        let file: String = sqlx::query_scalar("SELECT file FROM pragma_database_list WHERE name = 'main'")
            .fetch_one(pool)
            .await
            .map_err(|e| {
                let mut err = store_error(e);
                let named = pool.connect_options();
                err.message = format!("SQLite database {}: {}", named.get_filename().display(), err.message);
                err
            })?;
        if file.is_empty() {
            *held = Some(Held::InMemory);
            return Ok(());
        }
        let database = PathBuf::from(file);
        let mut path = OsString::from(database.as_os_str());
        path.push(".relay-lock");
        let path = PathBuf::from(path);
        let db = database.display();
        let lock = path.display();
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
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
        *held = Some(Held::File(file));
        Ok(())
    }
}
