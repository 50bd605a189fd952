use ferry_core::StoreError;

/// Classifies a database error: connection trouble is transient, a missing
/// schema is a configuration problem (run `ferry migrate`), the rest permanent.
pub fn store_error(err: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    match &err {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Protocol(_) => {
            StoreError::transient(format!("database unreachable: {err}"))
        }
        E::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                // undefined schema, table, function, column
                "3F000" | "42P01" | "42883" | "42703" => StoreError::config(format!(
                    "{err}: the ferry schema is missing or out of date; run `ferry migrate`"
                )),
                // serialization failure, deadlock, too many connections, shutting down
                "40001" | "40P01" | "53300" | "57P01" | "57P02" | "57P03" => StoreError::transient(err.to_string()),
                c if c.starts_with("08") => StoreError::transient(err.to_string()),
                _ => StoreError::permanent(err.to_string()),
            }
        }
        _ => StoreError::permanent(err.to_string()),
    }
}
