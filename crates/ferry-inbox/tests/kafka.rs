//! End to end on Kafka (librdkafka's mock cluster): outbox -> relay -> topic
//! -> consumer group with the inbox, counting the business effect per event
//! through an offset commit lost after the inbox commit, deliberate double
//! publishes, a relay that republishes after a crash, and a handler that
//! always fails; and per-key order of the effects.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_core::{Event, EventId, RetryPolicy, Sink};
use ferry_inbox::kafka::{DEAD_GROUP_HEADER, DEAD_REASON_HEADER, KafkaConsumer, KafkaConsumerOptions};
use ferry_inbox::{HandlerError, Inbox, ReceivedEvent};
use ferry_sink::kafka::{KafkaOptions, KafkaSink};
use ferry_testkit::kafka::broker;
use ferry_testkit::metrics::Counts;
use ferry_testkit::rabbit::unique_name;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;
use sqlx::PgConnection;
use support::{Db, RelayRun, WITHIN, effect, number, wait};
use tokio::sync::oneshot;

const PARTITIONS: i32 = 4;

struct Env<'c> {
    db: Db,
    cluster: MockCluster<'c, rdkafka::producer::DefaultProducerContext>,
    topic: String,
    dead_topic: String,
}

impl Env<'_> {
    async fn new(prefix: &str) -> Self {
        Self::with_brokers(prefix, 1).await
    }

    async fn with_brokers(prefix: &str, brokers: i32) -> Self {
        let cluster = MockCluster::new(brokers).expect("a mock cluster");
        let topic = unique_name(prefix);
        let dead_topic = format!("{topic}.dead");
        cluster.create_topic(&topic, PARTITIONS, 1).unwrap();
        cluster.create_topic(&dead_topic, 1, 1).unwrap();
        let db = Db::new().await;
        // The order effects happened in, to check per-key order.
        sqlx::query("ALTER TABLE effects ADD COLUMN at bigserial")
            .execute(&db.pool)
            .await
            .unwrap();
        Env {
            db,
            cluster,
            topic,
            dead_topic,
        }
    }

    fn options(&self) -> KafkaConsumerOptions {
        let mut o = KafkaConsumerOptions::new(
            self.cluster.bootstrap_servers(),
            &self.topic,
            "billing",
            &self.dead_topic,
        );
        o.reconnect_max_delay = Duration::from_millis(300);
        o.database_retry_delay = Duration::from_millis(50);
        o
    }

    fn relay(&self, routes: &[&str]) -> RelayRun {
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("topic.metadata.propagation.max.ms".into(), "1000".into());
        let sink = KafkaSink::new(KafkaOptions {
            bootstrap_servers: self.cluster.bootstrap_servers(),
            extra,
            ..KafkaOptions::default()
        })
        .unwrap();
        self.db.relay(Arc::new(sink) as Arc<dyn Sink>, routes, &self.topic)
    }

    /// The inbox, retrying a failed record after exactly `delay`.
    fn inbox_retrying_after(&self, delay: Duration) -> Inbox {
        Inbox::new(self.db.pool.clone(), "billing")
            .unwrap()
            .with_retry(RetryPolicy {
                max_attempts: 5,
                base_delay: delay,
                max_delay: delay,
                jitter: 0.0,
            })
    }

    /// Asserts that group `billing` has committed every partition of the
    /// topic up to its end.
    async fn assert_all_committed(&self) {
        let (servers, topic) = (self.cluster.bootstrap_servers(), self.topic.clone());
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", servers)
                .set("group.id", "billing")
                .create()
                .unwrap();
            let mut partitions = TopicPartitionList::new();
            for p in 0..PARTITIONS {
                partitions.add_partition(&topic, p);
            }
            let committed = reader.committed_offsets(partitions, WITHIN).unwrap();
            for p in 0..PARTITIONS {
                let (_, high) = reader.fetch_watermarks(&topic, p, WITHIN).unwrap();
                let at = committed.find_partition(&topic, p).unwrap().offset();
                // A partition no key hashed to has nothing to commit.
                let end = if high == 0 {
                    Offset::Invalid
                } else {
                    Offset::Offset(high)
                };
                assert_eq!(at, end, "partition {p}: committed {at:?}, its end {high}");
            }
        })
        .await
        .unwrap();
    }

    /// Waits until group `billing` has committed `offset` on the one
    /// partition of the topic that holds records.
    async fn wait_committed(&self, offset: i64) {
        let (partition, _, _) = self.only_partition().await;
        let (servers, topic) = (self.cluster.bootstrap_servers(), self.topic.clone());
        wait("the offset committed", || {
            let (servers, topic) = (servers.clone(), topic.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    let reader: BaseConsumer = ClientConfig::new()
                        .set("bootstrap.servers", servers)
                        .set("group.id", "billing")
                        .create()
                        .unwrap();
                    let mut one = TopicPartitionList::new();
                    one.add_partition(&topic, partition);
                    let committed = reader.committed_offsets(one, WITHIN).unwrap();
                    committed.find_partition(&topic, partition).unwrap().offset() == Offset::Offset(offset)
                })
                .await
                .unwrap()
            }
        })
        .await;
    }

    /// The one partition of the topic that holds records, with its log
    /// start and end.
    async fn only_partition(&self) -> (i32, i64, i64) {
        let (servers, topic) = (self.cluster.bootstrap_servers(), self.topic.clone());
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new().set("bootstrap.servers", servers).create().unwrap();
            let held: Vec<(i32, i64, i64)> = (0..PARTITIONS)
                .map(|p| {
                    let (low, high) = reader.fetch_watermarks(&topic, p, WITHIN).unwrap();
                    (p, low, high)
                })
                .filter(|(_, _, high)| *high > 0)
                .collect();
            assert_eq!(held.len(), 1, "{held:?}");
            held[0]
        })
        .await
        .unwrap()
    }

    /// Per key (event n has key k(n % 7)), effects happened in the order
    /// the events were produced.
    async fn assert_effects_in_key_order(&self) {
        let rows: Vec<(i32,)> = sqlx::query_as("SELECT n FROM effects ORDER BY at")
            .fetch_all(&self.db.pool)
            .await
            .unwrap();
        let mut last: HashMap<i32, i32> = HashMap::new();
        for (n,) in rows {
            if let Some(previous) = last.insert(n % 7, n) {
                assert!(previous < n, "key k{}: {n} after {previous}", n % 7);
            }
        }
    }

    /// Every record on the dead-letter topic, read by a group of its own.
    async fn dead_letters(&self, n: usize) -> Vec<(HashMap<String, String>, Vec<u8>)> {
        let reader: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.cluster.bootstrap_servers())
            .set("group.id", unique_name("reader"))
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        reader.subscribe(&[self.dead_topic.as_str()]).unwrap();
        let mut got = Vec::new();
        while got.len() < n {
            let m = tokio::time::timeout(WITHIN, reader.recv()).await.unwrap().unwrap();
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            got.push((headers, m.payload().unwrap_or_default().to_vec()));
        }
        got
    }
}

