//! Ferry's configuration, read in two steps.
//!
//! Step one reads a TOML file (see `ferry.example.toml` beside this crate's
//! manifest) and the `FERRY_<SECTION>__<FIELD>` environment overrides into
//! serde structs that mirror the file and reject unknown fields. Step two turns
//! those into a [`Config`] of checked, typed values with defaults filled in.
//! Every problem found names the field and says how to fix it, and step two
//! reports all of them at once rather than one per run.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ferry_core::{Glob, RetryPolicy, Route, redact};
use figment::Figment;
use figment::providers::{Format, Toml};

use crate::duration::{format_duration, parse_duration};

mod otel;
mod raw;
mod sinks;

pub use otel::TracingConfig;
use raw::{
    DurationText, EnvOverrides, RawAlerts, RawConfig, RawDatabase, RawLog, RawRelay, RawRetention, RawRoute, extract,
};
pub use sinks::{FileSpec, KafkaSpec, NatsSpec, RedisSpec, WebhookSpec};

/// Environment variables starting with this override config fields, with
/// `__` between section and field: `FERRY_DATABASE__URL` sets
/// `database.url`. A name without `__` is refused, except `FERRY_CONFIG`
/// and the test suite's `FERRY_TEST_*`.
pub const ENV_PREFIX: &str = "FERRY_";

/// The checked configuration of a Ferry relay.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub database: DatabaseConfig,
    pub relay: RelaySettings,
    /// Where the Prometheus endpoint listens; `None` serves no metrics.
    pub metrics: Option<SocketAddr>,
    pub log: LogConfig,
    pub retention: RetentionConfig,
    pub alerts: AlertsConfig,
    /// OpenTelemetry export; `None` exports no spans.
    pub tracing: Option<TracingConfig>,
    /// Sinks by name, as routes refer to them.
    pub sinks: BTreeMap<String, SinkSpec>,
    /// In file order.
    pub routes: Vec<Route>,
}

/// The outbox database.
#[derive(Clone, PartialEq, Eq)]
pub struct DatabaseConfig {
    /// A `postgres://` or `postgresql://` URL, or `sqlite://path` (one relay
    /// per database file).
    pub url: String,
    /// Upper bound of the relay's connection pool.
    pub max_connections: u32,
}

/// How the relay claims and retries events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelaySettings {
    /// Names this relay in leases, logs and metrics; unique per process.
    pub id: String,
    /// Events claimed per round trip.
    pub batch_size: usize,
    /// How long a claim stays valid; after it lapses another relay may take
    /// the events.
    pub lease: Duration,
    /// Attempts before an event is dead; the first publish counts.
    pub max_attempts: u32,
    /// Delay after the first failure; doubles per further failure.
    pub backoff_base: Duration,
    /// The retry delay never grows past this.
    pub backoff_max: Duration,
    /// Fallback poll while idle, catching anything a wake-up missed.
    pub poll_interval: Duration,
    /// On SIGTERM, how long in-flight publishes may finish before their
    /// events are released.
    pub shutdown_timeout: Duration,
    /// How new events reach the relay: polling the outbox, or streaming
    /// from a logical replication slot (PostgreSQL only).
    pub mode: RelayMode,
    /// The replication slot of WAL mode; created on first use.
    pub wal_slot: String,
    /// The publication of WAL mode; created on first use.
    pub wal_publication: String,
    /// WAL the slot may hold back before the relay warns and `ferry check`
    /// fails, in bytes.
    pub wal_lag_budget: u64,
    /// In WAL mode, how much change data the replication connection reads
    /// ahead of the relay, in bytes; the server holds the rest.
    pub wal_read_ahead: usize,
    /// In WAL mode, a route's publish that takes longer counts as failed and
    /// goes to the table path, so one slow destination cannot hold the
    /// stream up for the others.
    pub wal_publish_timeout: Duration,
    /// Polling mode: a route's share of a batch published straight from the
    /// outbox that takes longer counts as failed and goes to the route's
    /// worker, so one slow destination cannot hold the others up.
    pub direct_publish_timeout: Duration,
}

/// How new events reach the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayMode {
    /// Producers' commits wake the relay, which reads the outbox table.
    Poll,
    /// The relay streams committed events from a logical replication slot.
    Wal,
}

/// Retention: which settled events are deleted, when, and whether they are
/// archived first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionConfig {
    /// Whether `ferry run` deletes in the background; `ferry purge` runs
    /// either way.
    pub enabled: bool,
    /// Events whose deliveries are all published go this long after the
    /// last publish.
    pub published_window: Duration,
    /// Events with a dead or cancelled delivery go this long after it
    /// settled; `None` ("never") keeps them until an operator acts.
    pub dead_window: Option<Duration>,
    /// Events deleted per short transaction.
    pub batch_size: usize,
    /// Rest between batches, so the relay never queues behind retention.
    pub batch_pause: Duration,
    /// How often `ferry run` runs retention.
    pub interval: Duration,
    /// Each batch is written here (gzipped JSON lines) and fsynced before it
    /// is deleted.
    pub archive_dir: Option<PathBuf>,
}

