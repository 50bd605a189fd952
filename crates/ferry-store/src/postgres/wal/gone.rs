//! Which failures of the stream's writes say the server is going away or
//! cannot be reached ([`unreachable`]), as against a write refused by the
//! database it reached (a trigger, a constraint, a full disk).
//!
//! The streaming relay ends its session only on the first kind: a
//! walsender told to stop waits for its client to confirm everything sent,
//! and a relay that kept its stream open while it retried would hold a
//! clean stop of the server for good. On the second kind it retries with
//! the stream open, and replays nothing.

use ferry_core::{ErrorKind, StoreError};

use crate::postgres::store_error;

/// How a failure of [`unreachable`]'s kind begins (as
/// [`store_error`] words an I/O failure).
const UNREACHABLE: &str = "database unreachable: ";

/// Whether `e`, from [`WalSource::look`](super::WalSource::look) or
/// [`WalSource::settle`](super::WalSource::settle), says the server is going
/// away or cannot be reached: an I/O failure, the pool unable to connect,
/// SQLSTATE class 08 (connection exception), `57P01` (admin_shutdown),
/// `57P02` (crash_shutdown) or `57P03` (cannot_connect_now).
pub fn unreachable(e: &StoreError) -> bool {
    e.kind == ErrorKind::Transient && e.message.starts_with(UNREACHABLE)
}

/// A statement's failure, worded for [`unreachable`] when it is one.
pub(super) fn lost(err: sqlx::Error) -> StoreError {
    use sqlx::Error as E;
    let code = err.as_database_error().and_then(|db| db.code()).map(|c| c.into_owned());
    let gone = match &err {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed | E::Protocol(_) => true,
        E::Database(_) => code
            .as_deref()
            .is_some_and(|c| c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03")),
        _ => false,
    };
    if !gone {
        return store_error(err);
    }
    match code {
        Some(code) => StoreError::transient(format!("{UNREACHABLE}{err} (SQLSTATE {code})")),
        None => StoreError::transient(format!("{UNREACHABLE}{err}")),
    }
}

/// The pool's failure to hand over a connection: whatever the server said,
/// it could not be reached.
pub(super) fn unconnected(err: sqlx::Error) -> StoreError {
    match lost(err) {
        e if unreachable(&e) => e,
        e => StoreError::transient(format!("{UNREACHABLE}could not connect: {}", e.message)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_failures_and_pool_timeouts_are_unreachable_others_are_not() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(unreachable(&lost(io)));
        assert!(unreachable(&lost(sqlx::Error::PoolTimedOut)));
        assert!(!unreachable(&lost(sqlx::Error::RowNotFound)));
        assert!(unreachable(&unconnected(sqlx::Error::RowNotFound)));
        assert!(!unreachable(&StoreError::transient("anything")));
    }
}
