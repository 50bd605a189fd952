//! Faults between the sink and the receiver: a receiver that is down for a
//! while mid-drain, and one that never answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_sink::webhook::WebhookOptions;
use ferry_testkit::proxy::Proxy;
use ferry_testkit::sink_suite::{assert_all_arrived_in_key_order, drain_like_a_relay};

use crate::receiver::Receiver;
use crate::{SECRET, closed_port_url, expect_err, keyed, route, sink};

const DEADLINE: Duration = Duration::from_secs(120);

/// Polls `condition` until it holds; panics naming `what` after `DEADLINE`.
async fn until(what: &str, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_receiver_down_mid_drain_loses_nothing() {
    let receiver = Receiver::start(&[SECRET]).await;
    let proxy = Proxy::start(receiver.addr()).unwrap();
    let sink = Arc::new(sink(WebhookOptions {
        timeout: Duration::from_secs(5),
        ..WebhookOptions::default()
    }));
    let to = route(&format!("http://{}/hook", proxy.addr()));
    let events = keyed(3000, |seq| format!("k{}", seq % 10));
    let failures = Arc::new(AtomicUsize::new(0));

    // The relay's part, in batches of 100.
    let drain = tokio::spawn({
        let (sink, to, failures, events) = (Arc::clone(&sink), to.clone(), Arc::clone(&failures), events.clone());
        async move { drain_like_a_relay(&*sink, &to, &events, 100, &failures, DEADLINE).await }
    });

    // A third in: requests start hanging in the receiver, then the network
    // goes: live connections are reset and new ones refused.
    until("a third of the events", || receiver.count() >= 1000).await;
    receiver.set_gate(false);
    until("a request stuck in the receiver", || receiver.in_flight() > 0).await;
    proxy.set_refuse(true);
    proxy.cut();
    until("failed publishes during the outage", || {
        failures.load(Ordering::SeqCst) >= 50
    })
    .await;
    receiver.set_gate(true);
    proxy.set_refuse(false);
    let confirmed = drain.await.expect("the drain panicked");

    let received = receiver.all();
    for r in &received {
        assert_eq!(r.signed_with, vec![true], "a bad signature on {}", r.id);
    }
    // A request cut after the receiver took it is sent again: a duplicate,
    // which the receiver drops by webhook-id.
    let arrived: Vec<String> = received.iter().map(|r| r.id.clone()).collect();
    let duplicates = assert_all_arrived_in_key_order(&events, &arrived, &confirmed);
    assert!(failures.load(Ordering::SeqCst) > 0);
    println!(
        "{} events, {} failed publishes, {duplicates} duplicates",
        events.len(),
        failures.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn a_receiver_that_never_answers_times_out_transiently() {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions {
        timeout: Duration::from_millis(300),
        ..WebhookOptions::default()
    });
    let to = route(&receiver.url("/hook"));
    receiver.set_gate(false);
    let stalled = keyed(1, |_| "k".into());
    let outcomes = tokio::time::timeout(Duration::from_secs(10), sink.publish(&to, &stalled))
        .await
        .expect("bounded by the timeout");
    expect_err(&outcomes[0], ErrorKind::Transient, "timed out (sinks.web.timeout)");
    // Right after, the endpoint is left alone instead of waiting out
    // another timeout per event.
    let outcomes = sink.publish(&to, &keyed(3, |seq| format!("n{seq}"))).await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "not sent, next attempt in");
        // And says why, with the failure that started the backoff.
        expect_err(outcome, ErrorKind::Transient, "the last one failed: ");
        expect_err(outcome, ErrorKind::Transient, "timed out");
        // The relay waits out the backoff rather than spend attempts on
        // requests that would not be sent.
        let wait = outcome.as_ref().unwrap_err().retry_after;
        assert!(wait.is_some_and(|w| w > Duration::ZERO), "{wait:?}");
    }

    receiver.set_gate(true);
    let after = keyed(5, |seq| format!("a{seq}"));
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut pending = after.clone();
    while !pending.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "never recovered");
        let outcomes = sink.publish(&to, &pending).await;
        pending = pending
            .into_iter()
            .zip(&outcomes)
            .filter(|(_, o)| o.is_err())
            .map(|(e, _)| e)
            .collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `concurrency` requests timing out together are one outage: the endpoint
/// is left alone for the first step of its backoff, not for its cap, so the
/// events right after are answered "not sent" for at most 200 ms (each such
/// answer spends an attempt).
#[tokio::test]
async fn requests_timing_out_together_escalate_the_backoff_once() {
    let receiver = Receiver::start(&[SECRET]).await;
    let sink = sink(WebhookOptions {
        timeout: Duration::from_millis(300),
        concurrency: 8,
        ..WebhookOptions::default()
    });
    let to = route(&receiver.url("/hook"));
    receiver.set_gate(false);
    let stalled = sink.publish(&to, &keyed(8, |seq| format!("s{seq}"))).await;
    for outcome in &stalled {
        expect_err(outcome, ErrorKind::Transient, "timed out (sinks.web.timeout)");
    }
    let outcomes = sink.publish(&to, &keyed(8, |seq| format!("n{seq}"))).await;
    receiver.set_gate(true);
    for outcome in &outcomes {
        let err = outcome.as_ref().expect_err("the receiver is stalled");
        if err.message.starts_with("not sent") {
            let wait = err.retry_after.expect("a refusal says how long to wait");
            assert!(
                wait <= Duration::from_millis(200),
                "eight timeouts of one stall escalated the backoff past its first step: {err}"
            );
        }
    }
}

#[tokio::test]
async fn a_closed_port_fails_every_event_transiently_and_fast() {
    let sink = sink(WebhookOptions::default());
    let events = keyed(20, |seq| format!("k{}", seq % 4));
    let outcomes = tokio::time::timeout(
        Duration::from_secs(5),
        sink.publish(&route(&closed_port_url()), &events),
    )
    .await
    .expect("returned promptly");
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "");
    }
    expect_err(&outcomes[0], ErrorKind::Transient, "could not connect");
}
