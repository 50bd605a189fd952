//! Faults between the sink and the broker: a closed port, a connection cut
//! mid-batch, confirms that never come.

use std::collections::HashSet;
use std::time::Duration;

use ferry_core::{ErrorKind, Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::{TestTopology, amqp_url};
use ferry_testkit::sink_suite::{ARRIVAL_TIMEOUT, event};
use serde_json::json;

use crate::support::proxy::{self, FaultProxy};
use crate::support::{expect_err, ids, keyed, received_ids, route, sink_at};

#[tokio::test]
async fn an_unreachable_broker_fails_fast_and_transiently() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let sink = sink_at(proxy::redirect(&amqp_url(), addr).0);
    let events = keyed(3, |seq| format!("k{seq}"));

    let attempt = async {
        for _ in 0..2 {
            let outcomes = sink.publish(&route("anything", None), &events).await;
            assert_eq!(outcomes.len(), 3);
            for outcome in &outcomes {
                expect_err(outcome, ErrorKind::Transient, "RabbitMQ");
            }
        }
        let err = sink.check(&route("anything", None)).await.expect_err("unreachable");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(!err.message.contains("guest:guest"), "the password leaked: {err}");
        sink.close().await;
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .expect("returned promptly");
}

#[tokio::test]
async fn reconnects_after_the_connection_is_cut_mid_batch() {
    let topology = TestTopology::create("cut").await;
    let (_, upstream) = proxy::redirect(&amqp_url(), "127.0.0.1:1".parse().unwrap());
    let proxy = FaultProxy::start(upstream).await;
    let sink = sink_at(proxy::redirect(&amqp_url(), proxy.addr()).0);
    let to = route(topology.exchange(), None);

    let warmup = keyed(5, |seq| format!("w{seq}"));
    assert!(sink.publish(&to, &warmup).await.iter().all(Result::is_ok));
    assert_eq!(received_ids(&topology.receive(5, ARRIVAL_TIMEOUT).await), ids(&warmup));

    // About 3 MB of messages; the proxy cuts the link after 256 KiB of them.
    let padding = "p".repeat(1000);
    let batch: Vec<StoredEvent> = (0..3000)
        .map(|seq| {
            event(
                seq,
                "test.item.created",
                Some(&format!("k{}", seq % 7)),
                json!({ "seq": seq, "pad": padding }),
            )
        })
        .collect();
    proxy.cut_after_upstream_bytes(256 * 1024);
    let outcomes = sink.publish(&to, &batch).await;
    assert!(proxy.wait_for_cuts(1, ARRIVAL_TIMEOUT).await, "the proxy never cut");
    let ok: Vec<StoredEvent> = batch
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| o.is_ok())
        .map(|(e, _)| e.clone())
        .collect();
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    assert!(
        failed > 0,
        "the cut came after the batch: all {} confirmed",
        outcomes.len()
    );
    for outcome in outcomes.iter().filter(|o| o.is_err()) {
        expect_err(outcome, ErrorKind::Transient, "");
    }

    // Every event reported published must have arrived.
    let wanted = ids(&ok);
    let mut seen = HashSet::new();
    while !wanted.is_subset(&seen) {
        let missing = wanted.difference(&seen).count();
        let more = topology.receive(missing, ARRIVAL_TIMEOUT).await;
        assert!(
            !more.is_empty(),
            "{} confirmed events never arrived",
            wanted.difference(&seen).count()
        );
        seen.extend(received_ids(&more));
    }

    let after = keyed(50, |seq| format!("after-{}", seq % 3));
    let outcomes = sink.publish(&to, &after).await;
    assert!(
        outcomes.iter().all(Result::is_ok),
        "no reconnect: {:?}",
        outcomes.iter().find(|o| o.is_err())
    );
    let wanted = ids(&after);
    let mut seen = HashSet::new();
    while !wanted.is_subset(&seen) {
        let more = topology.receive(wanted.len(), ARRIVAL_TIMEOUT).await;
        assert!(!more.is_empty(), "events published after the reconnect never arrived");
        seen.extend(received_ids(&more));
    }
    sink.close().await;
    topology.delete().await;
}

/// A sink that reaches the test broker through a [`FaultProxy`].
async fn behind_a_proxy(publish_timeout: Duration) -> (FaultProxy, RabbitMqSink) {
    let (_, upstream) = proxy::redirect(&amqp_url(), "127.0.0.1:1".parse().unwrap());
    let proxy = FaultProxy::start(upstream).await;
    let sink = RabbitMqSink::new(RabbitMqOptions {
        url: proxy::redirect(&amqp_url(), proxy.addr()).0,
        publish_timeout,
        ..RabbitMqOptions::default()
    });
    (proxy, sink)
}

