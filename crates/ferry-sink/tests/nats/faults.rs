//! Faults between the sink and NATS: a closed port, a connection cut in the
//! middle of a drain, new connections refused for a while.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use ferry_core::{ErrorKind, Sink, StoredEvent};
use ferry_sink::nats::{NatsOptions, NatsSink};
use ferry_testkit::proxy::Proxy;
use ferry_testkit::sink_suite::{ARRIVAL_TIMEOUT, assert_all_arrived_in_key_order, drain_like_a_relay, event};
use serde_json::json;
use tokio::time::Instant;

use crate::support::{TestStream, expect_err, keyed, nats_url, route};

fn upstream() -> SocketAddr {
    let url = nats_url();
    let host = url.rsplit('@').next().unwrap().trim_start_matches("nats://");
    host.parse()
        .expect("FERRY_TEST_NATS_URL as nats://host:port with an IP")
}

fn sink_through(addr: SocketAddr, publish_timeout: Duration) -> NatsSink {
    NatsSink::new(NatsOptions {
        url: format!("nats://{addr}"),
        publish_timeout,
        reconnect_max_delay: Duration::from_millis(400),
        ..NatsOptions::default()
    })
}

#[tokio::test]
async fn an_unreachable_server_fails_fast_and_transiently() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let sink = sink_through(closed, Duration::from_secs(2));
    let events = keyed(3, |seq| format!("k{seq}"));
    let attempt = async {
        for _ in 0..2 {
            let outcomes = sink.publish(&route("anything"), &events).await;
            assert_eq!(outcomes.len(), 3);
            for outcome in &outcomes {
                expect_err(outcome, ErrorKind::Transient, "NATS");
            }
        }
        let err = sink.check(&route("anything")).await.expect_err("unreachable");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        sink.close().await;
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .expect("returned instead of hanging");
}

#[tokio::test]
async fn a_publish_during_an_outage_fails_transiently_and_the_sink_recovers() {
    let stream = TestStream::create("outage").await;
    let proxy = Proxy::start(upstream()).unwrap();
    let sink = sink_through(proxy.addr(), Duration::from_secs(2));
    let to = route(&stream.subject);
    assert!(
        sink.publish(&to, &keyed(3, |s| format!("w{s}")))
            .await
            .iter()
            .all(Result::is_ok)
    );

    proxy.set_refuse(true);
    proxy.cut();
    let during = keyed(20, |s| format!("d{}", s % 3));
    // Bounded by the publish timeout; the outer bound only turns a hang into
    // a failure instead of a stuck test.
    let outcomes = tokio::time::timeout(Duration::from_secs(20), sink.publish(&to, &during))
        .await
        .expect("a publish during an outage must not hang");
    let failed: Vec<_> = outcomes.iter().filter(|o| o.is_err()).collect();
    for outcome in &failed {
        expect_err(outcome, ErrorKind::Transient, "");
    }
    // The cut may reach the client only after the batch went out; then the
    // next batch fails, because new connections are refused.
    if failed.is_empty() {
        let again = keyed(5, |s| format!("x{s}"));
        let outcomes = tokio::time::timeout(Duration::from_secs(20), sink.publish(&to, &again))
            .await
            .expect("no hang");
        for outcome in &outcomes {
            expect_err(outcome, ErrorKind::Transient, "");
        }
    }

    proxy.set_refuse(false);
    let after = keyed(10, |s| format!("a{}", s % 2));
    let deadline = Instant::now() + ARRIVAL_TIMEOUT;
    loop {
        let outcomes = sink.publish(&to, &after).await;
        if outcomes.iter().all(Result::is_ok) {
            break;
        }
        assert!(Instant::now() < deadline, "never recovered: {outcomes:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stored: HashSet<String> = stream.all().await.iter().map(|m| m.id()).collect();
    assert!(after.iter().all(|e| stored.contains(&e.id.to_string())));
    sink.close().await;
    stream.delete().await;
}

/// The relay's loop in miniature: publish the oldest pending events in
/// batches; what failed stays pending, in seq order, and goes out again.
#[tokio::test]
async fn a_cut_mid_drain_loses_nothing_and_keeps_key_order() {
    const EVENTS: i64 = 3000;
    const BATCH: usize = 250;
    let stream = TestStream::create("cut").await;
    let proxy = Arc::new(Proxy::start(upstream()).unwrap());
    let sink = sink_through(proxy.addr(), Duration::from_secs(3));
    let to = route(&stream.subject);
    let padding = "p".repeat(1000);
    let events: Vec<StoredEvent> = (0..EVENTS)
        .map(|seq| {
            event(
                seq,
                "test.item.created",
                Some(&format!("k{}", seq % 7)),
                json!({ "seq": seq, "pad": padding }),
            )
        })
        .collect();

    // Cut every connection once the stream holds a third of the events, keep
    // new connections refused for a while, then cut once more right after.
    let faults = {
        let proxy = Arc::clone(&proxy);
        let stream = TestStream::watch(&stream).await;
        tokio::spawn(async move {
            while stream.count().await < (EVENTS as u64) / 3 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            proxy.set_refuse(true);
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(700)).await;
            proxy.set_refuse(false);
            while stream.count().await < (EVENTS as u64) * 2 / 3 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            proxy.cut();
        })
    };

    let failures = AtomicUsize::new(0);
    let confirmed = drain_like_a_relay(&sink, &to, &events, BATCH, &failures, Duration::from_secs(120)).await;
    faults.await.unwrap();
    assert!(failures.into_inner() > 0, "the faults never reached the sink");
    // JetStream deduplicates on Nats-Msg-Id, the same for every publish of
    // an event to one subject: a retried event is stored once.
    let stored: Vec<String> = stream.all().await.iter().map(|m| m.id()).collect();
    let duplicates = assert_all_arrived_in_key_order(&events, &stored, &confirmed);
    assert_eq!(duplicates, 0, "JetStream stored an event twice");
    sink.close().await;
    stream.delete().await;
}

/// A publish the relay gives up on (its bound passed) leaves PubAcks owed on
/// the connection, which may have stalled: the sink forgets it, and the next
/// batch connects anew rather than wait on it for its whole timeout.
#[tokio::test]
async fn a_publish_cut_short_leaves_its_connection_behind() {
    let stream = TestStream::create("abandoned").await;
    let proxy = Proxy::start(upstream()).unwrap();
    let sink = sink_through(proxy.addr(), Duration::from_secs(5));
    let to = route(&stream.subject);
    let events = keyed(6, |_| "k".to_owned());
    let outcomes = sink.publish(&to, &events[..3]).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(proxy.live_connections(), 1);
    // The server stalls; the relay gives up on the batch before its PubAcks.
    proxy.set_delay(Duration::from_secs(3));
    let cut_short = tokio::time::timeout(Duration::from_millis(300), sink.publish(&to, &events[3..])).await;
    assert!(cut_short.is_err(), "the batch finished in spite of the stall");
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.live_connections() > 0 {
        assert!(Instant::now() < deadline, "the abandoned connection is still open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.set_delay(Duration::ZERO);
    let outcomes = sink.publish(&to, &events[3..]).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    sink.close().await;
    stream.delete().await;
}
