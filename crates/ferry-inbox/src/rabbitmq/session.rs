//! One connection's life: connect, declare, consume, and for each delivery
//! decode, run the inbox, then acknowledge, requeue later, or dead-letter.

use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Acker, BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use sqlx::PgConnection;
use tokio::task::JoinSet;
use tokio::time::timeout;
use tracing::{debug, error, warn};

use super::{
    DEAD_CONSUMER_HEADER, DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, DEAD_USER_ID_HEADER, RabbitMqConsumerOptions, decode,
};
use crate::runner::{Counters, bounded_reason};
use crate::{HandlerError, Inbox, InboxError, Outcome, ReceivedEvent, metrics};

pub(super) enum Ended {
    Shutdown,
    /// The connection or the consumer went away; `started` once consuming
    /// had begun, so the reconnect delay starts over.
    Lost {
        started: bool,
    },
    /// The dead-letter exchange does not exist and the consumer may not
    /// declare it: going on would bring a message given up on back first on
    /// every reconnect.
    Refused(String),
    /// The inbox cannot use its table: going on would put every message
    /// back, counted by a quorum queue's delivery limit, until it drops it.
    Inbox(InboxError),
}

/// Why handling a delivery ended the session.
enum Stop {
    /// The channel or the connection failed.
    Channel(String),
    /// The broker closed the dead-letter channel: the exchange does not exist.
    DeadLetterExchangeGone(String),
    /// The inbox cannot use its table.
    Inbox(InboxError),
}

impl From<String> for Stop {
    fn from(error: String) -> Self {
        Stop::Channel(error)
    }
}

/// AMQP's reply code for a missing exchange.
const NOT_FOUND: u16 = 404;

pub(super) struct Session<'a, H> {
    inbox: &'a Inbox,
    options: &'a RabbitMqConsumerOptions,
    handler: &'a H,
    counters: &'a Counters,
    /// Requeues waiting out their backoff; aborted with the session, whose
    /// closing connection requeues those messages anyway.
    later: JoinSet<()>,
}

