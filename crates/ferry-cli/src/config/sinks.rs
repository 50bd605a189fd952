//! Step two for the `[sinks.<name>]` tables: one checked spec per kind.
//!
//! The defaults here are the sink options' own `Default`s (a test per kind
//! holds them equal), written out because the config is read even by a
//! binary built without a kind's feature. Where a sink's options have a
//! `validate()` or a fallible constructor, it runs too once the fields pass
//! the checks here, and its message is put under `sinks.<name>.<field>`.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::raw::RawSink;
use ferry_core::redact;

use super::{Checker, SinkSpec};

const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// RabbitMQ refuses messages above 512 MiB whatever its configuration.
const RABBITMQ_MAX_MESSAGE_BYTES: i64 = 512 * 1024 * 1024;
/// RabbitMQ's default `channel_max` allows 2047 per connection; past a few
/// per core, more channels only cost the broker memory.
const RABBITMQ_MAX_CHANNELS: i64 = 64;
const DEFAULT_RABBITMQ_CHANNELS: usize = 2;
const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(30);
const DEFAULT_SOURCE: &str = "ferry";
const KAFKA_DEFAULT_BOOTSTRAP: &str = "127.0.0.1:9092";
const KAFKA_DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
const KAFKA_DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;
const NATS_DEFAULT_URL: &str = "nats://127.0.0.1:4222";
const NATS_DEFAULT_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
const REDIS_DEFAULT_URL: &str = "redis://127.0.0.1:6379";
const WEBHOOK_DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const WEBHOOK_DEFAULT_CONCURRENCY: usize = 8;
/// Requests in flight per destination URL: the webhook sink's own bound
/// (`ferry_sink::webhook::MAX_CONCURRENCY`), checked here with the other
/// fields whether or not this binary has the webhook sink.
const WEBHOOK_MAX_CONCURRENCY: i64 = 1024;
const WEBHOOK_DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
const WEBHOOK_DEFAULT_ERROR_RESPONSE_BYTES: usize = 256;
/// The sink reads at most 64 KiB of an error response.
const WEBHOOK_MAX_ERROR_RESPONSE_BYTES: i64 = 64 * 1024;
const FILE_DEFAULT_MAX_FILE_BYTES: u64 = 100 * 1024 * 1024;
/// Files smaller than this would refuse most events (their lines do not
/// fit, and they go dead). A line of the largest event the outbox accepts
/// takes up to 2 MiB (a non-JSON payload is base64); a smaller limit is
/// allowed for files that only ever take small events.
const FILE_MIN_MAX_FILE_BYTES: i64 = 64 * 1024;

/// Every sink kind, and whether this binary was built with it.
pub(super) const SINK_KINDS: [(&str, bool); 7] = [
    ("rabbitmq", cfg!(feature = "rabbitmq")),
    ("kafka", cfg!(feature = "kafka")),
    ("nats", cfg!(feature = "nats")),
    ("redis", cfg!(feature = "redis")),
    ("webhook", cfg!(feature = "webhook")),
    ("file", cfg!(feature = "file")),
    ("stdout", cfg!(feature = "stdout")),
];

/// `[sinks.x] kind = "kafka"`.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSpec {
    /// `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    /// librdkafka's `message.timeout.ms`: enqueue to acknowledgement.
    pub publish_timeout: Duration,
    pub max_message_bytes: usize,
    /// The CloudEvents `source` attribute.
    pub source: String,
    /// More librdkafka producer properties, passed through.
    pub extra: BTreeMap<String, String>,
}

/// `[sinks.x] kind = "nats"`: JetStream.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsSpec {
    pub url: String,
    pub publish_timeout: Duration,
    pub reconnect_max_delay: Duration,
    pub max_message_bytes: usize,
    pub source: String,
}

/// `[sinks.x] kind = "redis"`: Redis Streams.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisSpec {
    pub url: String,
    pub publish_timeout: Duration,
    pub reconnect_max_delay: Duration,
    pub max_message_bytes: usize,
    /// `maxlen` in the file: `MAXLEN ~ n` for routes not in `maxlen_per_route`.
    pub maxlen_default: Option<u64>,
    /// By route name; `0` turns trimming off for that route.
    pub maxlen_per_route: BTreeMap<String, u64>,
    pub source: String,
    /// Replicas that must confirm a batch (`WAIT`); 0 for the primary alone.
    pub wait_replicas: u32,
}

