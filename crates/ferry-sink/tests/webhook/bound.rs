//! A batch ends within the sink's bound (twice `timeout`) however many
//! events one key has in it: what was answered 2xx is reported published,
//! the rest held back for a later batch, never failed.

use std::time::{Duration, Instant};

use ferry_core::{ErrorKind, PublishOutcome, Sink, StoredEvent};
use ferry_sink::webhook::WebhookOptions;
use ferry_testkit::sink_suite::{ARRIVAL_TIMEOUT, QUIET_PERIOD};

use crate::receiver::Receiver;
use crate::{SECRET, ids, keyed, received_ids, route, sink};

/// How many leading outcomes are `Ok`, after checking that every later one
/// is held back: transient, not sent, no attempt counted.
fn confirmed_then_held_back(outcomes: &[PublishOutcome]) -> usize {
    let confirmed = outcomes.iter().take_while(|o| o.is_ok()).count();
    for (i, outcome) in outcomes.iter().enumerate().skip(confirmed) {
        let err = outcome.as_ref().expect_err("no 2xx after a held-back event");
        assert!(
            err.held_back && err.kind == ErrorKind::Transient,
            "event {i}: expected held back, got {err}"
        );
    }
    confirmed
}

#[tokio::test]
async fn a_hot_key_stops_at_the_bound_and_holds_back_the_rest() {
    let receiver = Receiver::start(&[SECRET]).await;
    receiver.answer_after(Duration::from_millis(100));
    let timeout = Duration::from_millis(800);
    let bound = timeout * 2;
    let sink = sink(WebhookOptions {
        timeout,
        ..WebhookOptions::default()
    });
    let to = route(&receiver.url("/hook"));
    // 30 requests of 100 ms, one after another: 3 s, past the 1.6 s bound.
    let events = keyed(30, |_| "hot".into());

    let started = Instant::now();
    let outcomes = sink.publish(&to, &events).await;
    let took = started.elapsed();
    assert!(took < bound, "the publish took {took:?}, past its bound of {bound:?}");
    let confirmed = confirmed_then_held_back(&outcomes);
    assert!(confirmed > 0, "nothing was sent: {:?}", outcomes[0]);
    assert!(confirmed < events.len(), "all sent within {took:?}");
    assert_eq!(
        received_ids(&receiver.receive(confirmed, ARRIVAL_TIMEOUT).await),
        ids(&events[..confirmed]),
        "the receiver got exactly the events reported published"
    );

    // The next batches carry what was held back, as the relay's would.
    let mut pending: Vec<StoredEvent> = events[confirmed..].to_vec();
    let pending_at_first = pending.len();
    while !pending.is_empty() {
        let started = Instant::now();
        let outcomes = sink.publish(&to, &pending).await;
        assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
        let confirmed = confirmed_then_held_back(&outcomes);
        assert!(confirmed > 0, "no progress: {:?}", outcomes[0]);
        pending.drain(..confirmed);
    }
    receiver.receive(pending_at_first, ARRIVAL_TIMEOUT).await;
    assert!(
        receiver.receive(1, QUIET_PERIOD).await.is_empty(),
        "more requests than events"
    );
    assert_eq!(
        received_ids(&receiver.all()),
        ids(&events),
        "each event arrives once, in order"
    );
}
