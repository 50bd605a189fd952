//! A RabbitMQ consumer that drives the [`Inbox`]: manual acknowledgement
//! after the inbox commit, a prefetch window, a dead-letter exchange for
//! dead and malformed messages, and its own reconnect loop.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_inbox::Inbox;
//! use ferry_inbox::rabbitmq::{RabbitMqConsumer, RabbitMqConsumerOptions};
//! let options = RabbitMqConsumerOptions::new("amqp://127.0.0.1:5672/%2f", "billing", "billing.dead")
//!     .bind("orders", "order.#");
//! let consumer = RabbitMqConsumer::new(Inbox::new(pool, "billing")?, options)?;
//! consumer
//!     .run(
//!         async |tx, event| {
//!             sqlx::query("INSERT INTO paid (id) VALUES ($1)").bind(event.id.0).execute(tx).await?;
//!             Ok(())
//!         },
//!         async { tokio::signal::ctrl_c().await.ok(); },
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! lapin's automatic recovery replays topology and resumes channels behind
//! the caller's back, which leaves unacknowledged deliveries in an unclear
//! state; this runner instead drops a broken connection whole and connects
//! again. Everything it had not acknowledged goes back to the queue, and the
//! inbox turns the redeliveries of what had already committed into
//! duplicates.

mod decode;
mod session;

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::ShortString;
use sqlx::PgConnection;
use tracing::{error, info};

pub use decode::decode;

use crate::runner::{Counters, Reconnect, check_inbox, stopped_by_inbox};
use crate::{ConsumerError, ConsumerReport, HandlerError, Inbox, ReceivedEvent};

/// Header of a dead-lettered message: why it was given up on.
pub const DEAD_REASON_HEADER: &str = "ferry-dead-reason";
/// Header of a dead-lettered message: the consumer that gave up on it.
pub const DEAD_CONSUMER_HEADER: &str = "ferry-dead-consumer";
/// Header of a dead-lettered message: the queue it was consumed from.
pub const DEAD_QUEUE_HEADER: &str = "ferry-dead-queue";
/// Header of a dead-lettered message: the original's `user_id`, left out of
/// the dead copy since RabbitMQ refuses a publish whose `user_id` is not the
/// publishing connection's user.
pub const DEAD_USER_ID_HEADER: &str = "ferry-dead-user-id";

/// How a [`RabbitMqConsumer`] connects, what it consumes, and where dead
/// messages go.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RabbitMqConsumerOptions {
    /// `amqp://` or `amqps://` URL; the vhost is the path (`%2f` for `/`).
    pub url: String,
    /// The queue consumed.
    pub queue: String,
    /// Declare the queue (durable) and its bindings before consuming, and the
    /// dead-letter exchange (topic, durable) with a queue `<queue>.dead`
    /// bound to everything. Default true.
    pub declare: bool,
    /// `(exchange, binding key)` pairs bound to the queue when `declare`.
    pub bindings: Vec<(String, String)>,
    /// Unacknowledged deliveries the broker may hand over at once. Default 32.
    pub prefetch: u16,
    /// Where dead and malformed messages are published (with publisher
    /// confirms, and `mandatory`), carrying the reason in
    /// [`DEAD_REASON_HEADER`]; they are acknowledged only once confirmed.
    pub dead_letter_exchange: String,
    /// Bounds each connect, declare and dead-letter confirm. Default 10 s.
    pub timeout: Duration,
    /// The longest pause between reconnection attempts. Default 10 s.
    pub reconnect_max_delay: Duration,
    /// How long a message waits before it goes back to the queue when the
    /// inbox's database cannot be reached. Default 1 s.
    pub database_retry_delay: Duration,
}