/// `[sinks.x] kind = "webhook"`.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSpec {
    /// `whsec_<base64>` signing secrets.
    pub secrets: Vec<String>,
    /// Bound on one request.
    pub timeout: Duration,
    /// Requests in flight at once per destination URL.
    pub concurrency: usize,
    pub max_body_bytes: usize,
    pub source: String,
    /// Sent with every request (e.g. `Authorization`).
    pub headers: BTreeMap<String, String>,
    /// Bytes of an error response's body quoted in the delivery's error.
    pub error_response_bytes: usize,
}

/// `[sinks.x] kind = "file"`: JSON lines appended to files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// Rotate before a line would take a file past this size.
    pub max_file_bytes: u64,
}

impl SinkSpec {
    /// The field bounding one publish, and its value: the relay's lease must
    /// outlast it.
    pub(super) fn publish_bound(&self) -> Option<(&'static str, Duration)> {
        match self {
            SinkSpec::RabbitMq { publish_timeout, .. } => Some(("publish_timeout", *publish_timeout)),
            SinkSpec::Kafka(k) => Some(("publish_timeout", k.publish_timeout)),
            SinkSpec::Nats(n) => Some(("publish_timeout", n.publish_timeout)),
            SinkSpec::Redis(r) => Some(("publish_timeout", r.publish_timeout)),
            SinkSpec::Webhook(w) => Some(("timeout", w.timeout)),
            SinkSpec::File(_) | SinkSpec::Stdout => None,
        }
    }
}

// Config is logged at start-up: URLs, secrets and header values stay hidden.
impl fmt::Debug for KafkaSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let extra = redact::properties(&self.extra);
        f.debug_struct("KafkaSpec")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("publish_timeout", &self.publish_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("source", &self.source)
            .field("extra", &extra)
            .finish()
    }
}

impl fmt::Debug for NatsSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSpec")
            .field("url", &redact::url(&self.url))
            .field("publish_timeout", &self.publish_timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Debug for RedisSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSpec")
            .field("url", &redact::url(&self.url))
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

impl fmt::Debug for WebhookSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers = redact::header_values(self.headers.keys());
        f.debug_struct("WebhookSpec")
            .field("secrets", &format_args!("[{} hidden]", self.secrets.len()))
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("source", &self.source)
            .field("headers", &headers)
            .field("error_response_bytes", &self.error_response_bytes)
            .finish()
    }
}

/// Each kind-specific field and the kinds that take it.
const KIND_FIELDS: [(&str, &[&str]); 19] = [
    ("url", &["rabbitmq", "nats", "redis"]),
    ("management_url", &["rabbitmq"]),
    ("channels", &["rabbitmq"]),
    ("publish_timeout", &["rabbitmq", "kafka", "nats", "redis"]),
    ("max_message_bytes", &["rabbitmq", "kafka", "nats", "redis"]),
    ("reconnect_max_delay", &["nats", "redis"]),
    ("source", &["kafka", "nats", "redis", "webhook"]),
    ("bootstrap_servers", &["kafka"]),
    ("extra", &["kafka"]),
    ("maxlen", &["redis"]),
    ("maxlen_per_route", &["redis"]),
    ("wait_replicas", &["redis"]),
    ("secrets", &["webhook"]),
    ("timeout", &["webhook"]),
    ("concurrency", &["webhook"]),
    ("max_body_bytes", &["webhook"]),
    ("headers", &["webhook"]),
    ("error_response_bytes", &["webhook"]),
    ("max_file_bytes", &["file"]),
];

fn is_set(raw: &RawSink, field: &str) -> bool {
    match field {
        "url" => raw.url.is_some(),
        "management_url" => raw.management_url.is_some(),
        "channels" => raw.channels.is_some(),
        "publish_timeout" => raw.publish_timeout.is_some(),
        "max_message_bytes" => raw.max_message_bytes.is_some(),
        "reconnect_max_delay" => raw.reconnect_max_delay.is_some(),
        "source" => raw.source.is_some(),
        "bootstrap_servers" => raw.bootstrap_servers.is_some(),
        "extra" => raw.extra.is_some(),
        "maxlen" => raw.maxlen.is_some(),
        "maxlen_per_route" => raw.maxlen_per_route.is_some(),
        "wait_replicas" => raw.wait_replicas.is_some(),
        "secrets" => raw.secrets.is_some(),
        "timeout" => raw.timeout.is_some(),
        "concurrency" => raw.concurrency.is_some(),
        "max_body_bytes" => raw.max_body_bytes.is_some(),
        "headers" => raw.headers.is_some(),
        "error_response_bytes" => raw.error_response_bytes.is_some(),
        "max_file_bytes" => raw.max_file_bytes.is_some(),
        _ => false,
    }
}

