use chrono::{DateTime, Utc};

/// The source of "now" for every lease, retry and latency decision.
///
/// Injected so that tests drive time by hand instead of sleeping.
///
/// ```
/// use ferry_core::{Clock, SystemClock};
/// let now = SystemClock.now();
/// assert!(now.timestamp() > 0);
/// ```
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> DateTime<Utc>;
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}