/// Counter increments of this test process, by consumer (each test that
/// reads them names its inbox consumer uniquely).
fn counts() -> &'static Counts {
    static COUNTS: OnceLock<Counts> = OnceLock::new();
    COUNTS.get_or_init(|| {
        let counts = Counts::by_label("consumer");
        metrics::set_global_recorder(counts.clone()).expect("no other recorder in this test binary");
        counts
    })
}

fn keyed(n: usize) -> Vec<Event> {
    (0..n)
        .map(|n| Event::new("order.item.created", json!({ "n": n })).key(format!("k{}", n % 7)))
        .collect()
}

#[tokio::test]
async fn each_effect_happens_once_through_refused_offset_commits_and_duplicates() {
    const N: usize = 200;
    let env = Env::new("inbox-kafka").await;
    let consumer = KafkaConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), env.options()).unwrap();

    // From the tenth handler run on, the coordinator refuses every offset
    // commit: the inbox rows commit, the offsets do not; they are made again
    // once the coordinator takes commits again.
    let handled = AtomicU32::new(0);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        effect(tx, event).await?;
        if handled.fetch_add(1, Ordering::SeqCst) == 9 {
            env.cluster.request_errors(
                RDKafkaApiKey::OffsetCommit,
                &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_COMMIT_OFFSET_SIZE; 100_000],
            );
        }
        Ok(())
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        // Two routes to the same topic: every event is published twice.
        let relay = env.relay(&["first", "second"]);
        assert_eq!(env.db.produce(keyed(N)).await.len(), N);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;
        // The relay forgets a third of its publishes in a crash; a new one
        // publishes them again.
        let replayed = env.db.forget_a_third().await;
        let relay = env.relay(&["first", "second"]);
        env.db.all_published(2 * N as i64).await;
        relay.stop().await;

        let copies = 2 * N as u64 + replayed;
        wait("every copy consumed", || async {
            let r = consumer.report();
            r.processed == N as u64 && r.duplicates >= copies - N as u64
        })
        .await;
        env.cluster.clear_request_errors(RDKafkaApiKey::OffsetCommit);
        let _ = stop.send(());
        copies
    };
    let (report, copies) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!(report.processed, N as u64);
    assert!(report.duplicates >= copies - N as u64, "{report:?}");
    env.db.assert_effects_once(N).await;
    // The commits refused were made again as the consumer left.
    env.assert_all_committed().await;
}

