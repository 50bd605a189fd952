//! The Redis Streams sink: one `XADD` per event, a batch per pipeline, and an
//! event counts as published only once Redis answered its XADD with an entry
//! id.
//!
//! Each entry carries the fields `id` (the event id), `type`, `key` (when the
//! event has one), `payload` (the event's bytes), `content-type`, `time`,
//! `source`, `specversion` and `headers` (the producer's headers as a JSON
//! object). Entry ids are `*`: Redis cannot drop a re-publish, so delivery is
//! at least once and consumers deduplicate by `id`. See `publish.rs` for what
//! a partial pipeline means.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferry_sink::redis::{RedisOptions, RedisSink};
//!
//! let sink = RedisSink::new(RedisOptions {
//!     url: "redis://:secret@redis:6379/0".into(),
//!     maxlen_default: Some(1_000_000),
//!     ..RedisOptions::default()
//! });
//! ```

mod check;
mod codes;
mod message;
mod publish;

use std::collections::HashMap;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
use tokio::sync::Mutex;
use tracing::warn;

use crate::backoff::Backoff;
use std::time::Instant;

pub use codes::server_code_kind;
pub use message::{FIELDS, SPEC_VERSION};

use crate::batch::log_published;
use ferry_core::prepare_in_key_order;
use message::Entry;

/// How a [`RedisSink`] connects and publishes.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// `redis://[user:password@]host:port[/db]` or `rediss://` for TLS.
    /// Default `redis://127.0.0.1:6379`.
    pub url: String,
    /// How long to wait for the replies of a batch's pipeline, and for each
    /// connect or check. Default 10 s.
    pub publish_timeout: Duration,
    /// The longest pause between reconnect attempts. Default 30 s.
    pub reconnect_max_delay: Duration,
    /// Payloads larger than this are refused (permanently) before sending.
    /// Default 16 MiB: Redis itself takes up to 512 MiB per value, far more
    /// than a stream entry should hold.
    pub max_message_bytes: usize,
    /// Approximate trimming (`MAXLEN ~ n`) for routes not named in
    /// `maxlen_per_route`. Default `None`: streams grow until trimmed elsewhere.
    /// Trimming ignores consumer groups: entries a group has not read or
    /// acknowledged yet are removed too, so keep `n` above the largest backlog
    /// a group may build (see the README, "Redis Streams").
    pub maxlen_default: Option<u64>,
    /// Approximate trimming per route name; overrides `maxlen_default`, and
    /// `0` turns trimming off for that route.
    pub maxlen_per_route: HashMap<String, u64>,
    /// The `source` field. Default `"ferry"`.
    pub source: String,
    /// Replicas that must hold a batch's entries before they count as
    /// published (`WAIT`, within half of `publish_timeout`). An entry only
    /// the primary holds is lost if it fails over before replicating. An
    /// entry that fewer replicas confirm is retried, so the stream may hold
    /// it twice. Default 0: the primary's answer is enough.
    pub wait_replicas: u32,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 16 * 1024 * 1024,
            maxlen_default: None,
            maxlen_per_route: HashMap::new(),
            source: "ferry".into(),
            wait_replicas: 0,
        }
    }
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("publish_timeout", &self.publish_timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("maxlen_default", &self.maxlen_default)
            .field("maxlen_per_route", &self.maxlen_per_route)
            .field("source", &self.source)
            .field("wait_replicas", &self.wait_replicas)
            .finish()
    }
}

impl RedisOptions {
    /// The trimming for `route`, if any.
    pub fn maxlen_for(&self, route: &str) -> Option<u64> {
        match self.maxlen_per_route.get(route) {
            Some(0) => None,
            Some(&n) => Some(n),
            None => self.maxlen_default,
        }
    }

    /// Checks the options, naming the field that is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if ::redis::parse_redis_url(&self.url).is_none() {
            return Err("url: not a redis://, rediss:// or unix:// URL".into());
        }
        if self.publish_timeout.is_zero() {
            return Err("publish_timeout: must be above zero".into());
        }
        if self.max_message_bytes == 0 {
            return Err("max_message_bytes: must be above zero".into());
        }
        if self.maxlen_default == Some(0) {
            return Err("maxlen_default: 0 would trim every entry; leave it unset for no trimming".into());
        }
        let too_big = |n: u64| n > MAX_MAXLEN;
        if self.maxlen_default.is_some_and(too_big) {
            return Err(format!("maxlen_default: at most {MAX_MAXLEN}"));
        }
        if let Some((route, _)) = self.maxlen_per_route.iter().find(|(_, n)| too_big(**n)) {
            return Err(format!("maxlen_per_route.{route}: at most {MAX_MAXLEN}"));
        }
        Ok(())
    }
}