pub(super) fn sink_spec(check: &mut Checker, name: &str, raw: RawSink) -> Option<SinkSpec> {
    let field = |f: &str| format!("sinks.{name}.{f}");
    let kinds = || SINK_KINDS.map(|(kind, _)| kind).join(", ");
    let Some(kind) = raw.kind.as_deref() else {
        check.problem(field("kind"), format!("missing; set kind to one of: {}", kinds()));
        return None;
    };
    let Some(&(kind, compiled_in)) = SINK_KINDS.iter().find(|(k, _)| *k == kind) else {
        check.problem(
            field("kind"),
            format!("unknown kind {kind:?}; supported kinds: {}", kinds()),
        );
        return None;
    };
    if !compiled_in {
        check.problem(
            field("kind"),
            format!("this ferry was built without the {kind:?} feature; rebuild it with --features {kind}"),
        );
    }
    for (f, takers) in KIND_FIELDS {
        if is_set(&raw, f) && !takers.contains(&kind) {
            let hint = match (kind, f) {
                ("webhook", "publish_timeout") => "; webhook sinks bound a request with timeout",
                ("webhook", "max_message_bytes") => "; webhook sinks limit the request with max_body_bytes",
                ("redis", "timeout") | ("nats", "timeout") | ("kafka", "timeout") => "; use publish_timeout",
                _ => "",
            };
            check.problem(
                field(f),
                format!(
                    "{kind} sinks take no {f} (it belongs to {} sinks); remove it{hint}",
                    takers.join(", ")
                ),
            );
        }
    }
    let before = check.problems.len();
    let millisecond = Duration::from_millis(1);
    let source = |check: &mut Checker| match raw.source.clone() {
        Some(s) if s.trim().is_empty() => {
            check.problem(
                field("source"),
                "must not be empty; it is the CloudEvents source attribute (default \"ferry\")",
            );
            s
        }
        Some(s) => s,
        None => DEFAULT_SOURCE.to_owned(),
    };
    let spec = match kind {
        "rabbitmq" => {
            let url = match raw.url {
                Some(url) if url.starts_with("amqp://") || url.starts_with("amqps://") => url,
                Some(_) => {
                    check.problem(
                        field("url"),
                        "must start with amqp:// or amqps://, like amqp://user:password@host:5672/%2f",
                    );
                    String::new()
                }
                None => {
                    check.problem(
                        field("url"),
                        "missing; set it like url = \"amqp://user:password@host:5672/%2f\"",
                    );
                    String::new()
                }
            };
            let publish_timeout = check.duration_at_least(
                &field("publish_timeout"),
                raw.publish_timeout,
                DEFAULT_PUBLISH_TIMEOUT,
                millisecond,
            );
            let max_message_bytes = check.integer(
                &field("max_message_bytes"),
                raw.max_message_bytes,
                DEFAULT_MAX_MESSAGE_BYTES,
                1,
                Some(RABBITMQ_MAX_MESSAGE_BYTES),
            );
            let management_url = match raw.management_url {
                Some(u) if u.starts_with("http://") || u.starts_with("https://") => Some(u),
                Some(_) => {
                    check.problem(
                        field("management_url"),
                        "must start with http:// or https://, like http://user:password@host:15672",
                    );
                    None
                }
                None => None,
            };
            let channels = check.integer(
                &field("channels"),
                raw.channels,
                DEFAULT_RABBITMQ_CHANNELS,
                1,
                Some(RABBITMQ_MAX_CHANNELS),
            );
            SinkSpec::RabbitMq {
                url,
                publish_timeout,
                max_message_bytes,
                management_url,
                channels,
            }
        }
        "kafka" => {
            let bootstrap_servers = match raw.bootstrap_servers {
                Some(s) if s.trim().is_empty() => {
                    check.problem(
                        field("bootstrap_servers"),
                        "must not be empty; give host:port[,host:port...]",
                    );
                    s
                }
                Some(s) => s,
                None => KAFKA_DEFAULT_BOOTSTRAP.to_owned(),
            };
            SinkSpec::Kafka(KafkaSpec {
                bootstrap_servers,
                publish_timeout: check.duration_at_least(
                    &field("publish_timeout"),
                    raw.publish_timeout,
                    KAFKA_DEFAULT_PUBLISH_TIMEOUT,
                    millisecond,
                ),
                max_message_bytes: check.integer(
                    &field("max_message_bytes"),
                    raw.max_message_bytes,
                    KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
                    1,
                    None,
                ),
                source: source(check),
                extra: raw.extra.unwrap_or_default(),
            })
        }
        "nats" => SinkSpec::Nats(NatsSpec {
            url: raw.url.unwrap_or_else(|| NATS_DEFAULT_URL.to_owned()),
            publish_timeout: check.duration_at_least(
                &field("publish_timeout"),
                raw.publish_timeout,
                DEFAULT_PUBLISH_TIMEOUT,
                millisecond,
            ),
            reconnect_max_delay: check.duration_at_least(
                &field("reconnect_max_delay"),
                raw.reconnect_max_delay,
                DEFAULT_RECONNECT_MAX_DELAY,
                millisecond,
            ),
            max_message_bytes: check.integer(
                &field("max_message_bytes"),
                raw.max_message_bytes,
                NATS_DEFAULT_MAX_MESSAGE_BYTES,
                1,
                None,
            ),
            source: source(check),
        }),
        "redis" => {
            let maxlen_default = raw.maxlen.and_then(|n| {
                if n < 1 {
                    check.problem(
                        field("maxlen"),
                        format!("must be at least 1, got {n}; remove it for no trimming"),
                    );
                    None
                } else {
                    Some(n.unsigned_abs())
                }
            });
            let mut maxlen_per_route = BTreeMap::new();
            for (route, n) in raw.maxlen_per_route.unwrap_or_default() {
                if n < 0 {
                    check.problem(
                        field(&format!("maxlen_per_route.{route}")),
                        format!("must be at least 0 (0 turns trimming off), got {n}"),
                    );
                } else {
                    maxlen_per_route.insert(route, n.unsigned_abs());
                }
            }
            SinkSpec::Redis(RedisSpec {
                url: raw.url.unwrap_or_else(|| REDIS_DEFAULT_URL.to_owned()),
                publish_timeout: check.duration_at_least(
                    &field("publish_timeout"),
                    raw.publish_timeout,
                    DEFAULT_PUBLISH_TIMEOUT,
                    millisecond,
                ),
                reconnect_max_delay: check.duration_at_least(
                    &field("reconnect_max_delay"),
                    raw.reconnect_max_delay,
                    DEFAULT_RECONNECT_MAX_DELAY,
                    millisecond,
                ),
                max_message_bytes: check.integer(
                    &field("max_message_bytes"),
                    raw.max_message_bytes,
                    DEFAULT_MAX_MESSAGE_BYTES,
                    1,
                    None,
                ),
                maxlen_default,
                maxlen_per_route,
                source: source(check),
                wait_replicas: check.integer(&field("wait_replicas"), raw.wait_replicas, 0, 0, Some(64)),
            })
        }
        "webhook" => SinkSpec::Webhook(WebhookSpec {
            secrets: raw.secrets.unwrap_or_default(),
            timeout: check.duration_at_least(&field("timeout"), raw.timeout, WEBHOOK_DEFAULT_TIMEOUT, millisecond),
            concurrency: check.integer(
                &field("concurrency"),
                raw.concurrency,
                WEBHOOK_DEFAULT_CONCURRENCY,
                1,
                Some(WEBHOOK_MAX_CONCURRENCY),
            ),
            max_body_bytes: check.integer(
                &field("max_body_bytes"),
                raw.max_body_bytes,
                WEBHOOK_DEFAULT_MAX_BODY_BYTES,
                1,
                None,
            ),
            source: source(check),
            headers: raw.headers.unwrap_or_default(),
            error_response_bytes: check.integer(
                &field("error_response_bytes"),
                raw.error_response_bytes,
                WEBHOOK_DEFAULT_ERROR_RESPONSE_BYTES,
                0,
                Some(WEBHOOK_MAX_ERROR_RESPONSE_BYTES),
            ),
        }),
        "file" => SinkSpec::File(FileSpec {
            max_file_bytes: check.integer(
                &field("max_file_bytes"),
                raw.max_file_bytes,
                FILE_DEFAULT_MAX_FILE_BYTES,
                FILE_MIN_MAX_FILE_BYTES,
                None,
            ),
        }),
        "stdout" => SinkSpec::Stdout,
        _ => {
            check.problem(
                field("kind"),
                format!("{kind} sinks cannot be configured by this version"),
            );
            return None;
        }
    };
    // The sink's own checks only run on fields that passed ours, so one
    // mistake is not reported twice.
    if check.problems.len() == before
        && compiled_in
        && let Err(message) = sink_check(&spec)
    {
        let fields: Vec<&str> = KIND_FIELDS
            .iter()
            .filter(|(_, takers)| takers.contains(&kind))
            .map(|(f, _)| *f)
            .chain(["maxlen_default"])
            .collect();
        option_problem(check, name, &fields, &message);
    }
    Some(spec)
}

