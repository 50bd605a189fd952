//! The conformance suite every sink runs against its real destination.
//!
//! A sink's test implements [`SinkHarness`] (where to publish, how to read
//! what arrived) and calls [`run`]. The suite panics on the first broken
//! promise of the [`Sink`] contract: every event of a batch arrives exactly
//! once with its event id as message id, per-key order holds, outcomes come
//! back one per event in input order, and nothing is reported published that
//! the destination did not take.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use async_trait::async_trait;
//! # use ferry_core::{Route, Sink};
//! # use ferry_testkit::sink_suite::{self, ReceivedMessage, SinkHarness};
//! struct Harness { route: Route }
//!
//! #[async_trait]
//! impl SinkHarness for Harness {
//!     fn route(&self) -> Route { self.route.clone() }
//!     fn missing_route(&self) -> Option<Route> { None }
//!     async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
//!         Vec::new() // read from the destination
//!     }
//! }
//! # async fn example(sink: &dyn Sink, route: Route) {
//! sink_suite::run(sink, &Harness { route }).await;
//! # }
//! ```

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use ferry_core::{ErrorKind, EventId, Headers, PublishOutcome, Route, Sink, StoredEvent};
use serde_json::json;

/// How long the suite waits for messages it expects.
pub const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the suite waits for messages that must not come.
pub const QUIET_PERIOD: Duration = Duration::from_millis(500);

const BATCH: i64 = 200;
const KEYS: i64 = 5;

/// A message as the destination's consumer saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMessage {
    /// The message id the sink set; must be the event id.
    pub id: String,
    pub body: Vec<u8>,
    /// The aggregate key as carried by the sink, if it carries one.
    pub key: Option<String>,
}

/// What the suite needs from a sink's test.
#[async_trait]
pub trait SinkHarness: Send + Sync {
    /// A route to a destination that exists and has a consumer attached.
    fn route(&self) -> Route;

    /// A route to a destination that does not exist or reaches no consumer;
    /// `None` for sinks where every destination is valid (stdout).
    fn missing_route(&self) -> Option<Route>;

    /// The payload size limit the sink was configured with, if it has one.
    fn max_payload_bytes(&self) -> Option<usize> {
        None
    }

    /// Waits until `n` more messages reached [`SinkHarness::route`]'s
    /// destination or `timeout` passed; returns them in arrival order, each
    /// once (a message returned here is not returned again).
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage>;
}

/// A stored JSON event, as the relay would hand it to a sink.
pub fn event(seq: i64, event_type: &str, key: Option<&str>, payload: serde_json::Value) -> StoredEvent {
    StoredEvent {
        id: EventId::new(),
        seq,
        event_type: event_type.to_owned(),
        key: key.map(str::to_owned),
        payload: Bytes::from(serde_json::to_vec(&payload).expect("JSON serialises")),
        content_type: "application/json".to_owned(),
        headers: Headers::new(),
        created_at: chrono::Utc::now(),
    }
}

/// Runs every check against `sink`, panicking with the first failure.
pub async fn run(sink: &dyn Sink, harness: &dyn SinkHarness) {
    empty_batch(sink, harness).await;
    check_route(sink, harness).await;
    batch_arrives_once_in_key_order(sink, harness).await;
    if let Some(missing) = harness.missing_route() {
        missing_destination_is_never_ok(sink, harness, &missing).await;
    }
    if let Some(limit) = harness.max_payload_bytes() {
        oversized_payload_is_permanent(sink, harness, limit).await;
    }
    let strays = harness.received(1, QUIET_PERIOD).await;
    assert!(strays.is_empty(), "unexpected messages after the suite: {strays:?}");
}

async fn empty_batch(sink: &dyn Sink, harness: &dyn SinkHarness) {
    let outcomes = sink.publish(&harness.route(), &[]).await;
    assert!(outcomes.is_empty(), "an empty batch returned {outcomes:?}");
}

async fn check_route(sink: &dyn Sink, harness: &dyn SinkHarness) {
    let route = harness.route();
    if let Err(e) = sink.check(&route).await {
        panic!("check() failed for the good route {:?}: {e}", route.destination);
    }
}

async fn batch_arrives_once_in_key_order(sink: &dyn Sink, harness: &dyn SinkHarness) {
    let events: Vec<StoredEvent> = (0..BATCH)
        .map(|seq| {
            let key = format!("key-{}", seq % KEYS);
            event(seq, "suite.item.created", Some(&key), json!({ "seq": seq, "key": key }))
        })
        .collect();
    let outcomes = sink.publish(&harness.route(), &events).await;
    assert_all_ok(&events, &outcomes);
    let received = harness.received(events.len(), ARRIVAL_TIMEOUT).await;
    assert_received_exactly(&events, &received);

    let mut last_seq: HashMap<&str, i64> = HashMap::new();
    let by_id: HashMap<String, &StoredEvent> = events.iter().map(|e| (e.id.to_string(), e)).collect();
    for message in &received {
        let event = by_id[&message.id];
        let key = event.key.as_deref().expect("suite events have keys");
        if let Some(previous) = last_seq.insert(key, event.seq) {
            assert!(
                previous < event.seq,
                "key {key}: seq {} arrived after seq {previous}",
                event.seq
            );
        }
    }
}