impl RetentionConfig {
    pub fn rules(&self) -> ferry_store::RetentionRules {
        ferry_store::RetentionRules {
            published: self.published_window,
            settled: self.dead_window,
            batch_size: self.batch_size,
            pause: self.batch_pause,
        }
    }
}

/// Logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A level (`info`) or a `tracing` filter (`info,ferry=debug`).
    pub level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Thresholds `ferry status` checks, so that it can serve as a monitoring
/// check: a breach makes it exit 3. An unset threshold is not checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlertsConfig {
    /// The oldest event still waiting, to be routed or published, on any
    /// route.
    pub max_pending_age: Option<Duration>,
    /// Dead deliveries on one route.
    pub max_dead: Option<u64>,
    /// Keys held back by a failed or dead delivery on one route.
    pub max_blocked_keys: Option<u64>,
}

/// A configured destination; routes name it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SinkSpec {
    RabbitMq {
        /// `amqp://` or `amqps://` URL.
        url: String,
        /// How long to wait for a publisher confirm before the publish counts
        /// as failed (transiently).
        publish_timeout: Duration,
        /// Larger events are dead at once: the broker would reject them.
        max_message_bytes: usize,
        /// The management API that `check` asks for bindings; default
        /// derived from `url`.
        management_url: Option<String>,
        /// Confirm-mode channels a batch is spread over, by key.
        channels: usize,
    },
    /// Kafka, through an idempotent producer.
    Kafka(KafkaSpec),
    /// NATS JetStream.
    Nats(NatsSpec),
    /// Redis Streams.
    Redis(RedisSpec),
    /// HTTP POSTs, signed.
    Webhook(WebhookSpec),
    /// JSON lines appended to files.
    File(FileSpec),
    /// Writes each event to standard output.
    Stdout,
}

impl Config {
    /// The retry policy the relay applies to failed publishes.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.relay.max_attempts,
            base_delay: self.relay.backoff_base,
            max_delay: self.relay.backoff_max,
            jitter: 0.2,
        }
    }
}

// Config is logged at start-up; the URLs may carry passwords.
impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &redact::url(&self.url))
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl fmt::Debug for SinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SinkSpec::RabbitMq {
                url,
                publish_timeout,
                max_message_bytes,
                management_url,
                channels,
            } => f
                .debug_struct("RabbitMq")
                .field("url", &redact::url(url))
                .field("publish_timeout", publish_timeout)
                .field("max_message_bytes", max_message_bytes)
                .field("management_url", &management_url.as_deref().map(redact::url))
                .field("channels", channels)
                .finish(),
            SinkSpec::Kafka(k) => f.debug_tuple("Kafka").field(k).finish(),
            SinkSpec::Nats(n) => f.debug_tuple("Nats").field(n).finish(),
            SinkSpec::Redis(r) => f.debug_tuple("Redis").field(r).finish(),
            SinkSpec::Webhook(w) => f.debug_tuple("Webhook").field(w).finish(),
            SinkSpec::File(file) => f.debug_tuple("File").field(file).finish(),
            SinkSpec::Stdout => f.write_str("Stdout"),
        }
    }
}

/// Why a configuration was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    problems: Vec<Problem>,
}

/// One thing wrong with a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The field (`routes[1].sink`), or the file for problems with the file
    /// itself.
    pub field: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl ConfigError {
    fn one(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            problems: vec![Problem {
                field: field.into(),
                message: message.into(),
            }],
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.problems.as_slice() {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} problems in the configuration:", many.len())?;
                many.iter().try_for_each(|p| write!(f, "\n  {p}"))
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Reads the config file at `path` (none: environment only) and applies the
/// `FERRY_*__*` overrides from the process environment.
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    // Variables that are not Unicode cannot be config values; vars() would
    // panic on them.
    let env = std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    load_with_env(path, env)
}

/// [`load`] with the environment passed in, so tests need not mutate the
/// process's own.
pub fn load_with_env(
    path: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let mut figment = Figment::new();
    if let Some(path) = path {
        // Read it here rather than through figment's file provider, which
        // treats a missing file as empty and searches parent directories.
        let text = std::fs::read_to_string(path).map_err(|e| {
            let fix = if e.kind() == std::io::ErrorKind::NotFound {
                "check the path given with --config or FERRY_CONFIG"
            } else {
                "make the file readable by this user"
            };
            ConfigError::one(
                path.display().to_string(),
                format!("cannot read the config file ({e}); {fix}"),
            )
        })?;
        figment = figment.merge(Toml::string(&text));
    }
    // The file's sink names, as it spells them.
    let file_sinks: Vec<String> = match figment.find_value("sinks") {
        Ok(figment::value::Value::Dict(_, sinks)) => sinks.into_keys().collect(),
        _ => Vec::new(),
    };
    let env = EnvOverrides::new(env)?.naming_sinks_as(file_sinks.iter().map(String::as_str));
    let figment = figment.merge(env);
    let file = path.map_or_else(|| "config".to_owned(), |p| p.display().to_string());
    let raw = extract(&figment, &file)?;
    validate(raw, path.is_some())
}

/// Parses a config from TOML text alone, without the environment: for
/// configs Ferry writes itself (`ferry demo`) and for tests, which no
/// process environment can disturb.
#[cfg(any(test, feature = "demo"))]
pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
    let raw = extract(&Figment::from(Toml::string(toml)), "config")?;
    validate(raw, true)
}

