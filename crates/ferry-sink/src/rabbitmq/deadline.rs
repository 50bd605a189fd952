//! The one bound on a publish call: `publish_timeout` from when the call
//! has the connection (not counting its wait behind other batches), and
//! at most twice that, less a margin, from the call's start.
//!
//! The relay bounds a publish too (its direct publish timeout, the lease),
//! and past that bound it reports every event failed, including those the
//! broker acked, which are then sent twice. So no step of a call (a
//! reconnect, an exchange check, a channel open, a write, a confirm) gets
//! a timeout of its own: each gets what is left of the call's, and none
//! starts once it is spent.

use std::time::Duration;

use ferry_core::SinkError;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub(crate) struct Deadline {
    at: Instant,
    /// The whole call's time, for messages.
    timeout: Duration,
    /// The sink's name, for messages naming its setting.
    sink: String,
}

impl Deadline {
    /// `timeout` from now, for a call to sink `sink`.
    pub(crate) fn after(timeout: Duration, sink: &str) -> Self {
        Self {
            at: Instant::now() + timeout,
            timeout,
            sink: sink.to_owned(),
        }
    }

    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// What is left, zero once it passed.
    pub(crate) fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub(crate) fn passed(&self) -> bool {
        self.left().is_zero()
    }

    /// This deadline, brought forward to `at` if that is earlier: a part of
    /// the call that must leave the rest time to run.
    pub(crate) fn until(&self, at: Instant) -> Self {
        Self {
            at: self.at.min(at),
            ..self.clone()
        }
    }

    /// The error for what the call's time running out stopped; `what` says
    /// what was not done.
    pub(crate) fn error(&self, what: &str) -> SinkError {
        let sink = &self.sink;
        SinkError::transient(format!(
            "{what}: the publish call used up sinks.{sink}.publish_timeout ({:?}), and is retried; \
             if RabbitMQ is slow rather than down, raise sinks.{sink}.publish_timeout",
            self.timeout
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brought_forward_never_put_back() {
        let deadline = Deadline::after(Duration::from_secs(10), "rabbit");
        let sooner = deadline.until(Instant::now() + Duration::from_secs(1));
        assert!(sooner.left() <= Duration::from_secs(1));
        let later = deadline.until(Instant::now() + Duration::from_secs(60));
        assert_eq!(later.at(), deadline.at());
        assert!(!deadline.passed());
        let spent = deadline.until(Instant::now());
        assert!(spent.passed() && spent.left().is_zero());
        let err = spent.error("not sent");
        assert!(err.is_transient(), "{err}");
        assert!(err.message.starts_with("not sent: "), "{err}");
        assert!(err.message.contains("sinks.rabbit.publish_timeout (10s)"), "{err}");
    }
}