#[tokio::test]
async fn a_missing_confirm_times_out_transiently_and_the_link_is_replaced() {
    let topology = TestTopology::create("stall").await;
    let (proxy, sink) = behind_a_proxy(Duration::from_millis(500)).await;
    let to = route(topology.exchange(), None);
    let warmup = keyed(3, |seq| format!("w{seq}"));
    assert!(sink.publish(&to, &warmup).await.iter().all(Result::is_ok));

    proxy.stall(true);
    let stalled = keyed(10, |seq| format!("s{}", seq % 2));
    for outcome in sink.publish(&to, &stalled).await {
        expect_err(&outcome, ErrorKind::Transient, "no publisher confirm");
    }
    proxy.stall(false);
    let after = keyed(10, |seq| format!("a{}", seq % 2));
    let outcomes = sink.publish(&to, &after).await;
    assert!(outcomes.iter().all(Result::is_ok), "no new link: {outcomes:?}");
    // Released, the old link would work again: only a second connection
    // shows it was given up.
    assert_eq!(proxy.accepted(), 2, "the stalled link was kept, not replaced");

    // The unconfirmed messages did reach the queue: retrying them will
    // duplicate them, which is why every message carries the event id.
    let wanted: HashSet<String> = [&warmup, &stalled, &after].into_iter().flat_map(|b| ids(b)).collect();
    let received = topology.receive(wanted.len(), ARRIVAL_TIMEOUT).await;
    assert_eq!(received_ids(&received), wanted);
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn a_resource_alarm_is_named_refused_at_once_and_loses_nothing() {
    let topology = TestTopology::create("alarm").await;
    let (proxy, sink) = behind_a_proxy(Duration::from_secs(2)).await;
    let to = route(topology.exchange(), None);
    let warmup = keyed(3, |seq| format!("w{seq}"));
    assert!(sink.publish(&to, &warmup).await.iter().all(Result::is_ok));

    // The broker runs low on disk with a batch on its way: it blocks the
    // connection and reads nothing more, so no confirm comes.
    proxy.block("low on disk");
    let first = keyed(5, |seq| format!("a{seq}"));
    for outcome in &sink.publish(&to, &first).await {
        expect_err(outcome, ErrorKind::Transient, "resource alarm");
    }
    // While it lasts, a batch is refused at once, unsent, and check says why.
    let second = keyed(5, |seq| format!("b{seq}"));
    for outcome in &sink.publish(&to, &second).await {
        expect_err(outcome, ErrorKind::Transient, "not sent: RabbitMQ");
        expect_err(outcome, ErrorKind::Transient, "resource alarm");
    }
    let err = sink.check(&to).await.expect_err("blocked");
    assert!(err.is_transient() && err.message.contains("resource alarm"), "{err}");
    assert_eq!(proxy.accepted(), 1, "the blocked connection was given up for a new one");

    // The alarm clears: the retries go through on the same connection, and
    // every event arrives (the first batch's may arrive twice).
    proxy.unblock();
    let retried: Vec<StoredEvent> = first.iter().chain(&second).cloned().collect();
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    loop {
        let outcomes = sink.publish(&to, &retried).await;
        if outcomes.iter().all(Result::is_ok) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "still refused: {outcomes:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxy.accepted(), 1, "the connection was not kept through the alarm");
    let mut wanted = ids(&warmup);
    wanted.extend(ids(&retried));
    let mut seen = HashSet::new();
    while !wanted.is_subset(&seen) {
        let received = topology.receive(1, ARRIVAL_TIMEOUT).await;
        assert!(
            !received.is_empty(),
            "lost: {:?}",
            wanted.difference(&seen).collect::<Vec<_>>()
        );
        seen.extend(received_ids(&received));
    }
    sink.close().await;
}

#[tokio::test]
async fn after_an_alarm_no_confirm_owed_from_before_it_takes_a_later_return() {
    // A batch times out while the broker blocks the connection; the sink
    // keeps the connection, and lapin sends that batch once the alarm
    // clears. Were the next batch sent before those confirms came in, lapin
    // could hand one of its returns to an old, unread confirm, and an
    // unroutable event would pass for delivered. (That race needs the
    // broker's acks for the old batch to come after the new batch's
    // returns; it did not show here without the fix. What this checks is
    // that the owed confirms settle on the same connection and the next
    // batch's outcomes are each right.)
    let topology = TestTopology::create_with_binding("alarm-returns", "routable.#").await;
    let (proxy, sink) = behind_a_proxy(Duration::from_secs(2)).await;
    let routed = route(topology.exchange(), Some("{key}"));
    let warm = keyed(5, |seq| format!("routable.{seq}"));
    assert!(sink.publish(&routed, &warm).await.iter().all(Result::is_ok));

    proxy.block("low on memory");
    let held = keyed(3000, |seq| format!("routable.{seq}"));
    for outcome in &sink.publish(&routed, &held).await {
        expect_err(outcome, ErrorKind::Transient, "resource alarm");
    }
    proxy.unblock();
    let mixed = keyed(300, |seq| {
        if seq % 2 == 0 {
            format!("dropped.{seq}")
        } else {
            format!("routable.{seq}")
        }
    });
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    let outcomes = loop {
        let outcomes = sink.publish(&routed, &mixed).await;
        // Refused while lapin still reads the broker's unblock.
        if !outcomes
            .iter()
            .any(|o| o.as_ref().is_err_and(|e| e.message.contains("resource alarm")))
        {
            break outcomes;
        }
        assert!(tokio::time::Instant::now() < deadline, "still blocked");
        // At once, as a relay's next batch would, while the held batch's
        // answers are still coming in.
        tokio::task::yield_now().await;
    };
    for (e, outcome) in mixed.iter().zip(&outcomes) {
        if e.seq % 2 == 0 {
            expect_err(outcome, ErrorKind::Transient, "unroutable");
        } else {
            assert_eq!(outcome, &Ok(()), "event {}", e.seq);
        }
    }
    assert_eq!(proxy.accepted(), 1);
    sink.close().await;
    topology.delete().await;
}
