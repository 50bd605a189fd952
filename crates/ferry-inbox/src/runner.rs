//! What every consumer runner shares: its report and its start-up error.

use std::sync::atomic::{AtomicU64, Ordering};

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
