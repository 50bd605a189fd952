//! What the scenarios have created on the brokers and not yet deleted.
//!
//! A scenario deletes its topology and destinations itself when it ends,
//! whatever its outcome; but Ctrl-C drops the scenario's future at its
//! current await, and the deletes after it never run. So each resource is
//! noted here before it is created and forgotten once deleted, and
//! [`Leftovers::delete_all`], run after the scenarios whatever ended them,
//! deletes what is still noted over connections of its own.
//!
//! The in-process relays and readers of an interrupted scenario are noted
//! too, and waited for first: a relay stops by itself once its handle is
//! dropped, and librdkafka can crash when a topic it still has in its
//! metadata cache is deleted under it.

use std::sync::Mutex;
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::Instant;

#[cfg(feature = "bench-sinks")]
use super::dest::{self, Kind};
use super::topology;

/// How long deleting one leftover may take: a broker that went away must
/// not hold the bench's exit.
const DELETE_WITHIN: Duration = Duration::from_secs(10);
/// How long a relay may take to stop by itself (the relay's own stop
/// timeout), before it is aborted; and how long an aborted task then has.
const STOP_WITHIN: Duration = Duration::from_secs(30);
const ABORTED_WITHIN: Duration = Duration::from_secs(5);

/// A resource a scenario created, named as it was created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Leftover {
    /// A scenario's exchange and its queue.
    Rabbit {
        amqp_url: String,
        exchange: String,
        queue: String,
    },
    /// A Kafka topic, NATS stream or Redis stream of the sinks scenario, at
    /// the endpoint `at`.
    #[cfg(feature = "bench-sinks")]
    Dest { kind: Kind, at: String, name: String },
}

impl Leftover {
    fn name(&self) -> &str {
        match self {
            Leftover::Rabbit { exchange, .. } => exchange,
            #[cfg(feature = "bench-sinks")]
            Leftover::Dest { name, .. } => name,
        }
    }