/// Runs the sink's own validation of its options, where it has one.
#[allow(unused_variables)]
fn sink_check(spec: &SinkSpec) -> Result<(), String> {
    match spec {
        #[cfg(feature = "kafka")]
        SinkSpec::Kafka(k) => k.options().validate().map_err(|e| e.message),
        #[cfg(feature = "nats")]
        SinkSpec::Nats(n) => n.options().validate(),
        #[cfg(feature = "redis")]
        SinkSpec::Redis(r) => r.options().validate(),
        #[cfg(feature = "webhook")]
        SinkSpec::Webhook(w) => ferry_sink::webhook::WebhookSink::new(w.options())
            .map(drop)
            .map_err(|e| e.message),
        #[cfg(feature = "file")]
        SinkSpec::File(f) => ferry_sink::file::FileSink::new(f.options())
            .map(drop)
            .map_err(|e| e.message),
        _ => Ok(()),
    }
}

/// Files a sink's own message (`"url: not a ..."`, `"secrets[0] does not
/// ..."`, `"sinks.<kafka>.extra.\"acks\" is ..."`) under the field it names.
fn option_problem(check: &mut Checker, sink: &str, fields: &[&str], message: &str) {
    let message = message.strip_prefix("sinks.<kafka>.").unwrap_or(message);
    let end = message.find([':', ' ']).unwrap_or(message.len());
    let token = &message[..end];
    let root = token.split(['.', '[']).next().unwrap_or_default();
    if !token.is_empty() && fields.contains(&root) {
        // The file says `maxlen` where the options say `maxlen_default`.
        let token = token.replacen("maxlen_default", "maxlen", 1);
        let rest = message[end..].trim_start_matches(':').trim_start();
        check.problem(format!("sinks.{sink}.{token}"), rest);
    } else {
        check.problem(format!("sinks.{sink}"), message);
    }
}