/// A record waiting out a retry longer than `max.poll.interval.ms` keeps
/// the consumer in its group: it polls through the wait. It used to stop
/// polling, be dropped from the group, and rejoin.
#[tokio::test]
async fn a_retry_longer_than_the_poll_interval_keeps_the_group_membership() {
    const N: usize = 20;
    let env = Env::new("inbox-kafka-poll").await;
    let mut options = env.options();
    for (k, v) in [
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "500"),
        ("max.poll.interval.ms", "6000"),
    ] {
        options.extra.insert(k.into(), v.into());
    }
    let inbox = env.inbox_retrying_after(Duration::from_secs(9));
    let consumer = KafkaConsumer::new(inbox, options).unwrap();
    let failed = AtomicU32::new(0);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if number(event) == 3 && failed.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(HandlerError::transient("not yet"));
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        env.db.produce(keyed(N)).await;
        env.db.all_published(N as i64).await;
        relay.stop().await;
        wait("every record consumed", || async {
            consumer.report().processed == N as u64
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.processed, report.retried), (N as u64, 1), "{report:?}");
    assert_eq!(
        report.reconnects, 0,
        "the member left its group during the wait: {report:?}"
    );
    env.db.assert_effects_once(N).await;
    env.assert_all_committed().await;
}

/// A record waiting out its retries holds back its own partition only:
/// the member's other partitions go on meanwhile, and once the record is
/// processed its partition follows, in order. (The member used to pause
/// every partition it had and retry the record in place until it was done.)
#[tokio::test]
async fn a_record_waiting_out_its_retries_holds_back_only_its_partition() {
    const N: usize = 40;
    let env = Env::new("inbox-kafka-own-partition").await;
    let inbox = Inbox::new(env.db.pool.clone(), "billing")
        .unwrap()
        .with_retry(RetryPolicy {
            max_attempts: 10_000,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_millis(200),
            jitter: 0.0,
        });
    let consumer = KafkaConsumer::new(inbox, env.options()).unwrap();
    let failing = std::sync::atomic::AtomicBool::new(true);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if number(event) == 0 && failing.load(Ordering::SeqCst) {
            return Err(HandlerError::transient("not yet"));
        }
        effect(tx, event).await
    };
    // Event 0 (key k0) first, alone; the rest once it is failing. The key
    // of event n is k(n % 7).
    let events = |range: std::ops::Range<usize>| -> Vec<Event> {
        range
            .map(|n| Event::new("order.item.created", json!({ "n": n })).key(format!("k{}", n % 7)))
            .collect()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        env.db.produce(events(0..1)).await;
        wait("event 0 failing", || async { consumer.report().retried >= 1 }).await;
        env.db.produce(events(1..N)).await;
        wait("other partitions' records processed while event 0 waits", || async {
            consumer.report().processed >= 1
        })
        .await;
        // Key k0's later events are behind event 0 in its partition.
        let k0_done = env.db.scalar("SELECT count(*) FROM effects WHERE n % 7 = 0").await;
        assert_eq!(k0_done, 0, "a k0 event was processed ahead of event 0");
        failing.store(false, Ordering::SeqCst);
        wait("every record consumed", || async {
            consumer.report().processed == N as u64
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
    assert_eq!(report.processed, N as u64, "{report:?}");
    assert_eq!(report.reconnects, 0, "{report:?}");
    env.db.assert_effects_once(N).await;
    env.assert_effects_in_key_order().await;
    env.assert_all_committed().await;
}

/// A member joining while another waits out a retry starts a rebalance
/// that revokes the waiting member's partitions mid-wait: it polls through
/// the rebalance, leaves the record to the group if its partition is no
/// longer its own, and neither member restarts its session; each effect
/// happens once and every offset is committed. (librdkafka's mock
/// coordinator decides who ends up with which partition.)
#[tokio::test]
async fn a_rebalance_during_a_retry_wait_loses_nothing_and_restarts_no_session() {
    const N: usize = 40;
    let env = Env::new("inbox-kafka-rebalance").await;
    let inbox = env.inbox_retrying_after(Duration::from_secs(10));
    let mut o = env.options();
    // The mock coordinator waits a session timeout for a joining member.
    for (k, v) in [("session.timeout.ms", "6000"), ("heartbeat.interval.ms", "500")] {
        o.extra.insert(k.into(), v.into());
    }
    let first = KafkaConsumer::new(inbox.clone(), o.clone()).unwrap();
    let second = KafkaConsumer::new(inbox, o).unwrap();
    let failed = AtomicU32::new(0);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if number(event) == 3 && failed.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(HandlerError::transient("not yet"));
        }
        effect(tx, event).await
    };
    let (stop_first, first_stopped) = oneshot::channel::<()>();
    let (start_second, second_started) = oneshot::channel::<()>();
    let (stop_second, second_stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        env.db.produce(keyed(N)).await;
        env.db.all_published(N as i64).await;
        relay.stop().await;
        wait("the first member waiting out a retry", || async {
            first.report().retried == 1
        })
        .await;
        let _ = start_second.send(());
        wait("every record consumed", || async {
            first.report().processed + second.report().processed == N as u64
        })
        .await;
        let _ = stop_first.send(());
        let _ = stop_second.send(());
    };
    let (a, b, ()) = tokio::join!(
        first.run(handler, async {
            let _ = first_stopped.await;
        }),
        async {
            if second_started.await.is_err() {
                return Ok(second.report());
            }
            second
                .run(handler, async {
                    let _ = second_stopped.await;
                })
                .await
        },
        scenario
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.processed + b.processed, N as u64, "{a:?} {b:?}");
    assert_eq!((a.reconnects, b.reconnects), (0, 0), "{a:?} {b:?}");
    env.db.assert_effects_once(N).await;
    env.assert_all_committed().await;
}

