//! How many publishing channels a link holds, and whether the broker allows
//! one more for the passive declares that check exchanges.
//!
//! A refusal (530 NOT_ALLOWED for a user's `max-channels` or a node's
//! channel limit; lapin's own for the negotiated `channel_max`) lowers the
//! number, but not for good: the refusal may be brief (another connection
//! of the same user during a rolling deploy, RabbitMQ counting closed
//! channels a moment late), so the configured number is tried again after a
//! cool-down. Trying costs at most a reconnect before any event is sent, and
//! the cool-down doubles while the broker keeps refusing, up to
//! [`RETRY_AFTER_MAX`].
//!
//! Deciding only: the connector owns the clock and the channels.

use std::time::{Duration, Instant};

/// How long after a refusal the configured number is tried again.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(60);
/// The longest cool-down, reached while the broker keeps refusing.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(600);

#[derive(Debug)]
pub(crate) struct Lanes {
    /// The sink's `channels` setting.
    configured: usize,
    /// The channels a link publishes over now.
    current: usize,
    /// Whether the broker allows a channel beyond the publishing ones:
    /// assumed until a refusal says otherwise.
    spare: bool,
    /// The refusal that lowered `current`, for `check` to report; kept
    /// until the configured number opens.
    refusal: Option<String>,
    /// When the last refusal lowered the number (or took the spare).
    lowered_at: Option<Instant>,
    /// The configured number was tried again and has not opened yet.
    retrying: bool,
    /// The cool-down now in force.
    retry_after: Duration,
    /// The first cool-down, and the one after a success.
    base: Duration,
}

impl Lanes {
    pub(crate) fn new(configured: usize, retry_after: Duration) -> Self {
        let configured = configured.max(1);
        Self {
            configured,
            current: configured,
            spare: true,
            refusal: None,
            lowered_at: None,
            retrying: false,
            retry_after,
            base: retry_after,
        }
    }

    pub(crate) fn configured(&self) -> usize {
        self.configured
    }

    pub(crate) fn current(&self) -> usize {
        self.current
    }

    pub(crate) fn spare(&self) -> bool {
        self.spare
    }

    pub(crate) fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// Sets the first cool-down (and the one now in force).
    pub(crate) fn set_retry_after(&mut self, retry_after: Duration) {
        self.base = retry_after;
        self.retry_after = retry_after;
    }

    /// The broker allows `allowed` channels (at least 1), not one more:
    /// publish over one fewer, leaving one spare for passive declares, or
    /// over the one, with none spare. Returns the new number.
    pub(crate) fn refused(&mut self, allowed: usize, refusal: String, now: Instant) -> usize {
        self.current = allowed.saturating_sub(1).max(1);
        self.spare = allowed >= 2;
        self.refusal = Some(refusal);
        self.lowered(now);
        self.current
    }

    /// The broker refused a channel for a passive declare beside the
    /// publishing ones.
    pub(crate) fn no_spare(&mut self, now: Instant) {
        self.spare = false;
        self.lowered(now);
    }

    fn lowered(&mut self, now: Instant) {
        if self.retrying {
            self.retry_after = (self.retry_after * 2).min(RETRY_AFTER_MAX);
            self.retrying = false;
        }
        self.lowered_at = Some(now);
    }

    /// Whether the cool-down after a refusal has passed; if so, the
    /// configured number and a spare are assumed again, to be tried.
    pub(crate) fn retry_due(&mut self, now: Instant) -> bool {
        let Some(at) = self.lowered_at else { return false };
        if now.saturating_duration_since(at) < self.retry_after {
            return false;
        }
        self.current = self.configured;
        self.spare = true;
        self.lowered_at = None;
        self.retrying = true;
        true
    }

    /// A link opened `n` publishing channels: the configured number means
    /// the broker's limit no longer stands in the way.
    pub(crate) fn opened(&mut self, n: usize) {
        if n >= self.configured {
            self.refusal = None;
            if self.retrying {
                self.retrying = false;
                self.retry_after = self.base;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_after_a_refusal_then_the_configured_number_after_the_cool_down() {
        let start = Instant::now();
        let mut lanes = Lanes::new(4, RETRY_AFTER);
        assert_eq!((lanes.current(), lanes.spare()), (4, true));
        lanes.opened(4);
        assert_eq!(lanes.refused(3, "530".into(), start), 2, "one left spare");
        assert!(lanes.spare());
        assert_eq!(lanes.refusal(), Some("530"));
        assert!(!lanes.retry_due(start + RETRY_AFTER / 2));
        assert_eq!(lanes.current(), 2);

        assert!(lanes.retry_due(start + RETRY_AFTER));
        assert_eq!((lanes.current(), lanes.spare()), (4, true));
        assert!(!lanes.retry_due(start + RETRY_AFTER * 3), "tried once per refusal");
        lanes.opened(4);
        assert_eq!(lanes.refusal(), None, "nothing left to report");
    }

    #[test]
    fn the_cool_down_doubles_while_the_broker_keeps_refusing() {
        let mut now = Instant::now();
        let mut lanes = Lanes::new(2, RETRY_AFTER);
        lanes.refused(1, "530".into(), now);
        assert_eq!((lanes.current(), lanes.spare()), (1, false), "the one, none spare");
        let mut waits = Vec::new();
        for _ in 0..6 {
            let mut waited = Duration::ZERO;
            while !lanes.retry_due(now + waited) {
                waited += Duration::from_secs(1);
            }
            waits.push(waited.as_secs());
            now += waited;
            lanes.opened(1);
            lanes.refused(1, "530".into(), now);
        }
        assert_eq!(waits, [60, 120, 240, 480, 600, 600]);

        // Once the configured number opens, the next refusal waits the base.
        now += RETRY_AFTER_MAX;
        assert!(lanes.retry_due(now));
        lanes.opened(2);
        lanes.refused(1, "530".into(), now);
        assert!(!lanes.retry_due(now + RETRY_AFTER - Duration::from_secs(1)));
        assert!(lanes.retry_due(now + RETRY_AFTER));
    }

    #[test]
    fn a_refused_spare_is_tried_again_too() {
        let now = Instant::now();
        let mut lanes = Lanes::new(2, Duration::from_millis(10));
        lanes.no_spare(now);
        assert_eq!((lanes.current(), lanes.spare()), (2, false));
        assert_eq!(lanes.refusal(), None, "publishing over all configured");
        assert!(lanes.retry_due(now + Duration::from_millis(10)));
        assert!(lanes.spare());
    }
}
