//! End to end on Redis Streams: outbox -> relay -> stream -> consumer group
//! with the inbox, counting the business effect per event through a member
//! that dies between its commit and its XACK (its entries claimed by the
//! other member), deliberate double publishes, a relay that republishes
//! after a crash, and a handler that always fails.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferry_core::{Event, EventId, RetryPolicy, Sink};
use ferry_inbox::redis::{DEAD_GROUP_FIELD, DEAD_REASON_FIELD, RedisConsumer, RedisConsumerOptions};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_sink::redis::{RedisOptions, RedisSink};
use ferry_testkit::proxy::Proxy;
use ferry_testkit::rabbit::unique_name;
use redis::aio::MultiplexedConnection;
use serde_json::json;
use sqlx::PgConnection;
use support::{Db, RelayRun, effect, wait};
use tokio::sync::oneshot;

fn redis_url() -> String {
    std::env::var("FERRY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

struct Env {
    db: Db,
    stream: String,
    dead: String,
    redis: MultiplexedConnection,
}

impl Env {
    async fn new(prefix: &str) -> Env {
        let stream = unique_name(prefix);
        let client = redis::Client::open(redis_url()).unwrap();
        Env {
            db: Db::new().await,
            dead: format!("{stream}.dead"),
            stream,
            redis: client.get_multiplexed_async_connection().await.unwrap(),
        }
    }

    fn options(&self, url: String, member: &str) -> RedisConsumerOptions {
        let mut o = RedisConsumerOptions::new(url, &self.stream, "billing", member, &self.dead);
        o.batch = 8;
        o.block = Duration::from_millis(200);
        o.claim_idle = Duration::from_millis(500);
        o.reconnect_max_delay = Duration::from_millis(300);
        o.database_retry_delay = Duration::from_millis(50);
        o
    }

    fn relay(&self, routes: &[&str]) -> RelayRun {
        let sink = RedisSink::new(RedisOptions {
            url: redis_url(),
            ..RedisOptions::default()
        });
        self.db.relay(Arc::new(sink) as Arc<dyn Sink>, routes, &self.stream)
    }

    /// Entries of the group read but not acknowledged.
    async fn pending(&self) -> i64 {
        let reply: redis::Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg("billing")
            .query_async(&mut self.redis.clone())
            .await
            .unwrap();
        match reply {
            redis::Value::Array(items) => redis::from_redis_value_ref(&items[0]).unwrap(),
            other => panic!("XPENDING replied {other:?}"),
        }
    }

    async fn cleanup(mut self) {
        let _: i64 = redis::cmd("DEL")
            .arg(&self.stream)
            .arg(&self.dead)
            .query_async(&mut self.redis)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn each_effect_happens_once_when_a_member_dies_between_commit_and_ack() {
    const N: usize = 200;
    let env = Env::new("inbox-redis").await;
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap()).unwrap();
    let via_proxy = redis_url().replacen("127.0.0.1:6379", &proxy.addr().to_string(), 1);
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let doomed = RedisConsumer::new(inbox.clone(), env.options(via_proxy, "doomed")).unwrap();
    let survivor = RedisConsumer::new(inbox.clone(), env.options(redis_url(), "survivor")).unwrap();

    // The doomed member loses Redis for good inside its tenth handler run:
    // that event commits, its XACK never arrives, and the rest of its batch
    // stays pending under its name until the survivor claims them.
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
        // Two routes to the same stream: every event is published twice.
        let relay = env.relay(&["first", "second"]);
        let events = (0..N)
            .map(|n| Event::new("order.item.created", json!({ "n": n })).key(format!("k{}", n % 7)))
            .collect();
        assert_eq!(env.db.produce(events).await.len(), N);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;
        // The relay forgets a third of its publishes in a crash; a new one
        // publishes them again.
        let replayed = env.db.forget_a_third().await;
        let relay = env.relay(&["first", "second"]);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;

        let copies = 2 * N as u64 + replayed;
        wait("every copy consumed and acknowledged", || async {
            let (d, s) = (doomed.report(), survivor.report());
            d.processed + s.processed == N as u64
                && d.duplicates + s.duplicates > copies - N as u64
                && env.pending().await == 0
        })
        .await;
        let _ = stop.send(true);
        copies
    };
    let (doomed_report, survivor_report, copies) = tokio::join!(
        doomed.run(doomed_handler, until_stopped()),
        survivor.run(async |tx, event| effect(tx, event).await, until_stopped()),
        scenario
    );
    let (d, s) = (doomed_report.unwrap(), survivor_report.unwrap());
    assert!(
        handled.load(Ordering::SeqCst) >= 10,
        "the doomed member died as planned"
    );
    assert!(d.reconnects >= 1, "{d:?}");
    assert_eq!(d.processed + s.processed, N as u64, "{d:?} {s:?}");
    // Every copy, plus the doomed member's committed but unacknowledged one.
    assert!(d.duplicates + s.duplicates > copies - N as u64, "{d:?} {s:?}");
    env.db.assert_effects_once(N).await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_poison_event_is_dead_lettered_and_the_rest_flow() {
    const GOOD: usize = 30;
    let env = Env::new("inbox-redis-dead").await;
    let inbox = Inbox::new(env.db.pool.clone(), "billing")
        .unwrap()
        .with_retry(RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(100),
            jitter: 0.0,
        });
    let consumer = RedisConsumer::new(inbox.clone(), env.options(redis_url(), "only")).unwrap();
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
        // An entry no Ferry sink wrote: no event id.
        let _: String = redis::cmd("XADD")
            .arg(&env.stream)
            .arg("*")
            .arg("hello")
            .arg("world")
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
        wait("every entry consumed", || async {
            let r = consumer.report();
            r.processed == GOOD as u64 && r.dead == 3 && r.malformed == 1 && env.pending().await == 0
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

    let dead: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&env.dead)
        .arg("-")
        .arg("+")
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    assert_eq!(dead.len(), 4, "{dead:?}");
    let mut poisoned = 0;
    for (_, fields) in &dead {
        assert_eq!(fields[DEAD_GROUP_FIELD], "billing");
        let reason = &fields[DEAD_REASON_FIELD];
        if fields.contains_key("hello") {
            assert!(reason.starts_with("malformed message: id is missing"), "{reason}");
        } else {
            assert_eq!(reason, "max attempts (3) reached; last error: the poison pill");
            assert_eq!(fields["type"], "order.poison.created");
            let id: EventId = fields["id"].parse().unwrap();
            let record = inbox.record(id).await.unwrap().unwrap();
            assert_eq!((record.state.as_str(), record.attempts), ("dead", 3));
            poisoned += 1;
        }
    }
    assert_eq!(poisoned, 3);
    env.cleanup().await;
}

#[tokio::test]
async fn bad_options_name_the_field() {
    let db = Db::new().await;
    let inbox = Inbox::new(db.pool.clone(), "billing").unwrap();
    let err = RedisConsumer::new(inbox.clone(), RedisConsumerOptions::new(redis_url(), "s", "g", "", "d")).unwrap_err();
    assert!(err.to_string().contains("consumer is empty"), "{err}");
    let err = RedisConsumer::new(
        inbox.clone(),
        RedisConsumerOptions::new(redis_url(), "s", "g", "c", "s"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("dead_letter_stream"), "{err}");
    let err = RedisConsumer::new(inbox, RedisConsumerOptions::new("http://x", "s", "g", "c", "d")).unwrap_err();
    assert!(err.to_string().contains("url"), "{err}");
}
