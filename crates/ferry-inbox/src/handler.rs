//! The error a handler returns, saying whether to try again.

use std::fmt;

use ferry_core::ErrorKind;

/// Why a handler failed, and whether trying again can help.
///
/// Any error type converts into a transient one with `?`, so a handler reads
/// like ordinary code; [`HandlerError::permanent`] sends the event to the
/// dead-letter destination at once (a payload that will never parse, say).
/// Deliberately not a `std::error::Error` itself, so the blanket `From`
/// cannot overlap with the reflexive one.
pub struct HandlerError {
    kind: ErrorKind,
    message: String,
}

impl HandlerError {
    /// Worth another attempt: the event is redelivered after a backoff.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            message: message.into(),
        }
    }

    /// Never going to work: dead-lettered without further attempts.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            message: message.into(),
        }
    }

    pub fn is_permanent(&self) -> bool {
        self.kind != ErrorKind::Transient
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        let mut message = e.to_string();
        let mut source = e.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Self::transient(message)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandlerError({:?}: {})", self.kind, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_error_is_transient_with_its_causes() {
        let io = std::io::Error::other("disk full");
        let e = HandlerError::from(io);
        assert!(!e.is_permanent());
        assert_eq!(e.message(), "disk full");
        assert!(HandlerError::permanent("bad payload").is_permanent());
    }
}