const DEFAULT_MAX_CONNECTIONS: u32 = 10;
const DEFAULT_BATCH_SIZE: usize = 500;
const MAX_BATCH_SIZE: i64 = 10_000;
const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const MIN_LEASE: Duration = Duration::from_secs(2);
const DEFAULT_MAX_ATTEMPTS: u32 = 12;
const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(500);
const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(300);
const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(60);
const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_WAL_NAME: &str = "ferry";
const DEFAULT_WAL_LAG_BUDGET_MB: i64 = 1024;
/// 1 TiB: a larger budget is no budget, and its bytes would overflow.
const MAX_WAL_LAG_BUDGET_MB: i64 = 1024 * 1024;
const DEFAULT_WAL_READ_AHEAD_MB: usize = 64;
/// The read-ahead budget is a semaphore counted in u32 bytes.
const MAX_WAL_READ_AHEAD_MB: i64 = 4095;
/// Raised, like the direct bound, to twice every sink's own timeout.
const DEFAULT_WAL_PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// At least twice every sink's own timeout, which raises it where one is
/// longer than 15 s.
const DEFAULT_DIRECT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_PUBLISHED_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
const DEFAULT_RETENTION_BATCH: usize = 1_000;
const DEFAULT_RETENTION_PAUSE: Duration = Duration::from_millis(50);
const DEFAULT_RETENTION_INTERVAL: Duration = Duration::from_secs(300);
const TEMPLATE_PLACEHOLDERS: [&str; 4] = ["type", "domain", "key", "id"];

/// An integer type a config field is read into, with its largest value as
/// an `i64` (saturated), for the range an error names.
trait Bounded: TryFrom<i64> {
    const MAX_I64: i64;
}

macro_rules! bounded {
    ($($t:ty),*) => {
        $(impl Bounded for $t {
            const MAX_I64: i64 = if (<$t>::MAX as u128) > (i64::MAX as u128) { i64::MAX } else { <$t>::MAX as i64 };
        })*
    };
}

bounded!(u16, u32, u64, usize, i32, i64);

/// Collects problems; each check returns a usable value (the default when
/// the input is bad) so one pass finds every problem.
#[derive(Default)]
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn problem(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            field: field.into(),
            message: message.into(),
        });
    }

    fn duration(&mut self, field: &str, raw: Option<DurationText>, default: Duration) -> Duration {
        match raw.map(|t| parse_duration(&t.0)) {
            None => default,
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                self.problem(field, e);
                default
            }
        }
    }

    fn duration_at_least(
        &mut self,
        field: &str,
        raw: Option<DurationText>,
        default: Duration,
        min: Duration,
    ) -> Duration {
        let d = self.duration(field, raw, default);
        if d < min {
            let min_text = if min == Duration::from_millis(1) {
                "more than 0s".to_owned()
            } else {
                format!("at least {}", format_duration(min))
            };
            self.problem(
                field,
                format!("{} is too short; it must be {min_text}", format_duration(d)),
            );
        }
        d
    }

    /// `max: None` leaves the upper bound to the target type.
    fn integer<T: Bounded>(&mut self, field: &str, raw: Option<i64>, default: T, min: i64, max: Option<i64>) -> T {
        let Some(value) = raw else { return default };
        let message = match max {
            Some(max) if value < min || value > max => format!("must be between {min} and {max}, got {value}"),
            None if value < min => format!("must be at least {min}, got {value}"),
            _ => match T::try_from(value) {
                Ok(v) => return v,
                Err(_) => format!("must be at most {}, got {value}", T::MAX_I64),
            },
        };
        self.problem(field, message);
        default
    }

    fn finish(self, config: Config) -> Result<Config, ConfigError> {
        if self.problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError {
                problems: self.problems,
            })
        }
    }
}

