use ferry_core::StoreError;

/// Classifies a database error: a busy file or a failed read or write is
/// transient; a missing table (run `ferry migrate`), a file that cannot be
/// opened or is read-only are configuration problems, which retrying does
/// not mend; the rest permanent.
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
                1 if missing_schema(&err) => StoreError::config(format!(
                    "{err}: the ferry tables are missing or out of date; run `ferry migrate`"
                )),
                // BUSY, LOCKED, IOERR, FULL, PROTOCOL
                5 | 6 | 10 | 13 | 15 => StoreError::transient(err.to_string()),
                // CANTOPEN: the file's directory is missing or not
                // writable (SQLite creates the file, and its journal,
                // there). A relay retrying it would wait for ever.
                14 => StoreError::config(format!(
                    "{err}; check that the database file's directory exists and is writable"
                )),
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

/// Whether `err` says the ferry tables are missing or out of date
/// (SQLITE_ERROR: no such table or column).
pub(crate) fn missing_schema(err: &sqlx::Error) -> bool {
    err.as_database_error().is_some_and(|db| {
        let code: i64 = db.code().and_then(|c| c.parse().ok()).unwrap_or(1);
        code & 0xff == 1 && (db.message().contains("no such table") || db.message().contains("no such column"))
    })
}
