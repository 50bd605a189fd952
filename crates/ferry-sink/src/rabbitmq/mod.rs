//! The RabbitMQ sink: publisher confirms, mandatory publishing, CloudEvents
//! headers, and a reconnect loop of its own.
//!
//! An event is reported published only when RabbitMQ confirmed it *and* did
//! not hand it back as unroutable. lapin resolves the confirm of a mandatory
//! message that matched no queue as `Confirmation::Ack(Some(returned))`; that
//! is a permanent failure here, never a success.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
//!
//! let sink = RabbitMqSink::new(RabbitMqOptions {
//!     url: "amqp://ferry:secret@rabbit:5672/%2f".into(),
//!     publish_timeout: Duration::from_secs(5),
//!     ..RabbitMqOptions::default()
//! });
//! ```

mod bindings;
mod connector;
mod deadline;
mod lanes;
mod message;
mod missing;
mod publish;
mod reply;
mod resend;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
use tokio::sync::Mutex;

pub use message::{KEY_HEADER, SPEC_VERSION, properties};
pub use reply::{
    ACCESS_REFUSED, CONNECTION_FORCED, CONTENT_TOO_LARGE, INVALID_PATH, NO_CONSUMERS, NO_ROUTE, NOT_ALLOWED, NOT_FOUND,
    reply_code_kind,
};

use crate::batch::log_published;
use bindings::{Management, Reach};
use connector::Connector;
use deadline::Deadline;
use ferry_core::prepare_in_key_order;
use message::Message;

/// Messages RabbitMQ returned as unroutable (no queue bound for their
/// routing key), per exchange: each one is a failed publish, retried, then
/// dead; never counted as delivered.
pub const UNROUTABLE_METRIC: &str = "ferry_unroutable_returns_total";

/// How a [`RabbitMqSink`] connects and publishes.
#[derive(Clone, PartialEq, Eq)]
pub struct RabbitMqOptions {
    /// `amqp://` or `amqps://` URL; the vhost is the path, URL-encoded
    /// (`%2f` for `/`). Default `amqp://127.0.0.1:5672/%2f`.
    pub url: String,
    /// The longest a publish takes, from when the call has the connection
    /// (batches to one sink go one at a time, and a call's wait for the
    /// one before it is not counted, up to twice this from the call's
    /// start, which the relay's own bound on a publish leaves): connecting, checking exchanges found
    /// missing before, opening channels, writing the batch, sending again
    /// what a channel close failed, and awaiting the confirms all fit in
    /// it; what is not confirmed by then fails transiently. Also bounds
    /// each connect and declare of `check`.
    /// Default 10 s.
    pub publish_timeout: Duration,
    /// The longest pause between failed connection attempts. Default 30 s.
    pub reconnect_max_delay: Duration,
    /// Payloads larger than this are refused (permanently) before sending.
    /// Default 16 MiB, RabbitMQ 4's default `max_message_size`.
    pub max_message_bytes: usize,
    /// The CloudEvents `source` attribute. Default `"ferry"`.
    pub source: String,
    /// The management API (`http://user:password@host:15672`), asked by
    /// `check` whether a route's exchange has a queue bound for its routing
    /// key. Default: the AMQP host on port 15672 (15671 for amqps) with the
    /// AMQP credentials; when that does not answer, bindings go unchecked
    /// until the first unroutable publish.
    pub management_url: Option<String>,
    /// Confirm-mode channels on the connection that a batch is spread over,
    /// by key: a key's events always share one channel, which keeps their
    /// order. RabbitMQ works each channel in a process of its own, so more
    /// than one lets a busy broker use more than one core. At least 1;
    /// default [`DEFAULT_CHANNELS`]. Where the broker allows fewer (the
    /// negotiated `channel_max`, a user's `max-channels` limit, a node's
    /// channel limit), the sink publishes over those it gets, keeping one
    /// free for the passive declares that check exchanges, logs a warning,
    /// and `check` reports it; it tries the configured number again a
    /// minute later (then after a cool-down that doubles while the broker
    /// keeps refusing, up to ten minutes). Where it allows none, publishing
    /// fails transiently, naming the limit.
    pub channels: usize,
}