fn validate(raw: RawConfig, from_file: bool) -> Result<Config, ConfigError> {
    let mut check = Checker::default();
    let database = database(&mut check, raw.database, from_file);
    let direct_bound_set = raw.relay.direct_publish_timeout.is_some();
    let wal_bound_set = raw.relay.wal_publish_timeout.is_some();
    let mut relay = relay(&mut check, raw.relay);
    if relay.mode == RelayMode::Wal
        && !(database.url.starts_with("postgres://") || database.url.starts_with("postgresql://"))
    {
        check.problem(
            "relay.mode",
            "\"wal\" streams from PostgreSQL logical replication; with this database.url use \"poll\"",
        );
    }
    let metrics = raw
        .metrics
        .listen
        .and_then(|listen| match SocketAddr::from_str(&listen) {
            Ok(addr) => Some(addr),
            Err(_) => {
                check.problem(
                    "metrics.listen",
                    format!("{listen:?} is not an address; write it like \"127.0.0.1:9464\" or \"[::]:9464\""),
                );
                None
            }
        });
    let log = log(&mut check, raw.log);
    let retention = retention(&mut check, raw.retention);
    let alerts = alerts(&mut check, raw.alerts);
    let tracing = otel::tracing(&mut check, raw.tracing);
    // Routes are checked against every sink the file declares, so a sink with
    // a problem of its own does not also show up as "no sink named".
    let declared: BTreeSet<String> = raw.sinks.keys().cloned().collect();
    let sinks: BTreeMap<String, SinkSpec> = raw
        .sinks
        .into_iter()
        .filter_map(|(name, sink)| Some((name.clone(), sinks::sink_spec(&mut check, &name, sink)?)))
        .collect();
    let wal_mode = relay.mode == RelayMode::Wal;
    for (name, sink) in &sinks {
        // A sink's batch may take its timeout per message write and again
        // for the confirms: a publish bounded at less than twice it would be
        // abandoned, and sent again, in a merely slow moment.
        if let Some((field, timeout)) = sink.publish_bound() {
            for (bound_field, bound, set) in [
                (
                    "relay.direct_publish_timeout",
                    &mut relay.direct_publish_timeout,
                    direct_bound_set,
                ),
                // Only WAL mode reads it: a value left in a file while polling is no problem.
                (
                    "relay.wal_publish_timeout",
                    &mut relay.wal_publish_timeout,
                    wal_bound_set && wal_mode,
                ),
            ] {
                if *bound >= timeout * 2 {
                    continue;
                }
                if set {
                    check.problem(
                        bound_field,
                        format!(
                            "{} is less than twice sinks.{name}.{field} ({}); a batch that merely took the \
                             sink's time would be abandoned and sent again, so raise it or lower the timeout",
                            format_duration(*bound),
                            format_duration(timeout)
                        ),
                    );
                } else {
                    *bound = timeout * 2;
                }
            }
        }
        if let Some((field, timeout)) = sink.publish_bound()
            && relay.lease <= timeout
        {
            check.problem(
                "relay.lease",
                format!(
                    "{} is not longer than sinks.{name}.{field} ({}); a publish could outlast its lease \
                     and the event be delivered twice, so raise relay.lease or lower the timeout",
                    format_duration(relay.lease),
                    format_duration(timeout)
                ),
            );
        }
    }
    let routes = routes(&mut check, raw.routes, &declared);
    maxlen_routes(&mut check, &sinks, &routes);
    shared_streams(&mut check, &sinks, &routes);
    routing_keys(&mut check, &sinks, &routes);
    check.finish(Config {
        database,
        relay,
        metrics,
        log,
        retention,
        alerts,
        tracing,
        sinks,
        routes,
    })
}

/// The query parameters sqlx's PostgreSQL driver reads from a URL.
const POSTGRES_PARAMETERS: [&str; 18] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

fn database(check: &mut Checker, raw: RawDatabase, from_file: bool) -> DatabaseConfig {
    let max_connections = check.integer(
        "database.max_connections",
        raw.max_connections,
        DEFAULT_MAX_CONNECTIONS,
        1,
        None,
    );
    let Some(url) = raw.url else {
        let hint = if from_file {
            ""
        } else {
            " (no config file was given: pass --config FILE or set FERRY_CONFIG)"
        };
        check.problem(
            "database.url",
            format!("missing; set it in the config file or FERRY_DATABASE__URL{hint}"),
        );
        return DatabaseConfig {
            url: String::new(),
            max_connections,
        };
    };
    // Only the scheme is echoed: the rest may hold a password.
    let scheme = if url.to_ascii_lowercase().starts_with("sqlite:") {
        Some("sqlite".to_owned())
    } else {
        url.split_once("://").map(|(s, _)| s.to_ascii_lowercase())
    };
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => {
            // The driver ignores a parameter it does not know, and logs its
            // value when it connects: a misspelt `password` would be logged.
            // Others it ignores are left alone (a pooler's or another
            // driver's parameters, shared URLs carry them).
            let query = url.split_once('?').map_or("", |(_, query)| query);
            let unknown: Vec<&str> = query
                .split('&')
                .filter_map(|pair| pair.split('=').next())
                .filter(|key| {
                    let lower = key.to_ascii_lowercase();
                    !POSTGRES_PARAMETERS.contains(key)
                        && !lower.starts_with("options")
                        && ["pass", "pasw", "pwd", "secret", "token", "key", "auth"]
                            .iter()
                            .any(|s| lower.contains(s))
                })
                .collect();
            if !unknown.is_empty() {
                check.problem(
                    "database.url",
                    format!(
                        "query parameter {} is not one the PostgreSQL driver reads: it would be ignored, and \
                         its value, which looks secret, written to the log; remove it or use one of: {}",
                        unknown.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", "),
                        POSTGRES_PARAMETERS.join(", ")
                    ),
                );
            } else if let Err(e) = sqlx::postgres::PgConnectOptions::from_str(&url) {
                check.problem(
                    "database.url",
                    format!(
                        "not a valid PostgreSQL URL ({e}); write it like postgres://user:password@host:5432/dbname"
                    ),
                );
            }
        }
        #[cfg(feature = "sqlite")]
        Some("sqlite") => {
            if let Err(e) = sqlx::sqlite::SqliteConnectOptions::from_str(&url) {
                check.problem(
                    "database.url",
                    format!("not a valid SQLite URL ({e}); write it like sqlite://path/to/ferry.db"),
                );
            }
        }
        #[cfg(not(feature = "sqlite"))]
        Some("sqlite") => check.problem(
            "database.url",
            "this ferry was built without SQLite; rebuild it with `--features sqlite`, or use a postgres:// URL",
        ),
        Some(other) => check.problem(
            "database.url",
            format!("unsupported database {other:?}; use a postgres:// or sqlite:// URL"),
        ),
        None => check.problem(
            "database.url",
            "not a URL; write it like postgres://user:password@host:5432/dbname",
        ),
    }
    DatabaseConfig { url, max_connections }
}

