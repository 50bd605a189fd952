//! Sinks: every destination beside RabbitMQ, each measured three times per
//! round with `--sink-events` events: its own confirmed-publish rate from one
//! plain client (the baseline, in windows of `--batch-size`); the production
//! sink alone, publishing the same events built in memory in batches of
//! `--batch-size` one after the other as the relay does, with no database
//! (which tells the sink's own cost apart from the database's share of the
//! cores); then a pre-filled backlog drained through the relay with a single
//! route to that sink, timed until the destination has confirmed every event
//! to the relay (as the baseline is timed to its last confirmation) and then
//! checked to hold every event. A discard sink gives what the
//! database and the relay hand over when the destination costs nothing, and
//! RabbitMQ is measured the same way so that the fan-out run (one event type
//! routed to RabbitMQ, Redis and NATS at once) can be read against the
//! slowest of its three single-sink drains. After the rounds, each sink's
//! commit-to-confirmation latency is read at `--latency-rate` for
//! `--sink-latency-seconds`.
//!
//! A run of 20,000 events lasts about a second, so one round swings by ten
//! points or more on a shared machine: `--sink-rounds` rounds run one after
//! the other (every measurement once per round), the report gives the median
//! of each time and the spread of the per-round shares.

use std::time::Duration;

use super::broker::per_second;
use super::latency::LatencyResult;
#[cfg(any(test, feature = "bench-sinks"))]
use super::median;

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
    /// Median over the rounds.
    pub baseline: Duration,
    /// The sink publishing without the database (median over the rounds).
    pub alone: Duration,
    /// Median over the rounds.
    pub drain: Duration,
    /// Per round: the drain's rate as a share of that round's baseline.
    pub shares: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SinksResult {
    pub events: u64,
    pub window: usize,
    pub rounds: usize,
    /// The drain into a sink that only counts (median).
    pub handover: Option<Duration>,
    /// RabbitMQ first, then the kinds of [`Kind::ALL`].
    pub sinks: Vec<SinkFigures>,
    /// One event type to RabbitMQ, Redis and NATS at once (median).
    pub fanout: Option<Duration>,
    /// Per round: the fan-out's time over that round's drain of the sink
    /// that is slowest by median (see [`SinksResult::slowest_fanout_single`]).
    pub fanout_ratios: Vec<f64>,
    /// Commit-to-confirmation latency per sink kind (one run each, after
    /// the rounds).
    pub latencies: Vec<(&'static str, LatencyResult)>,
}

/// The destinations of the fan-out run.
pub(crate) const FANOUT: [&str; 3] = ["rabbitmq", "redis", "nats"];

impl SinkFigures {
    pub(crate) fn baseline_rate(&self, events: u64) -> f64 {
        per_second(events, self.baseline)
    }

    pub(crate) fn alone_rate(&self, events: u64) -> f64 {
        per_second(events, self.alone)
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

/// One round's times: every sink's baseline, publish alone and drain, the
/// hand-over and the fan-out.
#[cfg(any(test, feature = "bench-sinks"))]
pub(crate) struct Round {
    pub handover: Duration,
    /// RabbitMQ first.
    pub sinks: Vec<SinkRound>,
    pub fanout: Duration,
}

/// One sink's times in one round.
#[cfg(any(test, feature = "bench-sinks"))]
pub(crate) struct SinkRound {
    pub kind: &'static str,
    /// See [`SinkFigures::in_flight`].
    pub in_flight: Option<usize>,
    pub baseline: Duration,
    pub alone: Duration,
    pub drain: Duration,
}

/// Medians over the rounds, and the per-round shares.
#[cfg(any(test, feature = "bench-sinks"))]
pub(crate) fn summarise(events: u64, window: usize, rounds: Vec<Round>) -> SinksResult {
    let first = rounds.first();
    let sinks: Vec<SinkFigures> = first
        .map(|r| &r.sinks)
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, first)| {
            let times = |of: fn(&SinkRound) -> Duration| rounds.iter().map(|r| of(&r.sinks[i])).collect::<Vec<_>>();
            let baselines = times(|s| s.baseline);
            let drains = times(|s| s.drain);
            let shares = baselines
                .iter()
                .zip(&drains)
                .map(|(b, d)| b.as_secs_f64() / d.as_secs_f64().max(f64::EPSILON))
                .collect();
            SinkFigures {
                kind: first.kind,
                in_flight: first.in_flight,
                baseline: median(baselines).unwrap_or_default(),
                alone: median(times(|s| s.alone)).unwrap_or_default(),
                drain: median(drains).unwrap_or_default(),
                shares,
            }
        })
        .collect();
    let mut result = SinksResult {
        events,
        window,
        rounds: rounds.len(),
        handover: median(rounds.iter().map(|r| r.handover).collect()),
        sinks,
        fanout: median(rounds.iter().map(|r| r.fanout).collect()),
        fanout_ratios: Vec::new(),
        latencies: Vec::new(),
    };
    if let Some(slowest) = result.slowest_fanout_single().map(|k| k.kind) {
        let i = result.sinks.iter().position(|k| k.kind == slowest).unwrap_or_default();
        result.fanout_ratios = rounds
            .iter()
            .map(|r| r.fanout.as_secs_f64() / r.sinks[i].drain.as_secs_f64().max(f64::EPSILON))
            .collect();
    }
    result
}
