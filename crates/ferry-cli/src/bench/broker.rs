//! The broker's own ceiling: confirmed, persistent, mandatory publishes over
//! one connection and one channel, in windows of `batch-size` (publish the
//! window, await all its confirms), which is how the relay publishes a
//! claimed batch. The drain figure is read against this one, measured in the
//! same run.
//!
//! The plain baseline sends what a bare client would (message id, content
//! type, persistent). [`Format::Ferry`] sends the same bodies with the
//! properties and CloudEvents headers the RabbitMQ sink gives every event,
//! over as many channels as the sink spreads a batch over, so that what the
//! broker can do with Ferry's messages can be told apart from the relay's
//! own cost. [`Format::Stamped`] adds one 8-byte property to the
//! plain publish: RabbitMQ slows by a step once a message's encoded
//! properties pass 64 bytes, whatever they hold, and the plain ones take 57.

use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use chrono::Utc;
use ferry_core::{EventId, Headers, StoredEvent};
use ferry_sink::rabbitmq::RabbitMqOptions;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation};
use tokio::time::Instant;

use super::topology::{self, Topology};
use super::{Ctx, progress, workload};

const PERSISTENT: u8 = 2;
const CONTENT_TYPE: &str = "application/json";
/// A hyphenated UUID, the plain baseline's message id.
const MESSAGE_ID_BYTES: usize = 36;
/// How long one window may wait for its confirms, as long as the drain
/// waits without progress: RabbitMQ under a memory or disk alarm blocks
/// publishers and never confirms.
const CONFIRMS_WITHIN: Duration = Duration::from_secs(60);

/// The plain baseline's encoded properties: the flags (2), the content type
/// (1 + 16), the delivery mode (1) and the message id (1 + 36).
pub(crate) const PLAIN_PROPERTY_BYTES: usize = 2 + 1 + CONTENT_TYPE.len() + 1 + 1 + MESSAGE_ID_BYTES;
/// What a timestamp property adds.
pub(crate) const TIMESTAMP_BYTES: usize = 8;

/// What the baseline's messages carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Message id, content type, persistent: 57 bytes of encoded
    /// properties ([`PLAIN_PROPERTY_BYTES`]).
    Plain,
    /// The plain properties and a timestamp: 65 bytes.
    Stamped,
    /// What the RabbitMQ sink sends, the way it sends it: the properties of
    /// [`ferry_sink::rabbitmq::properties`], each window spread by key over
    /// the sink's default number of channels.
    Ferry,
}

impl Format {
    /// The confirm-mode channels the window is spread over.
    pub(crate) fn channels(self) -> usize {
        match self {
            Format::Plain | Format::Stamped => 1,
            Format::Ferry => RabbitMqOptions::default().channels,
        }
    }
}

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

pub(crate) async fn run(
    ctx: &Ctx<'_>,
    events: u64,
    window: usize,
    keys: u64,
    format: Format,
) -> anyhow::Result<BrokerResult> {
    let amqp_url = &ctx.args.amqp_url;
    topology::with_topology(ctx, "broker", async |t| {
        publish_all(amqp_url, t, events, window.max(1), keys, format).await
    })
    .await
}

async fn publish_all(
    amqp_url: &str,
    topology: &Topology,
    events: u64,
    window: usize,
    keys: u64,
    format: Format,
) -> anyhow::Result<BrokerResult> {
    let connection = topology::connect(amqp_url, "ferry-bench-broker").await?;
    let lanes = format.channels();
    let mut channels = Vec::with_capacity(lanes);
    for _ in 0..lanes {
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channels.push(channel);
    }
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    // The bodies are built before the clock starts, as the relay's come
    // ready-made from the database: the clock times the client alone.
    let messages = workload::Messages::build(events, keys);
    let bar = progress::bar(events, "broker");
    let started = Instant::now();
    let mut sent = 0u64;
    let plain = || {
        BasicProperties::default()
            .with_message_id(uuid::Uuid::now_v7().to_string().into())
            .with_content_type(CONTENT_TYPE.into())
            .with_delivery_mode(PERSISTENT)
    };
    while sent < events {
        let n = (events - sent).min(window as u64);
        let mut parts: Vec<Vec<(Bytes, BasicProperties)>> = vec![Vec::new(); lanes];
        for seq in sent..sent + n {
            let (body, key) = (messages.body(seq), messages.key(seq));
            let properties = match format {
                Format::Plain => plain(),
                Format::Stamped => plain().with_timestamp(Utc::now().timestamp().unsigned_abs()),
                Format::Ferry => ferry_properties(seq, key.to_owned())?,
            };
            // A key's messages share a channel, as the sink sends them.
            let lane = (seq % keys.max(1)) as usize % lanes;
            parts[lane].push((body, properties));
        }
        let windows = parts.into_iter().zip(&channels).map(|(part, channel)| async move {
            let mut confirms = Vec::with_capacity(part.len());
            for (body, properties) in part {
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
            for confirm in confirms {
                match confirm.await.context("awaiting a publisher confirm")? {
                    Confirmation::Ack(None) => {}
                    Confirmation::Ack(Some(_)) => bail!("RabbitMQ returned a message as unroutable"),
                    Confirmation::Nack(_) => bail!("RabbitMQ nacked a message"),
                    Confirmation::NotRequested => bail!("the channel is not in confirm mode"),
                }
            }
            anyhow::Ok(())
        });
        confirmed_within(CONFIRMS_WITHIN, n, futures::future::try_join_all(windows)).await?;
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

/// Waits for a window of `n` publishes and their confirms, for `within` at
/// most.
async fn confirmed_within<T>(
    within: Duration,
    n: u64,
    window: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(within, window).await.map_err(|_| {
        anyhow!(
            "RabbitMQ did not confirm a window of {n} publishes within {}s; a memory or disk alarm \
             blocks publishers until it clears (`rabbitmqctl status` lists alarms)",
            within.as_secs()
        )
    })?
}

/// The properties the RabbitMQ sink would send for this message as an event
/// of the bench's type, key and the sink's default source.
fn ferry_properties(seq: u64, key: String) -> anyhow::Result<BasicProperties> {
    let event = StoredEvent {
        id: EventId::new(),
        seq: i64::try_from(seq).unwrap_or(i64::MAX),
        event_type: workload::EVENT_TYPE.to_owned(),
        key: Some(key),
        payload: Bytes::new(),
        content_type: "application/json".to_owned(),
        headers: Headers::default(),
        created_at: Utc::now(),
    };
    ferry_sink::rabbitmq::properties(&event, &RabbitMqOptions::default().source)
        .map_err(|e| anyhow::anyhow!("building the sink's message properties: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_window_rabbitmq_never_confirms_fails_instead_of_hanging() {
        let never = std::future::pending::<anyhow::Result<()>>();
        let err = confirmed_within(Duration::from_millis(20), 500, never)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("did not confirm a window of 500 publishes"), "{err}");
        assert!(err.contains("alarm"), "{err}");
        let confirmed = confirmed_within(Duration::from_secs(60), 500, async { anyhow::Ok(7) }).await;
        assert_eq!(confirmed.unwrap(), 7);
    }
}