impl<'a, H> Session<'a, H>
where
    H: AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
{
    pub(super) fn new(
        inbox: &'a Inbox,
        options: &'a RabbitMqConsumerOptions,
        handler: &'a H,
        counters: &'a Counters,
    ) -> Self {
        Self {
            inbox,
            options,
            handler,
            counters,
            later: JoinSet::new(),
        }
    }

    pub(super) async fn run(&mut self, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> Result<Ended, String> {
        let limit = self.options.timeout;
        let properties = ConnectionProperties::default().with_connection_name("ferry-inbox".into());
        let connection = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(Ended::Shutdown),
            c = timeout(limit, Connection::connect(&self.options.url, properties)) => c
                .map_err(|_| format!("connecting took longer than {limit:?}"))?
                .map_err(|e| format!("connecting: {e}"))?,
        };
        let result = self.consume(&connection, shutdown).await;
        self.later.abort_all();
        // Closing hands every unacknowledged delivery back to the queue.
        let _ = timeout(limit, connection.close(200, "bye".into())).await;
        result
    }

    async fn consume(
        &mut self,
        connection: &Connection,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Ended, String> {
        let limit = self.options.timeout;
        if !self.options.declare {
            let exists = timeout(
                limit,
                dead_letter_exchange_exists(connection, &self.options.dead_letter_exchange),
            )
            .await
            .map_err(|_| format!("checking the dead-letter exchange took longer than {limit:?}"))??;
            if !exists {
                return Ok(Ended::Refused(missing(&self.options.dead_letter_exchange)));
            }
        }
        let (channel, mut dead_letters) = timeout(limit, self.open(connection))
            .await
            .map_err(|_| format!("opening channels took longer than {limit:?}"))?
            .map_err(|e| format!("opening channels and declaring: {e}"))?;
        let tag = format!("ferry-inbox-{}", self.inbox.consumer());
        // Bounded, and given up at shutdown: on a connection that died
        // without lapin noticing, the broker's answer never comes.
        let consume = channel.basic_consume(
            self.options.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let mut consumer = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(Ended::Shutdown),
            c = timeout(limit, consume) => c
                .map_err(|_| format!("consuming queue {:?} took longer than {limit:?}", self.options.queue))?
                .map_err(|e| format!("consuming queue {:?}: {e}", self.options.queue))?,
        };
        debug!(queue = %self.options.queue, "consuming");
        // lapin does not always notice a connection that died under an idle
        // consumer; its status does, so look at it now and then.
        let mut liveness = tokio::time::interval(Duration::from_secs(1));
        loop {
            let delivery = tokio::select! {
                biased;
                () = shutdown.as_mut() => {
                    // Within the timeout: a dead connection never answers.
                    let cancel = channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default());
                    let _ = timeout(limit, cancel).await;
                    return Ok(Ended::Shutdown);
                }
                next = consumer.next() => next,
                _ = liveness.tick() => {
                    if connection.status().connected() && channel.status().connected() {
                        continue;
                    }
                    return Ok(Ended::Lost { started: true });
                }
            };
            match delivery {
                Some(Ok(delivery)) => match self.handle(delivery, connection, &mut dead_letters).await {
                    Ok(()) => {}
                    Err(Stop::Channel(e)) => {
                        warn!(error = %e, "the channel failed while handling a delivery");
                        return Ok(Ended::Lost { started: true });
                    }
                    Err(Stop::DeadLetterExchangeGone(e)) if self.options.declare => {
                        error!(error = %e, "the dead-letter exchange is gone; the consumer declares it again");
                        return Ok(Ended::Lost { started: true });
                    }
                    Err(Stop::DeadLetterExchangeGone(e)) => {
                        return Ok(Ended::Refused(format!(
                            "{e}; {}",
                            missing(&self.options.dead_letter_exchange)
                        )));
                    }
                    Err(Stop::Inbox(e)) => return Ok(Ended::Inbox(e)),
                },
                Some(Err(e)) => {
                    warn!(error = %e, "RabbitMQ consumer failed");
                    return Ok(Ended::Lost { started: true });
                }
                None => return Ok(Ended::Lost { started: true }),
            }
        }
    }

    /// The consuming channel (with its prefetch) and a confirm-mode channel
    /// for dead letters, after the declarations.
    async fn open(&self, connection: &Connection) -> Result<(Channel, Channel), lapin::Error> {
        let o = self.options;
        let channel = connection.create_channel().await?;
        channel.basic_qos(o.prefetch, BasicQosOptions::default()).await?;
        if o.declare {
            let durable = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .queue_declare(o.queue.as_str().into(), durable, FieldTable::default())
                .await?;
            for (exchange, key) in &o.bindings {
                channel
                    .queue_bind(
                        o.queue.as_str().into(),
                        exchange.as_str().into(),
                        key.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
            }
            let exchange = ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            };
            let dlx = o.dead_letter_exchange.as_str();
            channel
                .exchange_declare(dlx.into(), ExchangeKind::Topic, exchange, FieldTable::default())
                .await?;
            let dead_queue = format!("{}.dead", o.queue);
            channel
                .queue_declare(dead_queue.as_str().into(), durable, FieldTable::default())
                .await?;
            channel
                .queue_bind(
                    dead_queue.as_str().into(),
                    dlx.into(),
                    "#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok((channel, dead_letter_channel(connection).await?))
    }

    /// One delivery. An error means the channel is gone: the session ends and
    /// the broker redelivers whatever was not acknowledged.
    async fn handle(
        &mut self,
        delivery: Delivery,
        connection: &Connection,
        dead_letters: &mut Channel,
    ) -> Result<(), Stop> {
        let consumer = self.inbox.consumer();
        let event = match decode(&delivery.properties, &delivery.data) {
            Ok(event) => event,
            Err(e) => {
                Counters::bump(&self.counters.malformed);
                metrics::malformed(consumer);
                warn!(consumer, routing_key = %delivery.routing_key, error = %e, "malformed message");
                return self
                    .dead_letter(delivery, connection, dead_letters, &e.to_string())
                    .await;
            }
        };
        let handler = self.handler;
        let run = async |tx: &mut PgConnection, ev: &ReceivedEvent| handler(tx, ev).await;
        // A redelivery may be of a message whose attempt the process died
        // in: the inbox marks the attempt's start first, to count it.
        let outcome = if delivery.redelivered {
            self.inbox.process_redelivered(&event, run).await
        } else {
            self.inbox.process(&event, run).await
        };
        match outcome {
            Ok(Outcome::Processed) => {
                Counters::bump(&self.counters.processed);
                self.ack(&delivery).await?;
            }
            Ok(Outcome::Duplicate) => {
                Counters::bump(&self.counters.duplicates);
                self.ack(&delivery).await?;
            }
            Ok(Outcome::Retry { delay, .. }) => {
                Counters::bump(&self.counters.retried);
                self.requeue_after(delivery.acker, delay);
            }
            Ok(Outcome::InProgress { delay }) => {
                // Another attempt holds the event: back to the queue later,
                // for any consumer.
                Counters::bump(&self.counters.in_progress);
                self.requeue_after(delivery.acker, delay);
            }
            Ok(Outcome::Dead { reason, .. }) => {
                Counters::bump(&self.counters.dead);
                return self.dead_letter(delivery, connection, dead_letters, &reason).await;
            }
            // Left unacknowledged: closing the connection puts it back.
            Err(e @ InboxError::Schema(_)) => return Err(Stop::Inbox(e)),
            Err(e) => {
                Counters::bump(&self.counters.inbox_unavailable);
                warn!(consumer, event = %event.id, error = %e, "inbox unavailable; the message goes back to the queue");
                self.requeue_after(delivery.acker, self.options.database_retry_delay);
            }
        }
        Ok(())
    }

    /// Acknowledges within the timeout: on a connection that died without
    /// lapin noticing, an ack can wait forever, and the session must end so
    /// the broker's redelivery (after the reconnect) can happen.
    async fn ack(&self, delivery: &Delivery) -> Result<(), String> {
        let limit = self.options.timeout;
        match timeout(limit, delivery.ack(BasicAckOptions::default())).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("acknowledging: {e}")),
            Err(_) => Err(format!("acknowledging took longer than {limit:?}")),
        }
    }

    /// Holds the message through its backoff, then hands it back; other
    /// deliveries flow meanwhile, within the prefetch window.
    fn requeue_after(&mut self, acker: Acker, delay: Duration) {
        // A finished task stays in the set until joined: reap them here, or
        // a long outage's requeues would pile up for the connection's life.
        while self.later.try_join_next().is_some() {}
        self.later.spawn(async move {
            tokio::time::sleep(delay).await;
            let requeue = BasicNackOptions {
                requeue: true,
                ..Default::default()
            };
            if let Err(e) = acker.nack(requeue).await {
                debug!(error = %e, "requeue failed; the closing connection requeues it");
            }
        });
    }

    /// Publishes the message to the dead-letter exchange with its reason and
    /// acknowledges it once the broker confirmed. Unconfirmed or unroutable,
    /// it goes back to the queue after a pause instead: never dropped.
    async fn dead_letter(
        &mut self,
        delivery: Delivery,
        connection: &Connection,
        channel: &mut Channel,
        reason: &str,
    ) -> Result<(), Stop> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        let long = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
        // Bounded: the headers travel in one frame, and a frame over the
        // connection's frame_max closes the connection, the message comes
        // back first in the queue, and is refused again, for ever.
        headers.insert(DEAD_REASON_HEADER.into(), long(bounded_reason(reason)));
        headers.insert(DEAD_CONSUMER_HEADER.into(), long(self.inbox.consumer()));
        headers.insert(DEAD_QUEUE_HEADER.into(), long(&self.options.queue));
        if let Some(user) = delivery.properties.user_id() {
            headers.insert(DEAD_USER_ID_HEADER.into(), long(user.as_str()));
        }
        let properties = dead_letter_properties(&delivery.properties, headers);
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let exchange = self.options.dead_letter_exchange.as_str();
        let confirmed = timeout(self.options.timeout, async {
            channel
                .basic_publish(
                    exchange.into(),
                    delivery.routing_key.clone(),
                    options,
                    &delivery.data,
                    properties,
                )
                .await?
                .await
        })
        .await;
        let failure = match confirmed {
            Ok(Ok(Confirmation::Ack(None))) => {
                self.ack(&delivery).await?;
                return Ok(());
            }
            Ok(Ok(Confirmation::Ack(Some(_)))) => format!(
                "dead-letter exchange {exchange:?} has no queue bound for routing key {:?}",
                delivery.routing_key.as_str()
            ),
            Ok(Ok(other)) => format!("dead-letter exchange {exchange:?} did not confirm: {other:?}"),
            Ok(Err(e)) if reply_code(&e) == Some(NOT_FOUND) => {
                return Err(Stop::DeadLetterExchangeGone(format!(
                    "dead-lettering a message of queue {:?} failed, the broker says {e}; it goes back to the queue",
                    self.options.queue
                )));
            }
            Ok(Err(e)) => return Err(Stop::Channel(format!("dead-lettering: {e}"))),
            // The confirm may still come, and lapin hands a basic.return to
            // whichever confirm it processes next: a later dead letter the
            // broker returns could then read as confirmed, and its message
            // be acknowledged and lost. The next dead letter goes on a
            // channel of its own; the message goes back to the queue.
            Err(_) => {
                let fresh = timeout(self.options.timeout, dead_letter_channel(connection))
                    .await
                    .map_err(|_| Stop::Channel("opening a dead-letter channel took too long".into()))?
                    .map_err(|e| Stop::Channel(format!("opening a dead-letter channel: {e}")))?;
                let late = std::mem::replace(channel, fresh);
                // Closed in the background: the broker may be slow to answer.
                tokio::spawn(async move {
                    let _ = late.close(200, "unconfirmed".into()).await;
                });
                format!(
                    "dead-letter exchange {exchange:?} did not confirm within {:?}",
                    self.options.timeout
                )
            }
        };
        warn!(consumer = self.inbox.consumer(), error = %failure, "dead-lettering failed; the message goes back to the queue");
        self.requeue_after(delivery.acker, self.options.database_retry_delay);
        Ok(())
    }
}