impl RabbitMqConsumerOptions {
    pub fn new(url: impl Into<String>, queue: impl Into<String>, dead_letter_exchange: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue: queue.into(),
            declare: true,
            bindings: Vec::new(),
            prefetch: 32,
            dead_letter_exchange: dead_letter_exchange.into(),
            timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(10),
            database_retry_delay: Duration::from_secs(1),
        }
    }

    /// Adds a binding of the queue to `exchange` by `binding_key`.
    pub fn bind(mut self, exchange: impl Into<String>, binding_key: impl Into<String>) -> Self {
        self.bindings.push((exchange.into(), binding_key.into()));
        self
    }

    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Consume an existing queue without declaring anything.
    pub fn no_declare(mut self) -> Self {
        self.declare = false;
        self
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        let short = |field: &str, value: &str| {
            if value.is_empty() || ShortString::try_new(value).is_err() {
                Err(ConsumerError::Config(format!(
                    "{field} is {:?}; use a non-empty name of at most 255 bytes",
                    value
                )))
            } else {
                Ok(())
            }
        };
        short("queue", &self.queue)?;
        short("dead_letter_exchange", &self.dead_letter_exchange)?;
        for (exchange, key) in &self.bindings {
            short("bindings[].exchange", exchange)?;
            if ShortString::try_new(key.as_str()).is_err() {
                return Err(ConsumerError::Config(
                    "bindings[].binding_key is longer than 255 bytes; shorten it".into(),
                ));
            }
        }
        if self.prefetch == 0 {
            return Err(ConsumerError::Config(
                "prefetch is 0, which RabbitMQ reads as unlimited; set at least 1".into(),
            ));
        }
        crate::runner::check_timeouts(self.timeout, self.reconnect_max_delay)
    }
}

impl std::fmt::Debug for RabbitMqConsumerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqConsumerOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("queue", &self.queue)
            .field("declare", &self.declare)
            .field("bindings", &self.bindings)
            .field("prefetch", &self.prefetch)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("timeout", &self.timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("database_retry_delay", &self.database_retry_delay)
            .finish()
    }
}

/// Consumes one queue into one [`Inbox`].
#[derive(Debug, Clone)]
pub struct RabbitMqConsumer {
    inbox: Inbox,
    options: RabbitMqConsumerOptions,
    counters: Arc<Counters>,
}

impl RabbitMqConsumer {
    /// Checks the options; connects only in [`RabbitMqConsumer::run`].
    pub fn new(inbox: Inbox, options: RabbitMqConsumerOptions) -> Result<Self, ConsumerError> {
        options.validate()?;
        Ok(Self {
            inbox,
            options,
            counters: Arc::default(),
        })
    }

    /// The counts so far, across every run of this consumer.
    pub fn report(&self) -> ConsumerReport {
        self.counters.snapshot()
    }

    /// Consumes until `shutdown` resolves, running `handler` for each event
    /// inside the inbox's transaction. The message being handled when
    /// `shutdown` resolves is finished and acknowledged; everything else
    /// unacknowledged goes back to the queue when the connection closes.
    pub async fn run(
        &self,
        handler: impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerReport, ConsumerError> {
        let mut shutdown = pin!(shutdown);
        let mut reconnect = Reconnect::new(self.options.reconnect_max_delay);
        let what = format!("RabbitMQ queue {}", self.options.queue);
        check_inbox(&self.inbox, &what).await?;
        loop {
            let mut session = session::Session::new(&self.inbox, &self.options, &handler, &self.counters);
            let (started, error) = match session.run(shutdown.as_mut()).await {
                Ok(session::Ended::Shutdown) => break,
                Ok(session::Ended::Lost { started }) => (started, "the connection was lost".to_owned()),
                Ok(session::Ended::Refused(why)) => {
                    error!(queue = %self.options.queue, "consumer stops: {why}");
                    return Err(ConsumerError::Config(why));
                }
                Ok(session::Ended::Inbox(e)) => return Err(stopped_by_inbox(&self.inbox, &what, e)),
                Err(e) => (false, e),
            };
            if !reconnect
                .after_loss(started, &self.counters, &what, &error, shutdown.as_mut())
                .await
            {
                break;
            }
        }
        info!(queue = %self.options.queue, "consumer stopped");
        Ok(self.report())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each zero duration is refused with its field's name and the fix,
    /// instead of a consumer that spins or never connects.
    #[test]
    fn zero_durations_are_refused_naming_the_field() {
        crate::runner::assert_zero_durations_refused(
            || RabbitMqConsumerOptions::new("amqp://127.0.0.1:5672/%2f", "orders", "orders.dead"),
            RabbitMqConsumerOptions::validate,
            &[
                ("timeout", |o| o.timeout = Duration::ZERO),
                ("reconnect_max_delay", |o| o.reconnect_max_delay = Duration::ZERO),
            ],
        );
    }

    #[test]
    fn debug_output_hides_the_password() {
        let options = RabbitMqConsumerOptions::new("amqp://ferry:s3cr3t-pw@rabbit:5672/%2f", "billing", "billing.dead");
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("rabbit:5672"), "{shown}");
        assert!(shown.contains("prefetch: 32"), "{shown}");
    }
}
