//! End to end on NATS JetStream: outbox -> relay -> stream -> durable pull
//! consumer with the inbox, counting the business effect per event through
//! a client that dies between its commit and its ack (its messages
//! redelivered to the other client after `ack_wait`), deliberate double
//! publishes, a relay that republishes after a crash, and a handler that
//! always fails; and durable consumers created earlier with other settings.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, Context, stream};
use ferry_core::{Event, EventId, Sink};
use ferry_inbox::nats::{DEAD_CONSUMER_HEADER, DEAD_REASON_HEADER, NatsConsumer, NatsConsumerOptions};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_sink::nats::{NatsOptions, NatsSink};
use ferry_testkit::proxy::Proxy;
use ferry_testkit::rabbit::unique_name;
use futures::StreamExt;
use serde_json::json;
use sqlx::PgConnection;
use support::{Db, RelayRun, WITHIN, effect, wait};
use tokio::sync::oneshot;

fn nats_url() -> String {
    std::env::var("FERRY_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A stream of the test's own (with a duplicate window short enough that
/// the relay's re-publishes reach the consumer) and a dead-letter stream.
struct Env {
    db: Db,
    js: Context,
    stream: String,
    subject: String,
    dead_stream: String,
    dead_subject: String,
}

impl Env {
    async fn new(prefix: &str) -> Env {
        let name = unique_name(prefix);
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        let env = Env {
            db: Db::new().await,
            subject: format!("{name}.orders"),
            dead_subject: format!("{name}-dead.orders"),
            dead_stream: format!("{name}-dead"),
            stream: name,
            js,
        };
        for (stream, subject) in [(&env.stream, &env.subject), (&env.dead_stream, &env.dead_subject)] {
            env.js
                .create_stream(stream::Config {
                    name: stream.clone(),
                    subjects: vec![subject.clone()],
                    duplicate_window: Duration::from_millis(100),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        env
    }

    fn options(&self, url: String) -> NatsConsumerOptions {
        let mut o = NatsConsumerOptions::new(url, &self.stream, "billing", &self.dead_subject);
        o.ack_wait = Duration::from_secs(1);
        o.timeout = Duration::from_secs(2);
        o.reconnect_max_delay = Duration::from_millis(300);
        o.database_retry_delay = Duration::from_millis(50);
        o
    }

    fn relay(&self, routes: &[&str]) -> RelayRun {
        let sink = NatsSink::new(NatsOptions {
            url: nats_url(),
            ..NatsOptions::default()
        });
        self.db.relay(Arc::new(sink) as Arc<dyn Sink>, routes, &self.subject)
    }

    /// Messages of the durable consumer not yet delivered or not yet acked.
    async fn outstanding(&self) -> u64 {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        match stream.consumer_info("billing").await {
            Ok(info) => info.num_pending + info.num_ack_pending as u64,
            Err(_) => u64::MAX,
        }
    }

    async fn dead_letters(&self) -> Vec<jetstream::Message> {
        let stream = self.js.get_stream(&self.dead_stream).await.unwrap();
        let reader = stream
            .create_consumer(jetstream::consumer::pull::Config::default())
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut batch = reader.fetch().max_messages(100).messages().await.unwrap();
        while let Ok(Some(m)) = tokio::time::timeout(WITHIN, batch.next()).await {
            got.push(m.unwrap());
        }
        got
    }

    /// Publishes a message no Ferry sink wrote: no headers at all, so every
    /// consumer takes it for malformed.
    async fn publish_headerless(&self) {
        self.js
            .publish(self.subject.clone(), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self.js.delete_stream(&self.dead_stream).await;
    }
}

#[tokio::test]
async fn each_effect_happens_once_when_a_client_dies_between_commit_and_ack() {
    const N: usize = 150;
    let env = Env::new("inbox-nats").await;
    let proxy = Proxy::start("127.0.0.1:4222".parse().unwrap()).unwrap();
    let via_proxy = nats_url().replacen("127.0.0.1:4222", &proxy.addr().to_string(), 1);
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let doomed = NatsConsumer::new(inbox.clone(), env.options(via_proxy)).unwrap();
    let survivor = NatsConsumer::new(inbox.clone(), env.options(nats_url())).unwrap();

    // The doomed client loses NATS for good inside its tenth handler run:
    // that event commits, its ack never arrives, and the server redelivers
    // it (and the rest it held) to the survivor after ack_wait.
    let handled = AtomicU32::new(0);
    let doomed_handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        effect(tx, event).await?;
        if handled.fetch_add(1, Ordering::SeqCst) == 9 {
            proxy.set_refuse(true);
            proxy.cut();
        }
        Ok(())
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let scenario = async {
        // Two routes to the same subject: every event is published twice;
        // JetStream drops a copy inside its duplicate window, the inbox any
        // copy that arrives later.
        let relay = env.relay(&["first", "second"]);
        let events = (0..N)
            .map(|n| Event::new("order.item.created", json!({ "n": n })).key(format!("k{}", n % 7)))
            .collect();
        assert_eq!(env.db.produce(events).await.len(), N);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;
        // The relay forgets a third of its publishes in a crash; a new one
        // publishes them again.
        env.db.forget_a_third().await;
        let relay = env.relay(&["first", "second"]);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;

        wait("every message consumed and acknowledged", || async {
            let (d, s) = (doomed.report(), survivor.report());
            d.processed + s.processed == N as u64 && d.duplicates + s.duplicates > 0 && env.outstanding().await == 0
        })
        .await;
        let _ = stop.send(true);
    };
    let (doomed_report, survivor_report, ()) = tokio::join!(
        doomed.run(doomed_handler, until_stopped()),
        survivor.run(async |tx, event| effect(tx, event).await, until_stopped()),
        scenario
    );
    let (d, s) = (doomed_report.unwrap(), survivor_report.unwrap());
    assert!(
        handled.load(Ordering::SeqCst) >= 10,
        "the doomed client died as planned"
    );
    assert!(d.reconnects >= 1, "{d:?}");
    assert_eq!(d.processed + s.processed, N as u64, "{d:?} {s:?}");
    assert!(s.duplicates >= 1, "the committed but unacked message came back: {s:?}");
    env.db.assert_effects_once(N).await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_poison_event_is_dead_lettered_and_the_rest_flow() {
    const GOOD: usize = 30;
    let env = Env::new("inbox-nats-dead").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = NatsConsumer::new(inbox.clone(), env.options(nats_url())).unwrap();
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if event.event_type == "order.poison.created" {
            return Err(HandlerError::transient("the poison pill"));
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let mut events = Vec::new();
        for n in 0..GOOD {
            events.push(Event::new("order.item.created", json!({ "n": n })));
            if n % 10 == 3 {
                events.push(Event::new("order.poison.created", json!({ "n": 1000 + n })));
            }
        }
        let ids = env.db.produce(events).await;
        env.publish_headerless().await;
        wait("every message consumed", || async {
            let r = consumer.report();
            r.processed == GOOD as u64 && r.dead == 3 && r.malformed == 1 && env.outstanding().await == 0
        })
        .await;
        relay.stop().await;
        let _ = stop.send(());
        ids
    };
    let (report, ids) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!(ids.len(), GOOD + 3);
    assert_eq!((report.processed, report.dead, report.malformed), (GOOD as u64, 3, 1));
    assert_eq!(report.retried, 6, "two retries before each death: {report:?}");
    env.db.assert_effects_once(GOOD).await;

    let dead = env.dead_letters().await;
    assert_eq!(dead.len(), 4);
    let mut poisoned = 0;
    for m in &dead {
        let headers = m.message.headers.as_ref().unwrap();
        assert_eq!(headers.get(DEAD_CONSUMER_HEADER).unwrap().as_str(), "billing");
        let reason = headers.get(DEAD_REASON_HEADER).unwrap().as_str();
        match headers.get("ce-id") {
            None => assert!(
                reason.starts_with("malformed message: Nats-Msg-Id is missing"),
                "{reason}"
            ),
            Some(id) => {
                assert_eq!(reason, "max attempts (3) reached; last error: the poison pill");
                let id: EventId = id.as_str().parse().unwrap();
                let record = inbox.record(id).await.unwrap().unwrap();
                assert_eq!((record.state.as_str(), record.attempts), ("dead", 3));
                poisoned += 1;
            }
        }
    }
    assert_eq!(poisoned, 3);
    env.cleanup().await;
}

/// A message whose event another attempt holds (a client stalled with its
/// transaction open) is naked for later, not waited on: the client goes on
/// with the rest, and takes the event when the stall ends.
#[tokio::test]
async fn a_message_whose_event_a_stalled_attempt_holds_is_naked_and_the_rest_flow() {
    let env = Env::new("inbox-nats-held").await;
    let inbox = env
        .db
        .inbox_giving_up_after(3)
        .with_lock_timeout(Duration::from_millis(200));
    let ids = env
        .db
        .produce(vec![
            Event::new("order.item.created", json!({ "n": 1 })),
            Event::new("order.item.created", json!({ "n": 2 })),
        ])
        .await;
    let held = ReceivedEvent::new(ids[0], "order.item.created", &b"{}"[..]);
    let (claimed, has_claimed) = oneshot::channel();
    let stalled = tokio::spawn({
        let inbox = inbox.clone();
        async move {
            inbox
                .process(&held, async move |_, _| {
                    let _ = claimed.send(());
                    std::future::pending::<()>().await;
                    Ok(())
                })
                .await
        }
    });
    has_claimed.await.unwrap();
    let consumer = NatsConsumer::new(inbox, env.options(nats_url())).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        wait("the other event processed, the held one put back", || async {
            let r = consumer.report();
            r.processed == 1 && r.in_progress >= 2
        })
        .await;
        stalled.abort();
        wait("both processed", || async {
            consumer.report().processed == 2 && env.outstanding().await == 0
        })
        .await;
        relay.stop().await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(async |tx, event| effect(tx, event).await, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.retried, report.dead), (0, 0), "{report:?}");
    env.db.assert_effects_once(2).await;
    env.cleanup().await;
}

/// A handler that runs longer than `ack_wait` (1 s here) has its message
/// reported in progress meanwhile: not redelivered, and so not handled
/// again, as a duplicate, once it is done.
#[tokio::test]
async fn a_handler_longer_than_ack_wait_keeps_its_message_from_redelivery() {
    let env = Env::new("inbox-nats-slow").await;
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let consumer = NatsConsumer::new(inbox, env.options(nats_url())).unwrap();
    env.db
        .produce(vec![Event::new("order.item.created", json!({ "n": 1 }))])
        .await;
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        wait("the event processed", || async {
            consumer.report().processed == 1 && env.outstanding().await == 0
        })
        .await;
        relay.stop().await;
        // Past another ack_wait: a redelivery, had there been one, is
        // handled by now.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let _ = stop.send(());
    };
    let slow = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        effect(tx, event).await
    };
    let (report, ()) = tokio::join!(
        consumer.run(slow, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.processed, report.duplicates), (1, 0), "{report:?}");
    let stream = env.js.get_stream(&env.stream).await.unwrap();
    let info = stream.consumer_info("billing").await.unwrap();
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    env.db.assert_effects_once(1).await;
    env.cleanup().await;
}

/// A dead-letter reason with a line break (a handler's multi-line error, a
/// failed assert's panic text) made the client panic building its header:
/// the consumer crashed before the ack, and again on every redelivery. And
/// a JetStream control header copied from the original (here another
/// producer's `Nats-Expected-Stream`) made the dead-letter stream refuse
/// the copy, for ever. Both are dead-lettered and acknowledged.
#[tokio::test]
async fn a_multi_line_reason_and_a_control_header_are_dead_lettered() {
    let env = Env::new("inbox-nats-dead-lines").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = NatsConsumer::new(inbox.clone(), env.options(nats_url())).unwrap();
    let handler =
        async |_tx: &mut PgConnection, _event: &ReceivedEvent| Err(HandlerError::permanent("line one\r\nline two"));
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        env.db
            .produce(vec![Event::new("order.item.created", json!({ "n": 1 }))])
            .await;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Expected-Stream", env.stream.as_str());
        env.js
            .publish_with_headers(env.subject.clone(), headers, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        wait("both dead-lettered", || async {
            let r = consumer.report();
            r.dead == 1 && r.malformed == 1 && env.outstanding().await == 0
        })
        .await;
        relay.stop().await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.dead, report.malformed), (1, 1));
    let dead = env.dead_letters().await;
    assert_eq!(dead.len(), 2);
    for m in &dead {
        let headers = m.message.headers.as_ref().unwrap();
        assert!(
            headers.get("Nats-Expected-Stream").is_none(),
            "a control header was copied"
        );
        let reason = headers.get(DEAD_REASON_HEADER).unwrap().as_str();
        if headers.get("ce-id").is_some() {
            assert!(reason.contains("line one  line two"), "{reason}");
        }
    }
    env.cleanup().await;
}

/// Two durable consumers of one stream that give up on the same message
/// both dead-letter it into a shared dead-letter stream: the second copy is
/// not dropped as a duplicate of the first (JetStream's duplicate window is
/// per stream, two minutes by default), which would ack a message whose
/// dead letter exists nowhere.
#[tokio::test]
async fn two_durables_giving_up_on_one_message_each_keep_their_dead_letter() {
    let env = Env::new("inbox-nats-dead-shared").await;
    let mut dead = env
        .js
        .get_stream(&env.dead_stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    dead.duplicate_window = Duration::from_secs(120);
    env.js.update_stream(&dead).await.unwrap();
    let billing = NatsConsumer::new(env.db.inbox_giving_up_after(3), env.options(nats_url())).unwrap();
    let mut options = env.options(nats_url());
    options.durable = "shipping".into();
    let shipping_inbox = Inbox::new(env.db.pool.clone(), "shipping").unwrap();
    let shipping = NatsConsumer::new(shipping_inbox, options).unwrap();
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| effect(tx, event).await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let scenario = async {
        // Malformed for both consumers: they give up on it at once.
        env.publish_headerless().await;
        wait("both consumers dead-lettered it", || async {
            billing.report().malformed == 1 && shipping.report().malformed == 1
        })
        .await;
        let _ = stop.send(true);
    };
    let until = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stopped| *stopped).await;
    };
    let (a, b, ()) = tokio::join!(
        billing.run(handler, until(stopped.clone())),
        shipping.run(handler, until(stopped.clone())),
        scenario
    );
    a.unwrap();
    b.unwrap();
    let mut by: Vec<String> = env
        .dead_letters()
        .await
        .iter()
        .map(|m| {
            let headers = m.message.headers.as_ref().unwrap();
            headers.get(DEAD_CONSUMER_HEADER).unwrap().as_str().to_owned()
        })
        .collect();
    by.sort();
    assert_eq!(by, ["billing", "shipping"], "a dead letter was dropped as a duplicate");
    env.cleanup().await;
}

/// A stream that captures the consumer's own dead-letter subject hands every
/// dead letter back to the consumer, which dead-letters it again, without
/// end, growing the stream. The consumer refuses to start on such a stream
/// and consumes nothing, so nothing is lost either.
/// A dead letter too large for its stream (`max_msg_size`) is refused by
/// JetStream, for as long as the limit stands: the message stays unacked
/// and comes back, never dropped, and is dead-lettered and acked once the
/// operator raises the limit.
#[tokio::test]
async fn a_dead_letter_too_large_for_its_stream_waits_until_it_fits() {
    let env = Env::new("inbox-nats-big-dead").await;
    let mut dead = env.js.get_stream(&env.dead_stream).await.unwrap();
    let mut config = dead.info().await.unwrap().config.clone();
    config.max_message_size = 64;
    env.js.update_stream(&config).await.unwrap();
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = NatsConsumer::new(inbox, env.options(nats_url())).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        // Malformed, so dead-lettered at once; with its headers the copy is
        // over 64 bytes.
        env.publish_headerless().await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            env.outstanding().await,
            1,
            "the message was acked without its dead letter"
        );
        assert_eq!(dead.info().await.unwrap().state.messages, 0);
        config.max_message_size = -1;
        env.js.update_stream(&config).await.unwrap();
        wait("the dead letter stored and the message acked", || async {
            env.outstanding().await == 0
        })
        .await;
        assert!(
            consumer.report().malformed > 1,
            "the message was not redelivered meanwhile"
        );
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(
            async |_: &mut PgConnection, _: &ReceivedEvent| Ok::<(), HandlerError>(()),
            async {
                let _ = stopped.await;
            }
        ),
        scenario
    );
    report.unwrap();
    assert_eq!(env.dead_letters().await.len(), 1);
    env.cleanup().await;
}