fn relay(check: &mut Checker, raw: RawRelay) -> RelaySettings {
    let id = match raw.id {
        None => default_relay_id(),
        Some(id) if id.trim().is_empty() || id.chars().any(char::is_control) => {
            check.problem(
                "relay.id",
                "must be non-empty text without control characters; remove it to use <hostname>-<pid>-<hex>",
            );
            id
        }
        Some(id) => id,
    };
    let millisecond = Duration::from_millis(1);
    let backoff_base = check.duration_at_least(
        "relay.backoff_base",
        raw.backoff_base,
        DEFAULT_BACKOFF_BASE,
        millisecond,
    );
    let backoff_max = check.duration("relay.backoff_max", raw.backoff_max, DEFAULT_BACKOFF_MAX);
    if backoff_max < backoff_base {
        check.problem(
            "relay.backoff_max",
            format!(
                "{} is less than relay.backoff_base ({}); raise backoff_max or lower backoff_base",
                format_duration(backoff_max),
                format_duration(backoff_base)
            ),
        );
    }
    RelaySettings {
        id,
        batch_size: check.integer(
            "relay.batch_size",
            raw.batch_size,
            DEFAULT_BATCH_SIZE,
            1,
            Some(MAX_BATCH_SIZE),
        ),
        lease: check.duration_at_least("relay.lease", raw.lease, DEFAULT_LEASE, MIN_LEASE),
        max_attempts: check.integer("relay.max_attempts", raw.max_attempts, DEFAULT_MAX_ATTEMPTS, 1, None),
        backoff_base,
        backoff_max,
        poll_interval: check.duration_at_least(
            "relay.poll_interval",
            raw.poll_interval,
            DEFAULT_POLL_INTERVAL,
            millisecond,
        ),
        // Zero would abort every publish in flight at a stop and leave no
        // time to close the sinks and hand the leases back.
        shutdown_timeout: check.duration_at_least(
            "relay.shutdown_timeout",
            raw.shutdown_timeout,
            DEFAULT_SHUTDOWN_TIMEOUT,
            Duration::from_secs(1),
        ),
        mode: match raw.mode.as_deref() {
            None | Some("poll") => RelayMode::Poll,
            Some("wal") => {
                if cfg!(not(feature = "postgres")) {
                    check.problem(
                        "relay.mode",
                        "this ferry was built without WAL streaming; rebuild it with `--features postgres`, or use \"poll\"",
                    );
                }
                RelayMode::Wal
            }
            Some(other) => {
                check.problem(
                    "relay.mode",
                    format!(
                        "unknown mode {other:?}; use \"poll\" (the default) or \"wal\" (PostgreSQL logical replication)"
                    ),
                );
                RelayMode::Poll
            }
        },
        wal_slot: wal_name(check, "relay.wal_slot", raw.wal_slot),
        wal_publication: wal_name(check, "relay.wal_publication", raw.wal_publication),
        wal_lag_budget: check.integer::<u64>(
            "relay.wal_lag_budget_mb",
            raw.wal_lag_budget_mb,
            DEFAULT_WAL_LAG_BUDGET_MB as u64,
            1,
            Some(MAX_WAL_LAG_BUDGET_MB),
        ) * 1024
            * 1024,
        wal_read_ahead: check.integer::<usize>(
            "relay.wal_read_ahead_mb",
            raw.wal_read_ahead_mb,
            DEFAULT_WAL_READ_AHEAD_MB,
            1,
            Some(MAX_WAL_READ_AHEAD_MB),
        ) * 1024
            * 1024,
        wal_publish_timeout: check.duration_at_least(
            "relay.wal_publish_timeout",
            raw.wal_publish_timeout,
            DEFAULT_WAL_PUBLISH_TIMEOUT,
            Duration::from_millis(10),
        ),
        direct_publish_timeout: check.duration_at_least(
            "relay.direct_publish_timeout",
            raw.direct_publish_timeout,
            DEFAULT_DIRECT_PUBLISH_TIMEOUT,
            Duration::from_millis(10),
        ),
    }
}

/// A slot or publication name PostgreSQL takes unquoted.
fn wal_name(check: &mut Checker, field: &str, raw: Option<String>) -> String {
    let name = raw.unwrap_or_else(|| DEFAULT_WAL_NAME.to_owned());
    #[cfg(feature = "postgres")]
    if !ferry_store::postgres::wal::valid_name(&name) {
        check.problem(field, format!("{name:?}: use 1 to 63 characters of a-z, 0-9 and _"));
    }
    // Without WAL streaming, relay.mode = "wal" is refused instead.
    #[cfg(not(feature = "postgres"))]
    let _ = (check, field);
    name
}