/// The default [`RabbitMqOptions::channels`]: on a 2-core host, two channels
/// carried 9–24% more confirmed publishes per second than one, and four no
/// more than two.
pub const DEFAULT_CHANNELS: usize = 2;

impl Default for RabbitMqOptions {
    fn default() -> Self {
        Self {
            url: "amqp://127.0.0.1:5672/%2f".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 16 * 1024 * 1024,
            source: "ferry".into(),
            management_url: None,
            channels: DEFAULT_CHANNELS,
        }
    }
}

impl std::fmt::Debug for RabbitMqOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let management_url = self.management_url.as_deref().map(ferry_core::redact::url);
        f.debug_struct("RabbitMqOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("publish_timeout", &self.publish_timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("source", &self.source)
            .field("management_url", &management_url)
            .field("channels", &self.channels)
            .finish()
    }
}

/// Publishes to RabbitMQ exchanges over one connection and its confirm-mode
/// channels ([`RabbitMqOptions::channels`]), reused across batches.
///
/// The route's `destination` is the exchange and its `routing_key` (default
/// `{type}`) the routing key; both may be templates. Batches are published
/// one at a time: a batch is spread over the channels by key and pipelined
/// (every message is written, then every confirm awaited), and holding the
/// channels for the whole batch keeps one batch's channel error from failing
/// another's events. Within a batch, a message the broker refuses by closing
/// its channel (a missing exchange, a write the user may not make) fails
/// alone: the events that failed with it are sent again in the same call.
/// An exchange found missing is remembered, and checked again with a passive
/// declare before later events are sent to it.
pub struct RabbitMqSink {
    options: RabbitMqOptions,
    connector: Mutex<Connector>,
    /// The frame size the last connection negotiated: a message's
    /// properties must fit one frame. 0 until the first connection.
    frame_max: Arc<AtomicUsize>,
}

impl RabbitMqSink {
    /// Creates the sink without connecting: the connection is made on first
    /// use, so a relay can start while the broker is still down.
    pub fn new(options: RabbitMqOptions) -> Self {
        // 0 until a connection negotiates it.
        let frame_max = Arc::new(AtomicUsize::new(0));
        let connector = Connector::new(
            options.url.clone(),
            options.publish_timeout,
            options.reconnect_max_delay,
            options.channels,
            frame_max.clone(),
        );
        Self {
            options,
            connector: Mutex::new(connector),
            frame_max,
        }
    }

    pub fn options(&self) -> &RabbitMqOptions {
        &self.options
    }

    /// How long after a channel-limit refusal the sink tries its configured
    /// number of channels again (the first cool-down; default a minute).
    /// For tests, which cannot wait a minute.
    #[doc(hidden)]
    pub fn with_channels_retry_after(mut self, after: Duration) -> Self {
        self.connector.get_mut().set_channels_retry_after(after);
        self
    }
}

impl std::fmt::Debug for RabbitMqSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqSink")
            .field("url", &ferry_core::redact::url(&self.options.url))
            .field("publish_timeout", &self.options.publish_timeout)
            .finish_non_exhaustive()
    }
}

/// The connection while a batch is on it, bound by the call's deadline. A
/// batch its caller stopped awaiting (a relay's bound on a publish) leaves
/// confirms owed on the channels, and lapin hands a `basic.return` to
/// whichever confirm resolves next: a later batch's unroutable message
/// could ride on a stale confirm and pass for delivered. So an unfinished
/// batch drops the connection.
struct InFlight<'a> {
    connector: tokio::sync::MutexGuard<'a, Connector>,
    finished: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.connector.set_deadline(None);
        if !self.finished {
            self.connector.lost(SinkError::transient(
                "a batch was abandoned before its confirms were in",
            ));
        }
    }
}