/// A channel for dead letters, with publisher confirms.
async fn dead_letter_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(channel)
}

/// Whether `exchange` exists: a passive declare, on a channel of its own
/// since the broker closes the channel of a failed one.
async fn dead_letter_exchange_exists(connection: &Connection, exchange: &str) -> Result<bool, String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("opening a channel: {e}"))?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    };
    // The kind is ignored by a passive declare.
    let declared = channel
        .exchange_declare(exchange.into(), ExchangeKind::Topic, passive, FieldTable::default())
        .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(true)
        }
        Err(e) if reply_code(&e) == Some(NOT_FOUND) => Ok(false),
        Err(e) => Err(format!("checking dead_letter_exchange {exchange:?}: {e}")),
    }
}

/// The refusal for a dead-letter exchange that does not exist.
fn missing(exchange: &str) -> String {
    format!(
        "dead_letter_exchange {exchange:?} does not exist and the consumer declares nothing (no_declare): a message \
         given up on could not be set aside and would come back first after every reconnect; declare the exchange \
         (with a queue bound to it), or let the consumer declare it"
    )
}

fn reply_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// The dead copy's properties: the original's, with `headers`, but kept
/// (persistent, `delivery_mode` 2) and without the original's `expiration`,
/// as RabbitMQ's own dead-lettering does: a message that had a TTL or was
/// sent transient would otherwise vanish from the dead-letter queue when
/// the TTL ran out or the broker restarted, after the original was acked.
/// Without its `user_id` too (the caller puts it in
/// [`DEAD_USER_ID_HEADER`]): RabbitMQ refuses a publish whose `user_id` is
/// not the connection's user, closing the channel, and the message, back
/// first in the queue, would be refused again for ever.
fn dead_letter_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let o = original;
    let mut p = BasicProperties::default().with_headers(headers).with_delivery_mode(2);
    if let Some(v) = o.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = o.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = o.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = o.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = o.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = o.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = o.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = o.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = o.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = o.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}