/// The group's coordinator away (its broker down) holds back no record:
/// offsets are committed without waiting for it, and made once it is back.
/// A commit that waited held each record up to `session.timeout.ms`.
#[tokio::test]
async fn a_coordinator_away_holds_back_no_record() {
    const N: usize = 40;
    let env = Env::with_brokers("inbox-kafka-coord", 2).await;
    // Partitions led by broker 1; the group coordinated by broker 2.
    for p in 0..PARTITIONS {
        env.cluster.partition_leader(&env.topic, p, Some(1)).unwrap();
    }
    env.cluster.partition_leader(&env.dead_topic, 0, Some(1)).unwrap();
    env.cluster
        .coordinator(MockCoordinator::Group("billing".into()), 2)
        .unwrap();
    let consumer = KafkaConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), env.options()).unwrap();
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| effect(tx, event).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let events = keyed(N);
        env.db.produce(events[..N / 2].to_vec()).await;
        wait("the first half consumed", || async {
            consumer.report().processed == N as u64 / 2
        })
        .await;
        env.cluster.broker_down(2).unwrap();
        env.db.produce(events[N / 2..].to_vec()).await;
        wait("the second half consumed, the coordinator away", || async {
            consumer.report().processed == N as u64
        })
        .await;
        env.cluster.broker_up(2).unwrap();
        relay.stop().await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(handler, async {
            let _ = stopped.await;
        }),
        scenario
    );
    assert_eq!(report.unwrap().processed, N as u64);
    env.db.assert_effects_once(N).await;
    env.assert_all_committed().await;
}

