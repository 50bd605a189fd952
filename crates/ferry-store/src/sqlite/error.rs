use ferry_core::StoreError;

/// Classifies a database error: a busy or unreachable file is transient, a
/// missing table is a configuration problem (run `ferry migrate`), the rest
/// permanent.
pub fn store_error(err: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    match &err {
        E::Io(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Protocol(_) => {
            StoreError::transient(format!("database unreachable: {err}"))
        }
        E::Database(db) => {
            // SQLite reports the extended result code; the primary code is
            // its low byte.
            let code: i64 = db.code().and_then(|c| c.parse().ok()).unwrap_or(1);
            match code & 0xff {
                // SQLITE_ERROR: a missing table or column means an old schema.
                1 if db.message().contains("no such table") || db.message().contains("no such column") => {
                    StoreError::config(format!(
                        "{err}: the ferry tables are missing or out of date; run `ferry migrate`"
                    ))
                }
                // BUSY, LOCKED, IOERR, FULL, CANTOPEN, PROTOCOL
                5 | 6 | 10 | 13 | 14 | 15 => StoreError::transient(err.to_string()),
                // READONLY: the file or its directory is not writable.
                8 => StoreError::config(format!(
                    "{err}: the database file is read-only; give the relay write access to the file and its directory"
                )),
                _ => StoreError::permanent(err.to_string()),
            }
        }
        _ => StoreError::permanent(err.to_string()),
    }
}
