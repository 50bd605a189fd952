//! Reconnect pacing shared by the sinks that hold a connection.
//!
//! Deciding is split from doing: [`Backoff`] only answers "may I try now?"
//! and records results; the caller owns the clock and the connect call, so
//! the schedule is tested without a broker or a sleep.

use std::time::{Duration, Instant};

/// The delay after the first failed attempt; it doubles per failure.
pub(crate) const BASE_DELAY: Duration = Duration::from_millis(200);

/// Exponential backoff between failed connection attempts.
///
/// A connection that was up and then broke does not count as a failure: the
/// first attempt after a loss is immediate, so a broker restart costs one
/// round trip, not a backoff period.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    max: Duration,
    failures: u32,
    next_attempt: Option<Instant>,
    last_error: Option<String>,
}

impl Backoff {
    pub(crate) fn new(max: Duration) -> Self {
        Self {
            max,
            failures: 0,
            next_attempt: None,
            last_error: None,
        }
    }

    /// `Ok` if an attempt may be made at `now`; otherwise how long remains.
    pub(crate) fn ready(&self, now: Instant) -> Result<(), Duration> {
        match self.next_attempt {
            Some(at) if at > now => Err(at - now),
            _ => Ok(()),
        }
    }

    /// Records a failed attempt at `now` and returns the delay before the next.
    pub(crate) fn failed(&mut self, now: Instant, error: impl Into<String>) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let delay = delay_for(self.failures, self.max);
        self.next_attempt = Some(now + delay);
        self.last_error = Some(error.into());
        delay
    }

    /// Records a successful attempt: the next failure starts from the base delay.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
        self.next_attempt = None;
        self.last_error = None;
    }

    pub(crate) fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }
}

/// `BASE_DELAY * 2^(failures-1)`, capped at `max`.
fn delay_for(failures: u32, max: Duration) -> Duration {
    let exponent = failures.saturating_sub(1).min(20);
    BASE_DELAY.saturating_mul(1 << exponent).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let max = Duration::from_secs(30);
        let delays: Vec<_> = (1..=10).map(|n| delay_for(n, max)).collect();
        assert_eq!(delays[0], Duration::from_millis(200));
        assert_eq!(delays[1], Duration::from_millis(400));
        assert_eq!(delays[4], Duration::from_millis(3200));
        assert_eq!(delays[9], max);
        assert_eq!(delay_for(u32::MAX, max), max);
    }

    #[test]
    fn gates_attempts_until_the_delay_passes() {
        let start = Instant::now();
        let mut b = Backoff::new(Duration::from_secs(1));
        assert_eq!(b.ready(start), Ok(()));
        assert_eq!(b.failed(start, "refused"), Duration::from_millis(200));
        assert_eq!(b.ready(start), Err(Duration::from_millis(200)));
        assert_eq!(b.last_error(), Some("refused"));
        let later = start + Duration::from_millis(200);
        assert_eq!(b.ready(later), Ok(()));
        assert_eq!(b.failed(later, "refused"), Duration::from_millis(400));
        for _ in 0..10 {
            b.failed(later, "refused");
        }
        assert_eq!(b.ready(later), Err(Duration::from_secs(1)));
        b.succeeded();
        assert_eq!(b.ready(later), Ok(()));
        assert_eq!(b.last_error(), None);
    }
}