#[async_trait]
impl Sink for RabbitMqSink {
    fn kind(&self) -> &'static str {
        "rabbitmq"
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        let opts = &self.options;
        let frame_max = self.frame_max.load(Ordering::Relaxed);
        Message::prepare(route, event, &opts.source, opts.max_message_bytes, frame_max).map(drop)
    }

    /// `publish` prepares the batch in key order before it sends any of it.
    fn admits_in_publish(&self) -> bool {
        true
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let opts = &self.options;
        let called = tokio::time::Instant::now();
        let mut batch = InFlight {
            connector: self.connector.lock().await,
            finished: false,
        };
        // From when the connection is this call's: time spent queued behind
        // another route's batch on this sink is not taken from its own. But
        // the relay's bound on the call runs from its start and is at least
        // twice the publish timeout, so the call ends a little inside that.
        let pt = opts.publish_timeout;
        let deadline = Deadline::after(pt, &route.sink).until(called + pt * 2 - (pt / 10).min(Duration::from_secs(1)));
        batch.connector.set_deadline(Some(deadline.clone()));
        // Connected first, so that the events are checked against the frame
        // size the broker negotiated, not refused for RabbitMQ's default.
        batch.connector.connect_if_needed().await;
        // The relay admits events first; checking again keeps a direct caller
        // from sending what admit() would have refused, out of key order.
        let frame_max = self.frame_max.load(Ordering::Relaxed);
        let prepare =
            |event: &StoredEvent| Message::prepare(route, event, &opts.source, opts.max_message_bytes, frame_max);
        let prepared = prepare_in_key_order(events, prepare);
        let outcomes = publish::publish_batch(&mut batch.connector, route, events, prepared, &deadline, &prepare).await;
        batch.finished = true;
        log_published("RabbitMQ", route, events, &outcomes);
        outcomes
    }

    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        for caveat in self.check_with_caveats(route).await? {
            tracing::warn!(route = %route.name, "{caveat}");
        }
        Ok(())
    }

    async fn check_with_caveats(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        let mut connector = self.connector.lock().await;
        let exchange = route.destination.as_str();
        let sink = route.sink.as_str();
        // The publishing channels first: a broker allowing fewer than
        // configured (or none) says so here, before any event.
        if let Err(e) = connector.confirm_channels(sink).await {
            return Err(connector.refusal_is_config(e));
        }
        let mut caveats: Vec<String> = connector.shortfall(sink).into_iter().collect();
        // A template names many exchanges, known only per event, and the
        // default exchange always exists: connectivity is all there is to check.
        if exchange.contains('{') || exchange.is_empty() {
            return Ok(caveats);
        }
        let exists = match connector.exchange_exists(exchange, sink).await {
            Ok(exists) => exists,
            Err(e) => return Err(connector.refusal_is_config(e)),
        };
        if !exists {
            return Err(SinkError::config(format!(
                "route {:?}: exchange {exchange:?} does not exist; declare it or fix \
                 routes[].destination",
                route.name
            )));
        }
        drop(connector);
        // Nobody home: an exchange with no queue for the route's messages
        // would return every one of them as unroutable.
        let key = route.routing_key.as_deref().unwrap_or("{type}");
        let key = (!key.contains('{')).then_some(key);
        let api = Management::new(
            &self.options.url,
            self.options.management_url.as_deref(),
            self.options.publish_timeout,
        )?;
        match api.reach(exchange, key).await? {
            Reach::Bound(_) => Ok(caveats),
            Reach::Nobody(what) => Err(SinkError::config(format!(
                "route {:?} reaches nobody: {what}, so every event would come back unroutable \
                 and be retried until dead; bind a consumer's queue to the exchange, or fix \
                 routes[].destination or routes[].routing_key",
                route.name
            ))),
            // The broker's own returns still catch an unroutable message
            // at publish time: nothing is lost, but the operator must hear
            // that this check could not look.
            Reach::Unknown(why) => {
                caveats.push(format!("exchange exists; bindings not checked: {why}"));
                Ok(caveats)
            }
            // An alternate exchange not followed to its end may take them.
            Reach::Uncertain(why) => {
                caveats.push(format!("route {:?}: {why}", route.name));
                Ok(caveats)
            }
        }
    }

    async fn close(&self) {
        self.connector.lock().await.close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_the_passwords_of_both_urls() {
        let options = RabbitMqOptions {
            url: "amqp://ferry:s3cr3t-pw@rabbit:5672/%2f".into(),
            management_url: Some("http://ferry:mgmt-pw@rabbit:15672".into()),
            ..RabbitMqOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(!shown.contains("mgmt-pw"), "{shown}");
        assert!(shown.contains("rabbit:5672"), "{shown}");
        assert!(shown.contains("rabbit:15672"), "{shown}");
        assert!(shown.contains("publish_timeout: 10s"), "{shown}");
    }
}
