//! Uniquely named RabbitMQ topology for one test, and a consumer to count
//! what arrived.
//!
//! Every name carries a random suffix so tests run in parallel against one
//! broker; queues are exclusive and auto-delete, so even a test that panics
//! before [`TestTopology::delete`] leaves nothing behind once its connection
//! closes.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout_at};

/// The broker tests use: `FERRY_TEST_AMQP_URL`, or the local default.
pub fn amqp_url() -> String {
    std::env::var("FERRY_TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// `ferry-test-<prefix>-<random hex>`: lowercase, so it is also usable as an
/// event type segment (and so as a `{domain}` in a destination template).
pub fn unique_name(prefix: &str) -> String {
    format!("ferry-test-{prefix}-{:016x}", rand::random::<u64>())
}

/// One message as a consumer saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub message_id: Option<String>,
    pub routing_key: String,
    /// Header values rendered as text (strings as themselves, others as Debug).
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
    pub content_type: Option<String>,
    pub delivery_mode: Option<u8>,
    /// The AMQP `type` property.
    pub message_type: Option<String>,
    /// The AMQP `timestamp` property, in seconds.
    pub timestamp: Option<u64>,
}

/// A topic exchange, optionally with a bound queue and a consumer on it.
pub struct TestTopology {
    connection: Connection,
    channel: Channel,
    exchange: String,
    queue: Option<String>,
    consumer: Mutex<Option<Consumer>>,
    deleted: bool,
}

impl TestTopology {
    /// An exchange with a queue bound by `#`: every routing key arrives.
    pub async fn create(prefix: &str) -> Self {
        Self::build(prefix, Some("#")).await
    }

    /// An exchange with a queue bound by `binding_key` only.
    pub async fn create_with_binding(prefix: &str, binding_key: &str) -> Self {
        Self::build(prefix, Some(binding_key)).await
    }

    /// An exchange with no queue bound: every mandatory publish is returned.
    pub async fn create_unbound(prefix: &str) -> Self {
        Self::build(prefix, None).await
    }

    async fn build(prefix: &str, binding_key: Option<&str>) -> Self {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("test broker at {url} unreachable: {e}"));
        let channel = connection.create_channel().await.expect("open a channel");
        let exchange = unique_name(prefix);
        let options = ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                options,
                FieldTable::default(),
            )
            .await
            .expect("declare the test exchange");
        let mut topology = Self {
            connection,
            channel,
            exchange,
            queue: None,
            consumer: Mutex::new(None),
            deleted: false,
        };
        if let Some(binding_key) = binding_key {
            topology.bind_queue(binding_key).await;
        }
        topology
    }

    async fn bind_queue(&mut self, binding_key: &str) {
        let queue = format!("{}.q", self.exchange);
        let options = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        let channel = &self.channel;
        channel
            .queue_declare(queue.as_str().into(), options, FieldTable::default())
            .await
            .expect("declare the test queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                self.exchange.as_str().into(),
                binding_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind the test queue");
        channel
            .basic_qos(1000, BasicQosOptions::default())
            .await
            .expect("set prefetch");
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "ferry-test".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume the test queue");
        self.queue = Some(queue);
        *self.consumer.get_mut() = Some(consumer);
    }

    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The bound queue; `None` for [`TestTopology::create_unbound`].
    pub fn queue(&self) -> Option<&str> {
        self.queue.as_deref()
    }

    /// Waits until `n` more messages arrived or `timeout` passed, acking each,
    /// and returns them in arrival order (possibly fewer than `n`).
    pub async fn receive(&self, n: usize, timeout: Duration) -> Vec<Received> {
        let deadline = Instant::now() + timeout;
        let mut consumer = self.consumer.lock().await;
        let consumer = consumer.as_mut().expect("receive() needs a topology with a queue");
        let mut received = Vec::with_capacity(n);
        while received.len() < n {
            let delivery = match timeout_at(deadline, consumer.next()).await {
                Err(_) | Ok(None) => break,
                Ok(Some(delivery)) => delivery.expect("the test consumer failed"),
            };
            delivery
                .ack(BasicAckOptions::default())
                .await
                .expect("ack a test message");
            let p = &delivery.properties;
            received.push(Received {
                message_id: p.message_id().as_ref().map(|s| s.to_string()),
                routing_key: delivery.routing_key.to_string(),
                headers: p.headers().as_ref().map(render_headers).unwrap_or_default(),
                body: delivery.data.clone(),
                content_type: p.content_type().as_ref().map(|s| s.to_string()),
                delivery_mode: *p.delivery_mode(),
                message_type: p.kind().as_ref().map(|s| s.to_string()),
                timestamp: *p.timestamp(),
            });
        }
        received
    }

    /// Deletes the queue and the exchange and closes the connection.
    pub async fn delete(mut self) {
        drop(self.consumer.get_mut().take());
        if let Some(queue) = &self.queue {
            self.channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .expect("delete the test queue");
        }
        self.channel
            .exchange_delete(self.exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .expect("delete the test exchange");
        let _ = self.connection.close(200, "OK".into()).await;
        self.deleted = true;
    }
}

impl Drop for TestTopology {
    /// Cleans up after a test that panicked or forgot [`TestTopology::delete`].
    /// A bound topology needs nothing: its exclusive queue dies with the
    /// connection, and the auto-delete exchange with its last binding. An
    /// unbound exchange never loses a binding, so it is deleted here, on a
    /// thread of its own because `drop` cannot await.
    fn drop(&mut self) {
        if self.deleted || self.queue.is_some() {
            return;
        }
        let exchange = std::mem::take(&mut self.exchange);
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async {
                let Ok(connection) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await else {
                    return;
                };
                if let Ok(channel) = connection.create_channel().await {
                    let options = ExchangeDeleteOptions::default();
                    let _ = channel.exchange_delete(exchange.as_str().into(), options).await;
                }
                let _ = connection.close(200, "OK".into()).await;
            });
        });
        let _ = cleanup.join();
    }
}

fn render_headers(table: &FieldTable) -> BTreeMap<String, String> {
    table
        .inner()
        .iter()
        .map(|(name, value)| {
            let text = match value {
                AMQPValue::LongString(s) => s.to_string(),
                AMQPValue::ShortString(s) => s.to_string(),
                other => format!("{other:?}"),
            };
            (name.to_string(), text)
        })
        .collect()
}