#[tokio::test]
async fn a_poison_event_is_dead_lettered_and_each_key_keeps_its_order() {
    const GOOD: usize = 60;
    let env = Env::new("inbox-kafka-dead").await;
    let inbox = env.db.inbox_giving_up_after(3);
    let consumer = KafkaConsumer::new(inbox.clone(), env.options()).unwrap();
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        if event.event_type == "order.poison.created" {
            return Err(HandlerError::transient("the poison pill"));
        }
        effect(tx, event).await
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let relay = env.relay(&["orders"]);
        let mut events = keyed(GOOD);
        for n in [5, 25, 45] {
            events.insert(
                n,
                Event::new("order.poison.created", json!({ "n": 1000 + n })).key("k2"),
            );
        }
        let ids = env.db.produce(events).await;
        // A record no Ferry sink wrote: no headers.
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", env.cluster.bootstrap_servers())
            .create()
            .unwrap();
        producer
            .send(
                FutureRecord::<(), _>::to(&env.topic).payload("{}"),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        wait("every record consumed", || async {
            let r = consumer.report();
            r.processed == GOOD as u64 && r.dead == 3 && r.malformed == 1
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

    env.assert_effects_in_key_order().await;

    let dead = env.dead_letters(4).await;
    let mut poisoned = 0;
    for (headers, _) in &dead {
        assert_eq!(headers[DEAD_GROUP_HEADER], "billing");
        let reason = &headers[DEAD_REASON_HEADER];
        match headers.get("ce_id") {
            None => assert!(reason.starts_with("malformed message: ce_id is missing"), "{reason}"),
            Some(id) => {
                assert_eq!(reason, "max attempts (3) reached; last error: the poison pill");
                let record = inbox.record(id.parse::<EventId>().unwrap()).await.unwrap().unwrap();
                assert_eq!((record.state.as_str(), record.attempts), ("dead", 3));
                poisoned += 1;
            }
        }
    }
    assert_eq!(poisoned, 3);
}

/// Records no Ferry producer could have written, with a NUL byte in the
/// type or the key or a type outside Ferry's grammar, are dead-lettered as
/// malformed and the partition moves on. A NUL in the type made PostgreSQL
/// refuse the claim, which the member took for an outage and waited out for
/// ever, holding back the whole partition.
#[tokio::test]
async fn a_record_the_inbox_cannot_store_is_malformed_and_the_partition_moves_on() {
    let env = Env::new("inbox-kafka-nul").await;
    let consumer = KafkaConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), env.options()).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", env.cluster.bootstrap_servers())
        .create()
        .unwrap();
    let records = [
        ("order.item\0created", None),
        ("Order Created", None),
        ("order.item.created", Some("o-\0-1")),
        ("order.item.created", Some("o-1")),
    ];
    for (event_type, subject) in records {
        let id = EventId::new().to_string();
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "ce_id",
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: "ce_type",
                value: Some(event_type),
            });
        if let Some(subject) = subject {
            headers = headers.insert(Header {
                key: "ce_subject",
                value: Some(subject),
            });
        }
        let record = FutureRecord::<(), _>::to(&env.topic)
            .partition(0)
            .payload("{\"n\": 1}")
            .headers(headers);
        producer.send(record, Duration::from_secs(10)).await.unwrap();
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        wait("the good record processed after the bad ones", || async {
            let r = consumer.report();
            r.malformed == 3 && r.processed == 1
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(effect, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!(
        (report.malformed, report.processed, report.dead),
        (3, 1, 0),
        "{report:?}"
    );
    assert_eq!(report.inbox_unavailable, 0, "{report:?}");
    env.db.assert_effects_once(1).await;
    let mut reasons: Vec<String> = env
        .dead_letters(3)
        .await
        .into_iter()
        .map(|(headers, _)| headers[DEAD_REASON_HEADER].clone())
        .collect();
    reasons.sort();
    assert!(
        reasons[0].starts_with("malformed message: ce_type \"Order Created\""),
        "{reasons:?}"
    );
    assert!(
        reasons[1].starts_with("malformed message: ce_type \"order.item\\0created\""),
        "{reasons:?}"
    );
    assert!(
        reasons[2].starts_with("malformed message: key \"o-\\0-1\" has a NUL byte"),
        "{reasons:?}"
    );
}

#[tokio::test]
async fn bad_options_name_the_field() {
    let db = Db::new().await;
    let inbox = Inbox::new(db.pool.clone(), "billing").unwrap();
    let err = KafkaConsumer::new(inbox.clone(), KafkaConsumerOptions::new("b:9092", "t", "", "d")).unwrap_err();
    assert!(err.to_string().contains("group is empty"), "{err}");
    let err = KafkaConsumer::new(inbox.clone(), KafkaConsumerOptions::new("b:9092", "t", "g", "t")).unwrap_err();
    assert!(err.to_string().contains("dead_letter_topic"), "{err}");
    let mut options = KafkaConsumerOptions::new("b:9092", "t", "g", "d");
    options.extra.insert("enable.auto.commit".into(), "true".into());
    let err = KafkaConsumer::new(inbox, options).unwrap_err();
    assert!(err.to_string().contains("extra.enable.auto.commit"), "{err}");
}

/// On a real broker: a consumer group with the inbox applies each event once
/// although every event is published twice (two routes to one topic).
#[tokio::test]
async fn on_tansu_a_consumer_group_applies_each_event_once() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    const N: usize = 100;
    let bootstrap = broker();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let topic = unique_name("inbox-tansu");
    let dead_topic = format!("{topic}.dead");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let created = admin
        .create_topics(
            [
                &NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1)),
                &NewTopic::new(&dead_topic, 1, TopicReplication::Fixed(1)),
            ],
            &options,
        )
        .await
        .unwrap();
    assert!(created.iter().all(Result::is_ok), "{created:?}");

    let db = Db::new().await;
    let mut consumer_options = KafkaConsumerOptions::new(&bootstrap, &topic, unique_name("billing"), &dead_topic);
    consumer_options.reconnect_max_delay = Duration::from_millis(300);
    let consumer = KafkaConsumer::new(Inbox::new(db.pool.clone(), "billing").unwrap(), consumer_options).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let scenario = async {
        let sink = KafkaSink::new(KafkaOptions {
            bootstrap_servers: bootstrap.clone(),
            ..KafkaOptions::default()
        })
        .unwrap();
        let relay = db.relay(Arc::new(sink) as Arc<dyn Sink>, &["first", "second"], &topic);
        assert_eq!(db.produce(keyed(N)).await.len(), N);
        db.all_published(2 * N as i64).await;
        relay.stop().await;
        wait("every copy consumed", || async {
            let r = consumer.report();
            r.processed == N as u64 && r.duplicates >= N as u64
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(
        consumer.run(effect, async {
            let _ = stopped.await;
        }),
        scenario
    );
    let report = report.unwrap();
    assert_eq!((report.processed, report.dead), (N as u64, 0), "{report:?}");
    db.assert_effects_once(N).await;
    let _ = admin.delete_topics(&[&topic, &dead_topic], &options).await;
}

/// A record given up on is produced to the dead-letter topic before its
/// offset is committed; with the topic missing the member rejoined for
/// ever, re-reading the record, its partition stalled and the log saying
/// "consumer lost its broker". It now refuses to start, naming the topic.
#[tokio::test]
async fn a_missing_dead_letter_topic_is_refused_at_start() {
    let env = Env::new("inbox-kafka-nodead").await;
    let mut options = env.options();
    options.dead_letter_topic = format!("{}.missing", env.topic);
    options.timeout = Duration::from_secs(2);
    let consumer = KafkaConsumer::new(Inbox::new(env.db.pool.clone(), "billing").unwrap(), options).unwrap();
    let run = consumer.run(effect, std::future::pending());
    let err = match tokio::time::timeout(WITHIN, run).await {
        Ok(result) => result.unwrap_err().to_string(),
        Err(_) => panic!("the consumer started without its dead-letter topic"),
    };
    assert!(
        err.contains(&format!("dead_letter_topic \"{}.missing\" does not exist", env.topic)),
        "{err}"
    );
    assert!(err.contains("create the topic"), "{err}");
}

/// A dead letter the topic refuses for good (too large for it here; a user
/// without Write the same) would be refused on every try: the consumer
/// stops, naming it, its record uncommitted, rather than rejoin for ever.
#[tokio::test]
async fn a_dead_letter_the_topic_refuses_for_good_stops_the_consumer() {
    let env = Env::new("inbox-kafka-dlq-refused").await;
    let relay = env.relay(&["orders"]);
    env.db
        .produce(vec![Event::new("order.poison.created", json!({ "n": 1 })).key("k1")])
        .await;
    env.db.all_published(1).await;
    relay.stop().await;
    // Every produce from now on, the dead letter's, is refused as too large.
    env.cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; 50],
    );
    let consumer = KafkaConsumer::new(env.db.inbox_giving_up_after(1), env.options()).unwrap();
    let handler = async |_: &mut PgConnection, _: &ReceivedEvent| Err(HandlerError::transient("the poison pill"));
    let err = match tokio::time::timeout(WITHIN, consumer.run(handler, std::future::pending())).await {
        Ok(result) => result.unwrap_err().to_string(),
        Err(_) => panic!("the consumer kept trying a dead letter the topic refuses for good"),
    };
    assert!(err.contains("refuses this record for good"), "{err}");
    assert!(err.contains("max.message.bytes"), "{err}");
}

/// A dead letter carries its record and a reason, so it can be larger than
/// any record the consumer read: a record near the sink's limit is
/// dead-lettered, not refused by the dead-letter producer's own default
/// limit (which would stop the consumer). And the consumer's `extra` gives
/// the producer nothing it could not be created with.
#[tokio::test]
async fn a_record_near_the_size_limit_is_dead_lettered() {
    let env = Env::new("inbox-kafka-dlq-large").await;
    let relay = env.relay(&["orders"]);
    let pad = "x".repeat(999_900);
    env.db
        .produce(vec![
            Event::new("order.poison.created", json!({ "pad": pad })).key("k1"),
        ])
        .await;
    env.db.all_published(1).await;
    relay.stop().await;
    // A producer's setting among the consumer's, which an idempotent
    // dead-letter producer could not be created with.
    let mut options = env.options();
    options
        .extra
        .insert("max.in.flight.requests.per.connection".into(), "10".into());
    options.extra.insert("delivery.report.only.error".into(), "true".into());
    let consumer = KafkaConsumer::new(env.db.inbox_giving_up_after(1), options).unwrap();
    let handler = async |_: &mut PgConnection, _: &ReceivedEvent| Err(HandlerError::permanent("refused"));
    let (stop, stopped) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        consumer
            .run(handler, async {
                let _ = stopped.await;
            })
            .await
    });
    let dead = env.dead_letters(1).await;
    assert!(
        dead[0].1.len() > 999_900,
        "the record's payload: {} bytes",
        dead[0].1.len()
    );
    let _ = stop.send(());
    let report = tokio::time::timeout(WITHIN, run)
        .await
        .expect("the consumer stops: no dead letter waits for a report that never comes")
        .unwrap()
        .unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
}