/// Redis takes a MAXLEN up to `i64::MAX`.
pub const MAX_MAXLEN: u64 = i64::MAX as u64;

/// Appends to Redis streams over one multiplexed connection, which
/// reconnects on its own (with exponential backoff) after a loss. The
/// route's `destination` is the stream key and may be a template
/// (`events:{domain}`); `routing_key` is not used.
pub struct RedisSink {
    options: RedisOptions,
    link: Mutex<Link>,
}

struct Link {
    /// Created on first use; replaced when a batch left it in doubt.
    connection: Option<ConnectionManager>,
    /// Paces attempts while Redis cannot be reached, so a publish against a
    /// down server fails at once instead of waiting out a connect.
    backoff: Backoff,
    /// Whether the last request got through: the first failure after that
    /// is a loss, retried at once; only repeated failures back off.
    up: bool,
    /// Whether Redis answered a request on `connection` yet. The connection
    /// manager connects on first use, so only an answer shows it opened;
    /// `ferry_sink_connections_total` counts it then.
    opened: bool,
}

impl Link {
    fn failed(&mut self, error: &SinkError) {
        self.connection = None;
        if std::mem::take(&mut self.up) {
            warn!(%error, "Redis connection lost; reconnecting on next use");
        } else {
            let delay = self.backoff.failed(Instant::now(), error.message.clone());
            warn!(%error, retry_in = ?delay, "Redis still unreachable");
        }
    }

    fn succeeded(&mut self) {
        self.up = true;
        self.backoff.succeeded();
        self.answered();
    }

    /// Redis answered on the connection: counted the first time.
    fn answered(&mut self) {
        if !std::mem::replace(&mut self.opened, true) {
            crate::connected("redis");
        }
    }
}

/// Forgets the connection of a batch abandoned half-way (the relay's bound
/// passed, or it stopped): the server still works through what was sent,
/// a WAIT among it for up to half of `publish_timeout`, and the next batch
/// would queue behind it on the same connection. The old connection closes
/// once its answers are in.
struct Abandoned<'a>(Option<&'a mut Link>);

impl Abandoned<'_> {
    fn finished(mut self) {
        self.0 = None;
    }
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(link) = self.0.take() {
            link.connection = None;
        }
    }
}

impl RedisSink {
    /// Creates the sink without connecting: the connection is made on first
    /// use, so a relay can start while Redis is still down.
    pub fn new(options: RedisOptions) -> Self {
        Self {
            link: Mutex::new(Link {
                connection: None,
                backoff: Backoff::new(options.reconnect_max_delay),
                up: false,
                opened: false,
            }),
            options,
        }
    }

    pub fn options(&self) -> &RedisOptions {
        &self.options
    }

    fn prepare(&self, route: &Route, event: &StoredEvent) -> Result<Entry, SinkError> {
        let opts = &self.options;
        Entry::prepare(
            route,
            event,
            &opts.source,
            opts.max_message_bytes,
            opts.maxlen_for(&route.name),
        )
    }

