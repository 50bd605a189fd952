use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::{ErrorKind, PublishOutcome};

/// How failed deliveries are retried.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts before a delivery is dead (the first publish counts as one).
    pub max_attempts: u32,
    /// Delay after the first failure; doubles with each further failure.
    pub base_delay: Duration,
    /// The delay never grows past this.
    pub max_delay: Duration,
    /// Fraction of the delay that is randomised (0 = none, 1 = full jitter).
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 12,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(300),
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// The delay before attempt `failures + 1`, given `failures` so far (>= 1).
    /// `unit` is a random number in `[0, 1)`, passed in so tests are exact.
    pub fn backoff(&self, failures: u32, unit: f64) -> Duration {
        let exp = failures.saturating_sub(1).min(30);
        let raw = self.base_delay.saturating_mul(1u32 << exp.min(31));
        let capped = raw.min(self.max_delay);
        let jitter = self.jitter.clamp(0.0, 1.0);
        let factor = 1.0 - jitter * unit.clamp(0.0, 1.0);
        capped.mul_f64(factor)
    }
}

/// What the store must do with a delivery after an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// Confirmed by the destination.
    Published { attempts: u32, at: DateTime<Utc> },
    /// Failed transiently; try again at `next_at`.
    Retry {
        attempts: u32,
        next_at: DateTime<Utc>,
        error: String,
    },
    /// Failed for good: max attempts reached or a permanent error.
    Dead { attempts: u32, reason: String },
}

impl Transition {
    pub fn attempts(&self) -> u32 {
        match self {
            Transition::Published { attempts, .. }
            | Transition::Retry { attempts, .. }
            | Transition::Dead { attempts, .. } => *attempts,
        }
    }
}

/// The one lifecycle decision: after an attempt with `outcome`, made when the
/// delivery had `previous_attempts` attempts behind it, what happens next.
///
/// ```
/// use chrono::Utc;
/// use ferry_core::{decide, RetryPolicy, SinkError, Transition};
/// let now = Utc::now();
/// let policy = RetryPolicy::default();
/// let t = decide(0, &Err(SinkError::transient("broker down")), now, &policy, 0.0);
/// assert!(matches!(t, Transition::Retry { attempts: 1, .. }));
/// let t = decide(0, &Err(SinkError::permanent("unroutable")), now, &policy, 0.0);
/// assert!(matches!(t, Transition::Dead { attempts: 1, .. }));
/// ```
pub fn decide(
    previous_attempts: u32,
    outcome: &PublishOutcome,
    now: DateTime<Utc>,
    policy: &RetryPolicy,
    unit: f64,
) -> Transition {
    let attempts = previous_attempts.saturating_add(1);
    match outcome {
        Ok(()) => Transition::Published { attempts, at: now },
        Err(err) => match err.kind {
            ErrorKind::Transient if attempts < policy.max_attempts.max(1) => {
                // A destination that asked for a pause gets it, up to the
                // policy's longest delay.
                let asked = err
                    .retry_after
                    .map_or(std::time::Duration::ZERO, |d| d.min(policy.max_delay));
                let delay = policy.backoff(attempts, unit).max(asked);
                let delay = chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX);
                Transition::Retry {
                    attempts,
                    next_at: now + delay,
                    error: storable(err.to_string()),
                }
            }
            ErrorKind::Transient => Transition::Dead {
                attempts,
                reason: storable(format!(
                    "max attempts ({}) reached; last error: {err}",
                    policy.max_attempts
                )),
            },
            _ => Transition::Dead {
                attempts,
                reason: storable(err.to_string()),
            },
        },
    }
}

