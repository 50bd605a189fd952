//! End to end on Redis Streams: outbox -> relay -> stream -> consumer group
//! with the inbox, counting the business effect per event through a member
//! that dies between its commit and its XACK (its entries claimed by the
//! other member), deliberate double publishes, a relay that republishes
//! after a crash, and a handler that always fails; and entries trimmed
//! from the stream before they were read or handled, each reported.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_core::{Event, EventId, Sink};
use ferry_inbox::redis::{DEAD_GROUP_FIELD, DEAD_REASON_FIELD, DEAD_SOURCE_FIELD, RedisConsumer, RedisConsumerOptions};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_sink::redis::{RedisOptions, RedisSink};
use ferry_testkit::metrics::Counts;
use ferry_testkit::proxy::Proxy;
use ferry_testkit::rabbit::unique_name;
use ferry_testkit::redis_server::RedisServer;
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

    /// Adds an entry the way Ferry's sink writes one, trimming the stream
    /// to exactly `maxlen` entries when set.
    async fn add(&self, maxlen: Option<u32>) -> String {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream);
        if let Some(n) = maxlen {
            cmd.arg("MAXLEN").arg(n);
        }
        ferry_entry(cmd.arg("*"))
            .query_async(&mut self.redis.clone())
            .await
            .unwrap()
    }

    /// Reads up to 10 new entries as `member` of the group, leaving them pending.
    async fn read_as(&self, member: &str) -> Vec<String> {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("billing")
            .arg(member)
            .arg("COUNT")
            .arg(10)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.redis.clone())
            .await
            .unwrap();
        reply.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).collect()
    }

    async fn create_group(&self) {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg("billing")
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.redis.clone())
            .await
            .unwrap();
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

/// The fields of an entry as Ferry's sink writes them, for a new event.
fn ferry_entry(cmd: &mut redis::Cmd) -> &mut redis::Cmd {
    cmd.arg("id")
        .arg(EventId::new().to_string())
        .arg("type")
        .arg("order.item.created")
        .arg("payload")
        .arg("{}")
        .arg("specversion")
        .arg("1.0")
}

/// Counter increments of this test process, by consumer (each test names
/// its inbox consumer uniquely).
fn counts() -> &'static Counts {
    static COUNTS: OnceLock<Counts> = OnceLock::new();
    COUNTS.get_or_init(|| {
        let counts = Counts::by_label("consumer");
        metrics::set_global_recorder(counts.clone()).expect("no other recorder in this test binary");
        counts
    })
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
    let inbox = env.db.inbox_giving_up_after(3);
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

/// Entries that wait (a backoff, or the inbox down) stay in the group's
/// pending list, not in the member's memory: it stops reading new ones
/// while a batch waits, so an outage of any length holds a batch or two.
#[tokio::test]
async fn a_member_reads_no_more_while_a_batch_of_entries_waits() {
    let env = Env::new("inbox-redis-bound").await;
    env.create_group().await;
    for _ in 0..100 {
        env.add(None).await;
    }
    // Every attempt fails and waits a minute: as good as an outage.
    let inbox = Inbox::new(env.db.pool.clone(), "billing")
        .unwrap()
        .with_retry(ferry_core::RetryPolicy {
            max_attempts: 100,
            base_delay: Duration::from_secs(60),
            max_delay: Duration::from_secs(60),
            jitter: 0.0,
        });
    let options = env.options(redis_url(), "only");
    let batch = options.batch as i64;
    let consumer = RedisConsumer::new(inbox, options).unwrap();
    let handler = async |_: &mut PgConnection, _: &ReceivedEvent| Err(HandlerError::transient("down"));
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("a batch waiting", || async {
            consumer.report().retried >= batch as u64
        })
        .await;
        // Many block and claim rounds (200 ms and 250 ms); each would read
        // another batch, and claim back the idle ones, without the bound.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let pending = env.pending().await;
        let _ = stop.send(());
        pending
    };
    let (report, pending) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert!(pending < 2 * batch, "{pending} entries read while {batch} waited");
    assert_eq!(report.retried, pending as u64, "each entry attempted once: {report:?}");
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

