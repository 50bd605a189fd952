//! What every consumer runner shares: its report and its start-up error.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Inbox, InboxError};

/// The longest dead-letter reason a header carries: a handler's error text
/// (a panic's, say) can be long, and the dead letter must fit the broker's
/// message size.
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) const MAX_REASON_BYTES: usize = 4096;

/// `reason`, cut at a character boundary to [`MAX_REASON_BYTES`].
#[cfg(any(feature = "rabbitmq", feature = "nats", feature = "kafka"))]
pub(crate) fn bounded_reason(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// A consumer that cannot start, or cannot go on; a broker or database
/// outage is never one (the runner waits and reconnects).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    #[error("invalid consumer options: {0}")]
    Config(String),
    /// The inbox's table is missing, out of date or not the role's to use
    /// ([`InboxError::Schema`]), found at start or at a delivery; the
    /// message of that delivery is left to the broker, unacknowledged.
    #[error(transparent)]
    Inbox(InboxError),
}

/// Refuses to start a runner whose inbox cannot use its table
/// ([`Inbox::check`]). A database that cannot be reached is an outage: the
/// runner starts, and its deliveries wait for the database.
pub(crate) async fn check_inbox(inbox: &Inbox, what: &str) -> Result<(), ConsumerError> {
    match inbox.check().await {
        Ok(()) => Ok(()),
        Err(e @ InboxError::Schema(_)) => Err(stopped_by_inbox(inbox, what, e)),
        Err(e) => {
            tracing::warn!(consumer = inbox.consumer(), error = %e, "could not check the inbox's table; consuming, each delivery waits for the database");
            Ok(())
        }
    }
}

/// Logs that the runner for `what` stops because its inbox cannot use its
/// table, and returns the error `run` returns.
pub(crate) fn stopped_by_inbox(inbox: &Inbox, what: &str, e: InboxError) -> ConsumerError {
    tracing::error!(consumer = inbox.consumer(), "consumer of {what} stops: {e}");
    ConsumerError::Inbox(e)
}

/// Refuses a zero `value` for the duration option `field`, saying what zero
/// would do and how to fix it: accepted, each of them runs a consumer that
/// never works, or spins (every connect failing, a tight reconnect or read
/// loop), instead of refusing to start.
pub(crate) fn nonzero(
    field: &str,
    value: std::time::Duration,
    zero_would: &str,
    fix: &str,
) -> Result<(), ConsumerError> {
    if value.is_zero() {
        return Err(ConsumerError::Config(format!(
            "{field} is 0, which {zero_would}; {fix}"
        )));
    }
    Ok(())
}

/// The checks every runner makes of `timeout` and `reconnect_max_delay`.
pub(crate) fn check_timeouts(
    timeout: std::time::Duration,
    reconnect_max_delay: std::time::Duration,
) -> Result<(), ConsumerError> {
    nonzero(
        "timeout",
        timeout,
        "fails every connect and broker call at once, and the consumer reconnects for ever",
        "set it above the broker's round trip (default 10 s)",
    )?;
    nonzero(
        "reconnect_max_delay",
        reconnect_max_delay,
        "reconnects in a tight loop while the broker is away",
        "set the longest pause between reconnects (default 10 s)",
    )
}

/// A field's name, and a change to options that sets it to zero.
#[cfg(test)]
pub(crate) type ZeroCase<O> = (&'static str, fn(&mut O));

/// Asserts that each of `cases` (a field's name, and a change that sets it
/// to zero) makes `validate` refuse the options `options` makes, naming
/// the field and the fix; the options as made pass.
#[cfg(test)]
pub(crate) fn assert_zero_durations_refused<O>(
    options: impl Fn() -> O,
    validate: impl Fn(&O) -> Result<(), ConsumerError>,
    cases: &[ZeroCase<O>],
) {
    assert!(validate(&options()).is_ok());
    for (field, zero) in cases {
        let mut o = options();
        zero(&mut o);
        let error = validate(&o).expect_err(field).to_string();
        assert!(error.contains(&format!("{field} is 0, which ")), "{error}");
        assert!(error.contains("; set "), "{error}");
    }
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
    /// Deliveries put back, untouched, because another attempt at the event
    /// held its inbox row ([`crate::Outcome::InProgress`]).
    pub in_progress: u64,
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
    pub(crate) in_progress: AtomicU64,
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
            in_progress: get(&self.in_progress),
            reconnects: get(&self.reconnects),
        }
    }
}

/// The pause between broker sessions: from 100 ms, doubling up to the
/// runner's `reconnect_max_delay`. It goes back to 100 ms only after a
/// session that got as far as consuming and then lasted at least that
/// longest pause: a broker that accepts the connection but fails every
/// session at once (a command the user may not run, a key of the wrong
/// type) is retried at the growing pace, not ten times a second.
pub(crate) struct Reconnect {
    delay: std::time::Duration,
    max: std::time::Duration,
    /// When the current session began: after the last pause ended.
    began: tokio::time::Instant,
}

impl Reconnect {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(100);

    pub(crate) fn new(max: std::time::Duration) -> Self {
        Self {
            delay: Self::FIRST,
            max,
            began: tokio::time::Instant::now(),
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
        if started && self.began.elapsed() >= self.max {
            self.delay = Self::FIRST;
        }
        Counters::bump(&counters.reconnects);
        let delay = self.delay;
        tracing::warn!(consumer = what, %error, ?delay, "consumer lost its broker; reconnecting");
        self.delay = (delay * 2).min(self.max);
        let go_on = tokio::select! {
            biased;
            () = shutdown => false,
            () = tokio::time::sleep(delay) => true,
        };
        self.began = tokio::time::Instant::now();
        go_on
    }
}

#[cfg(all(test, any(feature = "rabbitmq", feature = "nats", feature = "kafka")))]
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

#[cfg(test)]
mod reconnect_tests {
    use super::*;
    use std::time::Duration;

    async fn lose(reconnect: &mut Reconnect, started: bool) {
        let counters = Counters::default();
        let shutdown = std::pin::pin!(std::future::pending::<()>());
        assert!(
            reconnect
                .after_loss(started, &counters, "test", &"lost", shutdown)
                .await
        );
    }

    #[tokio::test]
    async fn a_session_that_fails_at_once_does_not_reset_the_pause() {
        let mut reconnect = Reconnect::new(Duration::from_millis(400));
        lose(&mut reconnect, true).await;
        assert_eq!(reconnect.delay, Duration::from_millis(200));
        // Consumed, but failed at once: the pause keeps growing.
        lose(&mut reconnect, true).await;
        assert_eq!(reconnect.delay, Duration::from_millis(400));
        // A session that lasted the longest pause starts over from 100 ms.
        tokio::time::sleep(Duration::from_millis(400)).await;
        lose(&mut reconnect, true).await;
        assert_eq!(reconnect.delay, Duration::from_millis(200));
        // One that never got as far as consuming never resets it.
        lose(&mut reconnect, false).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        lose(&mut reconnect, false).await;
        assert_eq!(reconnect.delay, Duration::from_millis(400));
    }
}
