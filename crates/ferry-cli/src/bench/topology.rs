//! A scenario's RabbitMQ topology: a durable topic exchange and a durable
//! queue bound to it by `#`, both uniquely named and deleted afterwards.
//!
//! Both are noted in the bench's [`Leftovers`] before they are declared, so
//! that they are deleted after Ctrl-C too. Should the bench be killed before
//! it deletes them, the queue expires after an hour unused and the exchange
//! (auto-delete) goes with its last binding.

use anyhow::Context;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};

use super::Ctx;
use super::leftovers::{Leftover, Leftovers};

const EXPIRES_MS: u32 = 60 * 60 * 1000;

pub(crate) struct Topology {
    connection: Connection,
    channel: Channel,
    exchange: String,
    queue: String,
}

impl Topology {
    /// Declares the exchange and the queue, noting them in `left` first.
    pub(crate) async fn create(amqp_url: &str, scenario: &str, left: &Leftovers) -> anyhow::Result<Self> {
        let exchange = format!("ferry-bench-{scenario}-{:08x}", rand::random::<u32>());
        let queue = format!("{exchange}.q");
        let connection = connect(amqp_url, "ferry-bench-admin").await?;
        let channel = connection.create_channel().await?;
        left.add(Leftover::Rabbit {
            amqp_url: amqp_url.to_owned(),
            exchange: exchange.clone(),
            queue: queue.clone(),
        });
        let durable = ExchangeDeclareOptions {
            durable: true,
            auto_delete: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("declaring exchange {exchange}"))?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongUInt(EXPIRES_MS));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), durable, arguments)
            .await
            .with_context(|| format!("declaring queue {queue}"))?;
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("binding queue {queue}"))?;
        Ok(Self {
            connection,
            channel,
            exchange,
            queue,
        })
    }

    pub(crate) fn exchange(&self) -> &str {
        &self.exchange
    }

    /// Messages ready in the queue, asked with a passive declare.
    pub(crate) async fn depth(&self) -> anyhow::Result<u64> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = self
            .channel
            .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await
            .with_context(|| format!("asking the depth of queue {}", self.queue))?;
        Ok(u64::from(queue.message_count()))
    }

    /// A consumer on the queue, on a channel of its own, with automatic acks.
    pub(crate) async fn consume(&self) -> anyhow::Result<Consumer> {
        let channel = self.connection.create_channel().await?;
        let no_ack = BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        };
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "ferry-bench".into(),
                no_ack,
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consuming queue {}", self.queue))?;
        Ok(consumer)
    }

    /// Deletes the exchange and the queue, forgets them in `left` and closes
    /// the connection.
    pub(crate) async fn delete(self, left: &Leftovers) -> anyhow::Result<()> {
        delete_on(&self.channel, &self.exchange, &self.queue).await?;
        left.remove(&self.exchange);
        let _ = self.connection.close(200, "OK".into()).await;
        Ok(())
    }
}

async fn delete_on(channel: &Channel, exchange: &str, queue: &str) -> anyhow::Result<()> {
    // The exchange first: it is auto-delete, so deleting the queue first
    // would take it along and make this delete fail.
    channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .with_context(|| format!("deleting exchange {exchange}"))?;
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .with_context(|| format!("deleting queue {queue}"))?;
    Ok(())
}

/// Deletes a topology a scenario left behind, over a connection of its own
/// (RabbitMQ deletes a missing exchange or queue without complaint).
pub(crate) async fn delete_named(amqp_url: &str, exchange: &str, queue: &str) -> anyhow::Result<()> {
    let connection = connect(amqp_url, "ferry-bench-cleanup").await?;
    let channel = connection.create_channel().await?;
    let deleted = delete_on(&channel, exchange, queue).await;
    let _ = connection.close(200, "OK".into()).await;
    deleted
}

/// Runs `body` with a fresh topology and deletes the topology afterwards,
/// whatever `body` returned.
pub(crate) async fn with_topology<T, F>(ctx: &Ctx<'_>, scenario: &str, body: F) -> anyhow::Result<T>
where
    F: AsyncFnOnce(&Topology) -> anyhow::Result<T>,
{
    let topology = Topology::create(&ctx.args.amqp_url, scenario, ctx.left).await?;
    let result = body(&topology).await;
    let deleted = topology.delete(ctx.left).await;
    let value = result?;
    deleted?;
    Ok(value)
}

pub(crate) async fn connect(amqp_url: &str, name: &str) -> anyhow::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(amqp_url, properties)
        .await
        .with_context(|| format!("cannot connect to RabbitMQ at {}", ferry_core::redact::url(amqp_url)))
}
