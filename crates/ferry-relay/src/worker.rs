use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::{Claimed, Clock, Ownership, Recorded, Route, Store, Transition, decide};
use rand::Rng;
use tokio::time::{Duration, Instant};
use tracing::{Instrument, debug, warn};

use crate::batch::{Published, publish_in_order};
use crate::engine::Shared;
use crate::metrics;

/// Outcomes of a published batch on their way into the store.
struct Unrecorded {
    owned: Ownership,
    /// The deliveries of `recorded`, in its order: counted once written.
    claimed: Vec<Claimed>,
    recorded: Vec<Recorded>,
    now: chrono::DateTime<chrono::Utc>,
    /// Keys with a failed or held-back delivery in the batch: until the
    /// failure is recorded the store cannot hold their later deliveries back,
    /// so the worker does.
    failed_keys: HashSet<String>,
}

/// The pause before a batch the sink held back whole is published again,
/// doubled while the sink keeps holding back, up to the longest.
const HELD_BACK_PAUSE_MIN: Duration = Duration::from_millis(50);
const HELD_BACK_PAUSE_MAX: Duration = Duration::from_secs(1);

/// One route's worker: claim due deliveries in outbox order, publish them as
/// one pipelined batch, record every outcome.
///
/// Recording a batch overlaps claiming and publishing the next one, so the
/// store's write is off the publish path. The next batch is claimed without
/// the deliveries being recorded, and is published only after the previous
/// batch was confirmed and its outcomes all written, so a key's events
/// still reach the destination in order; keys that failed in the
/// unrecorded batch are left out of it.
pub(crate) async fn run<S: Store, C: Clock>(shared: Arc<Shared<S, C>>, route: Route) {
    let sink = shared.sinks[&route.sink].clone();
    let wake = &shared.route_wake[&route.name];
    let mut backoff = Duration::from_millis(50);
    // For reads of the next retry's time that fail.
    let mut due_backoff = Duration::from_millis(50);
    let mut unrecorded: Option<Unrecorded> = None;
    // Held from a batch's publish until its outcomes are recorded, across
    // iterations: the lease keeper hands partitions back only while no
    // outcome is unrecorded (see `Shared::quiesce`).
    let mut held = None;
    // Set while the destination fails every publish transiently; the first
    // confirm after that counts as getting it back.
    let mut destination_down = false;
    // Before publishing again what the sink held back whole.
    let mut held_back_pause = HELD_BACK_PAUSE_MIN;
    shared.progress.worker_started();
    loop {
        if shared.cancel.is_cancelled() {
            if let Some(u) = unrecorded.take() {
                record(&shared, &route, u).await;
            }
            return;
        }
        let gate = match held.take() {
            Some(gate) => gate,
            None => shared.gate.read().await,
        };
        let Some(owned) = shared.valid_ownership() else {
            if let Some(u) = unrecorded.take() {
                record(&shared, &route, u).await;
            }
            drop(gate);
            let _idle = shared.progress.idle_guard();
            shared.wait_for_lease().await;
            continue;
        };
        let previous = unrecorded.take();
        let (exclude, failed_keys): (Vec<i64>, HashSet<String>) = match &previous {
            Some(u) => (u.recorded.iter().map(|r| r.seq).collect(), u.failed_keys.clone()),
            None => (Vec::new(), HashSet::new()),
        };
        let recording = async {
            let started = Instant::now();
            let whole = match previous {
                Some(u) => record(&shared, &route, u).await,
                None => true,
            };
            (started.elapsed(), whole)
        };
        let now = shared.clock.now();
        let claim_started = Instant::now();
        let claiming = async {
            let claimed = shared
                .store
                .claim(&owned, &route.name, shared.settings.batch_size, now, &exclude)
                .await;
            (claimed, claim_started.elapsed())
        };
        let ((claimed, claim_took), (record_took, recorded_whole)) = tokio::join!(claiming, recording);
        if !recorded_whole {
            // Claimed past deliveries whose outcomes were not all written
            // (the lease they were published under was lost, and may be
            // held again under a new token): those stay pending, and this
            // claim would publish later events of their keys ahead of
            // their next attempt. Claim again; it only read.
            drop(gate);
            continue;
        }
        let claimed = match claimed {
            Ok(c) => c,
            Err(e) => {
                drop(gate);
                warn!(route = %route.name, error = %e, "claim failed; retrying");
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "claim").increment(1);
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if backoff > Duration::from_millis(50) {
            ::metrics::counter!(metrics::RECONNECTS, "component" => "database").increment(1);
        }
        backoff = Duration::from_millis(50);
        shared.progress.advanced();
        // Left out, they stay pending and are claimed again once the failure
        // before them is recorded (and then held back by the store).
        let due = claimed.len();
        let claimed: Vec<Claimed> = if failed_keys.is_empty() {
            claimed
        } else {
            claimed
                .into_iter()
                .filter(|c| c.event.key.as_ref().is_none_or(|k| !failed_keys.contains(k)))
                .collect()
        };
        if claimed.is_empty() {
            if !exclude.is_empty() {
                // The previous batch was just recorded; what it held back
                // may be due now.
                drop(gate);
                continue;
            }
            if due > 0 {
                // All left out, and nothing of the previous batch to record:
                // the sink held every event of it back (no request slot
                // freed in time, say). They are pending and due, but
                // `next_due` sees only retries, so the slow poll would
                // leave them for minutes. Publish them again after a short
                // pause, longer while the sink keeps holding back.
                drop(gate);
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(held_back_pause.min(shared.settings.poll_interval * 4)) => {}
                    _ = shared.cancel.cancelled() => return,
                }
                held_back_pause = (held_back_pause * 2).min(HELD_BACK_PAUSE_MAX);
                continue;
            }
            let next = shared.store.next_due(&owned, &route.name, now).await;
            drop(gate);
            // The router wakes this worker when it creates deliveries, the
            // lease keeper when partitions arrive, the timer when a retry is
            // due; the slow poll only guards against a missed wake-up.
            let mut wait = shared.settings.poll_interval * 4;
            if next.is_ok() {
                due_backoff = Duration::from_millis(50);
            }
            match next {
                Ok(Some(at)) => {
                    let until = (at - shared.clock.now()).to_std().unwrap_or_default();
                    wait = wait.min(until + Duration::from_millis(1));
                }
                Ok(None) => {}
                // Not knowing when the next retry is due, look again soon
                // (backing off apart from the claim's, which a successful
                // claim resets), not at the slow poll.
                Err(e) => {
                    warn!(route = %route.name, error = %e, "reading the next retry's time failed; retrying");
                    ::metrics::counter!(metrics::STORE_ERRORS, "op" => "next_due").increment(1);
                    wait = wait.min(due_backoff);
                    due_backoff = (due_backoff * 2).min(Duration::from_secs(5));
                }
            }
            let _idle = shared.progress.idle_guard();
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = shared.cancel.cancelled() => return,
            }
            continue;
        }
        // Self-fence: never start publishing under a lease that may lapse.
        // Told to stop while claiming: the batch is left to the next relay,
        // not published in the time left for what is in flight.
        // And never publish what a partition lost since the claim holds.
        if shared.cancel.is_cancelled() || !shared.still_holds(&owned, claimed.iter().map(|c| c.partition)) {
            continue;
        }
        ::metrics::histogram!(metrics::BATCH_SIZE, "route" => route.name.clone()).record(claimed.len() as f64);
        let started = Instant::now();
        let span = tracing::info_span!("ferry.publish", route = %route.name, events = claimed.len());
        #[cfg(feature = "otel")]
        link_producers(&span, &claimed);
        let publishing = publish_in_order(sink.as_ref(), &route, claimed, None).instrument(span);
        let Some(Published {
            claimed,
            outcomes,
            order_breaks,
        }) = shared.while_leased(publishing).await
        else {
            warn!(
                route = %route.name,
                "the lease ran out during a publish (renewals failing); abandoned, its deliveries stay pending for the partitions' next holder"
            );
            drop(gate);
            continue;
        };
        let publish_took = started.elapsed();
        shared.progress.advanced();
        let confirmed = outcomes.iter().any(|o| matches!(o, Some(Ok(()))));
        if confirmed && destination_down {
            ::metrics::counter!(metrics::RECONNECTS, "component" => "destination", "route" => route.name.clone())
                .increment(1);
        }
        destination_down = !confirmed
            && outcomes
                .iter()
                .any(|o| matches!(o, Some(Err(e)) if e.kind == ferry_core::ErrorKind::Transient));
        ::metrics::histogram!(metrics::PUBLISH_SECONDS, "route" => route.name.clone())
            .record(publish_took.as_secs_f64());
        if order_breaks > 0 {
            warn!(
                route = %route.name,
                events = order_breaks,
                "the destination rejected an event after later events of its key were in flight; those arrived out of order"
            );
            shared.counters.order_breaks.fetch_add(order_breaks, Ordering::Relaxed);
            ::metrics::counter!(metrics::ORDER_BREAKS, "route" => route.name.clone()).increment(order_breaks);
        }
        let now = shared.clock.now();
        let mut failed_keys = HashSet::new();
        for (c, outcome) in claimed.iter().zip(&outcomes) {
            if let (Some(key), None | Some(Err(_))) = (&c.event.key, outcome) {
                failed_keys.insert(key.clone());
            }
        }
        // Held-back deliveries are not recorded: they stay pending, behind
        // the failure that stopped their key.
        let (claimed, recorded): (Vec<Claimed>, Vec<Recorded>) = {
            let mut rng = rand::rng();
            claimed
                .into_iter()
                .zip(outcomes)
                .filter_map(|(c, outcome)| outcome.map(|o| (c, o)))
                .map(|(c, outcome)| {
                    let transition = decide(c.attempts, &outcome, now, &shared.settings.retry, rng.random::<f64>());
                    let r = Recorded {
                        seq: c.event.seq,
                        expected_attempts: c.attempts,
                        transition,
                    };
                    (c, r)
                })
                .unzip()
        };
        if !recorded.is_empty() {
            held_back_pause = HELD_BACK_PAUSE_MIN;
        }
        debug!(route = %route.name, events = claimed.len(), ?claim_took, ?record_took, ?publish_took, "batch published");
        let batch = Unrecorded {
            owned,
            claimed,
            recorded,
            now,
            failed_keys,
        };
        if shared.quiesce.load(Ordering::SeqCst) {
            record(&shared, &route, batch).await;
            drop(gate);
        } else {
            unrecorded = Some(batch);
            held = Some(gate);
        }
    }
}

