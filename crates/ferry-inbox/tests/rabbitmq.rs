//! End to end on RabbitMQ: outbox -> relay -> broker -> consumer runner with
//! the inbox, counting the business effect per event through a consumer cut
//! off between its commit and its ack, deliberate double publishes, a relay
//! that republishes after a crash, and a handler that always fails.

mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::{Event, EventId, Sink};
use ferry_inbox::rabbitmq::{
    DEAD_CONSUMER_HEADER, DEAD_REASON_HEADER, DEAD_USER_ID_HEADER, RabbitMqConsumer, RabbitMqConsumerOptions,
};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::pg::TestDb;
use ferry_testkit::proxy::Proxy;
use ferry_testkit::rabbit::{amqp_url, unique_name};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;
use sqlx::PgConnection;
use support::{Db, RelayRun, WITHIN, effect, number, wait};
use tokio::sync::oneshot;

/// A database with the ferry schema and an `effects` table, and a broker
/// exchange of the test's own; the consumer declares its queues.
struct Env {
    db: Db,
    exchange: String,
    queue: String,
    dlx: String,
    amqp: Connection,
    channel: Channel,
}

impl Env {
    async fn new(prefix: &str) -> Env {
        let db = Db::new().await;
        let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = amqp.create_channel().await.unwrap();
        let exchange = unique_name(prefix);
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Env {
            db,
            queue: format!("{exchange}.q"),
            dlx: format!("{exchange}.dlx"),
            exchange,
            amqp,
            channel,
        }
    }

    fn options(&self, url: String) -> RabbitMqConsumerOptions {
        let mut o = RabbitMqConsumerOptions::new(url, &self.queue, &self.dlx)
            .bind(&self.exchange, "#")
            .prefetch(16);
        o.reconnect_max_delay = Duration::from_millis(500);
        o.timeout = Duration::from_secs(2);
        o.database_retry_delay = Duration::from_millis(50);
        o
    }

    /// Declares the queue and its bindings by running a consumer once, so
    /// nothing the relay publishes is returned as unroutable.
    async fn declare(&self, consumer: &RabbitMqConsumer) {
        let (tx, rx) = oneshot::channel::<()>();
        let run = consumer.run(async |_, _| Ok(()), async {
            let _ = rx.await;
        });
        let stop = async {
            wait("the queue exists", || async {
                let ch = self.amqp.create_channel().await.unwrap();
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                ch.queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
                    .await
                    .is_ok()
            })
            .await;
            let _ = tx.send(());
        };
        let (report, ()) = tokio::join!(run, stop);
        assert_eq!(report.unwrap().processed, 0);
    }

    fn relay(&self, routes: &[&str]) -> RelayRun {
        let sink = RabbitMqSink::new(RabbitMqOptions {
            url: amqp_url(),
            ..RabbitMqOptions::default()
        });
        self.db.relay(Arc::new(sink) as Arc<dyn Sink>, routes, &self.exchange)
    }

    /// Takes `n` messages off the dead-letter queue.
    async fn dead_letters(&self, n: usize) -> Vec<lapin::message::Delivery> {
        let ch = self.amqp.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                format!("{}.dead", self.queue).as_str().into(),
                "test".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut got = Vec::new();
        while got.len() < n {
            let d = tokio::time::timeout(WITHIN, consumer.next())
                .await
                .expect("dead letters arrive")
                .unwrap()
                .unwrap();
            d.ack(BasicAckOptions::default()).await.unwrap();
            got.push(d);
        }
        // Nothing beyond the expected ones.
        let extra = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
        assert!(extra.is_err(), "more dead letters than expected");
        got
    }

