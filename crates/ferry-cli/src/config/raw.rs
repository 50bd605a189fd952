//! Step one: the file's shape, and the environment overrides layered on it.
//!
//! These structs mirror the TOML file field for field and reject unknown
//! fields; they check nothing else. Every value is optional here so that
//! step two (in the parent module) can say what is missing and why.

use std::collections::BTreeMap;
use std::fmt;

use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use super::{ConfigError, ENV_PREFIX, Problem};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) database: RawDatabase,
    #[serde(default)]
    pub(super) relay: RawRelay,
    #[serde(default)]
    pub(super) metrics: RawMetrics,
    #[serde(default)]
    pub(super) log: RawLog,
    #[serde(default)]
    pub(super) retention: RawRetention,
    #[serde(default)]
    pub(super) alerts: RawAlerts,
    #[serde(default)]
    pub(super) tracing: RawTracing,
    #[serde(default)]
    pub(super) sinks: BTreeMap<String, RawSink>,
    #[serde(default)]
    pub(super) routes: Vec<RawRoute>,
}

// Numbers are read as i64 so that a negative or zero value reaches step two
// and gets a message with the allowed range, not a serde type error.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDatabase {
    pub(super) url: Option<String>,
    pub(super) max_connections: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRelay {
    pub(super) id: Option<String>,
    pub(super) batch_size: Option<i64>,
    pub(super) lease: Option<DurationText>,
    pub(super) max_attempts: Option<i64>,
    pub(super) backoff_base: Option<DurationText>,
    pub(super) backoff_max: Option<DurationText>,
    pub(super) poll_interval: Option<DurationText>,
    pub(super) shutdown_timeout: Option<DurationText>,
    pub(super) mode: Option<String>,
    pub(super) wal_slot: Option<String>,
    pub(super) wal_publication: Option<String>,
    pub(super) wal_lag_budget_mb: Option<i64>,
    pub(super) wal_read_ahead_mb: Option<i64>,
    pub(super) wal_publish_timeout: Option<DurationText>,
    pub(super) direct_publish_timeout: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) format: Option<String>,
    pub(super) level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetention {
    pub(super) enabled: Option<bool>,
    pub(super) published_window: Option<DurationText>,
    pub(super) dead_window: Option<DurationText>,
    pub(super) batch_size: Option<i64>,
    pub(super) batch_pause: Option<DurationText>,
    pub(super) interval: Option<DurationText>,
    pub(super) archive_dir: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAlerts {
    pub(super) max_pending_age: Option<DurationText>,
    pub(super) max_dead: Option<i64>,
    pub(super) max_blocked_keys: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    pub(super) otlp_endpoint: Option<String>,
    pub(super) service_name: Option<String>,
    pub(super) sample_ratio: Option<f64>,
}

/// The fields of every sink kind side by side, so that a field set on the
/// wrong kind gets a message saying which kind it belongs to.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSink {
    pub(super) kind: Option<String>,
    pub(super) url: Option<String>,
    pub(super) management_url: Option<String>,
    pub(super) publish_timeout: Option<DurationText>,
    pub(super) max_message_bytes: Option<i64>,
    pub(super) reconnect_max_delay: Option<DurationText>,
    pub(super) source: Option<String>,
    pub(super) bootstrap_servers: Option<String>,
    pub(super) extra: Option<BTreeMap<String, String>>,
    pub(super) maxlen: Option<i64>,
    pub(super) maxlen_per_route: Option<BTreeMap<String, i64>>,
    pub(super) wait_replicas: Option<i64>,
    pub(super) secrets: Option<Vec<String>>,
    pub(super) timeout: Option<DurationText>,
    pub(super) concurrency: Option<i64>,
    pub(super) channels: Option<i64>,
    pub(super) max_body_bytes: Option<i64>,
    pub(super) error_response_bytes: Option<i64>,
    pub(super) headers: Option<BTreeMap<String, String>>,
    pub(super) max_file_bytes: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: Option<String>,
    #[serde(rename = "match")]
    pub(super) matcher: Option<String>,
    pub(super) sink: Option<String>,
    pub(super) destination: Option<String>,
    pub(super) routing_key: Option<String>,
}

/// A duration as written. Numbers are accepted here so that `lease = 30`
/// gets the duration message in step two instead of a type error.
#[derive(Debug, Clone)]
pub(super) struct DurationText(pub(super) String);

