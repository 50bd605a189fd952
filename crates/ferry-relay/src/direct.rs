//! Publishing straight from the outbox, without a delivery row to claim:
//! shared by the router's direct delivery and WAL streaming. Whoever calls
//! it has decided which events may go directly (nothing earlier of their key
//! waits in the delivery table); the outcomes become delivery rows when the
//! batch is settled.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use chrono::{DateTime, Utc};
use ferry_core::{Claimed, Clock, DirectOutcome, ErrorKind, Recorded, Route, Store, Transition, decide};
use rand::Rng;
use tokio::time::{Duration, Instant};

use crate::batch::{Published, publish_in_order};
use crate::engine::Shared;
use crate::metrics;

/// One route's direct publish.
pub(crate) struct DirectPublish {
    /// (caller's index, outcome) for every event handed in.
    pub outcomes: Vec<(usize, DirectOutcome)>,
    /// The destination, or part of it, looks down: something failed
    /// transiently and either nothing was confirmed, or the publish was
    /// slow (see [`publish`]).
    pub down: bool,
    /// The outcomes, to count once they are written.
    pub tally: Tally,
}

/// A route's published outcomes, counted (metrics, [`crate::RunReport`])
/// once they are written: an event whose write failed or was refused is
/// published again, and counted then.
pub(crate) struct Tally {
    route: String,
    outcomes: Vec<(Claimed, Recorded)>,
    now: DateTime<Utc>,
}

impl Tally {
    /// Counts every outcome but those of the events in `left` (not written).
    pub fn count<S: Store, C: Clock>(&self, shared: &Shared<S, C>, left: &HashSet<i64>) {
        let written = self
            .outcomes
            .iter()
            .filter(|(c, _)| !left.contains(&c.event.seq))
            .map(|(c, r)| (c, r));
        crate::worker::account(shared, &self.route, written, self.now);
    }
}

/// Publishes `claimed` (each tagged with the caller's index) to `route` as
/// one pipelined batch, in order. An event held back behind a failure of its
/// key in the batch comes back [`DirectOutcome::Parked`]. A publish slower
/// than `timeout` counts as a transient failure of every event in it, and
/// puts the route down as any failure of all of it does.
pub(crate) async fn publish<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    route: &Route,
    tagged: Vec<(usize, Claimed)>,
    timeout: Option<Duration>,
    mode: &'static str,
) -> DirectPublish {
    let (index, claimed): (Vec<usize>, Vec<Claimed>) = tagged.into_iter().unzip();
    let sink = shared.sinks[&route.sink].clone();
    ::metrics::histogram!(metrics::BATCH_SIZE, "route" => route.name.clone()).record(claimed.len() as f64);
    let started = Instant::now();
    let span = tracing::info_span!("ferry.publish", route = %route.name, events = claimed.len(), mode);
    #[cfg(feature = "otel")]
    crate::worker::link_producers(&span, &claimed);
    let published =
        tracing::Instrument::instrument(publish_in_order(sink.as_ref(), route, claimed, timeout), span).await;
    let took = started.elapsed();
    ::metrics::histogram!(metrics::PUBLISH_SECONDS, "route" => route.name.clone()).record(took.as_secs_f64());
    let now = shared.clock.now();
    if published.order_breaks > 0 {
        shared
            .counters
            .order_breaks
            .fetch_add(published.order_breaks, Ordering::Relaxed);
        ::metrics::counter!(metrics::ORDER_BREAKS, "route" => route.name.clone()).increment(published.order_breaks);
    }
    let Published { claimed, outcomes, .. } = published;
    let transient = outcomes
        .iter()
        .any(|o| matches!(o, Some(Err(e)) if e.kind == ErrorKind::Transient));
    let confirmed = outcomes.iter().any(|o| matches!(o, Some(Ok(()))));
    // A route that confirmed part of its share and failed the rest
    // transiently is down only if the publish was slow: a part of the
    // destination that stalls (a Kafka partition without a leader) fails
    // its events at the sink's own publish timeout, which the configuration
    // keeps at most half of `timeout`, by default a third, and the next
    // direct publish with a fresh key there would wait as long, holding up
    // every route and the router. A quick failure of some events (a
    // RabbitMQ return, a missing exchange) comes back with the confirms, in
    // milliseconds; `carry` holds its key back, and putting the route down
    // for it would keep the route on its worker until nothing of it is
    // pending, which a delivery retried for ever never allows. A tenth of
    // `timeout` tells the two apart with room to spare either way.
    let slow = timeout.is_some_and(|t| took >= t / 10);
    let mut out = Vec::with_capacity(claimed.len());
    let mut tallied = Vec::with_capacity(claimed.len());
    {
        let mut rng = rand::rng();
        for ((i, c), o) in index.into_iter().zip(claimed).zip(outcomes) {
            let Some(o) = o else {
                out.push((i, DirectOutcome::Parked));
                continue;
            };
            let transition = decide(0, &o, now, &shared.settings.retry, rng.random::<f64>());
            out.push((
                i,
                match &transition {
                    Transition::Published { at, .. } => DirectOutcome::Published { at: *at },
                    Transition::Retry { next_at, error, .. } => DirectOutcome::Retry {
                        next_at: *next_at,
                        error: error.clone(),
                    },
                    Transition::Dead { attempts, reason } => DirectOutcome::Dead {
                        attempts: *attempts,
                        reason: reason.clone(),
                    },
                },
            ));
            let recorded = Recorded {
                seq: c.event.seq,
                expected_attempts: 0,
                transition,
            };
            tallied.push((c, recorded));
        }
    }
    DirectPublish {
        outcomes: out,
        down: transient && (!confirmed || slow),
        tally: Tally {
            route: route.name.clone(),
            outcomes: tallied,
            now,
        },
    }
}