async fn missing_destination_is_never_ok(sink: &dyn Sink, harness: &dyn SinkHarness, missing: &Route) {
    let err = sink.check(missing).await.err();
    assert!(
        err.is_some(),
        "check() passed for the missing destination {:?}",
        missing.destination
    );

    let events: Vec<StoredEvent> = (0..3)
        .map(|seq| {
            event(
                seq,
                "suite.item.lost",
                Some(&format!("lost-{seq}")),
                json!({ "seq": seq }),
            )
        })
        .collect();
    let outcomes = sink.publish(missing, &events).await;
    assert_eq!(outcomes.len(), events.len(), "one outcome per event");
    for (event, outcome) in events.iter().zip(&outcomes) {
        match outcome {
            Ok(()) => panic!("event {} reported published to a missing destination", event.id),
            Err(e) => assert!(!e.message.is_empty(), "error without a message: {e:?}"),
        }
    }

    // The sink must recover for the good route.
    let events: Vec<StoredEvent> = (0..10)
        .map(|seq| event(seq, "suite.item.created", Some("after-missing"), json!({ "seq": seq })))
        .collect();
    let outcomes = sink.publish(&harness.route(), &events).await;
    assert_all_ok(&events, &outcomes);
    let received = harness.received(events.len(), ARRIVAL_TIMEOUT).await;
    assert_received_exactly(&events, &received);
}

async fn oversized_payload_is_permanent(sink: &dyn Sink, harness: &dyn SinkHarness, limit: usize) {
    // A JSON string of n characters serialises to n + 2 bytes.
    let sized = |bytes: usize| json!("x".repeat(bytes - 2));
    let events = vec![
        event(0, "suite.item.created", Some("small-a"), json!({ "seq": 0 })),
        event(1, "suite.item.created", Some("at-limit"), sized(limit)),
        event(2, "suite.item.created", Some("too-big"), sized(limit + 1)),
        event(3, "suite.item.created", Some("small-b"), json!({ "seq": 3 })),
        event(4, "suite.item.created", Some("too-big"), json!({ "seq": 4 })),
    ];
    assert_eq!(events[1].payload.len(), limit);
    let route = harness.route();
    // admit() and publish() refuse the same event, permanently; publish()
    // holds back the later event of its key, which would otherwise arrive
    // ahead of it. (The relay skips its own admit() pass for a sink that
    // admits in publish.)
    for (i, e) in events.iter().enumerate().take(4) {
        let size = e.payload.len();
        match (i, sink.admit(&route, e)) {
            (2, Ok(())) => panic!("admit(): a payload of {size} bytes passed a limit of {limit}"),
            (2, Err(err)) => assert_eq!(err.kind, ErrorKind::Permanent, "admit() of an oversized payload: {err}"),
            (_, Err(err)) => panic!("admit() refused event {i} ({size} bytes, limit {limit}): {err}"),
            (_, Ok(())) => {}
        }
    }
    let outcomes = sink.publish(&route, &events).await;
    assert_eq!(outcomes.len(), events.len(), "one outcome per event");
    for i in [0, 1, 3] {
        if let Err(e) = &outcomes[i] {
            panic!(
                "event {i} ({} bytes, limit {limit}) failed: {e}",
                events[i].payload.len()
            );
        }
    }
    match &outcomes[2] {
        Err(e) => assert_eq!(e.kind, ErrorKind::Permanent, "oversized payload: {e}"),
        Ok(()) => panic!(
            "publish(): a payload of {} bytes passed a limit of {limit}",
            events[2].payload.len()
        ),
    }
    match &outcomes[4] {
        Err(e) => assert!(
            e.held_back && e.is_transient(),
            "the event after a refused one of its key must be held back (SinkError::held_back): {e:?}"
        ),
        Ok(()) => panic!("publish() sent an event after a refused event of its key: out of order"),
    }
    let expected = [events[0].clone(), events[1].clone(), events[3].clone()];
    let received = harness.received(expected.len(), ARRIVAL_TIMEOUT).await;
    assert_received_exactly(&expected, &received);
}

