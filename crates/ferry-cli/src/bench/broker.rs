//! The broker's own ceiling: confirmed, persistent, mandatory publishes over
//! one connection, in windows of `batch-size` (publish the window, await all
//! its confirms), which is how the relay publishes a claimed batch. The drain
//! figure is read against this one, measured in the same run.

use std::time::Duration;

use anyhow::{Context, bail};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation};
use tokio::time::Instant;

use super::progress;
use super::topology::{self, Topology};
use super::workload;

const PERSISTENT: u8 = 2;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BrokerResult {
    pub events: u64,
    pub window: usize,
    pub elapsed: Duration,
}

impl BrokerResult {
    pub(crate) fn rate(&self) -> f64 {
        per_second(self.events, self.elapsed)
    }
}

pub(crate) fn per_second(n: u64, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64().max(f64::EPSILON)
}

pub(crate) async fn run(amqp_url: &str, events: u64, window: usize, keys: u64) -> anyhow::Result<BrokerResult> {
    topology::with_topology(amqp_url, "broker", async |t| {
        publish_all(amqp_url, t, events, window.max(1), keys).await
    })
    .await
}

async fn publish_all(
    amqp_url: &str,
    topology: &Topology,
    events: u64,
    window: usize,
    keys: u64,
) -> anyhow::Result<BrokerResult> {
    let connection = topology::connect(amqp_url, "ferry-bench-broker").await?;
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let bar = progress::bar(events, "broker");
    let started = Instant::now();
    let mut sent = 0u64;
    let mut confirms = Vec::with_capacity(window);
    while sent < events {
        let n = (events - sent).min(window as u64);
        for seq in sent..sent + n {
            let body = workload::payload_bytes(seq, &workload::key(seq, keys));
            let properties = BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(PERSISTENT);
            let confirm = channel
                .basic_publish(
                    topology.exchange().into(),
                    workload::EVENT_TYPE.into(),
                    options,
                    &body,
                    properties,
                )
                .await
                .context("basic.publish")?;
            confirms.push(confirm);
        }
        for confirm in confirms.drain(..) {
            match confirm.await.context("awaiting a publisher confirm")? {
                Confirmation::Ack(None) => {}
                Confirmation::Ack(Some(_)) => bail!("RabbitMQ returned a message as unroutable"),
                Confirmation::Nack(_) => bail!("RabbitMQ nacked a message"),
                Confirmation::NotRequested => bail!("the channel is not in confirm mode"),
            }
        }
        sent += n;
        bar.set_position(sent);
    }
    let elapsed = started.elapsed();
    let result = BrokerResult {
        events,
        window,
        elapsed,
    };
    progress::done(
        &bar,
        format!(
            "broker: {events} confirmed publishes in {:.1} s: {:.0}/s",
            elapsed.as_secs_f64(),
            result.rate()
        ),
    );
    let depth = topology.depth().await?;
    anyhow::ensure!(
        depth == events,
        "the broker queue holds {depth} messages, expected {events}"
    );
    let _ = connection.close(200, "OK".into()).await;
    Ok(result)
}
