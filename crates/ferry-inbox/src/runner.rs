//! What every consumer runner shares: its report and its start-up error.

use std::sync::atomic::{AtomicU64, Ordering};

/// The longest dead-letter reason a header carries: a handler's error text
/// (a panic's, say) can be long, and the dead letter must fit the broker's
/// message size.
#[cfg(any(feature = "nats", feature = "kafka"))]
pub(crate) const MAX_REASON_BYTES: usize = 4096;

/// `reason`, cut at a character boundary to [`MAX_REASON_BYTES`].
#[cfg(any(feature = "nats", feature = "kafka"))]
pub(crate) fn bounded_reason(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// A consumer that cannot start; a broker or database outage is never one
/// (the runner waits and reconnects).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    #[error("invalid consumer options: {0}")]
    Config(String),
}

/// What a runner did: returned when it stops, and readable while it runs
/// through each runner's `report()`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    pub processed: u64,
    pub duplicates: u64,
    pub retried: u64,
    pub dead: u64,
    pub malformed: u64,
    /// Deliveries put back because the inbox's database was unreachable.
    pub inbox_unavailable: u64,
    /// Sessions that ended with the connection lost.
    pub reconnects: u64,
}

/// The live counters behind [`ConsumerReport`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) inbox_unavailable: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> ConsumerReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ConsumerReport {
            processed: get(&self.processed),
            duplicates: get(&self.duplicates),
            retried: get(&self.retried),
            dead: get(&self.dead),
            malformed: get(&self.malformed),
            inbox_unavailable: get(&self.inbox_unavailable),
            reconnects: get(&self.reconnects),
        }
    }
}

/// The pause between broker sessions: from 100 ms, doubling up to the
/// runner's `reconnect_max_delay`, and back to 100 ms after a session that
/// got as far as consuming.
pub(crate) struct Reconnect {
    delay: std::time::Duration,
    max: std::time::Duration,
}

impl Reconnect {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(100);

    pub(crate) fn new(max: std::time::Duration) -> Self {
        Self {
            delay: Self::FIRST,
            max,
        }
    }

    /// After a lost session: counts the reconnect, logs it with `what` (the
    /// broker and its queue, stream or topic) and waits. `false` when the
    /// shutdown came during the wait.
    pub(crate) async fn after_loss(
        &mut self,
        started: bool,
        counters: &Counters,
        what: &str,
        error: &(impl std::fmt::Display + Sync),
        shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> bool {
        if started {
            self.delay = Self::FIRST;
        }
        Counters::bump(&counters.reconnects);
        let delay = self.delay;
        tracing::warn!(consumer = what, %error, ?delay, "consumer lost its broker; reconnecting");
        self.delay = (delay * 2).min(self.max);
        tokio::select! {
            biased;
            () = shutdown => false,
            () = tokio::time::sleep(delay) => true,
        }
    }
}

#[cfg(all(test, any(feature = "nats", feature = "kafka")))]
mod tests {
    use super::*;

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = bounded_reason(&long);
        assert!(cut.len() <= MAX_REASON_BYTES && cut.len() >= MAX_REASON_BYTES - 1);
        assert_eq!(bounded_reason("short"), "short");
    }
}
