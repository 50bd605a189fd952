//! A publish call ends within its `publish_timeout` from when it has the
//! sink's connection, and within twice that from its start, whatever it
//! has to do on the way (check exchanges found missing before, reconnect,
//! open channels, send again): the relay's own bound on it is not much
//! longer, and past that bound acked events are reported failed and sent
//! twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_core::{ErrorKind, Route, Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::{TestTopology, amqp_url, unique_name};
use ferry_testkit::sink_suite::{ARRIVAL_TIMEOUT, event};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::support::proxy;
use crate::support::{LIMIT, expect_err, keyed, route};

/// A TCP proxy in front of the test broker that delays what the broker
/// sends by a latency that can be changed at any time: a far or slow
/// broker, on which every round trip counts.
struct SlowLink {
    addr: std::net::SocketAddr,
    latency_ms: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl SlowLink {
    async fn start() -> Self {
        let (_, upstream) = proxy::redirect(&amqp_url(), "127.0.0.1:1".parse().unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let latency_ms = Arc::new(AtomicU64::new(0));
        let latency = Arc::clone(&latency_ms);
        let accept = tokio::spawn(async move {
            let mut links = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                links.spawn(forward(client, upstream.clone(), Arc::clone(&latency)));
            }
        });
        Self {
            addr,
            latency_ms,
            accept,
        }
    }

    /// A sink through this link, publishing over one channel.
    fn sink(&self, publish_timeout: Duration) -> RabbitMqSink {
        RabbitMqSink::new(RabbitMqOptions {
            url: self.url(),
            publish_timeout,
            max_message_bytes: LIMIT,
            channels: 1,
            ..RabbitMqOptions::default()
        })
    }

    fn url(&self) -> String {
        proxy::redirect(&amqp_url(), self.addr).0
    }

    fn set_latency(&self, latency: Duration) {
        self.latency_ms.store(latency.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts the links.
        self.accept.abort();
    }
}

async fn forward(client: TcpStream, upstream: String, latency_ms: Arc<AtomicU64>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = tokio::io::copy(&mut client_read, &mut server_write);
    // Each chunk the broker sends goes on after the latency, in order.
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let due = Instant::now() + Duration::from_millis(latency_ms.load(Ordering::SeqCst));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if client_write.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = async { tokio::join!(read, write) } => {}
    }
}

/// `missing.len()` events to the exchanges in `missing`, each of a key of
/// its own, among `good` events to `exchange` over four keys.
fn batch(exchange: &str, missing: &[String], good: i64, round: i64) -> Vec<StoredEvent> {
    let to = |domain: &str, seq: i64, key: String| {
        event(
            seq,
            &format!("{domain}.item.created"),
            Some(&key),
            json!({ "seq": seq }),
        )
    };
    let mut events = Vec::new();
    for i in 0..good.max(missing.len() as i64) {
        if let Some(domain) = missing.get(i as usize) {
            events.push(to(domain, round * 1000 + 500 + i, format!("m{i}")));
        }
        if i < good {
            events.push(to(exchange, round * 1000 + i, format!("g{}", i % 4)));
        }
    }
    events
}

/// Events of one key of their own to each exchange in `missing`, one call
/// each on a fast link: each exchange is found missing and remembered,
/// without one call having to do it all within its publish timeout.
async fn remember_missing(sink: &RabbitMqSink, missing: &[String]) {
    let templated = route("{domain}", None);
    for (i, domain) in missing.iter().enumerate() {
        let seed = vec![event(
            900_000 + i as i64,
            &format!("{domain}.item.created"),
            Some(&format!("seed{i}")),
            json!({ "seed": i }),
        )];
        for outcome in &sink.publish(&templated, &seed).await {
            expect_err(outcome, ErrorKind::Transient, "does not exist");
        }
    }
}

#[tokio::test]
async fn checking_many_exchanges_found_missing_on_a_slow_link_keeps_within_the_publish_timeout() {
    let topology = TestTopology::create("deadline").await;
    let missing: Vec<String> = (0..20).map(|i| unique_name(&format!("deadline-gone{i}"))).collect();
    let link = SlowLink::start().await;
    let publish_timeout = Duration::from_secs(4);
    let sink = link.sink(publish_timeout);
    let templated = route("{domain}", None);

    // On a fast link, the sink finds the twenty exchanges missing and
    // remembers them.
    remember_missing(&sink, &missing).await;

    // 200 ms from the broker: a passive check of one exchange (channel
    // open, declare, close) takes two or three round trips, all twenty
    // well past the publish timeout.
    link.set_latency(Duration::from_millis(200));
    // Generous for a busy machine, and still far below the twenty checks.
    let bound = publish_timeout * 3 / 2;
    let deadline = Instant::now() + ARRIVAL_TIMEOUT;
    let mut good_published = false;
    for round in 1.. {
        let events = batch(topology.exchange(), &missing, 8, round);
        let started = Instant::now();
        let outcomes = sink.publish(&templated, &events).await;
        let took = started.elapsed();
        assert!(
            took <= bound,
            "round {round}: the publish call took {took:?}, past its publish_timeout of {publish_timeout:?}"
        );
        for (e, outcome) in events.iter().zip(&outcomes) {
            if e.key.as_deref().is_some_and(|k| k.starts_with('m')) {
                expect_err(outcome, ErrorKind::Transient, "does not exist");
            } else if let Err(err) = outcome {
                // Out of time: retried, with the setting named.
                assert_eq!(err.kind, ErrorKind::Transient, "{err}");
            }
        }
        // The checks leave the batch time of its own: its events go.
        if outcomes
            .iter()
            .zip(&events)
            .filter(|(_, e)| e.key.as_deref().is_some_and(|k| k.starts_with('g')))
            .all(|(o, _)| o.is_ok())
        {
            good_published = true;
        }
        if good_published && round >= 3 {
            break;
        }
        assert!(Instant::now() < deadline, "the good events never went: {outcomes:?}");
    }
    sink.close().await;
    topology.delete().await;
}

/// A sink through a slow link of no latency yet, with `publish_timeout`,
/// connected by a first batch to a fresh exchange.
async fn connected(name: &str, publish_timeout: Duration) -> (TestTopology, SlowLink, RabbitMqSink, Route) {
    let topology = TestTopology::create(name).await;
    let link = SlowLink::start().await;
    let sink = link.sink(publish_timeout);
    let to = route(topology.exchange(), None);
    assert!(
        sink.publish(&to, &keyed(2, |seq| format!("w{seq}")))
            .await
            .iter()
            .all(Result::is_ok)
    );
    (topology, link, sink, to)
}

/// Batches to one sink go one at a time: a call waiting for the one before
/// it still gets its whole publish timeout once the connection is its own.
#[tokio::test]
async fn a_call_queued_behind_another_gets_its_whole_publish_timeout() {
    let (topology, link, sink, to) = connected("deadline-queued", Duration::from_secs(4)).await;

    // Each batch takes one round trip, 2.5 s: the second waits that long
    // for the first, then needs as long again.
    link.set_latency(Duration::from_millis(2500));
    let first = keyed(3, |seq| format!("a{seq}"));
    let second = keyed(3, |seq| format!("b{seq}"));
    let (first_outcomes, second_outcomes) = tokio::join!(sink.publish(&to, &first), sink.publish(&to, &second));
    assert!(first_outcomes.iter().all(Result::is_ok), "{first_outcomes:?}");
    assert!(second_outcomes.iter().all(Result::is_ok), "{second_outcomes:?}");
    link.set_latency(Duration::ZERO);
    sink.close().await;
    topology.delete().await;
}

/// The relay's bound on a publish runs from the call's start: a call queued
/// behind two others gets what is left of twice its publish timeout, not a
/// whole one more, and fails transiently, unsent, rather than run past the
/// relay's bound (which would report acked events failed).
#[tokio::test]
async fn a_call_queued_past_twice_the_publish_timeout_ends_inside_it() {
    let (topology, link, sink, to) = connected("deadline-capped", Duration::from_secs(2)).await;

    // Each batch takes one round trip, 1.5 s: the third waits 3 s for the
    // two before it, which leaves it 0.8 s of the 3.8 s its call may take.
    link.set_latency(Duration::from_millis(1500));
    let first = keyed(2, |seq| format!("a{seq}"));
    let second = keyed(2, |seq| format!("b{seq}"));
    let third = keyed(2, |seq| format!("c{seq}"));
    let started = tokio::time::Instant::now();
    let (first_outcomes, (second_outcomes, third_outcomes)) = tokio::join!(sink.publish(&to, &first), async {
        // Queued in this order behind the first.
        tokio::time::sleep(Duration::from_millis(100)).await;
        tokio::join!(sink.publish(&to, &second), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let outcomes = sink.publish(&to, &third).await;
            (outcomes, started.elapsed())
        })
    });
    assert!(first_outcomes.iter().all(Result::is_ok), "{first_outcomes:?}");
    assert!(second_outcomes.iter().all(Result::is_ok), "{second_outcomes:?}");
    let (third_outcomes, took) = third_outcomes;
    for outcome in &third_outcomes {
        expect_err(outcome, ErrorKind::Transient, "publish_timeout (2s)");
    }
    assert!(took < Duration::from_secs(6), "the third call took {took:?}");
    link.set_latency(Duration::ZERO);
    sink.close().await;
    topology.delete().await;
}

/// A connect nobody answers within the whole publish timeout is a failed
/// connect like any other: it backs off and says so, and does not blame
/// the publish timeout for a broker that is not there.
#[tokio::test]
async fn a_connect_nobody_answers_backs_off_without_blaming_the_publish_timeout() {
    // Never accepted: the kernel completes the handshake, nothing answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let sink = RabbitMqSink::new(RabbitMqOptions {
        url: proxy::redirect(&amqp_url(), silent.local_addr().unwrap()).0,
        publish_timeout: Duration::from_secs(2),
        max_message_bytes: LIMIT,
        ..RabbitMqOptions::default()
    });
    let outcomes = sink
        .publish(&route("anything", None), &keyed(2, |seq| format!("k{seq}")))
        .await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "no answer within 2s");
        let err = outcome.as_ref().unwrap_err();
        assert!(!err.message.contains("publish_timeout"), "{err}");
    }
    sink.close().await;
}
