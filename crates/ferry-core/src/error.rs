use std::fmt;

/// How a failure should be handled. The relay branches on this, never on text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Worth retrying: a broker or database that is down, a timeout, a 5xx.
    Transient,
    /// Retrying cannot help: unroutable, too large, rejected as malformed.
    Permanent,
    /// The operator's configuration is wrong; fix it and restart.
    Config,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
            ErrorKind::Config => "config",
        })
    }
}

/// A producer-side input that Ferry refuses, naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid event {field}: {problem}; {fix}")]
pub struct ValidationError {
    pub field: &'static str,
    pub problem: String,
    pub fix: &'static str,
}

impl ValidationError {
    pub(crate) fn new(field: &'static str, problem: impl Into<String>, fix: &'static str) -> Self {
        Self {
            field,
            problem: problem.into(),
            fix,
        }
    }
}