#[tokio::test]
async fn a_consumer_whose_stream_captures_its_dead_letters_consumes_nothing() {
    let name = unique_name("inbox-nats-loop");
    let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let db = Db::new().await;
    let inbox = Inbox::new(db.pool.clone(), "billing").unwrap();
    let mut options = NatsConsumerOptions::new(nats_url(), &name, "billing", format!("{name}.dead"));
    options.timeout = Duration::from_secs(2);
    options.reconnect_max_delay = Duration::from_millis(300);
    let consumer = NatsConsumer::new(inbox, options).unwrap();
    // A message no Ferry sink wrote: malformed, so dead-lettered at once.
    js.publish(format!("{name}.orders"), "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let err = consumer
        .run(
            async |_: &mut PgConnection, _: &ReceivedEvent| Ok::<(), HandlerError>(()),
            tokio::time::sleep(WITHIN),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("is captured by stream"), "{err}");
    assert_eq!(consumer.report().malformed, 0);
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    let _ = js.delete_stream(&name).await;
}

/// A dead letter published to a subject no stream captures is refused
/// (no responders): the message came back after every nak, for ever. The
/// consumer refuses to start, naming the subject.
#[tokio::test]
async fn a_dead_letter_subject_no_stream_captures_is_refused_at_start() {
    let mut env = Env::new("inbox-nats-nodead").await;
    env.dead_subject = format!("{}-nowhere.orders", env.stream);
    let err = refusal(&env).await;
    assert!(
        err.contains(&format!(
            "dead_letter_subject {:?} is captured by no stream",
            env.dead_subject
        )),
        "{err}"
    );
    env.cleanup().await;
}

/// Runs a consumer with the test's options until it stops by itself, which
/// only a refusal makes it do.
async fn refusal(env: &Env) -> String {
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let consumer = NatsConsumer::new(inbox, env.options(nats_url())).unwrap();
    let run = consumer.run(
        async |_: &mut PgConnection, _: &ReceivedEvent| Ok::<(), HandlerError>(()),
        std::future::pending(),
    );
    match tokio::time::timeout(WITHIN, run).await {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(report)) => panic!("the consumer ran: {report:?}"),
        Err(_) => panic!("the consumer started and consumed, though it should have refused"),
    }
}