impl<'de> Deserialize<'de> for DurationText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl Visitor<'_> for TextVisitor {
            type Value = DurationText;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"30s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DurationText, E> {
                Ok(DurationText(v.to_owned()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DurationText, E> {
                Ok(DurationText(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DurationText, E> {
                Ok(DurationText(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<DurationText, E> {
                Ok(DurationText(v.to_string()))
            }
        }
        deserializer.deserialize_any(TextVisitor)
    }
}

const ENV_SOURCE: &str = "environment";

/// The `FERRY_<SECTION>__<FIELD>` variables as a figment provider.
///
/// figment's own `Env` provider reads the process environment directly; this
/// one takes the variables as a value so tests can pass their own. Every
/// field lives in a section, so a name of ours without `__` is a mistake
/// (`FERRY_DATABASE_URL`), and ignoring it would leave the file's value in
/// force without a word: it is refused, except the names Ferry reads for
/// something else ([`OTHER_USES`]).
///
/// Names are matched without regard to case, as the environment's are
/// written in capitals: `FERRY_SINKS__RABBIT__URL` reaches `[sinks.Rabbit]`
/// ([`EnvOverrides::naming_sinks_as`]).
pub(super) struct EnvOverrides(Vec<(Vec<String>, String)>);

/// `FERRY_` names that are not config fields: `FERRY_CONFIG` (the file,
/// read by the command line), and the `FERRY_TEST_*` family (the test
/// suite's service addresses, such as `FERRY_TEST_PG_URL`), which a
/// developer's or CI's shell exports and every `ferry` the tests start
/// inherits. A prefix, not a list: the suite adds services, and no config
/// section is named `test`.
const OTHER_USES: [&str; 2] = ["CONFIG", "TEST_"];

/// Whether `FERRY_<rest>=value` is one of the variables Kubernetes (and
/// Docker links) give every pod for a Service whose name starts with
/// `ferry` (`ferry`, `ferry-metrics`): `<SVC>_SERVICE_HOST=10.0.0.1`,
/// `<SVC>_SERVICE_PORT[_<NAME>]=9464`, `<SVC>_PORT=tcp://10.0.0.1:9464`,
/// `<SVC>_PORT_9464_TCP[_PROTO|_PORT|_ADDR]`. Refused, they would stop
/// every `ferry` in the namespace. Matched by name and value, so that a
/// setting mistyped with one underscore (`FERRY_METRICS_PORT=9464`) is
/// still refused.
fn service_variable(rest: &str, value: &str) -> bool {
    let parts: Vec<&str> = rest.split('_').collect();
    let number = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
    let address = |v: &str| v.parse::<std::net::IpAddr>().is_ok();
    let link = |v: &str| {
        ["tcp://", "udp://", "sctp://"]
            .iter()
            .any(|scheme| v.starts_with(scheme))
    };
    (0..parts.len()).any(|i| match (parts[i], &parts[i + 1..]) {
        ("SERVICE", ["HOST"]) => address(value),
        ("SERVICE", ["PORT", ..]) => number(value),
        ("PORT", []) => link(value),
        ("PORT", [port, proto, more @ ..]) if number(port) && matches!(*proto, "TCP" | "UDP" | "SCTP") => match more {
            [] => link(value),
            ["PROTO"] => matches!(value, "tcp" | "udp" | "sctp"),
            ["PORT"] => number(value),
            ["ADDR"] => address(value),
            _ => false,
        },
        _ => false,
    })
}

impl EnvOverrides {
    pub(super) fn new(env: impl IntoIterator<Item = (String, String)>) -> Result<Self, ConfigError> {
        let mut vars = Vec::new();
        let mut problems = Vec::new();
        for (name, value) in env {
            let Some(rest) = name
                .get(..ENV_PREFIX.len())
                .filter(|head| head.eq_ignore_ascii_case(ENV_PREFIX))
                .map(|_| &name[ENV_PREFIX.len()..])
            else {
                continue;
            };
            if !rest.contains("__") {
                let upper = rest.to_ascii_uppercase();
                let other_use = OTHER_USES.iter().any(|other| {
                    if other.ends_with('_') {
                        upper.starts_with(other)
                    } else {
                        upper == *other
                    }
                }) || service_variable(&upper, &value);
                if !other_use {
                    problems.push(Problem {
                        message: single_underscore(&upper),
                        field: name,
                    });
                }
                continue;
            }
            let keys: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if keys.iter().any(String::is_empty) {
                problems.push(Problem {
                    field: name,
                    message: "empty field name; separate sections and fields with exactly \"__\", as in \
                              FERRY_DATABASE__URL"
                        .into(),
                });
                continue;
            }
            // A list is set whole (`secrets`, comma-separated); a table of
            // lists (`[[routes]]`) only in the file.
            if keys[0] == "routes" {
                problems.push(Problem {
                    field: name,
                    message: "routes cannot be set from the environment; write them as [[routes]] in the \
                              config file (a sink's fields, such as its url, can be: FERRY_SINKS__<NAME>__URL)"
                        .into(),
                });
                continue;
            }
            // A sink may be named "1"; an index anywhere else is a list's.
            let index =
                |(i, k): (usize, &String)| !(i == 1 && keys[0] == "sinks") && k.bytes().all(|b| b.is_ascii_digit());
            if keys.iter().enumerate().any(index) {
                problems.push(Problem {
                    field: name,
                    message: "a list is set whole, its items separated by commas, as in \
                              FERRY_SINKS__<NAME>__SECRETS=whsec_a,whsec_b"
                        .into(),
                });
                continue;
            }
            if let Some(message) = sets_nothing(&keys, &value) {
                problems.push(Problem { field: name, message });
                continue;
            }
            vars.push((keys, value));
        }
        if !problems.is_empty() {
            // The environment's order is arbitrary; the message's is not.
            problems.sort_by(|a, b| a.field.cmp(&b.field));
            return Err(ConfigError { problems });
        }
        Ok(Self(vars))
    }

    /// Spells each `FERRY_SINKS__<NAME>__...` variable's sink name as the
    /// file does (`Rabbit` for `RABBIT`): read in lowercase, it would name
    /// a second sink, and the file's would keep its value.
    pub(super) fn naming_sinks_as<'a>(mut self, file_sinks: impl IntoIterator<Item = &'a str>) -> Self {
        let names: Vec<&str> = file_sinks.into_iter().collect();
        for (keys, _) in &mut self.0 {
            if let [section, name, ..] = keys.as_mut_slice()
                && section == "sinks"
                && let Some(spelled) = names.iter().find(|n| n.eq_ignore_ascii_case(name))
            {
                *name = (*spelled).to_owned();
            }
        }
        self
    }
}

/// Why `FERRY_<section>__<field>=value` is refused when its value is
/// blank, or, for `secrets`, holds a blank item. Such a value is most often
/// a substitution that came out empty (`SECRETS=${WEBHOOK_SECRET}` with the
/// variable unset), and read as set it would replace the file's: an empty
/// `secrets` list sends every webhook unsigned, an empty header value goes
/// out as it is. The file refuses an empty secret; no field takes a blank
/// value from the environment.
fn sets_nothing(keys: &[String], value: &str) -> Option<String> {
    let field = field_path(keys);
    let fix = "unset the variable to keep the config file's value (or the default), or give it a value";
    if value.trim().is_empty() {
        return Some(format!("is empty, which would set {field} to nothing; {fix}"));
    }
    if keys.last().is_some_and(|k| k == "secrets") {
        let items: Vec<&str> = value.split(',').map(str::trim).collect();
        if items.iter().all(|item| item.is_empty()) {
            return Some(format!(
                "holds only commas, which would set {field} to no secret at all and send every webhook \
                 unsigned; {fix}, as in whsec_a,whsec_b"
            ));
        }
        if let Some(i) = items.iter().position(|item| item.is_empty()) {
            return Some(format!(
                "item {} of {} is empty (a doubled or trailing comma, or a part that expanded to nothing); \
                 remove the comma or give the secret",
                i + 1,
                items.len()
            ));
        }
    }
    None
}

/// Why `FERRY_<rest>` (no `__`) is refused, with the name it likely meant:
/// `DATABASE_URL` is `FERRY_DATABASE__URL`.
fn single_underscore(rest: &str) -> String {
    const SECTIONS: [&str; 7] = ["DATABASE", "RELAY", "METRICS", "LOG", "RETENTION", "ALERTS", "TRACING"];
    let meant = rest
        .split_once('_')
        .filter(|(section, field)| SECTIONS.contains(section) && !field.is_empty())
        .map(|(section, field)| format!("{ENV_PREFIX}{section}__{field}"));
    let fix = match meant {
        Some(name) => format!("write {name}"),
        // Sinks are named by the user, so the split cannot be guessed.
        None => "write FERRY_<SECTION>__<FIELD>, as in FERRY_DATABASE__URL or FERRY_SINKS__<NAME>__URL".into(),
    };
    format!(
        "not a setting Ferry reads, and ignoring it would leave the config file's value in force; sections \
         and fields are joined by a double underscore, so {fix} (or unset it)"
    )
}

impl Provider for EnvOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named(ENV_SOURCE).interpolater(|_: &Profile, keys: &[&str]| {
            let keys: Vec<String> = keys.iter().map(|k| k.to_ascii_uppercase()).collect();
            format!("{ENV_PREFIX}{}", keys.join("__"))
        })
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut root = Dict::new();
        for (keys, value) in &self.0 {
            // Values stay strings: extract_lossy reads "10" as a number where
            // a number is expected, and a password such as "12345" stays text.
            let value = if keys.last().is_some_and(|k| k == "secrets") {
                // The one list a sink has; base64 holds no comma. Blank
                // items were refused in `new`.
                Value::from(
                    value
                        .split(',')
                        .map(str::trim)
                        .map(str::to_owned)
                        .collect::<Vec<String>>(),
                )
            } else {
                Value::from(value.clone())
            };
            insert(&mut root, keys, value);
        }
        Ok(Profile::Default.collect(root))
    }
}

fn insert(dict: &mut Dict, keys: &[String], value: Value) {
    match keys {
        [] => {}
        [last] => {
            dict.insert(last.clone(), value);
        }
        [first, rest @ ..] => {
            let entry = dict.entry(first.clone()).or_insert_with(|| Value::from(Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, child) = entry {
                insert(child, rest, value);
            }
        }
    }
}

pub(super) fn extract(figment: &Figment, file: &str) -> Result<RawConfig, ConfigError> {
    figment.extract_lossy().map_err(|error| ConfigError {
        problems: error.into_iter().map(|e| figment_problem(e, file)).collect(),
    })
}

fn figment_problem(error: figment::Error, file: &str) -> Problem {
    use figment::error::Kind;
    // For an unknown field the path already ends with the field's name.
    let path = &error.path;
    let message = match &error.kind {
        Kind::UnknownField(_, expected) => {
            format!(
                "unknown field{}; remove it or use one of: {}",
                env_source(&error, path),
                expected.join(", ")
            )
        }
        // The value itself is never echoed: it may be a secret set through
        // the environment, where every value is a string.
        Kind::InvalidType(actual, expected) => {
            format!(
                "expected {expected}, found {}{}",
                kind_of(actual),
                env_source(&error, path)
            )
        }
        Kind::InvalidValue(actual, expected) => {
            format!(
                "expected {expected}, found {}{}",
                kind_of(actual),
                env_source(&error, path)
            )
        }
        kind => format!("{kind}{}", env_source(&error, path)),
    };
    if path.is_empty() {
        // No field: a syntax error in the file, whose message has the line
        // and column. Not the line's text, which the parser quotes: it may
        // hold a secret (an unclosed quote after a password in a URL).
        let message = message
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !quotes_the_source(line))
            .collect::<Vec<_>>()
            .join(": ");
        return Problem {
            field: file.to_owned(),
            message,
        };
    }
    Problem {
        field: field_path(path),
        message,
    }
}

/// A line of a parse error that shows the file: `3 | url = "..."`, or the
/// `|` and `^` lines around it.
fn quotes_the_source(line: &str) -> bool {
    let rest = line.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start();
    rest.starts_with('|')
}

/// ` (set by FERRY_X__Y)` when the value came from the environment, which the
/// field path alone would not reveal.
/// What kind of value `actual` is, without the value.
fn kind_of(actual: &figment::error::Actual) -> &'static str {
    use figment::error::Actual;
    match actual {
        Actual::Bool(_) => "a boolean",
        Actual::Unsigned(_) | Actual::Signed(_) => "an integer",
        Actual::Float(_) => "a number",
        Actual::Char(_) | Actual::Str(_) => "a string",
        Actual::Bytes(_) => "bytes",
        Actual::Unit => "an empty value",
        Actual::Option => "an optional value",
        Actual::Seq => "a list",
        Actual::Map => "a table",
        _ => "another kind of value",
    }
}

fn env_source(error: &figment::Error, path: &[String]) -> String {
    match &error.metadata {
        Some(md) if md.name == ENV_SOURCE => {
            format!(" (set by {})", md.interpolate(&Profile::Default, path))
        }
        _ => String::new(),
    }
}

/// `["routes", "1", "sink"]` -> `routes[1].sink`.
pub(super) fn field_path(keys: &[String]) -> String {
    let mut out = String::new();
    for key in keys {
        if key.parse::<usize>().is_ok() && !out.is_empty() {
            out.push_str(&format!("[{key}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(key);
        }
    }
    out
}