#[cfg(feature = "kafka")]
impl KafkaSpec {
    pub fn options(&self) -> ferry_sink::kafka::KafkaOptions {
        ferry_sink::kafka::KafkaOptions {
            bootstrap_servers: self.bootstrap_servers.clone(),
            publish_timeout: self.publish_timeout,
            max_message_bytes: self.max_message_bytes,
            source: self.source.clone(),
            extra: self.extra.clone(),
        }
    }
}

#[cfg(feature = "nats")]
impl NatsSpec {
    pub fn options(&self) -> ferry_sink::nats::NatsOptions {
        ferry_sink::nats::NatsOptions {
            url: self.url.clone(),
            publish_timeout: self.publish_timeout,
            reconnect_max_delay: self.reconnect_max_delay,
            max_message_bytes: self.max_message_bytes,
            source: self.source.clone(),
        }
    }
}

#[cfg(feature = "redis")]
impl RedisSpec {
    pub fn options(&self) -> ferry_sink::redis::RedisOptions {
        ferry_sink::redis::RedisOptions {
            url: self.url.clone(),
            publish_timeout: self.publish_timeout,
            reconnect_max_delay: self.reconnect_max_delay,
            max_message_bytes: self.max_message_bytes,
            maxlen_default: self.maxlen_default,
            maxlen_per_route: self.maxlen_per_route.clone().into_iter().collect(),
            source: self.source.clone(),
            wait_replicas: self.wait_replicas,
        }
    }
}

#[cfg(feature = "webhook")]
impl WebhookSpec {
    pub fn options(&self) -> ferry_sink::webhook::WebhookOptions {
        ferry_sink::webhook::WebhookOptions {
            secrets: self.secrets.clone(),
            timeout: self.timeout,
            concurrency: self.concurrency,
            max_body_bytes: self.max_body_bytes,
            source: self.source.clone(),
            headers: self.headers.clone(),
            error_response_bytes: self.error_response_bytes,
            ..ferry_sink::webhook::WebhookOptions::default()
        }
    }
}

#[cfg(feature = "file")]
impl FileSpec {
    pub fn options(&self) -> ferry_sink::file::FileOptions {
        ferry_sink::file::FileOptions {
            max_file_bytes: self.max_file_bytes,
        }
    }
}
