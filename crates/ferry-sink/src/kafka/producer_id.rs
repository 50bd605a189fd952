//! What the sink knows about its producer id, so that `check` asks the
//! cluster (with a probe producer, see `check::producer_id`) only when it
//! must: once for all routes, not once per route.
//!
//! Deciding is split from doing: [`ProducerIds`] takes the time as a
//! parameter and only says whether to probe; the sink runs the probe.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry_core::SinkError;
use tokio::sync::watch;

/// How long a failed probe's error stands: checks within it (the next
/// route's at start-up, the health probe's every 15 s) return it at once
/// instead of spending up to `publish_timeout` on a probe of their own.
pub(super) const FAILED_PROBE_TTL: Duration = Duration::from_secs(60);

/// A probe's outcome, once it has one.
pub(super) type Settled = Option<Result<(), SinkError>>;

/// The producer-id knowledge of one sink.
pub(super) struct ProducerIds {
    state: Mutex<State>,
}

enum State {
    /// Nothing known yet, or a failure that stood its time.
    Unknown,
    /// A probe is running; its outcome comes on the channel.
    Probing(watch::Receiver<Settled>),
    /// A producer of the sink's options got one: a probe said so, or the
    /// sink's own producer delivered, which it cannot without one.
    Proven,
    /// A probe failed, or the sink's own producer was refused one: until
    /// `until`, checks fail with `error`.
    Failed { error: SinkError, until: Instant },
}

/// What a check does next.
pub(super) enum Next {
    /// The answer is known.
    Known(Result<(), SinkError>),
    /// Another check's probe is running: wait for its outcome.
    Wait(watch::Receiver<Settled>),
    /// Run a probe and send its outcome here, after [`ProducerIds::settle`].
    Probe(watch::Sender<Settled>),
}

impl ProducerIds {
    pub(super) fn new() -> Self {
        Self {
            state: Mutex::new(State::Unknown),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("the producer-id state is never poisoned")
    }

    /// What a check at `now` does; a [`Next::Probe`] marks a probe running.
    pub(super) fn next(&self, now: Instant) -> Next {
        let mut state = self.state();
        match &*state {
            State::Proven => return Next::Known(Ok(())),
            State::Failed { error, until } if now < *until => return Next::Known(Err(error.clone())),
            // A probe whose task ended without an outcome (it panicked)
            // leaves a closed channel: probe again.
            State::Probing(settled) if settled.has_changed().is_ok() || settled.borrow().is_some() => {
                return Next::Wait(settled.clone());
            }
            _ => {}
        }
        let (send, settled) = watch::channel(None);
        *state = State::Probing(settled);
        Next::Probe(send)
    }

    /// Records a probe's outcome at `now`. A failed probe does not undo a
    /// proof that came while it ran (a delivery by the sink's producer).
    pub(super) fn settle(&self, outcome: &Result<(), SinkError>, now: Instant) {
        let mut state = self.state();
        *state = match (outcome, &*state) {
            (Ok(()), _) => State::Proven,
            (Err(_), State::Proven) => return,
            (Err(error), _) => State::Failed {
                error: error.clone(),
                until: now + FAILED_PROBE_TTL,
            },
        };
    }

    /// The sink's producer delivered: it has a producer id.
    pub(super) fn proven(&self) {
        *self.state() = State::Proven;
    }

    /// The sink's producer was refused a producer id (`error`, as `check`
    /// reports it) at `now`: checks report it rather than a proof from
    /// before, until a probe after [`FAILED_PROBE_TTL`] finds otherwise.
    pub(super) fn refused(&self, error: SinkError, now: Instant) {
        let mut state = self.state();
        if !matches!(*state, State::Probing(_)) {
            *state = State::Failed {
                error,
                until: now + FAILED_PROBE_TTL,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(next: Next) -> Result<(), SinkError> {
        match next {
            Next::Known(outcome) => outcome,
            Next::Wait(_) => panic!("waits for a probe"),
            Next::Probe(_) => panic!("probes"),
        }
    }

    #[test]
    fn a_failed_probe_stands_for_its_ttl_and_one_probe_runs_at_a_time() {
        let ids = ProducerIds::new();
        let now = Instant::now();
        let Next::Probe(send) = ids.next(now) else {
            panic!("nothing known: probe")
        };
        // A second check while the first probes waits for its outcome.
        let Next::Wait(mut settled) = ids.next(now) else {
            panic!("waits")
        };
        let refused = Err(SinkError::config("no producer id"));
        ids.settle(&refused, now);
        send.send_replace(Some(refused.clone()));
        assert_eq!(*settled.borrow_and_update(), Some(refused.clone()));
        assert_eq!(known(ids.next(now + FAILED_PROBE_TTL / 2)), refused);
        assert!(matches!(ids.next(now + FAILED_PROBE_TTL), Next::Probe(_)));
    }

    #[test]
    fn a_probe_that_ended_without_an_outcome_is_run_again() {
        let ids = ProducerIds::new();
        let Next::Probe(send) = ids.next(Instant::now()) else {
            panic!("probes")
        };
        drop(send);
        assert!(matches!(ids.next(Instant::now()), Next::Probe(_)));
    }

    #[test]
    fn a_delivery_proves_the_id_and_a_refusal_of_the_sinks_producer_undoes_it() {
        let ids = ProducerIds::new();
        let now = Instant::now();
        ids.settle(&Err(SinkError::transient("no answer")), now);
        ids.proven();
        assert_eq!(known(ids.next(now)), Ok(()));
        // A probe that failed while the producer delivered changes nothing.
        ids.settle(&Err(SinkError::transient("no answer")), now);
        assert_eq!(known(ids.next(now)), Ok(()));
        let refused = SinkError::config("no producer id");
        ids.refused(refused.clone(), now);
        assert_eq!(known(ids.next(now)), Err(refused));
        assert!(matches!(ids.next(now + FAILED_PROBE_TTL), Next::Probe(_)));
    }
}