    async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Leftover::Rabbit {
                amqp_url,
                exchange,
                queue,
            } => topology::delete_named(amqp_url, exchange, queue).await,
            #[cfg(feature = "bench-sinks")]
            Leftover::Dest { kind, at, name } => dest::delete_named(*kind, at, name).await,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Leftovers {
    items: Mutex<Vec<Leftover>>,
    /// Tasks that publish to or read from the noted resources.
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Leftovers {
    /// Notes `item`, before it is created: an interrupted create may have
    /// made part of it.
    pub(crate) fn add(&self, item: Leftover) {
        self.items.lock().expect("not poisoned").push(item);
    }

    /// Forgets the resource named `name`, once deleted.
    pub(crate) fn remove(&self, name: &str) {
        self.items
            .lock()
            .expect("not poisoned")
            .retain(|item| item.name() != name);
    }

    /// Notes a task that uses the resources: [`Leftovers::delete_all`]
    /// waits for it to end.
    pub(crate) fn track(&self, task: AbortHandle) {
        let mut tasks = self.tasks.lock().expect("not poisoned");
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }

    /// Waits for the noted tasks to end, then deletes every resource still
    /// noted, telling on stderr what it deleted and what it could not.
    pub(crate) async fn delete_all(&self) {
        let items = std::mem::take(&mut *self.items.lock().expect("not poisoned"));
        let tasks = std::mem::take(&mut *self.tasks.lock().expect("not poisoned"));
        if items.is_empty() {
            return;
        }
        wait_for(&tasks).await;
        for item in items {
            let name = item.name().to_owned();
            match tokio::time::timeout(DELETE_WITHIN, item.delete()).await {
                Ok(Ok(())) => eprintln!("deleted {name}, left by an unfinished scenario"),
                Ok(Err(e)) => eprintln!("warning: could not delete {name}: {e:#}"),
                Err(_) => eprintln!(
                    "warning: could not delete {name}: no answer within {}s",
                    DELETE_WITHIN.as_secs()
                ),
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn noted(&self) -> Vec<Leftover> {
        self.items.lock().expect("not poisoned").clone()
    }
}

/// Waits until every task has ended, aborting those still running after
/// [`STOP_WITHIN`].
async fn wait_for(tasks: &[AbortHandle]) {
    let deadline = Instant::now() + STOP_WITHIN;
    let mut aborted = false;
    while tasks.iter().any(|t| !t.is_finished()) {
        let now = Instant::now();
        if !aborted && now >= deadline {
            eprintln!(
                "warning: a relay of the unfinished scenario did not stop within {}s; aborting it",
                STOP_WITHIN.as_secs()
            );
            tasks.iter().for_each(AbortHandle::abort);
            aborted = true;
        }
        if aborted && now >= deadline + ABORTED_WITHIN {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use lapin::ExchangeKind;
    use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;

    use super::*;
    use crate::bench::topology::Topology;

    /// Runs `create` as a scenario that Ctrl-C interrupts once it has
    /// created what it creates: the future is dropped at its await.
    async fn interrupted<T>(create: impl Future<Output = T>) {
        let (created, made) = tokio::sync::oneshot::channel();
        let scenario = async {
            let _held = create.await;
            let _ = created.send(());
            std::future::pending::<()>().await;
        };
        tokio::select! {
            () = scenario => unreachable!("the scenario never ends"),
            _ = made => {}
        }
    }

    async fn rabbit_has(amqp_url: &str, exchange: &str, queue: &str) -> (bool, bool) {
        let connection = topology::connect(amqp_url, "ferry-bench-test").await.unwrap();
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        // A failed passive declare closes its channel: one channel each.
        let has_queue = connection
            .create_channel()
            .await
            .unwrap()
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .is_ok();
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let has_exchange = connection
            .create_channel()
            .await
            .unwrap()
            .exchange_declare(exchange.into(), ExchangeKind::Topic, passive, FieldTable::default())
            .await
            .is_ok();
        let _ = connection.close(200, "OK".into()).await;
        (has_exchange, has_queue)
    }

    #[tokio::test]
    async fn a_topology_an_interrupted_scenario_left_is_deleted_afterwards() {
        let amqp_url = ferry_testkit::rabbit::amqp_url();
        let left = Leftovers::default();
        interrupted(async { Topology::create(&amqp_url, "leftover-test", &left).await.unwrap() }).await;
        let noted = left.noted();
        let [Leftover::Rabbit { exchange, queue, .. }] = noted.as_slice() else {
            panic!("noted: {noted:?}");
        };
        assert_eq!(rabbit_has(&amqp_url, exchange, queue).await, (true, true));
        left.delete_all().await;
        assert_eq!(rabbit_has(&amqp_url, exchange, queue).await, (false, false));
        assert!(left.noted().is_empty());
    }

    #[tokio::test]
    async fn the_tasks_of_an_interrupted_scenario_end_before_its_leftovers_are_deleted() {
        let left = Leftovers::default();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(async move {
            let _ = released.await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
        left.track(relay.abort_handle());
        // As the relay's handle is dropped with the scenario, it stops.
        drop(release);
        left.add(Leftover::Rabbit {
            amqp_url: ferry_testkit::rabbit::amqp_url(),
            exchange: "ferry-bench-never-declared".into(),
            queue: "ferry-bench-never-declared.q".into(),
        });
        left.delete_all().await;
        assert!(relay.is_finished());
        assert!(left.noted().is_empty());
    }

    #[tokio::test]
    async fn a_deleted_topology_is_forgotten() {
        let amqp_url = ferry_testkit::rabbit::amqp_url();
        let left = Leftovers::default();
        let topology = Topology::create(&amqp_url, "leftover-test", &left).await.unwrap();
        assert_eq!(left.noted().len(), 1);
        topology.delete(&left).await.unwrap();
        assert!(left.noted().is_empty());
    }

    #[cfg(feature = "bench-sinks")]
    #[tokio::test]
    async fn destinations_an_interrupted_scenario_left_are_deleted_afterwards() {
        use rdkafka::ClientConfig;
        use rdkafka::producer::{BaseProducer, Producer};

        use crate::bench::dest::{Dest, Endpoints, js_api};

        let at = Endpoints {
            kafka: ferry_testkit::kafka::broker(),
            nats: std::env::var("FERRY_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
            redis: std::env::var("FERRY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
        };
        let left = Leftovers::default();
        interrupted(async {
            let mut dests = Vec::new();
            for kind in [Kind::Kafka, Kind::Nats, Kind::Redis] {
                dests.push(Dest::create(kind, "leftover-test", &at, &left).await.unwrap());
            }
            dests
        })
        .await;
        let noted = left.noted();
        let name = |kind: Kind| {
            noted
                .iter()
                .find_map(|item| match item {
                    Leftover::Dest { kind: k, name, .. } if *k == kind => Some(name.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("no {kind:?} noted: {noted:?}"))
        };
        let (topic, stream, key) = (name(Kind::Kafka), name(Kind::Nats), name(Kind::Redis));

        let kafka: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", &at.kafka)
            .create()
            .unwrap();
        let kafka = std::sync::Arc::new(kafka);
        let has_topic = |topic: String| {
            let kafka = std::sync::Arc::clone(&kafka);
            async move {
                tokio::task::spawn_blocking(move || {
                    let metadata = kafka.client().fetch_metadata(None, Duration::from_secs(10)).unwrap();
                    metadata.topics().iter().any(|t| t.name() == topic)
                })
                .await
                .unwrap()
            }
        };
        let nats = async_nats::connect(&at.nats).await.unwrap();
        let has_stream = async |stream: &str| {
            let info = js_api(&nats, &format!("$JS.API.STREAM.INFO.{stream}"), None)
                .await
                .unwrap();
            info.get("error").is_none()
        };
        let mut redis = redis::Client::open(at.redis.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let has_key = async |redis: &mut redis::aio::MultiplexedConnection, key: &str| {
            let n: u64 = redis::cmd("EXISTS").arg(key).query_async(redis).await.unwrap();
            n == 1
        };

        assert!(has_topic(topic.clone()).await, "{topic}");
        assert!(has_stream(&stream).await, "{stream}");
        assert!(has_key(&mut redis, &key).await, "{key}");
        left.delete_all().await;
        assert!(!has_topic(topic.clone()).await, "{topic}");
        assert!(!has_stream(&stream).await, "{stream}");
        assert!(!has_key(&mut redis, &key).await, "{key}");
        assert!(left.noted().is_empty());
    }
}