/// `XADD ... MAXLEN` removes the oldest entries whether or not the group has
/// read them, and `XREADGROUP >` goes on after the gap without a word. The
/// consumer reports such a gap when it starts (the group has not read past
/// it yet) and while it runs (the group has read past it), each loss once.
/// A server that refuses the trim check's script (EVAL renamed away, as
/// some hosted services do) is consumed without the check, instead of the
/// consumer failing its start and reconnecting for ever.
#[tokio::test]
async fn a_server_that_refuses_scripts_is_consumed_without_the_trim_check() {
    let server = RedisServer::start(&["--rename-command", "EVAL", ""]);
    let env = Env::new("inbox-redis-noeval").await;
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut add = redis::cmd("XADD");
    ferry_entry(add.arg(&env.stream).arg("*"));
    let _: String = add.query_async(&mut conn).await.unwrap();
    let refused = redis::cmd("EVAL")
        .arg("return 1")
        .arg(0)
        .query_async::<i64>(&mut conn)
        .await;
    assert!(refused.is_err(), "EVAL is still there: {refused:?}");
    let name = unique_name("billing");
    let inbox = Inbox::new(env.db.pool.clone(), name.as_str()).unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(server.url(), "only")).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the entry handled", || async { consumer.report().processed == 1 }).await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(async |_: &mut PgConnection, _: &ReceivedEvent| Ok(()), async {
            let _ = stopped.await;
        }),
        scenario
    );
    assert_eq!(report.unwrap().processed, 1);
}

/// Entries a member keeps for a backoff longer than `claim_idle` stay its
/// own: another member does not claim them meanwhile and try them early.
/// A whole batch waits, so the member claims nothing itself (which would
/// refresh them as a side effect).
#[tokio::test]
async fn entries_waiting_out_a_backoff_are_not_claimed_by_another_member() {
    use std::collections::HashSet;
    use std::sync::Mutex;
    let env = Env::new("inbox-redis-keep").await;
    env.create_group().await;
    let batch = env.options(redis_url(), "a").batch;
    for _ in 0..batch {
        env.add(None).await;
    }
    let name = unique_name("billing");
    let inbox = || {
        Inbox::new(env.db.pool.clone(), name.as_str())
            .unwrap()
            .with_retry(ferry_core::RetryPolicy {
                max_attempts: 10,
                base_delay: Duration::from_secs(8),
                max_delay: Duration::from_secs(8),
                jitter: 0.0,
            })
    };
    // Renewed every second, idle for 2 s at most before another member may
    // claim them (a margin for a loaded machine): eight intervals pass
    // during the backoff.
    let options = |member| {
        let mut o = env.options(redis_url(), member);
        o.claim_idle = Duration::from_secs(2);
        o
    };
    let a = RedisConsumer::new(inbox(), options("a")).unwrap();
    let b = RedisConsumer::new(inbox(), options("b")).unwrap();
    let tried: Mutex<HashSet<EventId>> = Mutex::new(HashSet::new());
    let by_b = AtomicU32::new(0);
    // Each event's first attempt fails.
    let attempt = |member: &str, event: &ReceivedEvent| {
        if member == "b" {
            by_b.fetch_add(1, Ordering::SeqCst);
        }
        if tried.lock().unwrap().insert(event.id) {
            Err(HandlerError::transient("the first attempt fails"))
        } else {
            Ok(())
        }
    };
    let (stop_a, stopped_a) = oneshot::channel::<()>();
    let (stop_b, stopped_b) = oneshot::channel::<()>();
    let (start_b, b_may_start) = oneshot::channel::<()>();
    let scenario = async {
        wait("a's first attempts", || async { a.report().retried == batch as u64 }).await;
        let _ = start_b.send(());
        wait("every entry processed", || async {
            a.report().processed + b.report().processed == batch as u64
        })
        .await;
        let _ = stop_a.send(());
        let _ = stop_b.send(());
    };
    let run_b = async {
        let _ = b_may_start.await;
        b.run(async |_: &mut PgConnection, e: &ReceivedEvent| attempt("b", e), async {
            let _ = stopped_b.await;
        })
        .await
    };
    let (ra, rb, ()) = tokio::join!(
        a.run(async |_: &mut PgConnection, e: &ReceivedEvent| attempt("a", e), async {
            let _ = stopped_a.await;
        }),
        run_b,
        scenario
    );
    ra.unwrap();
    rb.unwrap();
    assert_eq!(
        by_b.load(Ordering::SeqCst),
        0,
        "another member tried them during the backoff"
    );
    env.cleanup().await;
}

