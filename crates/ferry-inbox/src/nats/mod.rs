//! A NATS JetStream consumer that drives the [`Inbox`]: a durable pull
//! consumer with explicit acks, acknowledged (and the ack confirmed) only
//! after the inbox commit; retries as delayed naks; dead and malformed
//! messages published to a dead-letter subject before they are acknowledged.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_inbox::Inbox;
//! use ferry_inbox::nats::{NatsConsumer, NatsConsumerOptions};
//! let options = NatsConsumerOptions::new("nats://127.0.0.1:4222", "ORDERS", "billing", "billing.dead");
//! let consumer = NatsConsumer::new(Inbox::new(pool, "billing")?, options)?;
//! consumer
//!     .run(async |tx, event| {
//!         sqlx::query("INSERT INTO paid (id) VALUES ($1)").bind(event.id.0).execute(tx).await?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! A message not acknowledged within `ack_wait` is redelivered by the
//! server, to this or any other client of the same durable consumer (while
//! its handler runs, the runner reports progress, which restarts the
//! wait); the inbox turns a redelivery whose handler had already committed
//! into a duplicate, and one that meets an attempt still holding the event
//! into [`Outcome::InProgress`](crate::Outcome::InProgress), naked for later.

mod decode;
mod durable;
mod session;

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use tracing::{error, info};

pub use decode::decode;

use crate::runner::{Counters, Reconnect, check_inbox, stopped_by_inbox};
use crate::{ConsumerError, ConsumerReport, HandlerError, Inbox, ReceivedEvent};

/// Header of a dead-lettered message: why it was given up on.
pub const DEAD_REASON_HEADER: &str = "Ferry-Dead-Reason";
/// Header of a dead-lettered message: the durable consumer that gave up on it.
pub const DEAD_CONSUMER_HEADER: &str = "Ferry-Dead-Consumer";
/// Header of a dead-lettered message: the subject it was published to.
pub const DEAD_SUBJECT_HEADER: &str = "Ferry-Dead-Subject";

/// How a [`NatsConsumer`] connects, what it consumes, and where dead
/// messages go.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsConsumerOptions {
    /// `nats://[user:password@]host:port`.
    pub url: String,
    /// The JetStream stream consumed; it must exist.
    pub stream: String,
    /// The durable consumer's name, created if missing: every client using
    /// the same name shares its messages and its progress. An existing one
    /// with another ack policy than explicit, or another filter, is refused
    /// (the run returns an error); its `ack_wait`, `max_deliver` and
    /// `max_ack_pending` are set to these options'.
    pub durable: String,
    /// Only subjects matching this filter, when set.
    pub filter_subject: Option<String>,
    /// Published to (and confirmed by a stream capturing it) with the reason
    /// in [`DEAD_REASON_HEADER`], before a dead or malformed message is
    /// acknowledged.
    pub dead_letter_subject: String,
    /// Unacknowledged messages the server may hand over at once. Default 32.
    /// They wait in the runner for one handler at a time, each with its
    /// `ack_wait` running: lower it for slow handlers.
    pub max_ack_pending: i64,
    /// Redelivery after this long without an ack, from when the server hands
    /// the message over. While the message's handler runs, the runner
    /// reports it in progress every half `ack_wait`, which restarts the
    /// wait, so one long run is not redelivered; before that, the message
    /// may wait behind `max_ack_pending` others, so keep it above that many
    /// times the longest handler run. Default 30 s.
    pub ack_wait: Duration,
    /// The server stops delivering a message after this many deliveries,
    /// silently; so it is off (`-1`) by default and, when set, must stay
    /// well above the inbox's `max_attempts`, which decides dead letters.
    pub max_deliver: i64,
    /// Bounds connecting, acks and dead-letter confirms. Default 10 s.
    pub timeout: Duration,
    /// The longest pause between reconnection attempts. Default 10 s.
    pub reconnect_max_delay: Duration,
    /// How long a message waits before redelivery when the inbox's
    /// database cannot be reached. Default 1 s.
    pub database_retry_delay: Duration,
}