/// `<hostname>-<pid>-<4 hex>`: readable in `ferry status`, and unique even
/// when a supervisor restarts a relay that reuses its predecessor's pid.
fn default_relay_id() -> String {
    format!("{}-{}-{:04x}", hostname(), std::process::id(), rand::random::<u16>())
}

fn hostname() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes, which is the
        // length passed; gethostname writes nothing beyond it.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        // POSIX leaves a truncated name without its NUL; stop at the buffer's end then.
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if rc == 0
            && let Ok(name) = std::str::from_utf8(&buf[..end])
            && !name.is_empty()
        {
            return name.to_owned();
        }
    }
    "ferry".to_owned()
}

fn retention(check: &mut Checker, raw: RawRetention) -> RetentionConfig {
    let second = Duration::from_secs(1);
    let published_window = check.duration_at_least(
        "retention.published_window",
        raw.published_window,
        DEFAULT_PUBLISHED_WINDOW,
        second,
    );
    // Kept unless a window is set: a dead event holds its key back until an
    // operator requeues or cancels it, and deleting it would release the
    // key and lose the event without anyone deciding to.
    let dead_window = match raw.dead_window {
        None => None,
        Some(text) if text.0.trim() == "never" => None,
        raw => Some(check.duration_at_least("retention.dead_window", raw, published_window, second)),
    };
    if let Some(dead) = dead_window
        && dead < published_window
    {
        check.problem(
            "retention.dead_window",
            format!(
                "{} is shorter than retention.published_window ({}); dead and cancelled events are kept at \
                 least as long as published ones, so raise dead_window or set it to \"never\"",
                format_duration(dead),
                format_duration(published_window)
            ),
        );
    }
    let archive_dir = match raw.archive_dir {
        Some(dir) if dir.trim().is_empty() => {
            check.problem(
                "retention.archive_dir",
                "must not be empty; name a directory, or remove it to delete without archiving",
            );
            None
        }
        dir => dir.map(PathBuf::from),
    };
    RetentionConfig {
        enabled: raw.enabled.unwrap_or(true),
        published_window,
        dead_window,
        batch_size: check.integer(
            "retention.batch_size",
            raw.batch_size,
            DEFAULT_RETENTION_BATCH,
            1,
            Some(MAX_BATCH_SIZE),
        ),
        batch_pause: check.duration("retention.batch_pause", raw.batch_pause, DEFAULT_RETENTION_PAUSE),
        interval: check.duration_at_least("retention.interval", raw.interval, DEFAULT_RETENTION_INTERVAL, second),
        archive_dir,
    }
}

fn alerts(check: &mut Checker, raw: RawAlerts) -> AlertsConfig {
    let max_pending_age = raw.max_pending_age.map(|text| {
        check.duration_at_least(
            "alerts.max_pending_age",
            Some(text),
            Duration::ZERO,
            Duration::from_secs(1),
        )
    });
    AlertsConfig {
        max_pending_age,
        max_dead: raw
            .max_dead
            .map(|n| check.integer("alerts.max_dead", Some(n), 0, 0, None)),
        max_blocked_keys: raw
            .max_blocked_keys
            .map(|n| check.integer("alerts.max_blocked_keys", Some(n), 0, 0, None)),
    }
}

fn log(check: &mut Checker, raw: RawLog) -> LogConfig {
    let format = match raw.format.as_deref() {
        None | Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => {
            check.problem(
                "log.format",
                format!("unknown format {other:?}; use \"text\" or \"json\""),
            );
            LogFormat::Text
        }
    };
    let level = raw.level.unwrap_or_else(|| "info".to_owned());
    if let Err(message) = check_log_filter(&level) {
        check.problem("log.level", message);
    }
    LogConfig { format, level }
}