/// JetStream hands an existing durable over as it was created. One with
/// ack_policy "all" (an ack of a later message acknowledges a message
/// waiting out its retry: lost) or "none", or reading other subjects, is
/// refused with the way out, and left as it is.
#[tokio::test]
async fn a_durable_with_another_ack_policy_or_filter_is_refused() {
    let env = Env::new("inbox-nats-durable").await;
    let stream = env.js.get_stream(&env.stream).await.unwrap();
    for (ack_policy, filter_subject, expected) in [
        (AckPolicy::All, String::new(), "has ack_policy \"all\""),
        (AckPolicy::None, String::new(), "has ack_policy \"none\""),
        (AckPolicy::Explicit, env.subject.clone(), "reads only \""),
    ] {
        stream
            .create_consumer(pull::Config {
                durable_name: Some("billing".into()),
                ack_policy,
                filter_subject,
                ..Default::default()
            })
            .await
            .unwrap();
        let err = refusal(&env).await;
        assert!(err.contains("durable consumer \"billing\""), "{err}");
        assert!(err.contains(expected), "{err}");
        assert!(
            err.contains(&format!("nats consumer rm {} billing", env.stream)),
            "{err}"
        );
        let info = stream.consumer_info("billing").await.unwrap();
        assert_eq!(info.config.ack_policy, ack_policy, "left as it was");
        stream.delete_consumer("billing").await.unwrap();
    }
    env.cleanup().await;
}