/// An entry whose event another attempt holds (a member stalled with its
/// transaction open) is left pending, not waited on: the member goes on
/// with the rest, and XAUTOCLAIM hands the entry out again after
/// `claim_idle`, until the stall ends.
#[tokio::test]
async fn an_entry_whose_event_a_stalled_attempt_holds_is_left_pending_and_the_rest_flow() {
    let env = Env::new("inbox-redis-held").await;
    env.create_group().await;
    // The held event's entry first: read first.
    let held = EventId::new();
    for id in [held, EventId::new()] {
        let _: String = redis::cmd("XADD")
            .arg(&env.stream)
            .arg("*")
            .arg("id")
            .arg(id.to_string())
            .arg("type")
            .arg("order.item.created")
            .arg("payload")
            .arg("{}")
            .arg("specversion")
            .arg("1.0")
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
    }
    let inbox = Inbox::new(env.db.pool.clone(), unique_name("billing").as_str())
        .unwrap()
        .with_lock_timeout(Duration::from_millis(200));
    let (claimed, has_claimed) = oneshot::channel();
    let stalled = tokio::spawn({
        let inbox = inbox.clone();
        let event = ReceivedEvent::new(held, "order.item.created", &b"{}"[..]);
        async move {
            inbox
                .process(&event, async move |_, _| {
                    let _ = claimed.send(());
                    std::future::pending::<()>().await;
                    Ok(())
                })
                .await
        }
    });
    has_claimed.await.unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(redis_url(), "only")).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the other entry processed, the held one claimed again", || async {
            let r = consumer.report();
            r.processed == 1 && r.in_progress >= 2
        })
        .await;
        stalled.abort();
        wait("both processed", || async {
            consumer.report().processed == 2 && env.pending().await == 0
        })
        .await;
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

