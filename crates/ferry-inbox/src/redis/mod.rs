//! A Redis Streams consumer that drives the [`Inbox`]: a consumer group,
//! `XACK` only after the inbox commit, `XAUTOCLAIM` of entries a dead
//! consumer left pending, and a dead-letter stream.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use ferry_inbox::Inbox;
//! use ferry_inbox::redis::{RedisConsumer, RedisConsumerOptions};
//! let options = RedisConsumerOptions::new("redis://127.0.0.1:6379", "orders", "billing", "billing-1", "orders.dead");
//! let consumer = RedisConsumer::new(Inbox::new(pool, "billing")?, options)?;
//! consumer
//!     .run(async |tx, event| {
//!         sqlx::query("INSERT INTO paid (id) VALUES ($1)").bind(event.id.0).execute(tx).await?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! An entry read but not acknowledged stays in the group's pending list.
//! After a restart the consumer reads its own pending entries first; entries
//! of a consumer that never comes back are claimed by any other member once
//! idle for `claim_idle`. Either way the inbox turns an entry whose handler
//! had already committed into a duplicate.

mod decode;
mod session;
mod trim;

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use tracing::{error, info};

pub use decode::decode;

use crate::runner::{Counters, Reconnect, check_inbox, stopped_by_inbox};
use crate::{ConsumerError, ConsumerReport, HandlerError, Inbox, ReceivedEvent};

/// Field of a dead-lettered entry: why it was given up on.
pub const DEAD_REASON_FIELD: &str = "dead-reason";
/// Field of a dead-lettered entry: the consumer group that gave up on it.
pub const DEAD_GROUP_FIELD: &str = "dead-group";
/// Field of a dead-lettered entry: the stream and entry id it came from.
pub const DEAD_SOURCE_FIELD: &str = "dead-source";

/// How a [`RedisConsumer`] connects, what it reads, and where dead entries go.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConsumerOptions {
    /// `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// The stream key read.
    pub stream: String,
    /// The consumer group: every event is handled by one member of it.
    pub group: String,
    /// This member's name in the group, stable across restarts of the same
    /// instance (so it finds its own pending entries) and unique among the
    /// instances running at once.
    pub consumer: String,
    /// Create the group (and the stream) if missing, reading from the
    /// stream's first entry. Default true.
    pub create_group: bool,
    /// Entries read per call. Default 32.
    pub batch: usize,
    /// How long one read waits for new entries. Default 1 s.
    pub block: Duration,
    /// Entries pending longer than this are taken from their consumer,
    /// presumed dead. Keep it above `batch` times the longest handler run
    /// (an entry read with a batch waits for the entries before it, its
    /// idle time running), or a slow consumer's entries are handled twice
    /// (harmlessly, through the inbox, but wastefully). Entries a live member keeps for a retry backoff are
    /// not taken, however long the backoff: it renews them every
    /// `claim_idle / 2`. Default 60 s.
    pub claim_idle: Duration,
    /// Where dead and malformed entries are added, with the reason in
    /// [`DEAD_REASON_FIELD`], before they are acknowledged.
    pub dead_letter_stream: String,
    /// Bounds connecting and every command but the blocking read. Default 10 s.
    pub timeout: Duration,
    /// The longest pause between reconnection attempts. Default 10 s.
    pub reconnect_max_delay: Duration,
    /// How long an entry waits before it is tried again when the inbox's
    /// database cannot be reached. Default 1 s.
    pub database_retry_delay: Duration,
}

impl RedisConsumerOptions {
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
        dead_letter_stream: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            create_group: true,
            batch: 32,
            block: Duration::from_secs(1),
            claim_idle: Duration::from_secs(60),
            dead_letter_stream: dead_letter_stream.into(),
            timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(10),
            database_retry_delay: Duration::from_secs(1),
        }
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        let named = |field: &str, value: &str| {
            if value.is_empty() {
                Err(ConsumerError::Config(format!("{field} is empty; name it")))
            } else {
                Ok(())
            }
        };
        named("stream", &self.stream)?;
        named("group", &self.group)?;
        named("consumer", &self.consumer)?;
        named("dead_letter_stream", &self.dead_letter_stream)?;
        if self.dead_letter_stream == self.stream {
            return Err(ConsumerError::Config(
                "dead_letter_stream is the stream read; use a stream of its own".into(),
            ));
        }
        if self.batch == 0 {
            return Err(ConsumerError::Config("batch is 0; set at least 1".into()));
        }
        crate::runner::nonzero(
            "block",
            self.block,
            "polls Redis for new entries without a pause",
            "set how long one read waits for new entries (default 1 s)",
        )?;
        crate::runner::check_timeouts(self.timeout, self.reconnect_max_delay)?;
        if self.claim_idle.is_zero() {
            return Err(ConsumerError::Config(
                "claim_idle is 0, which would take entries from live consumers; set it above batch times the longest \
                 handler run"
                    .into(),
            ));
        }
        redis::Client::open(self.url.as_str())
            .map_err(|e| ConsumerError::Config(format!("url is not a Redis URL ({e}); use redis://host:port/db")))?;
        Ok(())
    }
}

impl std::fmt::Debug for RedisConsumerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConsumerOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("create_group", &self.create_group)
            .field("batch", &self.batch)
            .field("block", &self.block)
            .field("claim_idle", &self.claim_idle)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("timeout", &self.timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("database_retry_delay", &self.database_retry_delay)
            .finish()
    }
}

/// Consumes one stream, as one member of a group, into one [`Inbox`].
#[derive(Debug, Clone)]
pub struct RedisConsumer {
    inbox: Inbox,
    options: RedisConsumerOptions,
    counters: Arc<Counters>,
}

impl RedisConsumer {
    /// Checks the options; connects only in [`RedisConsumer::run`].
    pub fn new(inbox: Inbox, options: RedisConsumerOptions) -> Result<Self, ConsumerError> {
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
    /// inside the inbox's transaction. Entries being handled are finished
    /// first; entries read but not yet handled stay pending for the next run
    /// (or another member) to take.
    pub async fn run(
        &self,
        handler: impl AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerReport, ConsumerError> {
        let mut shutdown = pin!(shutdown);
        let mut reconnect = Reconnect::new(self.options.reconnect_max_delay);
        let what = format!("Redis stream {}", self.options.stream);
        check_inbox(&self.inbox, &what).await?;
        loop {
            let mut session = session::Session::new(&self.inbox, &self.options, &handler, &self.counters);
            let error = match session.run(shutdown.as_mut()).await {
                Ok(()) => break,
                Err(session::Failure::Lost(e)) => e,
                Err(session::Failure::Refused(why)) => {
                    error!(stream = %self.options.stream, group = %self.options.group, "consumer stops: {why}");
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
        info!(stream = %self.options.stream, "consumer stopped");
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
            || {
                RedisConsumerOptions::new(
                    "redis://127.0.0.1:6379",
                    "orders",
                    "billing",
                    "billing-1",
                    "orders.dead",
                )
            },
            RedisConsumerOptions::validate,
            &[
                ("block", |o| o.block = Duration::ZERO),
                ("timeout", |o| o.timeout = Duration::ZERO),
                ("reconnect_max_delay", |o| o.reconnect_max_delay = Duration::ZERO),
            ],
        );
    }

    #[test]
    fn debug_output_hides_the_password() {
        let options = RedisConsumerOptions::new(
            "redis://ferry:s3cr3t-pw@redis-host:6379/0",
            "orders",
            "billing",
            "billing-1",
            "orders.dead",
        );
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("redis-host:6379"), "{shown}");
        assert!(shown.contains("claim_idle: 60s"), "{shown}");
    }
}
