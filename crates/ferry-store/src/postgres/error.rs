use ferry_core::StoreError;

/// Classifies a database error: connection trouble and waits cut short are
/// transient, a missing schema is a configuration problem (run `ferry
/// migrate`), the rest permanent.
pub fn store_error(err: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    match &err {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Protocol(_) => {
            StoreError::transient(format!("database unreachable: {err}"))
        }
        E::Database(_) if missing_schema(&err) => StoreError::config(format!(
            "{err}: the ferry schema is missing or out of date; run `ferry migrate`"
        )),
        E::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                // serialization failure, deadlock, too many connections, shutting down
                "40001" | "40P01" | "53300" | "57P01" | "57P02" | "57P03" => StoreError::transient(err.to_string()),
                // A wait cut short: a relay's tick behind an operator's
                // batch, or another relay's tick, outlasting a
                // `statement_timeout` from the URL's options is a busy
                // moment that passes, not a broken store. The relay retries;
                // an admin command retries a few times, then reports it.
                "57014" => StoreError::transient(format!(
                    "{err}: the statement outlasted statement_timeout (or was cancelled by pg_cancel_backend), \
                     often while waiting on a lock another transaction held"
                )),
                "55P03" => StoreError::transient(format!(
                    "{err}: a row or table stayed locked by another transaction for longer than lock_timeout"
                )),
                c if c.starts_with("08") => StoreError::transient(err.to_string()),
                _ => StoreError::permanent(err.to_string()),
            }
        }
        _ => StoreError::permanent(err.to_string()),
    }
}

/// Whether `err` says the ferry schema is missing or out of date: an
/// undefined schema, table, function or column.
pub(crate) fn missing_schema(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| matches!(code.as_ref(), "3F000" | "42P01" | "42883" | "42703"))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::error::Error as StdError;

    use ferry_core::ErrorKind;
    use sqlx::error::{DatabaseError, ErrorKind as DbErrorKind};

    use super::store_error;

    /// A server error with just a SQLSTATE, as PostgreSQL sends it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error {}", self.0)
        }
    }

    impl StdError for Coded {}

    impl DatabaseError for Coded {
        fn message(&self) -> &str {
            "error"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn StdError + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> DbErrorKind {
            DbErrorKind::Other
        }
    }

    fn kind_of(code: &'static str) -> ErrorKind {
        store_error(sqlx::Error::Database(Box::new(Coded(code)))).kind
    }

    #[test]
    fn a_statement_or_lock_timeout_is_transient() {
        // query_canceled (statement_timeout, pg_cancel_backend) and
        // lock_not_available (lock_timeout): the relay retries them.
        assert_eq!(kind_of("57014"), ErrorKind::Transient);
        assert_eq!(kind_of("55P03"), ErrorKind::Transient);
        let message = store_error(sqlx::Error::Database(Box::new(Coded("57014")))).message;
        assert!(message.contains("statement_timeout"), "{message}");
        let message = store_error(sqlx::Error::Database(Box::new(Coded("55P03")))).message;
        assert!(message.contains("lock_timeout"), "{message}");
    }

    #[test]
    fn other_codes_keep_their_kind() {
        for code in ["40001", "40P01", "53300", "57P01", "08006"] {
            assert_eq!(kind_of(code), ErrorKind::Transient, "{code}");
        }
        for code in ["3F000", "42P01", "42883", "42703"] {
            assert_eq!(kind_of(code), ErrorKind::Config, "{code}");
        }
        // A refused statement (unique or check violation, bad input, no
        // privilege) stays permanent.
        for code in ["23505", "23514", "22P02", "42501"] {
            assert_eq!(kind_of(code), ErrorKind::Permanent, "{code}");
        }
    }
}