/// The levels tracing knows, as `log.level` and `RUST_LOG` name them.
pub(crate) const LOG_LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The crate a bare word names as tracing reads it (`ferry_relay::lease`
/// names `ferry_relay`), or `None` for a level name, a directive with a
/// level, several directives or a span filter.
pub(crate) fn bare_target(value: &str) -> Option<&str> {
    if value.contains(['=', ',', '[']) || LOG_LEVELS.contains(&value.to_ascii_lowercase().as_str()) {
        return None;
    }
    Some(value.split("::").next().unwrap_or(value))
}

/// Checks a log level or filter, as `log.level` or `RUST_LOG` gives it; the
/// error says what is wrong and which values are taken.
pub(crate) fn check_log_filter(level: &str) -> Result<(), String> {
    let fix = "use one of off, error, warn, info, debug, trace, or a filter like \"info,ferry=debug\"";
    // A bare word that is not a level would be read by tracing as a target
    // name ("verbose" = everything from target `verbose`, so nothing of
    // Ferry's): almost surely a typo.
    if bare_target(level).is_some() {
        return Err(format!("unknown level {level:?}; {fix}"));
    }
    tracing_subscriber::EnvFilter::try_new(level)
        .map(drop)
        .map_err(|e| format!("{level:?} is not a valid filter ({e}); {fix}"))
}

fn routes(check: &mut Checker, raw: Vec<RawRoute>, sinks: &BTreeSet<String>) -> Vec<Route> {
    // Route names key per-route delivery state, so a collision would merge
    // two routes' progress.
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    let mut routes = Vec::with_capacity(raw.len());
    for (i, r) in raw.into_iter().enumerate() {
        let field = |f: &str| format!("routes[{i}].{f}");
        let matcher = match r.matcher {
            None => {
                check.problem(
                    field("match"),
                    "missing; set match to a glob on the event type, like \"order.*\"",
                );
                None
            }
            Some(pattern) => Glob::new(pattern).map_err(|e| check.problem(field("match"), e)).ok(),
        };
        let sink = match r.sink {
            None => {
                let fix = match sink_names(sinks) {
                    Some(names) => format!("set sink to one of: {names}"),
                    None => "no sinks are defined yet; add a [sinks.<name>] table and name it here".to_owned(),
                };
                check.problem(field("sink"), format!("missing; {fix}"));
                String::new()
            }
            Some(sink) => {
                if !sinks.contains(&sink) {
                    let others = sink_names(sinks).map(|names| format!(" or use one of: {names}"));
                    check.problem(
                        field("sink"),
                        format!(
                            "no sink named {sink:?}; define [sinks.{sink}]{}",
                            others.unwrap_or_default()
                        ),
                    );
                }
                sink
            }
        };
        let destination = match r.destination {
            Some(d) if !d.is_empty() => {
                check_template(check, &field("destination"), &d);
                d
            }
            _ => {
                check.problem(
                    field("destination"),
                    "missing; set destination to where the sink sends (for RabbitMQ, the exchange)",
                );
                String::new()
            }
        };
        if let Some(key) = &r.routing_key {
            check_template(check, &field("routing_key"), key);
        }
        let (name, explicit) = match r.name {
            Some(name) => (name, true),
            None => (format!("{sink}:{destination}"), false),
        };
        if !explicit && redact::carries_secrets(&without_placeholders(&destination)) {
            // The name is a metric label, a log field and a column: a token
            // in the destination would go wherever the name goes.
            check.problem(
                field("name"),
                format!(
                    "missing; the default name <sink>:<destination> would carry the destination's \
                     credentials, query or a token in its path ({}) into metrics, logs and the \
                     database: set name = \"...\" \
                     (a route that already has deliveries under its default name keeps them only \
                     under that name: write it out as the name, or cancel them after renaming)",
                    redact::url(&destination)
                ),
            );
        }
        // What messages show of the name: a default one holds the
        // destination, credentials and all.
        let shown = if explicit {
            format!("{name:?}")
        } else {
            format!("{:?}", format!("{sink}:{}", redact::url(&destination)))
        };
        if explicit && name.trim().is_empty() {
            check.problem(
                field("name"),
                "must not be empty; remove it to use the default <sink>:<destination>",
            );
        }
        // Names in parentheses are Ferry's own: `(no route)` holds the
        // dead deliveries of events no route matched, and a route by that
        // name would share them (its keys held back behind them), and
        // `(direct)` labels metrics.
        if name.starts_with('(') {
            check.problem(
                field("name"),
                format!(
                    "{shown} starts with '(', which Ferry keeps for its own names such as {:?}; choose another name",
                    ferry_core::NO_ROUTE
                ),
            );
        }
        if let Some(first) = names.get(&name) {
            let whose = if explicit {
                "the name"
            } else {
                "the default name (<sink>:<destination>)"
            };
            check.problem(
                field("name"),
                format!("{whose} {shown} is already used by routes[{first}]; set name = \"...\" to tell them apart"),
            );
        } else {
            names.insert(name.clone(), i);
        }
        if let Some(matcher) = matcher {
            routes.push(Route {
                name,
                matcher,
                sink,
                destination,
                routing_key: r.routing_key,
            });
        }
    }
    routes
}

/// A Redis sink's `maxlen_per_route` may only name routes that send to it:
/// a misspelt name would silently leave a stream untrimmed.
fn maxlen_routes(check: &mut Checker, sinks: &BTreeMap<String, SinkSpec>, routes: &[Route]) {
    for (name, sink) in sinks {
        let SinkSpec::Redis(redis) = sink else { continue };
        let own: Vec<&str> = routes
            .iter()
            .filter(|r| r.sink == *name)
            .map(|r| r.name.as_str())
            .collect();
        let fix = if own.is_empty() {
            format!("no route sends to sinks.{name} yet; remove the entry or add a route with sink = \"{name}\"")
        } else {
            format!("use the name of one of its routes: {}", own.join(", "))
        };
        for route in redis.maxlen_per_route.keys() {
            let message = match routes.iter().find(|r| r.name == *route) {
                None => format!("no route is named {route:?}; {fix}"),
                Some(r) if r.sink != *name => {
                    format!("route {route:?} sends to sink {:?}, not to this one; {fix}", r.sink)
                }
                Some(_) => continue,
            };
            check.problem(format!("sinks.{name}.maxlen_per_route.{route}"), message);
        }
    }
}

/// `MAXLEN ~ n` trims the whole stream, whichever route's XADD carries it:
/// two routes of one Redis sink that write the same stream with different
/// trimming would trim each other's entries, so the one promised less
/// trimming (or none) would not get it. Templates are not compared: which
/// keys they render to is known only per event (the README says to keep
/// such routes on streams apart).
fn shared_streams(check: &mut Checker, sinks: &BTreeMap<String, SinkSpec>, routes: &[Route]) {
    let shown = |maxlen: Option<u64>| maxlen.map_or("none (no trimming)".to_owned(), |n| n.to_string());
    for (name, sink) in sinks {
        let SinkSpec::Redis(redis) = sink else { continue };
        // The route's trimming, and the field that sets it.
        let maxlen = |route: &str| match redis.maxlen_per_route.get(route) {
            Some(&n) => ((n > 0).then_some(n), format!("sinks.{name}.maxlen_per_route.{route}")),
            None => (redis.maxlen_default, format!("sinks.{name}.maxlen")),
        };
        let literal: Vec<&Route> = routes
            .iter()
            .filter(|r| r.sink == *name && !r.destination.contains('{'))
            .collect();
        for (i, later) in literal.iter().enumerate() {
            let (later_n, field) = maxlen(&later.name);
            let Some(earlier) = literal[..i]
                .iter()
                .find(|r| r.destination == later.destination && maxlen(&r.name).0 != later_n)
            else {
                continue;
            };
            check.problem(
                field,
                format!(
                    "routes {:?} (maxlen {}) and {:?} (maxlen {}) both write stream {:?}, and XADD MAXLEN trims \
                     the whole stream, so one route's trimming removes the other's entries too; give them the \
                     same maxlen, or separate streams",
                    earlier.name,
                    shown(maxlen(&earlier.name).0),
                    later.name,
                    shown(later_n),
                    later.destination
                ),
            );
        }
    }
}

/// Only RabbitMQ routes by a routing key: on a route to any other sink it
/// would be read by nothing, and the events sent where `destination` says.
fn routing_keys(check: &mut Checker, sinks: &BTreeMap<String, SinkSpec>, routes: &[Route]) {
    for (i, route) in routes.iter().enumerate() {
        let (Some(_), Some(sink)) = (&route.routing_key, sinks.get(&route.sink)) else {
            continue;
        };
        let kind = match sink {
            SinkSpec::RabbitMq { .. } => continue,
            SinkSpec::Kafka(_) => "kafka",
            SinkSpec::Nats(_) => "nats",
            SinkSpec::Redis(_) => "redis",
            SinkSpec::Webhook(_) => "webhook",
            SinkSpec::File(_) => "file",
            SinkSpec::Stdout => "stdout",
        };
        check.problem(
            format!("routes[{i}].routing_key"),
            format!(
                "sink {:?} is a {kind} sink, which takes no routing key (only rabbitmq does); remove it, and \
                 put what it should select in destination (a template may use {{type}}, {{domain}}, {{key}}, {{id}})",
                route.sink
            ),
        );
    }
}

/// The defined sinks' names, comma-separated; `None` when there are none.
fn sink_names(sinks: &BTreeSet<String>) -> Option<String> {
    (!sinks.is_empty()).then(|| sinks.iter().map(String::as_str).collect::<Vec<_>>().join(", "))
}

/// `template` with its placeholders taken out: what is literally in it.
fn without_placeholders(template: &str) -> String {
    let mut out = template.to_owned();
    for p in TEMPLATE_PLACEHOLDERS {
        out = out.replace(&format!("{{{p}}}"), "");
    }
    out
}

/// Catches a misspelt placeholder, which would otherwise send every event to
/// a destination literally named `{tpye}`.
///
/// A destination may be a URL with a password or a token in it: messages
/// show it through [`redact::url`], and leave out an unknown placeholder
/// that only the hidden parts hold.
fn check_template(check: &mut Checker, field: &str, template: &str) {
    let shown = redact::url(template);
    let mut rest = template;
    let mut unknown = BTreeSet::new();
    let mut hidden = 0;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            // Where, since the redacted text may not show it.
            let at = template[..template.len() - rest.len() + open].chars().count() + 1;
            check.problem(
                field,
                format!("{shown:?} has an unclosed {{ (character {at}); close it, or remove it"),
            );
            return;
        };
        let name = &rest[open + 1..open + close];
        if !TEMPLATE_PLACEHOLDERS.contains(&name) {
            let placeholder = format!("{{{name}}}");
            if shown.contains(&placeholder) {
                unknown.insert(placeholder);
            } else {
                hidden += 1;
            }
        }
        rest = &rest[open + close + 1..];
    }
    if hidden > 0 {
        unknown.insert(format!(
            "{{...}} ({hidden} in the credentials, query or fragment of {shown:?}, not shown here)"
        ));
    }
    if !unknown.is_empty() {
        let known: Vec<String> = TEMPLATE_PLACEHOLDERS.iter().map(|p| format!("{{{p}}}")).collect();
        check.problem(
            field,
            format!(
                "unknown placeholder {}; use {}",
                unknown.into_iter().collect::<Vec<_>>().join(", "),
                known.join(", ")
            ),
        );
    }
}

#[cfg(test)]
mod tests;