/// An error text as a store can keep it: a destination's text can hold a
/// NUL byte (a binary error body), which PostgreSQL refuses in text, and
/// the outcome could never be written. The byte becomes U+FFFD, as in the
/// inbox's reasons.
fn storable(text: String) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SinkError;
    use proptest::prelude::*;

    #[test]
    fn an_error_text_is_kept_without_nul_bytes() {
        let now = Utc::now();
        let err = Err(SinkError::transient("bad\0gateway"));
        match decide(0, &err, now, &policy(), 0.0) {
            Transition::Retry { error, .. } => assert!(error.starts_with("bad\u{FFFD}gateway"), "{error}"),
            other => panic!("{other:?}"),
        }
        match decide(0, &Err(SinkError::permanent("no\0")), now, &policy(), 0.0) {
            Transition::Dead { reason, .. } => assert!(!reason.contains('\0'), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(10),
            jitter: 0.5,
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = policy();
        let d: Vec<u64> = (1..=6).map(|f| p.backoff(f, 0.0).as_secs()).collect();
        assert_eq!(d, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(p.backoff(1, 0.999_999).as_millis(), 500);
    }

    #[test]
    fn transient_retries_until_max_then_dead() {
        let now = Utc::now();
        let p = policy();
        let err: PublishOutcome = Err(SinkError::transient("timeout"));
        for prev in 0..4 {
            match decide(prev, &err, now, &p, 0.0) {
                Transition::Retry {
                    attempts,
                    next_at,
                    error,
                } => {
                    assert_eq!(attempts, prev + 1);
                    assert!(next_at > now);
                    assert!(error.contains("timeout"));
                }
                t => panic!("expected retry, got {t:?}"),
            }
        }
        match decide(4, &err, now, &p, 0.0) {
            Transition::Dead { attempts: 5, reason } => assert!(reason.contains("max attempts (5)"), "{reason}"),
            t => panic!("expected dead, got {t:?}"),
        }
    }

    #[test]
    fn a_destination_asking_for_a_pause_gets_it_up_to_the_longest_delay() {
        let now = Utc::now();
        let p = policy();
        let next = |asked: u64| match decide(
            0,
            &Err(SinkError::transient("busy").with_retry_after(Duration::from_secs(asked))),
            now,
            &p,
            0.0,
        ) {
            Transition::Retry { next_at, .. } => (next_at - now).to_std().unwrap(),
            other => panic!("{other:?}"),
        };
        // The first backoff is 1 s: a shorter ask changes nothing, a longer
        // one is honoured, one past the policy's 10 s longest delay is capped.
        assert_eq!(next(0), Duration::from_secs(1));
        assert_eq!(next(7), Duration::from_secs(7));
        assert_eq!(next(3600), Duration::from_secs(10));
    }

    #[test]
    fn permanent_and_config_errors_are_dead_at_once() {
        let now = Utc::now();
        for err in [SinkError::permanent("no route"), SinkError::config("bad exchange")] {
            let t = decide(0, &Err(err), now, &policy(), 0.0);
            assert!(matches!(t, Transition::Dead { attempts: 1, .. }), "{t:?}");
        }
    }

    #[test]
    fn success_is_published_now() {
        let now = Utc::now();
        assert_eq!(
            decide(3, &Ok(()), now, &policy(), 0.3),
            Transition::Published { attempts: 4, at: now }
        );
    }

    proptest! {
        #[test]
        fn backoff_stays_within_bounds(failures in 1u32..100, unit in 0.0f64..1.0) {
            let p = policy();
            let d = p.backoff(failures, unit);
            prop_assert!(d <= p.max_delay);
            prop_assert!(d >= p.base_delay.mul_f64(1.0 - p.jitter).min(p.max_delay.mul_f64(1.0 - p.jitter)));
        }

        #[test]
        fn a_delivery_never_outlives_max_attempts(prev in 0u32..50) {
            let t = decide(prev, &Err(SinkError::transient("x")), Utc::now(), &policy(), 0.5);
            if prev + 1 >= 5 {
                prop_assert!(matches!(t, Transition::Dead { .. }), "dead expected");
            } else {
                prop_assert!(matches!(t, Transition::Retry { .. }), "retry expected");
            }
        }
    }
}