/// A handler that kills its process (a crash in C code, an out-of-memory
/// kill, kill -9) rolled its attempt back, count and all: the member that
/// took the partition next read the record again from the committed
/// offset and died on it too, for ever, the partition wedged on every
/// member. Here each member dies in the handler (its future dropped
/// mid-attempt); after an assignment the partition's records are marked
/// before they run, and past the inbox's attempts the record is
/// dead-lettered unrun, the partition moves on, every other event applied
/// once.
#[tokio::test]
async fn a_record_whose_handler_kills_the_process_is_dead_lettered_after_its_attempts() {
    const N: i64 = 10;
    const KILLER: i64 = 4;
    const ATTEMPTS: u32 = 2;
    let env = Env::new("inbox-kafka-killer").await;
    let inbox = env.db.inbox_giving_up_after(ATTEMPTS);
    let mut options = env.options();
    options.extra.insert("session.timeout.ms".into(), "6000".into());
    // One key: one partition, the killer behind records processed first.
    let events = (0..N)
        .map(|n| Event::new("order.item.created", json!({ "n": n })).key("k"))
        .collect();
    let relay = env.relay(&["orders"]);
    let ids = env.db.produce(events).await;
    env.db.all_published(N).await;
    relay.stop().await;

    let killer = support::Killer::new(KILLER);
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| killer.handle(tx, event).await;
    // The first member reaches the killer after records it processed anew,
    // so it does not mark it: one more death than the attempts.
    for life in 1..=ATTEMPTS + 1 {
        let consumer = KafkaConsumer::new(inbox.clone(), options.clone()).unwrap();
        tokio::select! {
            report = consumer.run(handler, std::future::pending()) => panic!("the consumer stopped: {report:?}"),
            () = wait("the handler to take the killer record", || async { killer.runs() == life }) => {}
        }
    }
    let consumer = KafkaConsumer::new(inbox.clone(), options).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = consumer.run(handler, async {
        let _ = stopped.await;
    });
    let scenario = killer.until_dead(&env.db, || consumer.report().dead, N, ATTEMPTS + 1, stop);
    let (report, ()) = tokio::join!(run, scenario);
    let report = report.unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
    env.db.assert_effects_once(N as usize - 1).await;
    env.assert_effects_in_key_order().await;
    let dead = env.dead_letters(1).await;
    support::assert_dead_unfinished(&inbox, ids[KILLER as usize], ATTEMPTS, &dead[0].0[DEAD_REASON_HEADER]).await;
}