    async fn cleanup(self) {
        let ch = &self.channel;
        for q in [self.queue.clone(), format!("{}.dead", self.queue)] {
            let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
        for x in [&self.exchange, &self.dlx] {
            let _ = ch
                .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.amqp.close(200, "OK".into()).await;
    }
}

#[tokio::test]
async fn each_effect_happens_once_through_crashes_and_duplicates() {
    const N: usize = 300;
    let env = Env::new("inbox-e2e").await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).unwrap();
    let url = amqp_url().replacen("127.0.0.1:5672", &proxy.addr().to_string(), 1);
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let consumer = RabbitMqConsumer::new(inbox.clone(), env.options(url)).unwrap();
    env.declare(&consumer).await;

    // Every 50th event cuts the consumer's connection once, from inside its
    // handler: the inbox commits, the ack can no longer reach the broker.
    // Two cuts in one session (a message taken before the first cut is
    // handled after it) end that session once: each cut is recorded with
    // the session it fell in, the count of reconnects so far.
    let crash_at: HashSet<i64> = (0..N as i64).filter(|n| n % 50 == 7).collect();
    let crashed = Mutex::new(HashSet::new());
    let cut_sessions = Mutex::new(HashSet::new());
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        effect(tx, event).await?;
        let n = number(event);
        if crash_at.contains(&n) && crashed.lock().unwrap().insert(n) {
            cut_sessions.lock().unwrap().insert(consumer.report().reconnects);
            proxy.cut();
        }
        Ok(())
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });

    let scenario = async {
        // Two routes to the same exchange: every event is published twice.
        let relay = env.relay(&["first", "second"]);
        let events = (0..N)
            .map(|n| Event::new("order.item.created", json!({ "n": n })).key(format!("k{}", n % 7)))
            .collect();
        let ids = env.db.produce(events).await;
        assert_eq!(ids.len(), N);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;

        // The relay's record of a third of its publishes is lost in a crash;
        // a new relay publishes them again.
        let replayed = env.db.forget_a_third().await;
        assert!(replayed > 0);
        let relay = env.relay(&["first", "second"]);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;

        // Every copy delivered is either the one processing or a duplicate;
        // each session cut adds at least one redelivery.
        let copies = 2 * N as u64 + replayed;
        wait("every copy consumed", || async {
            let r = consumer.report();
            let cuts = cut_sessions.lock().unwrap().len() as u64;
            r.processed == N as u64 && r.duplicates >= copies - N as u64 + cuts
        })
        .await;
        let _ = stop.send(());
        copies
    };
    let (report, copies) = tokio::join!(run, scenario);
    let report = report.unwrap();
    let cuts = cut_sessions.lock().unwrap().len() as u64;
    assert!(cuts >= 1, "no cut reached a session");

    assert_eq!(
        crashed.lock().unwrap().len(),
        crash_at.len(),
        "every planned cut happened"
    );
    assert_eq!(report.processed, N as u64);
    assert!(report.duplicates >= copies - N as u64 + cuts, "{report:?}");
    assert!(report.reconnects >= cuts, "{report:?}");
    assert_eq!((report.retried, report.dead, report.malformed), (0, 0, 0), "{report:?}");
    // Exactly once: every event's effect, none twice.
    env.db.assert_effects_once(N).await;
    assert_eq!(env.db.scalar("SELECT count(DISTINCT n) FROM effects").await, N as i64);
    assert_eq!(
        env.db
            .scalar("SELECT count(*) FROM ferry.inbox WHERE consumer = 'billing' AND state = 'done'")
            .await,
        N as i64
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_poison_event_is_dead_lettered_and_the_rest_flow() {
    const GOOD: usize = 40;
    const POISON: usize = 3;
    let env = Env::new("inbox-dead").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = RabbitMqConsumer::new(inbox.clone(), env.options(amqp_url())).unwrap();
    env.declare(&consumer).await;

    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if event.event_type == "order.poison.created" {
            return Err(HandlerError::transient("the poison pill"));
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let mut events = Vec::new();
        for n in 0..GOOD {
            events.push(Event::new("order.item.created", json!({ "n": n })));
            if n % 15 == 5 {
                events.push(Event::new("order.poison.created", json!({ "n": 1000 + n })));
            }
        }
        let ids = env.db.produce(events).await;
        // A message no Ferry sink wrote: no event id at all.
        env.channel
            .basic_publish(
                env.exchange.as_str().into(),
                "order.stray.created".into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        wait("every event consumed", || async {
            let r = consumer.report();
            r.processed == GOOD as u64 && r.dead == POISON as u64 && r.malformed == 1
        })
        .await;
        relay.stop().await;
        let dead = env.dead_letters(POISON + 1).await;
        let _ = stop.send(());
        (ids, dead)
    };
    let (report, (ids, dead)) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(ids.len(), GOOD + POISON);
    assert_eq!(report.processed, GOOD as u64);
    assert_eq!(report.dead, POISON as u64);
    assert_eq!(
        report.retried,
        2 * POISON as u64,
        "two retries before each death: {report:?}"
    );
    assert_eq!(report.malformed, 1);
    env.db.assert_effects_once(GOOD).await;

    let header = |d: &lapin::message::Delivery, name: &str| -> Option<String> {
        match d.properties.headers().as_ref()?.inner().get(name)? {
            AMQPValue::LongString(s) => Some(s.to_string()),
            other => panic!("{name} is {other:?}"),
        }
    };
    let mut dead_ids = HashSet::new();
    let mut malformed = 0;
    for d in &dead {
        assert_eq!(header(d, DEAD_CONSUMER_HEADER).as_deref(), Some("billing"));
        let reason = header(d, DEAD_REASON_HEADER).unwrap();
        if d.routing_key.as_str() == "order.stray.created" {
            malformed += 1;
            assert!(
                reason.starts_with("malformed message: message_id is missing"),
                "{reason}"
            );
        } else {
            assert_eq!(d.routing_key.as_str(), "order.poison.created");
            assert_eq!(reason, "max attempts (3) reached; last error: the poison pill");
            dead_ids.insert(header(d, "cloudEvents:id").unwrap().parse::<EventId>().unwrap());
        }
    }
    assert_eq!((dead_ids.len(), malformed), (POISON, 1));
    for id in dead_ids {
        let record = inbox.record(id).await.unwrap().unwrap();
        assert_eq!((record.state.as_str(), record.attempts), ("dead", 3));
    }
    env.cleanup().await;
}

/// Messages no Ferry producer could have written, with a NUL byte in the
/// type or the key or a type outside Ferry's grammar, are dead-lettered as
/// malformed. A NUL in the type made PostgreSQL refuse the claim, which the
/// runner took for an outage: the message went back to the queue for ever,
/// never counted, never dead-lettered.
#[tokio::test]
async fn a_message_the_inbox_cannot_store_is_dead_lettered_as_malformed() {
    let env = Env::new("inbox-nul").await;
    let consumer = RabbitMqConsumer::new(
        Inbox::new(env.db.pool.clone(), "billing").unwrap(),
        env.options(amqp_url()),
    )
    .unwrap();
    env.declare(&consumer).await;
    let long = |s: &str| AMQPValue::LongString(s.as_bytes().into());
    for (event_type, key) in [
        ("order.item\0created", None),
        ("Order Created", None),
        ("order.item.created", Some("o-\0-1")),
        ("order.item.created", Some("o-1")),
    ] {
        let mut headers = FieldTable::default();
        headers.insert("cloudEvents:id".into(), long(&EventId::new().to_string()));
        headers.insert("cloudEvents:type".into(), long(event_type));
        if let Some(key) = key {
            headers.insert("ferry-key".into(), long(key));
        }
        env.channel
            .basic_publish(
                env.exchange.as_str().into(),
                "order.item.created".into(),
                BasicPublishOptions::default(),
                b"{\"n\": 1}",
                // Sent transient and with a TTL, as foreign messages may be:
                // the dead copy must outlive both.
                BasicProperties::default()
                    .with_headers(headers)
                    .with_delivery_mode(1)
                    .with_expiration("1500".into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(async |tx, event| effect(tx, event).await, async {
        let _ = stopped.await;
    });
    let scenario = async {
        wait("the bad messages dead-lettered, the good one processed", || async {
            let r = consumer.report();
            r.malformed == 3 && r.processed == 1
        })
        .await;
        // Past the originals' TTL.
        tokio::time::sleep(Duration::from_millis(1600)).await;
        let dead = env.dead_letters(3).await;
        for d in &dead {
            assert_eq!(d.properties.expiration(), &None, "the dead copy kept the TTL");
            assert_eq!(
                d.properties.delivery_mode(),
                &Some(2),
                "the dead copy is not persistent"
            );
        }
        let _ = stop.send(());
        dead
    };
    let (report, dead) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(
        (report.malformed, report.processed, report.dead),
        (3, 1, 0),
        "{report:?}"
    );
    assert_eq!(report.inbox_unavailable, 0, "{report:?}");
    env.db.assert_effects_once(1).await;
    let mut reasons: Vec<String> = dead
        .iter()
        .map(
            |d| match d.properties.headers().as_ref().unwrap().inner().get(DEAD_REASON_HEADER) {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("{other:?}"),
            },
        )
        .collect();
    reasons.sort();
    assert!(
        reasons[0].starts_with("malformed message: cloudEvents:type \"Order Created\""),
        "{reasons:?}"
    );
    assert!(
        reasons[1].starts_with("malformed message: cloudEvents:type \"order.item\\0created\""),
        "{reasons:?}"
    );
    assert!(
        reasons[2].starts_with("malformed message: key \"o-\\0-1\" has a NUL byte"),
        "{reasons:?}"
    );
    env.cleanup().await;
}

/// A handler that panics on an event is counted like a failing one and the
/// event dead-lettered after the last attempt; the consumer goes on. The
/// panic used to unwind through the runner, and the message, back at the
/// head of the queue, crashed every consumer that took it again.
#[tokio::test]
async fn a_panicking_handler_is_dead_lettered_after_its_attempts() {
    let env = Env::new("inbox-panic").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = RabbitMqConsumer::new(inbox.clone(), env.options(amqp_url())).unwrap();
    env.declare(&consumer).await;
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if event.event_type == "order.poison.created" {
            panic!("the poison pill");
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let ids = env
            .db
            .produce(vec![
                Event::new("order.poison.created", json!({ "n": 1000 })),
                Event::new("order.item.created", json!({ "n": 1 })),
            ])
            .await;
        wait("the poison dead, the other processed", || async {
            let r = consumer.report();
            r.dead == 1 && r.processed == 1
        })
        .await;
        relay.stop().await;
        let dead = env.dead_letters(1).await;
        let _ = stop.send(());
        (ids, dead)
    };
    let (report, (ids, dead)) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!((report.processed, report.dead, report.retried), (1, 1, 2), "{report:?}");
    env.db.assert_effects_once(1).await;
    match dead[0]
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get(DEAD_REASON_HEADER)
    {
        Some(AMQPValue::LongString(s)) => assert_eq!(
            s.to_string(),
            "max attempts (3) reached; last error: the handler panicked: the poison pill"
        ),
        other => panic!("{other:?}"),
    }
    let record = inbox.record(ids[0]).await.unwrap().unwrap();
    assert_eq!((record.state.as_str(), record.attempts), ("dead", 3));
    env.cleanup().await;
}

/// A handler's error text can be long (a panic's, a remote body): the dead
/// letter carries it cut to 4 KiB, since headers over the connection's
/// frame_max close the connection, and the message, back first in the
/// queue, would be refused again for ever with nothing behind it handled.
#[tokio::test]
async fn a_long_error_is_dead_lettered_cut_short_and_the_rest_flow() {
    let env = Env::new("inbox-long-reason").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = RabbitMqConsumer::new(inbox.clone(), env.options(amqp_url())).unwrap();
    env.declare(&consumer).await;
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if event.event_type == "order.poison.created" {
            return Err(HandlerError::permanent("é".repeat(100_000)));
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = async {
        let relay = env.relay(&["orders"]);
        env.db
            .produce(vec![
                Event::new("order.poison.created", json!({ "n": 1000 })).key("k"),
                Event::new("order.item.created", json!({ "n": 1 })).key("k"),
            ])
            .await;
        let dead = env.dead_letters(1).await;
        wait("the other processed", || async { consumer.report().processed == 1 }).await;
        relay.stop().await;
        let _ = stop.send(());
        dead
    };
    let (report, dead) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!((report.processed, report.reconnects), (1, 0), "{report:?}");
    env.db.assert_effects_once(1).await;
    match dead[0]
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get(DEAD_REASON_HEADER)
    {
        Some(AMQPValue::LongString(s)) => {
            let reason = s.to_string();
            assert!(
                reason.len() <= 4096 && reason.starts_with("é"),
                "{} bytes",
                reason.len()
            );
        }
        other => panic!("{other:?}"),
    }
    env.cleanup().await;
}

#[tokio::test]
async fn an_inbox_database_outage_delays_events_and_loses_none() {
    const N: usize = 30;
    let env = Env::new("inbox-dbdown").await;
    // The inbox reaches PostgreSQL through a proxy; the relay directly.
    let pg = Proxy::start("127.0.0.1:5432".parse().unwrap()).unwrap();
    let url = env.db.url.replacen("127.0.0.1:5432", &pg.addr().to_string(), 1);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(500))
        .connect(&url)
        .await
        .unwrap();
    let consumer = RabbitMqConsumer::new(Inbox::new(pool, "billing").unwrap(), env.options(amqp_url())).unwrap();
    env.declare(&consumer).await;
    pg.set_refuse(true);
    pg.cut();

    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(async |tx, event| effect(tx, event).await, async {
        let _ = stopped.await;
    });
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let events = (0..N)
            .map(|n| Event::new("order.item.created", json!({ "n": n })))
            .collect();
        env.db.produce(events).await;
        env.db.all_published(N as i64).await;
        relay.stop().await;
        wait("deliveries put back while the database is away", || async {
            consumer.report().inbox_unavailable >= 10
        })
        .await;
        assert_eq!(consumer.report().processed, 0);
        pg.set_refuse(false);
        wait("every event processed", || async {
            consumer.report().processed == N as u64
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(
        (report.processed, report.dead, report.malformed),
        (N as u64, 0, 0),
        "{report:?}"
    );
    env.db.assert_effects_once(N).await;
    env.cleanup().await;
}

#[tokio::test]
async fn bad_options_name_the_field() {
    let db = TestDb::create().await;
    let inbox = Inbox::new(db.pool().await, "billing").unwrap();
    let err = RabbitMqConsumer::new(inbox.clone(), RabbitMqConsumerOptions::new(amqp_url(), "", "dlx")).unwrap_err();
    assert!(err.to_string().contains("queue is \"\""), "{err}");
    let err = RabbitMqConsumer::new(inbox.clone(), RabbitMqConsumerOptions::new(amqp_url(), "q", "")).unwrap_err();
    assert!(err.to_string().contains("dead_letter_exchange"), "{err}");
    let options = RabbitMqConsumerOptions::new(amqp_url(), "q", "dlx").prefetch(0);
    let err = RabbitMqConsumer::new(inbox, options).unwrap_err();
    assert!(err.to_string().contains("prefetch"), "{err}");
}

impl Env {
    /// The queue, durable, without the consumer's declarations.
    async fn declare_queue(&self) {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        self.channel
            .queue_declare(self.queue.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap();
    }

    /// A message no Ferry sink wrote, straight to the queue.
    async fn publish_malformed(&self) {
        self.channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                b"not an event",
                BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages ready in the queue.
    async fn ready(&self) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let ch = self.amqp.create_channel().await.unwrap();
        ch.queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }
}

/// With `no_declare` and no dead-letter exchange, the broker closed the
/// channel of the first dead letter (404), the session ended, and the
/// requeued message came first again after every reconnect, logged as a
/// lost broker. The consumer now refuses to start, naming the exchange.
#[tokio::test]
async fn a_missing_dead_letter_exchange_is_refused_at_start() {
    let env = Env::new("inbox-rabbit-nodlx").await;
    env.declare_queue().await;
    env.publish_malformed().await;
    let options = env.options(amqp_url()).no_declare();
    let consumer = RabbitMqConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), options).unwrap();
    let run = consumer.run(effect, std::future::pending());
    let err = match tokio::time::timeout(WITHIN, run).await {
        Ok(result) => result.unwrap_err().to_string(),
        Err(_) => panic!("the consumer started without its dead-letter exchange"),
    };
    assert!(
        err.contains(&format!("dead_letter_exchange {:?} does not exist", env.dlx)),
        "{err}"
    );
    assert_eq!(consumer.report().malformed, 0);
    assert_eq!(env.ready().await, 1, "the message waits in the queue");
    env.cleanup().await;
}

/// The dead-letter exchange deleted while the consumer runs (`no_declare`):
/// the consumer stops, saying the exchange is gone, and the message it could
/// not set aside is back in the queue.
#[tokio::test]
async fn a_dead_letter_exchange_deleted_while_running_stops_the_consumer() {
    let env = Env::new("inbox-rabbit-dlx-gone").await;
    env.declare_queue().await;
    env.channel
        .exchange_declare(
            env.dlx.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let options = env.options(amqp_url()).no_declare();
    let consumer = RabbitMqConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), options).unwrap();
    let scenario = async {
        // Consuming once the consumer holds the queue.
        wait("the consumer consumes", || async {
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let ch = env.amqp.create_channel().await.unwrap();
            ch.queue_declare(env.queue.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap()
                .consumer_count()
                == 1
        })
        .await;
        env.channel
            .exchange_delete(env.dlx.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
        env.publish_malformed().await;
    };
    let (result, ()) = tokio::join!(
        tokio::time::timeout(WITHIN, consumer.run(effect, std::future::pending())),
        scenario
    );
    let err = result.expect("the consumer stopped").unwrap_err().to_string();
    assert!(err.contains("NOT_FOUND"), "{err}");
    assert!(
        err.contains(&format!("dead_letter_exchange {:?} does not exist", env.dlx)),
        "{err}"
    );
    assert_eq!(consumer.report().reconnects, 0);
    wait("the message back in the queue", || async { env.ready().await == 1 }).await;
    env.cleanup().await;
}

/// A handler that kills its process (a crash in C code, an out-of-memory
/// kill, kill -9) rolled its attempt back, count and all: the message came
/// back redelivered, killed the next consumer, and so on for ever, nothing
/// dead-lettered. Here each consumer dies in the handler (its future
/// dropped mid-attempt, its connection cut); redelivered, the event's
/// attempts are marked before they run, and past the inbox's attempts it
/// is dead-lettered unrun, the others of the batch applied once.
#[tokio::test]
async fn an_event_whose_handler_kills_the_process_is_dead_lettered_after_its_attempts() {
    const N: i64 = 10;
    const KILLER: i64 = 4;
    const ATTEMPTS: u32 = 2;
    let env = Env::new("inbox-killer").await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).unwrap();
    let options = env.options(amqp_url().replacen("127.0.0.1:5672", &proxy.addr().to_string(), 1));
    let inbox = env.db.inbox_giving_up_after(ATTEMPTS);
    env.declare(&RabbitMqConsumer::new(inbox.clone(), options.clone()).unwrap())
        .await;
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
        let consumer = RabbitMqConsumer::new(inbox.clone(), options.clone()).unwrap();
        tokio::select! {
            report = consumer.run(handler, std::future::pending()) => panic!("the consumer stopped: {report:?}"),
            () = wait("the handler to take the killer event", || async { killer.runs() == life }) => {}
        }
        proxy.cut();
    }
    let consumer = RabbitMqConsumer::new(inbox.clone(), options).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = killer.until_dead(&env.db, || consumer.report().dead, N, ATTEMPTS + 1, stop);
    let (report, ()) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
    env.db.assert_effects_once(N as usize - 1).await;
    let dead = env.dead_letters(1).await;
    match dead[0]
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get(DEAD_REASON_HEADER)
    {
        Some(AMQPValue::LongString(s)) => {
            support::assert_dead_unfinished(&inbox, ids[KILLER as usize], ATTEMPTS, &s.to_string()).await
        }
        other => panic!("{other:?}"),
    }
    env.cleanup().await;
}

/// On a connection that died without lapin noticing (no packet comes
/// back), the consumer asked to stop waited for the broker's answer to its
/// cancel for ever: SIGTERM never returned. It stops within its timeouts.
#[tokio::test]
async fn a_consumer_on_a_silent_connection_stops_when_asked() {
    let env = Env::new("inbox-silent").await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).unwrap();
    let options = env.options(amqp_url().replacen("127.0.0.1:5672", &proxy.addr().to_string(), 1));
    let limit = options.timeout;
    let consumer = RabbitMqConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), options).unwrap();
    env.declare(&consumer).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(effect, async {
        let _ = stopped.await;
    });
    let scenario = async {
        wait("the consumer consuming", || async {
            let ch = env.amqp.create_channel().await.unwrap();
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let queue = ch
                .queue_declare(env.queue.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap();
            let _ = ch.close(200, "OK".into()).await;
            queue.consumer_count() == 1
        })
        .await;
        // Nothing reaches either side any more; neither side notices.
        proxy.set_delay(Duration::from_secs(3600));
        let _ = stop.send(());
    };
    // The cancel and the close, each within the timeout, and some slack.
    let bound = 3 * limit + Duration::from_secs(2);
    let stopped_in_time = tokio::time::timeout(bound, async { tokio::join!(run, scenario) }).await;
    let (report, ()) = stopped_in_time.unwrap_or_else(|_| panic!("the consumer did not stop within {bound:?}"));
    report.unwrap();
    env.cleanup().await;
}

/// Deployed before `ferry migrate` brought the database to schema 25
/// (`ferry.inbox.unfinished`), the consumer failed every delivery with an
/// undefined column, logged it as an inbox outage and put the message back
/// every second, for ever; a quorum queue dropped it past its delivery
/// limit, the inbox bypassed. The consumer now refuses to start, saying to
/// migrate; and a table that goes wrong while it runs stops it the same way,
/// the message back in the queue.
#[tokio::test]
async fn an_inbox_table_before_schema_25_stops_the_consumer_saying_to_migrate() {
    let env = Env::new("inbox-rabbit-schema").await;
    let old = TestDb::create().await;
    let pool = old.pool().await;
    sqlx::query("CREATE SCHEMA ferry").execute(&pool).await.unwrap();
    for (_, _, sql) in ferry_store::postgres::MIGRATIONS.iter().filter(|m| m.0 <= 24) {
        sqlx::raw_sql(*sql).execute(&pool).await.unwrap();
    }
    let consumer = RabbitMqConsumer::new(Inbox::new(pool, "billing").unwrap(), env.options(amqp_url())).unwrap();
    let stopped = |result: Option<Result<_, ferry_inbox::ConsumerError>>| match result {
        Some(Err(e @ ferry_inbox::ConsumerError::Inbox(_))) => e.to_string(),
        other => panic!("the consumer did not stop for its inbox: {other:?}"),
    };
    let run = tokio::time::timeout(WITHIN, consumer.run(effect, std::future::pending()));
    let err = stopped(run.await.ok());
    assert!(err.contains("ferry migrate") && err.contains("schema 25"), "{err}");

    // Running on an up-to-date table, which then loses the column.
    let consumer = RabbitMqConsumer::new(
        Inbox::new(env.db.pool.clone(), "billing").unwrap(),
        env.options(amqp_url()),
    )
    .unwrap();
    env.declare(&consumer).await;
    let relay = env.relay(&["orders"]);
    let publish = async |n: i64| {
        env.db
            .produce(vec![Event::new("order.item.created", json!({ "n": n }))])
            .await;
        env.db.all_published(n).await;
    };
    let run = tokio::time::timeout(WITHIN, consumer.run(effect, std::future::pending()));
    let scenario = async {
        publish(1).await;
        wait("the first event processed", || async {
            consumer.report().processed == 1
        })
        .await;
        sqlx::query("ALTER TABLE ferry.inbox DROP COLUMN unfinished")
            .execute(&env.db.pool)
            .await
            .unwrap();
        publish(2).await;
    };
    let (run, ()) = tokio::join!(run, scenario);
    relay.stop().await;
    let err = stopped(run.ok());
    assert!(err.contains("ferry migrate"), "{err}");
    let report = consumer.report();
    assert_eq!((report.processed, report.inbox_unavailable), (1, 0), "{report:?}");
    wait("the message back in the queue", || async { env.ready().await == 1 }).await;
    env.cleanup().await;
}

/// A RabbitMQ user of the test's own, for a producer other than the
/// consumer; deleted on drop.
struct BrokerUser {
    name: String,
    password: String,
}

impl BrokerUser {
    fn create(prefix: &str) -> BrokerUser {
        let user = BrokerUser {
            name: unique_name(prefix),
            password: unique_name("password"),
        };
        rabbitmqctl(&["add_user", &user.name, &user.password]);
        rabbitmqctl(&["set_permissions", "-p", "/", &user.name, ".*", ".*", ".*"]);
        user
    }

    /// A connection to the broker as this user.
    async fn connect(&self) -> Connection {
        let mut uri: lapin::uri::AMQPUri = amqp_url().parse().unwrap();
        uri.authority.userinfo.username = self.name.clone();
        uri.authority.userinfo.password = self.password.clone();
        Connection::connect_uri(uri, ConnectionProperties::default())
            .await
            .unwrap()
    }
}

impl Drop for BrokerUser {
    /// Without asserting: a panic here, while a failed test unwinds, would
    /// abort the test binary.
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .stdout(std::process::Stdio::null())
            .status();
    }
}

fn rabbitmqctl(args: &[&str]) {
    let status = std::process::Command::new("rabbitmqctl")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("rabbitmqctl runs");
    assert!(status.success(), "rabbitmqctl {args:?}: {status}");
}

/// A message published by another producer with `user_id` set (RabbitMQ
/// checks it against the publishing connection's user; Spring AMQP can set
/// it) kept its `user_id` in the dead copy the consumer published as its
/// own user: the broker closed the channel (406 PRECONDITION_FAILED), the
/// session ended, and the message came back first after every reconnect,
/// nothing behind it handled. The dead copy now leaves `user_id` out and
/// carries it in `ferry-dead-user-id`.
#[tokio::test]
async fn a_message_with_another_users_user_id_is_dead_lettered_and_the_rest_flow() {
    let env = Env::new("inbox-user-id").await;
    let consumer = RabbitMqConsumer::new(
        Inbox::new(env.db.pool.clone(), "billing").unwrap(),
        env.options(amqp_url()),
    )
    .unwrap();
    env.declare(&consumer).await;
    let producer = BrokerUser::create("inbox-producer");
    let amqp = producer.connect().await;
    let channel = amqp.create_channel().await.unwrap();
    let long = |s: &str| AMQPValue::LongString(s.as_bytes().into());
    let mut event = FieldTable::default();
    event.insert("cloudEvents:id".into(), long(&EventId::new().to_string()));
    event.insert("cloudEvents:type".into(), long("order.item.created"));
    // No event id first, then an event.
    for (body, headers) in [(&b"not an event"[..], FieldTable::default()), (b"{\"n\": 1}", event)] {
        let properties = BasicProperties::default()
            .with_headers(headers)
            .with_user_id(producer.name.as_str().into());
        channel
            .basic_publish(
                "".into(),
                env.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let _ = amqp.close(200, "OK".into()).await;

    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(effect, async {
        let _ = stopped.await;
    });
    let scenario = async {
        wait("the message dead-lettered, the event processed", || async {
            let r = consumer.report();
            r.malformed >= 1 && r.processed == 1
        })
        .await;
        let dead = env.dead_letters(1).await;
        let _ = stop.send(());
        dead
    };
    let (report, dead) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(
        (report.malformed, report.processed, report.reconnects),
        (1, 1, 0),
        "{report:?}"
    );
    env.db.assert_effects_once(1).await;
    let p = &dead[0].properties;
    assert_eq!(p.user_id(), &None);
    let headers = p.headers().as_ref().unwrap().inner();
    match headers.get(DEAD_USER_ID_HEADER) {
        Some(AMQPValue::LongString(s)) => assert_eq!(s.to_string(), producer.name),
        other => panic!("{other:?}"),
    }
    match headers.get(DEAD_REASON_HEADER) {
        Some(AMQPValue::LongString(s)) => assert!(s.to_string().starts_with("malformed message"), "{s}"),
        other => panic!("{other:?}"),
    }
    env.cleanup().await;
}
