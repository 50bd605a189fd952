//! The error a handler returns, saying whether to try again.

use std::any::Any;
use std::fmt;

use ferry_core::ErrorKind;

/// Why a handler failed, and whether trying again can help.
///
/// Any error type converts into a transient one with `?`, so a handler reads
/// like ordinary code; [`HandlerError::permanent`] sends the event to the
/// dead-letter destination at once (a payload that will never parse, say).
/// Deliberately not a `std::error::Error` itself, so the blanket `From`
/// cannot overlap with the reflexive one.
///
/// The message is recorded in the inbox row and sent with a dead letter, so
/// a NUL byte in it, which PostgreSQL cannot store in text, is replaced with
/// U+FFFD: recording the failure must not fail for the text of the error.
pub struct HandlerError {
    kind: ErrorKind,
    message: String,
}

impl HandlerError {
    /// Worth another attempt: the event is redelivered after a backoff.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Transient, message.into())
    }

    /// Never going to work: dead-lettered without further attempts.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Permanent, message.into())
    }

    /// A handler that panicked: transient, so it is counted like any failed
    /// attempt and dead-lettered after the last one, never left to crash the
    /// consumer on the same message again and again.
    pub(crate) fn panicked(panic: Box<dyn Any + Send>) -> Self {
        let what = match panic.downcast::<String>() {
            Ok(message) => *message,
            Err(panic) => match panic.downcast::<&'static str>() {
                Ok(message) => (*message).to_owned(),
                Err(_) => "a panic without a message".to_owned(),
            },
        };
        Self::transient(format!("the handler panicked: {what}"))
    }

    fn new(kind: ErrorKind, mut message: String) -> Self {
        if message.contains('\0') {
            message = message.replace('\0', "\u{FFFD}");
        }
        Self { kind, message }
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

    #[test]
    fn a_panic_is_a_transient_error_with_its_message() {
        let e = HandlerError::panicked(Box::new("index out of bounds"));
        assert_eq!(
            (e.is_permanent(), e.message()),
            (false, "the handler panicked: index out of bounds")
        );
        let e = HandlerError::panicked(Box::new(format!("order {}", 7)));
        assert_eq!(e.message(), "the handler panicked: order 7");
        assert_eq!(
            HandlerError::panicked(Box::new(7)).message(),
            "the handler panicked: a panic without a message"
        );
    }

    #[test]
    fn a_nul_byte_in_the_message_is_replaced() {
        assert_eq!(HandlerError::transient("a\0b").message(), "a\u{FFFD}b");
        let e = HandlerError::from(std::io::Error::other("c\0"));
        assert_eq!(e.to_string(), "c\u{FFFD}");
    }
}