/// An entry another member took while this one kept it for a backoff (this
/// member's loop ran late) is theirs: it is not taken back in the middle of
/// their run, and this member does not try it again.
#[tokio::test]
async fn an_entry_another_member_took_is_not_taken_back() {
    let env = Env::new("inbox-redis-taken").await;
    env.create_group().await;
    let id = env.add(None).await;
    let inbox = Inbox::new(env.db.pool.clone(), unique_name("billing").as_str())
        .unwrap()
        .with_retry(ferry_core::RetryPolicy {
            max_attempts: 10,
            base_delay: Duration::from_secs(2),
            max_delay: Duration::from_secs(2),
            jitter: 0.0,
        });
    let a = RedisConsumer::new(inbox, env.options(redis_url(), "a")).unwrap();
    let attempts = AtomicU32::new(0);
    let owner = async || -> String {
        let reply: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(&env.stream)
            .arg("billing")
            .arg(&id)
            .arg(&id)
            .arg(1)
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
        reply.first().map(|r| r.1.clone()).unwrap_or_default()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("a's first attempt", || async { a.report().retried == 1 }).await;
        assert_eq!(owner().await, "a");
        // What another member's XAUTOCLAIM does, then its handler's run,
        // which keeps the entry fresh (as its own renewal would): past a's
        // backoff, and many of a's claim intervals (250 ms).
        for _ in 0..15 {
            let _: redis::Value = redis::cmd("XCLAIM")
                .arg(&env.stream)
                .arg("billing")
                .arg("b")
                .arg(0)
                .arg(&id)
                .arg("JUSTID")
                .query_async(&mut env.redis.clone())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let owner = owner().await;
        let _ = stop.send(());
        owner
    };
    let (report, owner) = tokio::join!(
        a.run(
            async |_: &mut PgConnection, _: &ReceivedEvent| {
                attempts.fetch_add(1, Ordering::SeqCst);
                Err(HandlerError::transient("down"))
            },
            async {
                let _ = stopped.await;
            }
        ),
        scenario
    );
    report.unwrap();
    assert_eq!(owner, "b", "taken back from the member that took it");
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "tried again by the member it was taken from"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn entries_trimmed_before_the_group_read_them_are_reported() {
    let env = Env::new("inbox-redis-trim").await;
    let name = unique_name("billing");
    let inbox = Inbox::new(env.db.pool.clone(), name.as_str()).unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(redis_url(), "only")).unwrap();
    let lost = || counts().get(ferry_inbox::metrics::LOST, &name);
    env.create_group().await;
    for _ in 0..2 {
        env.add(None).await;
    }
    let read = env.read_as("earlier").await;
    let _: i64 = redis::cmd("XACK")
        .arg(&env.stream)
        .arg("billing")
        .arg(&read)
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    // Four more, the stream kept at two: the first two of them are gone
    // before the group read them.
    for _ in 0..4 {
        env.add(Some(2)).await;
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the first gap reported, the rest handled", || async {
            lost() == 2 && consumer.report().processed == 2
        })
        .await;
        // Four at once, the stream kept at one: the consumer reads the last
        // and so skips the three before it.
        let mut add = redis::pipe();
        add.atomic();
        for _ in 0..4 {
            let mut cmd = redis::cmd("XADD");
            ferry_entry(cmd.arg(&env.stream).arg("MAXLEN").arg(1).arg("*"));
            add.add_command(cmd);
        }
        let _: Vec<String> = add.query_async(&mut env.redis.clone()).await.unwrap();
        wait("the second gap reported", || async {
            lost() == 5 && consumer.report().processed == 3
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(async |_: &mut PgConnection, _: &ReceivedEvent| Ok(()), async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!(
        (report.processed, report.malformed, report.dead),
        (3, 0, 0),
        "{report:?}"
    );
    assert_eq!(lost(), 5, "each loss reported once");
    // The group's counters tell the truth again: nothing left to read.
    let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&env.stream)
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    assert_eq!(groups[0]["lag"], redis::Value::Int(0), "{groups:?}");
    env.cleanup().await;
}

/// A group that has read past a gap and still trails the stream by far more
/// than a batch (270 entries after its last-delivered id, 10 up to it) is
/// told of the loss at once, not only once it has caught up: the consumer
/// reports it before it handles anything.
#[tokio::test]
async fn a_gap_the_group_read_past_is_reported_while_the_group_trails_the_stream() {
    let env = Env::new("inbox-redis-trim-trailing").await;
    let name = unique_name("billing");
    let inbox = Inbox::new(env.db.pool.clone(), name.as_str()).unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(redis_url(), "only")).unwrap();
    let lost = || counts().get(ferry_inbox::metrics::LOST, &name);
    env.create_group().await;
    let mut add = redis::pipe();
    for _ in 0..300 {
        let mut cmd = redis::cmd("XADD");
        ferry_entry(cmd.arg(&env.stream).arg("*"));
        add.add_command(cmd).ignore();
    }
    let () = add.query_async(&mut env.redis.clone()).await.unwrap();
    let ack = async |ids: Vec<String>| {
        let _: i64 = redis::cmd("XACK")
            .arg(&env.stream)
            .arg("billing")
            .arg(&ids)
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
    };
    ack(env.read_as("earlier").await).await;
    // The 10 entries after those read are trimmed; the group reads past them.
    let kept: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&env.stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(21)
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    let _: i64 = redis::cmd("XTRIM")
        .arg(&env.stream)
        .arg("MINID")
        .arg(&kept[20].0)
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    ack(env.read_as("earlier").await).await;
    let (open, gate) = tokio::sync::watch::channel(false);
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the gap reported, nothing handled yet", || async { lost() == 10 }).await;
        assert_eq!(consumer.report().processed, 0);
        open.send(true).unwrap();
        wait("the rest handled", || async { consumer.report().processed == 270 }).await;
        let _ = stop.send(());
    };
    let handler = async |_: &mut PgConnection, _: &ReceivedEvent| {
        let _ = gate.clone().wait_for(|open| *open).await;
        Ok(())
    };
    let (report, ()) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    assert_eq!(report.unwrap().processed, 270);
    assert_eq!(lost(), 10, "reported once");
    env.cleanup().await;
}