/// A group's committed offset can fall out of its partition's log: the
/// records from it on removed while the consumer was stopped (retention,
/// `kafka-delete-records`; here the mock broker, which keeps 5 MiB a
/// partition). librdkafka then reset the position to the log start and said
/// so only in a warning the runner dropped: the records in between were
/// skipped with no error and nothing counted. The reset is now reported,
/// its skipped records counted in `ferry_inbox_lost_total`.
#[tokio::test]
async fn records_an_offset_reset_skips_are_reported_and_counted() {
    const FIRST: i64 = 3;
    const LARGE: i64 = 7;
    let env = Env::new("inbox-kafka-reset").await;
    let name = unique_name("billing");
    let lost = || counts().get(ferry_inbox::metrics::LOST, &name);
    let mut options = env.options();
    // The mock broker lets the second member join only once the first
    // one's session expired.
    options.extra.insert("session.timeout.ms".into(), "6000".into());
    let consumer =
        || KafkaConsumer::new(Inbox::new(env.db.pool.clone(), name.as_str()).unwrap(), options.clone()).unwrap();
    let relay = env.relay(&["orders"]);
    // One key: one partition.
    let event = |n: i64, pad: &str| Event::new("order.item.created", json!({ "n": n, "pad": pad })).key("k");
    env.db.produce((0..FIRST).map(|n| event(n, "")).collect()).await;
    env.db.all_published(FIRST).await;

    let first = consumer();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = first.run(effect, async {
        let _ = stopped.await;
    });
    let scenario = async {
        wait("the first records processed", || async {
            first.report().processed == FIRST as u64
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(run, scenario);
    report.unwrap();
    env.wait_committed(FIRST).await;
    assert_eq!(lost(), 0, "a new group starting at the log start loses nothing");

    // While the consumer is stopped, enough arrives for the broker to drop
    // the oldest records, the committed offset's among them.
    let pad = "x".repeat(999_000);
    env.db
        .produce((FIRST..FIRST + LARGE).map(|n| event(n, &pad)).collect())
        .await;
    env.db.all_published(FIRST + LARGE).await;
    relay.stop().await;
    let (partition, low, high) = env.only_partition().await;
    assert_eq!(high, FIRST + LARGE);
    assert!(
        low > FIRST,
        "the log of partition {partition} starts at {low}, past the committed {FIRST}"
    );

    let second = consumer();
    let (stop, stopped) = oneshot::channel::<()>();
    let run = second.run(effect, async {
        let _ = stopped.await;
    });
    let scenario = async {
        wait("the reset counted and what is left processed", || async {
            lost() == (low - FIRST) as u64 && second.report().processed == (high - low) as u64
        })
        .await;
        let _ = stop.send(());
    };
    let (report, ()) = tokio::join!(run, scenario);
    assert_eq!(report.unwrap().processed, (high - low) as u64);
    assert_eq!(lost(), (low - FIRST) as u64, "reported once");
}