/// Records outcomes, retrying while the lease lasts: a failed write only
/// costs a duplicate publish later, but retrying spares it. False unless
/// every outcome was written: some were refused (lease lost, delivery
/// moved on) or the lease ran out first.
async fn record<S: Store, C: Clock>(shared: &Shared<S, C>, route: &Route, batch: Unrecorded) -> bool {
    let Unrecorded {
        owned,
        claimed,
        recorded,
        now,
        ..
    } = batch;
    if recorded.is_empty() {
        return true;
    }
    let owned = &owned;
    let recorded = &recorded[..];
    let mut backoff = Duration::from_millis(20);
    let mut failures = 0u32;
    loop {
        match shared.store.record(owned, &route.name, recorded, now).await {
            Ok(applied) => {
                // Counted once written: what was not is published again by
                // whoever claims it next, and counted then. After a failed
                // attempt, outcomes the fence finds stale were written by it
                // (it committed, its answer was lost) as long as their
                // partitions are still held under the same tokens: those
                // are no refusal.
                let partitions: Vec<_> = claimed.iter().map(|c| c.partition).collect();
                let written = shared.written(owned, &partitions, applied, failures > 0);
                let outcomes = claimed.iter().zip(recorded).zip(&written);
                account(shared, &route.name, outcomes.filter(|(_, w)| **w).map(|(o, _)| o), now);
                let n = recorded.len() as u64;
                let refused = if failures > 0 {
                    written.iter().filter(|w| !**w).count() as u64
                } else {
                    n - applied.min(n)
                };
                if failures > 0 && applied < n && refused == 0 {
                    debug!(route = %route.name, events = n, applied, "a record whose answer was lost had written the outcomes");
                }
                if refused > 0 {
                    warn!(route = %route.name, refused, "outcomes refused: lease lost or delivery moved on");
                    shared.counters.refused.fetch_add(refused, Ordering::Relaxed);
                    ::metrics::counter!(metrics::REFUSED, "route" => route.name.clone()).increment(refused);
                }
                return refused == 0;
            }
            Err(e) => {
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "record").increment(1);
                if shared.valid_ownership().is_none() {
                    warn!(route = %route.name, events = recorded.len(), error = %e, "could not record outcomes before the lease ran out; they will be published again");
                    return false;
                }
                failures += 1;
                if loud(failures) {
                    // The route waits on this write: a refusal that does not
                    // pass must be seen, not only counted.
                    warn!(route = %route.name, events = recorded.len(), failures, error = %e, "recording outcomes keeps failing; the route waits for it; retrying");
                } else {
                    debug!(route = %route.name, events = recorded.len(), error = %e, "recording outcomes failed; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Whether the `failures`th failure in a row of a write the relay waits on
/// is logged as a warning: the fifth, then every fiftieth (about one a
/// minute at the 1 s retry interval).
pub(crate) fn loud(failures: u32) -> bool {
    failures == 5 || failures.is_multiple_of(50)
}

/// Counts written outcomes in the metrics and the run report (and logs the
/// failures): call it once the store has them, so that an event published
/// again after a write that failed or was refused counts once.
pub(crate) fn account<'a, S: Store, C: Clock>(
    shared: &Shared<S, C>,
    route: &str,
    outcomes: impl IntoIterator<Item = (&'a Claimed, &'a Recorded)>,
    now: chrono::DateTime<chrono::Utc>,
) {
    let (mut published, mut retried, mut dead) = (0u64, 0u64, 0u64);
    // Per event type: (published, failed, dead).
    let mut by_type: std::collections::HashMap<&str, (u64, u64, u64)> = std::collections::HashMap::new();
    for (c, r) in outcomes {
        let counts = by_type.entry(c.event.event_type.as_str()).or_default();
        match &r.transition {
            Transition::Published { .. } => {
                published += 1;
                counts.0 += 1;
                if c.attempts == 0 {
                    let age = (now - c.event.created_at).to_std().unwrap_or_default();
                    ::metrics::histogram!(metrics::COMMIT_TO_PUBLISH_SECONDS, "route" => route.to_owned())
                        .record(age.as_secs_f64());
                }
            }
            Transition::Retry { error, .. } => {
                retried += 1;
                counts.1 += 1;
                debug!(
                    route,
                    event_id = %c.event.id,
                    key = c.event.key.as_deref(),
                    attempt = c.attempts + 1,
                    %error,
                    "delivery failed; will retry"
                );
            }
            Transition::Dead { reason, .. } => {
                dead += 1;
                counts.1 += 1;
                counts.2 += 1;
                warn!(
                    route,
                    event_id = %c.event.id,
                    key = c.event.key.as_deref(),
                    event_type = %c.event.event_type,
                    attempt = c.attempts + 1,
                    %reason,
                    "delivery is dead"
                );
            }
        }
    }
    for (event_type, (published, failed, dead)) in by_type {
        let labels = [("route", route.to_owned()), ("type", event_type.to_owned())];
        ::metrics::counter!(metrics::PUBLISHED, &labels).increment(published);
        if failed > 0 {
            ::metrics::counter!(metrics::FAILED, &labels).increment(failed);
        }
        if dead > 0 {
            ::metrics::counter!(metrics::DEAD, &labels).increment(dead);
        }
    }
    shared.counters.published.fetch_add(published, Ordering::Relaxed);
    shared.counters.retried.fetch_add(retried, Ordering::Relaxed);
    shared.counters.dead.fetch_add(dead, Ordering::Relaxed);
}

/// Links the batch's publish span to each event's producer span (the
/// `traceparent` header). A link, not a parent: one batch carries events of
/// many traces, and a span has one parent. Costs nothing when no
/// OpenTelemetry layer listens.
#[cfg(feature = "otel")]
pub(crate) fn link_producers(span: &tracing::Span, claimed: &[Claimed]) {
    use opentelemetry::KeyValue;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return;
    }
    for c in claimed {
        if let Some(producer) = ferry_core::trace::span_context(&c.event.headers) {
            span.add_link_with_attributes(producer, vec![KeyValue::new("ferry.event_id", c.event.id.to_string())]);
        }
    }
}