/// Entries read but not yet acknowledged can be trimmed too: this member's
/// own (read before a restart) come back from the pending list without
/// fields, another member's are named as deleted by XAUTOCLAIM. Each is
/// counted as lost and dead-lettered saying it was trimmed, none as
/// malformed.
#[tokio::test]
async fn pending_entries_trimmed_before_they_were_handled_are_dead_lettered_as_trimmed() {
    let env = Env::new("inbox-redis-trim-pending").await;
    let name = unique_name("billing");
    let inbox = Inbox::new(env.db.pool.clone(), name.as_str()).unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(redis_url(), "only")).unwrap();
    let lost = || counts().get(ferry_inbox::metrics::LOST, &name);
    env.create_group().await;
    for _ in 0..2 {
        env.add(None).await;
    }
    let mut trimmed = env.read_as("only").await;
    env.add(None).await;
    trimmed.extend(env.read_as("gone").await);
    env.add(Some(1)).await;
    assert_eq!(trimmed.len(), 3);

    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the trimmed entries dead-lettered, the last handled", || async {
            lost() == 3 && consumer.report().processed == 1 && env.pending().await == 0
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(async |_: &mut PgConnection, _: &ReceivedEvent| Ok(()), async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.processed, report.malformed), (1, 0), "{report:?}");
    let dead: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&env.dead)
        .arg("-")
        .arg("+")
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    let mut sources: Vec<String> = dead
        .iter()
        .map(|(_, fields)| {
            let reason = &fields[DEAD_REASON_FIELD];
            assert!(reason.starts_with("trimmed from the stream"), "{reason}");
            fields[DEAD_SOURCE_FIELD].clone()
        })
        .collect();
    sources.sort();
    let expected: Vec<String> = trimmed.iter().map(|id| format!("{} {id}", env.stream)).collect();
    assert_eq!(sources, expected);
    assert_eq!(lost(), 3);
    env.cleanup().await;
}

