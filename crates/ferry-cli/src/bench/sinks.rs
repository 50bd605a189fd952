//! Sinks: every destination beside RabbitMQ, each measured twice in one run
//! with `--sink-events` events: its own confirmed-publish rate from one plain
//! client (the baseline, in windows of `--batch-size`), then a pre-filled
//! backlog drained through the relay with a single route to that sink, timed
//! until the destination holds every event. A discard sink gives what the
//! database and the relay hand over when the destination costs nothing, and
//! RabbitMQ is measured the same way so that the fan-out run (one event type
//! routed to RabbitMQ, Redis and NATS at once) can be read against the
//! slowest of its three single-sink drains.

use std::time::Duration;

use super::broker::per_second;

#[cfg(feature = "bench-sinks")]
mod measure;
#[cfg(feature = "bench-sinks")]
pub(crate) use measure::run;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SinkFigures {
    pub kind: &'static str,
    /// Requests in flight in the baseline, where it does not publish in
    /// windows of `--batch-size` (the webhook).
    pub in_flight: Option<usize>,
    pub baseline: Duration,
    pub drain: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SinksResult {
    pub events: u64,
    pub window: usize,
    /// The drain into a sink that only counts.
    pub handover: Option<Duration>,
    /// RabbitMQ first, then the kinds of [`Kind::ALL`].
    pub sinks: Vec<SinkFigures>,
    /// One event type to RabbitMQ, Redis and NATS at once.
    pub fanout: Option<Duration>,
}

/// The destinations of the fan-out run.
pub(crate) const FANOUT: [&str; 3] = ["rabbitmq", "redis", "nats"];

impl SinkFigures {
    pub(crate) fn baseline_rate(&self, events: u64) -> f64 {
        per_second(events, self.baseline)
    }

    pub(crate) fn drain_rate(&self, events: u64) -> f64 {
        per_second(events, self.drain)
    }
}

impl SinksResult {
    /// The slowest single-sink drain among the fan-out's destinations.
    pub(crate) fn slowest_fanout_single(&self) -> Option<&SinkFigures> {
        self.sinks
            .iter()
            .filter(|s| FANOUT.contains(&s.kind))
            .max_by_key(|s| s.drain)
    }
}