/// Limits JetStream can change in place are set to the runner's: a durable
/// created with a small max_deliver would stop redelivering silently.
#[tokio::test]
async fn a_durable_with_other_limits_is_brought_in_line() {
    let env = Env::new("inbox-nats-limits").await;
    let stream = env.js.get_stream(&env.stream).await.unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some("billing".into()),
            ack_policy: AckPolicy::Explicit,
            max_deliver: 2,
            ack_wait: Duration::from_secs(7),
            max_ack_pending: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    let options = env.options(nats_url());
    let consumer = NatsConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), options.clone()).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the durable updated", || async {
            let c = stream.consumer_info("billing").await.unwrap().config;
            (c.max_deliver, c.ack_wait, c.max_ack_pending) == (-1, options.ack_wait, options.max_ack_pending)
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(
            async |_: &mut PgConnection, _: &ReceivedEvent| Ok::<(), HandlerError>(()),
            async {
                let _ = stopped.await;
            }
        ),
        scenario
    );
    report.unwrap();
    env.cleanup().await;
}

#[tokio::test]
async fn bad_options_name_the_field() {
    let db = Db::new().await;
    let inbox = Inbox::new(db.pool.clone(), "billing").unwrap();
    let err = NatsConsumer::new(inbox.clone(), NatsConsumerOptions::new(nats_url(), "a.b", "d", "dead")).unwrap_err();
    assert!(err.to_string().contains("stream is \"a.b\""), "{err}");
    let err = NatsConsumer::new(inbox.clone(), NatsConsumerOptions::new(nats_url(), "s", "", "dead")).unwrap_err();
    assert!(err.to_string().contains("durable"), "{err}");
    let err = NatsConsumer::new(inbox, NatsConsumerOptions::new(nats_url(), "s", "d", "dead.>")).unwrap_err();
    assert!(err.to_string().contains("dead_letter_subject"), "{err}");
}