/// A dead-letter key holding something else than a stream made every
/// dead-lettering fail (WRONGTYPE), and the entry came back after every
/// reconnect. The consumer refuses to start on it, naming the key; if the
/// key changes while it runs, it stops at the first dead letter, and the
/// entry stays pending.
#[tokio::test]
async fn a_dead_letter_key_that_is_not_a_stream_stops_the_consumer() {
    let env = Env::new("inbox-redis-dead-type").await;
    let inbox = Inbox::new(env.db.pool.clone(), "billing").unwrap();
    let consumer = RedisConsumer::new(inbox, env.options(redis_url(), "only")).unwrap();
    let set_dead_key = || async {
        let _: () = redis::cmd("SET")
            .arg(&env.dead)
            .arg("not a stream")
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
    };
    let run = || async {
        let run = consumer.run(
            async |_: &mut PgConnection, _: &ReceivedEvent| Ok(()),
            std::future::pending(),
        );
        match tokio::time::timeout(support::WITHIN, run).await {
            Ok(result) => result.unwrap_err().to_string(),
            Err(_) => panic!("the consumer went on with a dead-letter key that is not a stream"),
        }
    };
    let malformed = || async {
        let _: String = redis::cmd("XADD")
            .arg(&env.stream)
            .arg("*")
            .arg("hello")
            .arg("world")
            .query_async(&mut env.redis.clone())
            .await
            .unwrap();
    };

    set_dead_key().await;
    let err = run().await;
    assert!(
        err.contains(&format!("dead_letter_stream {:?} is a string, not a stream", env.dead)),
        "{err}"
    );

    let _: i64 = redis::cmd("DEL")
        .arg(&env.dead)
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    let scenario = async {
        // The key becomes a string after the start, before a dead letter.
        wait("the consumer reads", || async {
            let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(&env.stream)
                .query_async(&mut env.redis.clone())
                .await
                .unwrap_or_default();
            groups.first().is_some_and(|g| g["consumers"] == redis::Value::Int(1))
        })
        .await;
        set_dead_key().await;
        malformed().await;
    };
    let (err, ()) = tokio::join!(run(), scenario);
    assert!(err.contains("dead-lettering entry"), "{err}");
    assert!(err.contains("is a string, not a stream"), "{err}");
    assert_eq!(env.pending().await, 1, "the entry stays pending");
    assert_eq!(consumer.report().reconnects, 0);
    env.cleanup().await;
}

/// A handler that kills its process (a crash in C code, an out-of-memory
/// kill, kill -9) rolled its attempt back, count and all: the restarted
/// member read the entry again from its pending list first and died on it
/// too, for ever, nothing dead-lettered. Here each member dies in the
/// handler (its future dropped mid-attempt) and starts again under its
/// name; entries from the pending list are marked before they run, and
/// past the inbox's attempts the event is dead-lettered unrun, the rest
/// applied once.
#[tokio::test]
async fn an_event_whose_handler_kills_the_process_is_dead_lettered_after_its_attempts() {
    const N: i64 = 10;
    const KILLER: i64 = 4;
    const ATTEMPTS: u32 = 2;
    let env = Env::new("inbox-redis-killer").await;
    let options = env.options(redis_url(), "m1");
    let inbox = env.db.inbox_giving_up_after(ATTEMPTS);
    env.create_group().await;
    let relay = env.relay(&["orders"]);
    let events = (0..N)
        .map(|n| Event::new("order.item.created", json!({ "n": n })))
        .collect();
    let ids = env.db.produce(events).await;
    env.db.all_published(N).await;
    relay.stop().await;

    let killer = support::Killer::new(KILLER);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| killer.handle(tx, event).await;
    // The first read of an entry is not marked (only one read again is):
    // one more death than the attempts.
    for life in 1..=ATTEMPTS + 1 {
        let consumer = RedisConsumer::new(inbox.clone(), options.clone()).unwrap();
        tokio::select! {
            report = consumer.run(handler, std::future::pending()) => panic!("the consumer stopped: {report:?}"),
            () = wait("the handler to take the killer event", || async { killer.runs() == life }) => {}
        }
    }
    let consumer = RedisConsumer::new(inbox.clone(), options).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = killer.until_dead(&env.db, || consumer.report().dead, N, ATTEMPTS + 1, stop);
    let (report, ()) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
    env.db.assert_effects_once(N as usize - 1).await;
    let dead: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&env.dead)
        .arg("-")
        .arg("+")
        .query_async(&mut env.redis.clone())
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    support::assert_dead_unfinished(&inbox, ids[KILLER as usize], ATTEMPTS, &dead[0].1[DEAD_REASON_FIELD]).await;
    env.cleanup().await;
}