fn assert_all_ok(events: &[StoredEvent], outcomes: &[PublishOutcome]) {
    assert_eq!(outcomes.len(), events.len(), "one outcome per event");
    for (i, (event, outcome)) in events.iter().zip(outcomes).enumerate() {
        if let Err(e) = outcome {
            panic!("event {i} ({}) failed: {e}", event.id);
        }
    }
}

/// `received` holds each of `events` exactly once, with the event id as
/// message id, the payload as body and the key as key.
fn assert_received_exactly(events: &[StoredEvent], received: &[ReceivedMessage]) {
    let by_id: HashMap<String, &StoredEvent> = events.iter().map(|e| (e.id.to_string(), e)).collect();
    let mut seen = HashSet::new();
    for message in received {
        let Some(event) = by_id.get(&message.id) else {
            panic!("received a message with an unknown id {:?}", message.id);
        };
        assert!(seen.insert(&message.id), "event {} received twice", message.id);
        assert_eq!(message.body, event.payload, "body of event {}", message.id);
        assert_eq!(message.key, event.key, "key of event {}", message.id);
    }
    let missing: Vec<&String> = by_id.keys().filter(|id| !seen.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} events never arrived: {missing:?}",
        missing.len(),
        events.len()
    );
}

#[cfg(test)]
mod tests;

/// The relay's loop in miniature, for fault tests: publishes the oldest
/// pending events in batches of `batch`; what failed stays pending, in seq
/// order, and goes out again after a short pause. Every failure must be
/// transient (a fault test injects only outages), and no event may be
/// confirmed after an earlier event of its key failed in the same batch.
/// Counts failures into `failures` as they happen, so a fault injector can
/// watch them. Returns the ids the sink confirmed.
///
/// # Panics
///
/// On a broken promise above, or when the events are not all confirmed
/// within `within`.
pub async fn drain_like_a_relay(
    sink: &dyn Sink,
    route: &Route,
    events: &[StoredEvent],
    batch: usize,
    failures: &std::sync::atomic::AtomicUsize,
    within: Duration,
) -> HashSet<String> {
    use std::sync::atomic::Ordering;
    let mut pending: std::collections::VecDeque<StoredEvent> = events.iter().cloned().collect();
    let mut confirmed = HashSet::new();
    let deadline = tokio::time::Instant::now() + within;
    while !pending.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} events never published",
            pending.len()
        );
        let n = pending.len().min(batch);
        let sent: Vec<StoredEvent> = pending.drain(..n).collect();
        let outcomes = sink.publish(route, &sent).await;
        assert_eq!(outcomes.len(), sent.len(), "one outcome per event");
        let mut failed_keys = HashSet::new();
        let mut retry = Vec::new();
        for (e, outcome) in sent.into_iter().zip(&outcomes) {
            match outcome {
                Ok(()) => {
                    assert!(
                        !failed_keys.contains(&e.key),
                        "event {} of key {:?} confirmed after an earlier one failed",
                        e.seq,
                        e.key
                    );
                    confirmed.insert(e.id.to_string());
                }
                Err(err) => {
                    assert_eq!(err.kind, ErrorKind::Transient, "an outage must be transient: {err}");
                    failures.fetch_add(1, Ordering::SeqCst);
                    failed_keys.insert(e.key.clone());
                    retry.push(e);
                }
            }
        }
        if !retry.is_empty() {
            for e in retry.into_iter().rev() {
                pending.push_front(e);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    confirmed
}

/// At least once and in order per key, as a destination stored it: every
/// event's id is among `stored` (ids in arrival order), nothing unknown is,
/// every `confirmed` id arrived, and per key first arrivals are in seq
/// order. Returns how many arrivals were repeats.
///
/// # Panics
///
/// On a lost, unknown or out-of-order event.
pub fn assert_all_arrived_in_key_order(
    events: &[StoredEvent],
    stored: &[String],
    confirmed: &HashSet<String>,
) -> usize {
    let by_id: HashMap<String, &StoredEvent> = events.iter().map(|e| (e.id.to_string(), e)).collect();
    let mut seen = HashSet::new();
    let mut last_seq: HashMap<Option<&str>, i64> = HashMap::new();
    let mut duplicates = 0;
    for id in stored {
        let e = by_id.get(id).unwrap_or_else(|| panic!("unknown message {id}"));
        if !seen.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        if let Some(previous) = last_seq.insert(e.key.as_deref(), e.seq)
            && e.key.is_some()
        {
            assert!(
                previous < e.seq,
                "key {:?}: seq {} first arrived after seq {previous}",
                e.key,
                e.seq
            );
        }
    }
    let lost = events.len() - seen.len();
    assert_eq!(lost, 0, "{lost} events lost");
    let unconfirmed: Vec<&String> = confirmed.difference(&seen).collect();
    assert!(unconfirmed.is_empty(), "confirmed but never arrived: {unconfirmed:?}");
    duplicates
}