impl NatsConsumerOptions {
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
        dead_letter_subject: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            dead_letter_subject: dead_letter_subject.into(),
            max_ack_pending: 32,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(10),
            database_retry_delay: Duration::from_secs(1),
        }
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        let token = |field: &str, value: &str| {
            if value.is_empty() || value.contains(['.', '*', '>', ' ', '/', '\\']) {
                Err(ConsumerError::Config(format!(
                    "{field} is {value:?}; use a non-empty name without '.', '*', '>', spaces or slashes"
                )))
            } else {
                Ok(())
            }
        };
        token("stream", &self.stream)?;
        token("durable", &self.durable)?;
        if self.dead_letter_subject.is_empty() || self.dead_letter_subject.contains(['*', '>', ' ']) {
            return Err(ConsumerError::Config(format!(
                "dead_letter_subject is {:?}; use a subject without wildcards or spaces",
                self.dead_letter_subject
            )));
        }
        if self.max_ack_pending < 1 {
            return Err(ConsumerError::Config(
                "max_ack_pending is below 1; set at least 1".into(),
            ));
        }
        crate::runner::nonzero(
            "ack_wait",
            self.ack_wait,
            "JetStream reads as its default (30 s), not as no wait",
            "set it above max_ack_pending times the longest handler run (default 30 s)",
        )?;
        crate::runner::check_timeouts(self.timeout, self.reconnect_max_delay)?;
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return Err(ConsumerError::Config(
                "max_deliver must be -1 (unlimited) or at least 1".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Debug for NatsConsumerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumerOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("timeout", &self.timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("database_retry_delay", &self.database_retry_delay)
            .finish()
    }
}

/// Consumes one durable JetStream consumer into one [`Inbox`].
#[derive(Debug, Clone)]
pub struct NatsConsumer {
    inbox: Inbox,
    options: NatsConsumerOptions,
    counters: Arc<Counters>,
}

impl NatsConsumer {
    /// Checks the options; connects only in [`NatsConsumer::run`].
    pub fn new(inbox: Inbox, options: NatsConsumerOptions) -> Result<Self, ConsumerError> {
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
    /// inside the inbox's transaction. The message being handled is finished
    /// first; the rest of what the server handed over is redelivered after
    /// `ack_wait`.
    pub async fn run(
        &self,
        handler: impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerReport, ConsumerError> {
        let mut shutdown = pin!(shutdown);
        let mut reconnect = Reconnect::new(self.options.reconnect_max_delay);
        let what = format!("JetStream stream {}", self.options.stream);
        check_inbox(&self.inbox, &what).await?;
        loop {
            let mut session = session::Session::new(&self.inbox, &self.options, &handler, &self.counters);
            let error = match session.run(shutdown.as_mut()).await {
                Ok(()) => break,
                Err(session::Failure::Lost(e)) => e,
                Err(session::Failure::Refused(why)) => {
                    error!(stream = %self.options.stream, durable = %self.options.durable, "consumer refuses to start: {why}");
                    return Err(ConsumerError::Config(why));
                }
                Err(session::Failure::Inbox(e)) => return Err(stopped_by_inbox(&self.inbox, &what, e)),
            };
            if !reconnect
                .after_loss(session.started(), &self.counters, &what, &error, shutdown.as_mut())
                .await
            {
                break;
            }
        }
        info!(stream = %self.options.stream, durable = %self.options.durable, "consumer stopped");
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
            || NatsConsumerOptions::new("nats://127.0.0.1:4222", "ORDERS", "billing", "billing.dead"),
            NatsConsumerOptions::validate,
            &[
                ("ack_wait", |o| o.ack_wait = Duration::ZERO),
                ("timeout", |o| o.timeout = Duration::ZERO),
                ("reconnect_max_delay", |o| o.reconnect_max_delay = Duration::ZERO),
            ],
        );
    }

    #[test]
    fn debug_output_hides_the_password_and_a_token() {
        let options = NatsConsumerOptions::new(
            "nats://ferry:s3cr3t-pw@nats-host:4222",
            "ORDERS",
            "billing",
            "billing.dead",
        );
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("nats-host:4222"), "{shown}");
        assert!(shown.contains("ack_wait: 30s"), "{shown}");
        let options = NatsConsumerOptions::new("nats://tok-123@nats-host:4222", "ORDERS", "billing", "billing.dead");
        let shown = format!("{options:?}");
        assert!(!shown.contains("tok-123"), "{shown}");
        assert!(shown.contains("nats-host:4222"), "{shown}");
    }
}