    fn connection(&self, link: &mut Link) -> Result<ConnectionManager, SinkError> {
        if let Some(connection) = &link.connection {
            return Ok(connection.clone());
        }
        if let Err(wait) = link.backoff.ready(Instant::now()) {
            return Err(SinkError::transient(format!(
                "not connected to Redis; next attempt in {wait:?} (last error: {})",
                link.backoff.last_error().unwrap_or("none")
            )));
        }
        let client = ::redis::Client::open(self.options.url.as_str())
            .map_err(|e| SinkError::config(format!("sinks.redis.url is not a valid Redis URL: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.options.publish_timeout))
            .set_response_timeout(Some(self.options.publish_timeout))
            .set_min_delay(crate::backoff::BASE_DELAY)
            .set_max_delay(self.options.reconnect_max_delay)
            .set_exponent_base(2.0)
            .set_number_of_retries(1);
        let connection = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| SinkError::config(format!("setting up the Redis connection: {e}")))?;
        link.connection = Some(connection.clone());
        link.opened = false;
        Ok(connection)
    }
}

impl std::fmt::Debug for RedisSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSink")
            .field("publish_timeout", &self.options.publish_timeout)
            .field("maxlen_default", &self.options.maxlen_default)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Sink for RedisSink {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        self.prepare(route, event).map(drop)
    }

    /// `publish` prepares the batch in key order before it sends any of it.
    fn admits_in_publish(&self) -> bool {
        true
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        // One batch at a time keeps batches of a route in order on the wire.
        let mut link = self.link.lock().await;
        let mut connection = match self.connection(&mut link) {
            Ok(connection) => connection,
            Err(e) => return events.iter().map(|_| Err(e.clone())).collect(),
        };
        // The relay admits events first; checking again keeps a direct caller
        // from sending what admit() would have refused, out of key order.
        let prepared = prepare_in_key_order(events, |event| self.prepare(route, event));
        let abandoned = Abandoned(Some(&mut link));
        let published = publish::publish_batch(
            &route.sink,
            &mut connection,
            prepared,
            self.options.publish_timeout,
            self.options.wait_replicas,
        )
        .await;
        abandoned.finished();
        // A batch none of which was sent made no request: it tells nothing
        // about the connection.
        match &published.connection_in_doubt {
            _ if !published.sent => {}
            Some(error) => {
                if published.answered {
                    link.answered();
                }
                link.failed(error);
            }
            None => link.succeeded(),
        }
        log_published("Redis", route, events, &published.outcomes);
        published.outcomes
    }

    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        for caveat in self.check_with_caveats(route).await? {
            warn!(route = %route.name, "{caveat}");
        }
        Ok(())
    }

    /// PING; `INFO cluster`, which must not say cluster mode; WAIT, with
    /// `wait_replicas`; then for a plain key: it must be a stream a
    /// consumer group reads. A template names many keys, known only per
    /// event: for it, the key is not checked. A command the user's ACL
    /// refuses leaves a caveat, not a failure: publishing needs only XADD.
    async fn check_with_caveats(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        self.checked(route).await
    }

    async fn close(&self) {
        // Dropping the last handle closes the multiplexed connection; nothing
        // is left unconfirmed between batches.
        self.link.lock().await.connection.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maxlen_per_route_overrides_the_default_and_zero_turns_it_off() {
        let options = RedisOptions {
            maxlen_default: Some(100),
            maxlen_per_route: [("short".to_owned(), 10), ("all".to_owned(), 0)].into(),
            ..RedisOptions::default()
        };
        assert_eq!(options.maxlen_for("short"), Some(10));
        assert_eq!(options.maxlen_for("all"), None);
        assert_eq!(options.maxlen_for("other"), Some(100));
        assert_eq!(RedisOptions::default().maxlen_for("other"), None);
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(RedisOptions::default().validate(), Ok(()));
        let bad = |options: RedisOptions| options.validate().unwrap_err();
        let field = |e: String| e.split(':').next().unwrap().to_owned();
        assert_eq!(
            field(bad(RedisOptions {
                url: "http://x".into(),
                ..RedisOptions::default()
            })),
            "url"
        );
        assert_eq!(
            field(bad(RedisOptions {
                publish_timeout: Duration::ZERO,
                ..RedisOptions::default()
            })),
            "publish_timeout"
        );
        assert_eq!(
            field(bad(RedisOptions {
                maxlen_default: Some(0),
                ..RedisOptions::default()
            })),
            "maxlen_default"
        );
        assert_eq!(
            field(bad(RedisOptions {
                maxlen_per_route: [("orders".to_owned(), u64::MAX)].into(),
                ..RedisOptions::default()
            })),
            "maxlen_per_route.orders"
        );
    }

    #[test]
    fn debug_output_hides_the_password() {
        let options = RedisOptions {
            url: "redis://ferry:s3cr3t-pw@redis-host:6379/0".into(),
            ..RedisOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("redis-host:6379"), "{shown}");
        assert!(shown.contains("publish_timeout: 10s"), "{shown}");
    }
}