/// A handler that kills its process (a crash in C code, an out-of-memory
/// kill, kill -9) rolled its attempt back, count and all: after `ack_wait`
/// the server handed the message to the next client, which died on it
/// too, for ever, nothing dead-lettered. Here each client dies in the
/// handler (its future dropped mid-attempt, its connection cut); delivered
/// again, the event's attempts are marked before they run, and past the
/// inbox's attempts it is dead-lettered unrun, the rest applied once.
#[tokio::test]
async fn an_event_whose_handler_kills_the_process_is_dead_lettered_after_its_attempts() {
    const N: i64 = 10;
    const KILLER: i64 = 4;
    const ATTEMPTS: u32 = 2;
    let env = Env::new("inbox-nats-killer").await;
    let proxy = Proxy::start("127.0.0.1:4222".parse().unwrap()).unwrap();
    let options = env.options(nats_url().replacen("127.0.0.1:4222", &proxy.addr().to_string(), 1));
    let inbox = env.db.inbox_giving_up_after(ATTEMPTS);
    let relay = env.relay(&["orders"]);
    let events = (0..N)
        .map(|n| Event::new("order.item.created", json!({ "n": n })))
        .collect();
    let ids = env.db.produce(events).await;
    env.db.all_published(N).await;
    relay.stop().await;

    let killer = support::Killer::new(KILLER);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| killer.handle(tx, event).await;
    // The first delivery is not marked (only a redelivery is): one more
    // death than the attempts.
    for life in 1..=ATTEMPTS + 1 {
        let consumer = NatsConsumer::new(inbox.clone(), options.clone()).unwrap();
        tokio::select! {
            report = consumer.run(handler, std::future::pending()) => panic!("the consumer stopped: {report:?}"),
            () = wait("the handler to take the killer event", || async { killer.runs() == life }) => {}
        }
        proxy.cut();
    }
    let consumer = NatsConsumer::new(inbox.clone(), options).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = killer.until_dead(&env.db, || consumer.report().dead, N, ATTEMPTS + 1, stop);
    let (report, ()) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
    env.db.assert_effects_once(N as usize - 1).await;
    let dead = env.dead_letters().await;
    assert_eq!(dead.len(), 1);
    let reason = dead[0]
        .message
        .headers
        .as_ref()
        .unwrap()
        .get(DEAD_REASON_HEADER)
        .unwrap()
        .as_str();
    support::assert_dead_unfinished(&inbox, ids[KILLER as usize], ATTEMPTS, reason).await;
    env.cleanup().await;
}
