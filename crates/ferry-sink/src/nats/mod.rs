//! The NATS JetStream sink: every event is published to a subject with a
//! reply inbox and counts as published only once a stream's PubAck says it
//! is stored.
//!
//! - `Nats-Msg-Id` is `<event id>:<subject>` ([`msg_id`]), so the stream's
//!   duplicate window drops a re-publish to the same subject after a crash
//!   (a PubAck with `duplicate: true` is a success), while the same event
//!   sent by two routes to two subjects of one stream is stored under each:
//!   JetStream deduplicates by message id across the whole stream.
//! - CloudEvents 1.0 binary mode: `ce-id`, `ce-type`, `ce-source`, `ce-time`,
//!   `ce-specversion`, and `ce-subject` for the aggregate key; `content-type`
//!   and the producer's own headers ride along.
//! - A subject that no stream captures gets "no responders" (`503`) from the
//!   server, never a success. So does a stream electing its leader, which
//!   passes: the sink retries it (transient, naming the subject), `check`
//!   reports a plain subject that no stream captures before the relay starts,
//!   and warns of a template none of whose subjects a stream captures; an
//!   event sent there ends dead after the retry policy's `max_attempts`.
//! - `check` refuses a template whose own text cannot make a subject (a
//!   wildcard or an empty token: `events.>.{type}`, `events..{domain}`),
//!   which would send every event dead at its first attempt.
//! - `check` refuses a stream that would confirm every event the route sends
//!   and keep none (`no_ack`, or interest retention with no consumer whose
//!   filter matches the route's subject), for a template's streams as for a
//!   plain subject's; a template only some of whose subjects are wanted, or
//!   only some of whose streams would keep them, is warned of.
//! - A subject whose first token the event's key made and NATS reserves
//!   (`$JS`, `$SYS`, any `$…`, `_INBOX`, `_R_`) is refused (dead): an event
//!   keyed `$JS.API.STREAM.PURGE.EVENTS` under `{key}` would purge a stream.
//! - A batch is pipelined: every publish is queued, then every PubAck awaited,
//!   all within `publish_timeout`.
//!
//! ```no_run
//! use std::time::Duration;
//! use ferry_sink::nats::{NatsOptions, NatsSink};
//!
//! let sink = NatsSink::new(NatsOptions {
//!     url: "nats://ferry:secret@nats:4222".into(),
//!     publish_timeout: Duration::from_secs(5),
//!     ..NatsOptions::default()
//! });
//! ```

mod codes;
mod connector;
mod message;
mod publish;
mod subjects;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::RequestErrorKind;
use async_trait::async_trait;
use bytes::Bytes;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::sync::Mutex;
use tokio::time::timeout;
use tracing::info;

pub use codes::{
    ACCOUNT_RESOURCES_EXCEEDED, CLUSTER_NOT_AVAILABLE, CLUSTER_NOT_LEADER, EXPECTED_STREAM_MISMATCH,
    HEADER_EXCEEDS_MAXIMUM, INSUFFICIENT_RESOURCES, JETSTREAM_NOT_ENABLED, JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
    MEMORY_RESOURCES_EXCEEDED, MESSAGE_EXCEEDS_MAXIMUM, STORAGE_RESOURCES_EXCEEDED, STORE_FAILED, STREAM_NOT_FOUND,
    STREAM_OFFLINE, STREAM_SEALED, WRONG_LAST_MSG_ID, WRONG_LAST_SEQUENCE, api_error_kind, status_kind,
};
pub use message::{MSG_ID_HEADER, SPEC_VERSION, msg_id};

use crate::batch::log_published;
use connector::{Connector, Denial, Handle};
use ferry_core::prepare_in_key_order;
use message::{Message, key_makes_first_token, template_filter, validate_template};
use subjects::Shape;

/// How a [`NatsSink`] connects and publishes.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsOptions {
    /// `nats://[user:password@]host:port` (or `tls://`); a token goes in the
    /// user part. Default `nats://127.0.0.1:4222`.
    pub url: String,
    /// How long to wait for NATS: for the PubAcks of a batch once it is
    /// queued, and for each connect or check. Default 10 s.
    pub publish_timeout: Duration,
    /// The longest pause between failed connection attempts. Default 30 s.
    pub reconnect_max_delay: Duration,
    /// Payloads larger than this are refused (permanently) before sending;
    /// so is a message larger than the server's `max_payload` (1 MiB by
    /// default), headers included. Default 1 MiB.
    pub max_message_bytes: usize,
    /// The CloudEvents `source` attribute. Default `"ferry"`.
    pub source: String,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 1024 * 1024,
            source: "ferry".into(),
        }
    }
}

impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsOptions")
            .field("url", &ferry_core::redact::url(&self.url))
            .field("publish_timeout", &self.publish_timeout)
            .field("reconnect_max_delay", &self.reconnect_max_delay)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("source", &self.source)
            .finish()
    }
}

impl NatsOptions {
    /// Checks the options, naming the field that is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if async_nats::ServerAddr::from_str(&self.url).is_err() {
            return Err(format!(
                "url: {:?} is not a nats:// or tls:// URL",
                ferry_core::redact::url(&self.url)
            ));
        }
        if self.publish_timeout.is_zero() {
            return Err("publish_timeout: must be above zero".into());
        }
        if self.max_message_bytes == 0 {
            return Err("max_message_bytes: must be above zero".into());
        }
        Ok(())
    }
}

/// Publishes to JetStream subjects over one connection, reused across
/// batches. The route's `destination` is the subject and may be a template
/// (`events.{domain}.{type}`); `routing_key` is not used.
pub struct NatsSink {
    options: NatsOptions,
    connector: Mutex<Connector>,
    /// The server's `max_payload` once connected, `0` before.
    server_max_payload: Arc<AtomicUsize>,
}

impl NatsSink {
    /// Creates the sink without connecting: the connection is made on first
    /// use, so a relay can start while NATS is still down.
    pub fn new(options: NatsOptions) -> Self {
        let connector = Connector::new(
            options.url.clone(),
            options.publish_timeout,
            options.reconnect_max_delay,
        );
        Self {
            server_max_payload: connector.max_payload(),
            options,
            connector: Mutex::new(connector),
        }
    }

    pub fn options(&self) -> &NatsOptions {
        &self.options
    }

    fn prepare(&self, route: &Route, event: &StoredEvent) -> Result<Message, SinkError> {
        let opts = &self.options;
        let server_max = self.server_max_payload.load(Ordering::Relaxed);
        Message::prepare(route, event, &opts.source, opts.max_message_bytes, server_max)
    }
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink")
            .field("publish_timeout", &self.options.publish_timeout)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct StreamNames {
    streams: Option<Vec<String>>,
    error: Option<ApiError>,
}

/// Forgets the connection of a batch cut short (the relay's bound passed,
/// or its lease ran out): PubAcks are still owed on it, and a server that
/// stalled would hold the next batch for its whole timeout too. The next
/// batch connects anew.
struct Abandoned<'a>(Option<&'a mut Connector>);

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(connector) = self.0.take() {
            connector.lost(SinkError::transient("a publish was abandoned mid-batch"));
        }
    }
}

#[derive(Deserialize)]
struct StreamInfo {
    config: Option<StreamConfig>,
    state: Option<StreamState>,
    error: Option<ApiError>,
}

#[derive(Deserialize, Default)]
struct StreamState {
    #[serde(default)]
    consumer_count: u64,
}

/// What of a stream's config decides whether Ferry's publishes can be
/// confirmed and deduplicated.
#[derive(Deserialize, Default)]
struct StreamConfig {
    /// Empty for a stream that only mirrors or sources others.
    #[serde(default)]
    subjects: Vec<String>,
    #[serde(default)]
    no_ack: bool,
    /// Nanoseconds; 0 when the server did not say (its default is 2 min).
    #[serde(default)]
    duplicate_window: u64,
    /// `limits`, `interest` or `workqueue`.
    #[serde(default)]
    retention: String,
    /// Rewrites the subject a message is stored under (NATS 2.10 and
    /// later); its consumers filter the rewritten subjects.
    #[serde(default)]
    subject_transform: Option<SubjectTransform>,
}

#[derive(Deserialize, Default, Debug, Clone, PartialEq, Eq)]
struct SubjectTransform {
    /// The subjects rewritten; empty for all.
    #[serde(default)]
    src: String,
    #[serde(default)]
    dest: String,
}

/// A page of `$JS.API.CONSUMER.LIST.<stream>`.
#[derive(Deserialize)]
struct ConsumerPage {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    consumers: Option<Vec<ConsumerInfo>>,
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct ConsumerInfo {
    #[serde(default)]
    config: ConsumerConfig,
}

/// Which of a stream's subjects a consumer wants.
#[derive(Deserialize, Default, Debug, Clone, PartialEq, Eq)]
struct ConsumerConfig {
    #[serde(default)]
    filter_subject: String,
    /// Several filters (NATS 2.10 and later), instead of `filter_subject`.
    #[serde(default)]
    filter_subjects: Option<Vec<String>>,
}

impl ConsumerConfig {
    /// The consumer's filters: `>` (all the stream holds) when it has none.
    fn filters(&self) -> Vec<&str> {
        let mut filters: Vec<&str> = self.filter_subjects.iter().flatten().map(String::as_str).collect();
        filters.extend(Some(self.filter_subject.as_str()));
        filters.retain(|f| !f.is_empty());
        if filters.is_empty() {
            filters.push(">");
        }
        filters
    }
}

/// A subject rendered with the event key holds the key as it is: a key
/// with a `.` in it makes a deeper subject than the template suggests, and
/// one that cannot be part of a subject at all goes dead.
fn key_in_subject_caveat(route: &Route) -> Option<String> {
    let template = route.destination.as_str();
    template.contains("{key}").then(|| {
        let deeper = template.replace("{key}", "a.b");
        let one_token = template.replace("{key}", "*");
        format!(
            "route {:?}: subject template {template:?} holds the event key as it is, and a '.' in a \
             key makes more tokens: key \"a.b\" is published to {deeper:?}, which consumers filtering \
             {one_token:?} never see and a stream capturing only {one_token:?} does not store (the \
             event is retried, then goes dead); a key that is empty or has a space, '*' or '>' in it \
             goes dead at once. Keep such keys out of the route's events, or use {{domain}} and \
             {{type}} instead",
            route.name
        )
    })
}

/// What `check` cannot promise for a template whose own text is valid:
/// that a stream captures its subjects (none does when no stream's subjects
/// overlap `filter`: every event would be retried, then go dead), and that
/// a key in it makes one token.
fn template_caveats(route: &Route, filter: &str, streams: &[String]) -> Vec<String> {
    let subject = &route.destination;
    let mut caveats = Vec::new();
    if streams.is_empty() {
        caveats.push(format!(
            "route {:?}: no JetStream stream captures any subject that template {subject:?} renders \
             (none overlaps {filter:?}), so every event sent by it would be retried, then go dead; \
             create a stream whose subjects include them (e.g. `nats stream add EVENTS --subjects \
             '{filter}'`) or fix routes[].destination",
            route.name
        ));
    } else {
        info!(route = %route.name, subject, ?streams, "subject template overlaps JetStream streams");
    }
    caveats.extend(key_in_subject_caveat(route));
    caveats.extend(first_token_caveat(route));
    caveats
}

/// A template whose first token the event's key makes may render a subject
/// NATS reserves (`$JS.API.…`, `_INBOX.…`, `_R_.…`): such an event is
/// refused, and dead. `{domain}`, `{type}` and `{id}` cannot make one.
fn first_token_caveat(route: &Route) -> Option<String> {
    let template = route.destination.as_str();
    key_makes_first_token(template).then(|| {
        format!(
            "route {:?}: subject template {template:?} takes its first token from the event's key \
             ({{key}}), so an event whose key makes it start with '$' or be \"_INBOX\" or \"_R_\" \
             (subjects NATS reserves for its API, system and replies: `$JS.API.…` would be a \
             JetStream request) is not sent and goes dead at once; start the template with a fixed \
             token (e.g. \"events.{template}\")",
            route.name
        )
    })
}

/// How many of the streams capturing a template's subjects `check` asks
/// about (a request or two each), so that a template as wide as `{type}`
/// on a server with many streams is checked in bounded time.
const MOST_STREAMS_LOOKED_AT: usize = 50;

/// The relay's default longest retry delay (`relay.backoff_max`): a stream
/// that forgets a message id sooner may store a retried publish twice.
const RECOMMENDED_DUPLICATE_WINDOW: Duration = Duration::from_secs(300);

/// What a refusal means for `check`. Without the PubAck inbox no event can
/// be confirmed: a configuration error. Without the JetStream API only the
/// check itself is blind; publishing needs no API subject, so the relay
/// may still start.
///
/// async-nats subscribes its request inbox once per connection, so the
/// server refuses it once: the connection is dropped then, or the next
/// check on it would wait out its timeout without hearing why.
fn refused_in_check(connector: &mut Connector, denial: &Denial) -> SinkError {
    let error = denial.error();
    match denial.publish_to {
        None => connector.lost(SinkError::config(error.message)),
        Some(_) => SinkError::transient(format!(
            "{}; the stream cannot be checked without it, though publishing does not need it",
            error.message
        )),
    }
}

/// A JetStream API request within `limit`. `Err(None)`: no answer in time;
/// `Err(Some(_))`: the server refused a permission the request needs (to
/// publish to the API subject, or to subscribe to the reply inbox), which
/// it says only on the connection.
async fn ask(
    handle: &mut Handle,
    api: String,
    body: Bytes,
    limit: Duration,
) -> Result<Result<async_nats::Message, async_nats::RequestError>, Option<Denial>> {
    let Handle { client, denied, .. } = handle;
    let seen = denied.borrow_and_update().total;
    // Refusals of other subjects (a route's publishes) are not this request's.
    let refused = async {
        while denied.changed().await.is_ok() {
            if let Some(denial) = denied.borrow_and_update().since(seen).find(|d| d.stops(&api)) {
                return denial.clone();
            }
        }
        std::future::pending().await
    };
    tokio::select! {
        answer = timeout(limit, client.request(api.clone(), body)) => answer.map_err(|_| None),
        denial = refused => Err(Some(denial)),
    }
}

/// Refuses a stream that never acknowledges (every event would wait out its
/// PubAck and go dead, stored or not) or that would delete every event the
/// route sends it on arrival (interest retention with no consumer whose
/// filter matches `filter`, the route's subject or its template's filter);
/// warns of one that deletes only some (a template's subjects, only some
/// of which a consumer wants) and of a duplicate window shorter than a
/// retry may come. Work-queue retention keeps a message no consumer wants
/// until one does: nothing is lost there.
fn stream_caveats(
    route: &Route,
    stream: &str,
    filter: &str,
    config: &StreamConfig,
    state: &StreamState,
    consumers: &[ConsumerConfig],
) -> Result<Vec<String>, SinkError> {
    let mut caveats = Vec::new();
    // Acknowledged, then deleted on arrival: nobody wants it.
    if config.retention == "interest" && (state.consumer_count == 0 || consumers.is_empty()) {
        return Err(SinkError::config(format!(
            "route {:?}: stream {stream:?} keeps a message only while a consumer wants it (interest \
             retention) and has no consumer, so every event sent to it would be confirmed and deleted at \
             once; add the consumers first (`nats consumer add {stream}`), or give the stream limits \
             retention",
            route.name
        )));
    }
    if config.retention == "interest" {
        caveats.extend(interest_caveat(route, stream, filter, config, consumers)?);
    }
    if config.no_ack {
        return Err(SinkError::config(format!(
            "route {:?}: stream {stream:?} is set not to acknowledge publishes (no_ack), so no \
             event sent to it could be confirmed; turn no_ack off (`nats stream edit {stream} \
             --ack`) or route elsewhere",
            route.name
        )));
    }
    let window = Duration::from_nanos(config.duplicate_window);
    if !window.is_zero() && window < RECOMMENDED_DUPLICATE_WINDOW {
        caveats.push(format!(
            "stream {stream:?} keeps message ids for {window:?} only: an event published again after a \
             lost PubAck later than that (a retry's delay grows to relay.backoff_max, 5 min by default) \
             is stored twice; raise it (`nats stream edit {stream} --dupe-window 10m`)"
        ));
    }
    Ok(caveats)
}

/// An interest stream deletes on arrival a message no consumer's filter
/// matches, after acknowledging it. Of the subjects the route renders (its
/// subject, or its template's shape), the stream holds what its own
/// subjects capture. Refused when no consumer wants any of that, warned of
/// when the consumers' filters, together, match only some of it. A stream
/// that rewrites those subjects (`subject_transform`) stores them under
/// others, which its consumers filter: they are not compared, and a caveat
/// says so.
fn interest_caveat(
    route: &Route,
    stream: &str,
    filter: &str,
    config: &StreamConfig,
    consumers: &[ConsumerConfig],
) -> Result<Option<String>, SinkError> {
    let template = &route.destination;
    let sent = [Shape::template(template)];
    let captured: Vec<Shape> = if config.subjects.is_empty() {
        vec![Shape::filter(">")]
    } else {
        config.subjects.iter().map(|s| Shape::filter(s)).collect()
    };
    if !subjects::meet(&[&sent, &captured]) {
        // It holds none of the route's subjects.
        return Ok(None);
    }
    if let Some(transform) = config.subject_transform.as_ref().filter(|t| !t.dest.is_empty()) {
        let src = if transform.src.is_empty() {
            ">"
        } else {
            transform.src.as_str()
        };
        if subjects::meet(&[&sent, &captured, &[Shape::filter(src)]]) {
            return Ok(Some(format!(
                "route {:?}: stream {stream:?} keeps a message only while a consumer wants it (interest \
                 retention) and stores what it captures of {template:?} under other subjects \
                 (subject_transform {src:?} -> {:?}), which its consumers filter: `ferry check` did not \
                 compare their filters with the route's subjects; make sure a consumer wants the \
                 rewritten subjects, or any event nobody wants is confirmed and deleted at once",
                route.name, transform.dest
            )));
        }
    }
    let wanted: Vec<&str> = consumers.iter().flat_map(ConsumerConfig::filters).collect();
    let wanted_shapes: Vec<Shape> = wanted.iter().map(|f| Shape::filter(f)).collect();
    let mut shown: Vec<String> = Vec::new();
    for f in &wanted {
        let f = format!("{f:?}");
        if !shown.contains(&f) {
            shown.push(f);
        }
    }
    if shown.len() > 5 {
        let more = shown.len() - 5;
        shown.truncate(5);
        shown.push(format!("and {more} more"));
    }
    let shown = shown.join(", ");
    let (what, add) = if template.contains('{') {
        (
            format!("any subject template {template:?} renders ({filter:?})"),
            format!("nats consumer add {stream} --filter '{filter}'"),
        )
    } else {
        (
            format!("subject {template:?}"),
            format!("nats consumer add {stream} --filter '{template}'"),
        )
    };
    if !subjects::meet(&[&sent, &captured, &wanted_shapes]) {
        return Err(SinkError::config(format!(
            "route {:?}: stream {stream:?} keeps a message only while a consumer wants it (interest \
             retention), and no consumer's filter ({shown}) matches {what}, so every event sent to it \
             would be confirmed and deleted at once; add a consumer that wants it (`{add}`), or give \
             the stream limits retention",
            route.name
        )));
    }
    let all = subjects::covered(&[&sent, &captured], &wanted_shapes);
    Ok((!all).then(|| {
        format!(
            "route {:?}: stream {stream:?} keeps a message only while a consumer wants it (interest \
             retention), and its consumers' filters ({shown}), together, match only some of the \
             subjects template {template:?} renders ({filter:?}): an event sent to any other is \
             confirmed and deleted at once; add a consumer that wants them (`{add}`), or give the \
             stream limits retention",
            route.name
        )
    }))
}

/// One JetStream API request in `check`, its answer read as `T`.
async fn ask_for<T: DeserializeOwned>(
    connector: &mut Connector,
    handle: &mut Handle,
    api: String,
    body: Bytes,
    limit: Duration,
) -> Result<T, SinkError> {
    let answer = match ask(handle, api.clone(), body, limit).await {
        Err(Some(denial)) => return Err(refused_in_check(connector, &denial)),
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return Err(SinkError::transient(format!("asking JetStream ({api}): {e}"))),
        Err(None) => {
            return Err(connector.lost(SinkError::transient(format!(
                "asking JetStream ({api}): no answer within {limit:?}"
            ))));
        }
    };
    serde_json::from_slice(&answer.payload)
        .map_err(|e| SinkError::transient(format!("unreadable answer to {api}: {e}")))
}

/// How `stream` is set up and, for interest retention (where they decide
/// what is kept), what its consumers want.
async fn look_at(
    connector: &mut Connector,
    handle: &mut Handle,
    stream: &str,
    limit: Duration,
) -> Result<(StreamConfig, StreamState, Vec<ConsumerConfig>), SinkError> {
    let api = format!("$JS.API.STREAM.INFO.{stream}");
    let info: StreamInfo = ask_for(connector, handle, api, Bytes::new(), limit).await?;
    if let Some(err) = info.error {
        return Err(codes::error(
            api_error_kind(err.err_code),
            format!("asking JetStream about stream {stream:?}: {}", err.description),
        ));
    }
    let (config, state) = (info.config.unwrap_or_default(), info.state.unwrap_or_default());
    let mut consumers = Vec::new();
    if config.retention == "interest" && state.consumer_count > 0 {
        // A page holds up to 256; a consumer added meanwhile may shift one
        // to the next page, seen twice, which is harmless here.
        loop {
            let api = format!("$JS.API.CONSUMER.LIST.{stream}");
            let body = Bytes::from(serde_json::json!({ "offset": consumers.len() }).to_string());
            let page: ConsumerPage = ask_for(connector, handle, api, body, limit).await?;
            if let Some(err) = page.error {
                return Err(codes::error(
                    api_error_kind(err.err_code),
                    format!(
                        "asking JetStream about the consumers of stream {stream:?}: {}",
                        err.description
                    ),
                ));
            }
            let page_consumers = page.consumers.unwrap_or_default();
            let done = page_consumers.is_empty();
            consumers.extend(page_consumers.into_iter().map(|c| c.config));
            if done || consumers.len() >= page.total {
                break;
            }
        }
    }
    Ok((config, state, consumers))
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u16,
    #[serde(default)]
    description: String,
}

#[async_trait]
impl Sink for NatsSink {
    fn kind(&self) -> &'static str {
        "nats"
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
        let mut connector = self.connector.lock().await;
        // Connect first so the server's max_payload is known when preparing.
        if let Err(e) = connector.handle_to_publish().await {
            return events.iter().map(|_| Err(e.clone())).collect();
        }
        // The relay admits events first; checking again keeps a direct caller
        // from sending what admit() would have refused, out of key order.
        let prepared = prepare_in_key_order(events, |event| self.prepare(route, event));
        let mut held = Abandoned(Some(&mut connector));
        let link = held.0.as_deref_mut().expect("held until the batch ends");
        let outcomes = publish::publish_batch(link, prepared, self.options.publish_timeout).await;
        held.0 = None;
        log_published("NATS", route, events, &outcomes);
        outcomes
    }

    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        for caveat in self.check_with_caveats(route).await? {
            tracing::warn!(route = %route.name, "{caveat}");
        }
        Ok(())
    }

    /// Checks the subject (a template's own text), connects, and asks
    /// JetStream which stream captures it and, for a plain subject, how
    /// that stream is set up. A template names many subjects, known only
    /// per event: for it, a caveat says when no stream captures any of them.
    async fn check_with_caveats(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        let subject = route.destination.as_str();
        let templated = subject.contains('{');
        let what = if templated { "subject template" } else { "subject" };
        if let Err(why) = validate_template(subject) {
            return Err(SinkError::config(format!(
                "route {:?}: {what} {subject:?} {why}; fix routes[].destination",
                route.name
            )));
        }
        let mut connector = self.connector.lock().await;
        let mut handle = connector.handle().await?;
        let limit = self.options.publish_timeout;
        // A filter: JetStream names every stream whose subjects overlap it.
        let filter = if templated {
            template_filter(subject)
        } else {
            subject.to_owned()
        };
        let api = "$JS.API.STREAM.NAMES";
        let body = Bytes::from(serde_json::json!({ "subject": filter }).to_string());
        let answer = match ask(&mut handle, api.to_owned(), body, limit).await {
            Err(Some(denial)) => return Err(refused_in_check(&mut connector, &denial)),
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) if e.kind() == RequestErrorKind::NoResponders => {
                return Err(SinkError::config(format!(
                    "JetStream is not enabled on the NATS server at {} (no responders on {api}); \
                     start nats-server with -js or use an account with JetStream",
                    connector.display_url()
                )));
            }
            Ok(Err(e)) => return Err(SinkError::transient(format!("asking JetStream ({api}): {e}"))),
            Err(None) => {
                return Err(connector.lost(SinkError::transient(format!(
                    "asking JetStream ({api}): no answer within {limit:?}"
                ))));
            }
        };
        let names: StreamNames = serde_json::from_slice(&answer.payload)
            .map_err(|e| SinkError::transient(format!("unreadable answer to {api}: {e}")))?;
        if let Some(err) = names.error {
            return Err(codes::error(
                api_error_kind(err.err_code),
                format!(
                    "asking JetStream which stream captures {subject:?}: {}",
                    err.description
                ),
            ));
        }
        let streams = names.streams.unwrap_or_default();
        if templated {
            // Every stream that captures some of the template's subjects is
            // looked at; one refusing all it captures is refused only when
            // every such stream is (no event of the route could be kept),
            // and warned of otherwise.
            let mut caveats = template_caveats(route, &filter, &streams);
            let mut refusals = Vec::new();
            for stream in streams.iter().take(MOST_STREAMS_LOOKED_AT) {
                let (config, state, consumers) = look_at(&mut connector, &mut handle, stream, limit).await?;
                match stream_caveats(route, stream, &filter, &config, &state, &consumers) {
                    Ok(more) => caveats.extend(more),
                    Err(refusal) => refusals.push(refusal),
                }
            }
            if !refusals.is_empty() && refusals.len() == streams.len() {
                return Err(refusals.swap_remove(0));
            }
            if let Some(more) = streams.len().checked_sub(MOST_STREAMS_LOOKED_AT).filter(|n| *n > 0) {
                caveats.push(format!(
                    "route {:?}: {} JetStream streams capture subjects of template {subject:?}; the \
                     first {MOST_STREAMS_LOOKED_AT} were looked at, not the other {more}",
                    route.name,
                    streams.len()
                ));
            }
            caveats.extend(refusals.into_iter().map(|refusal| {
                format!(
                    "{} (other streams capture other subjects of the template)",
                    refusal.message
                )
            }));
            return Ok(caveats);
        }
        match streams.first() {
            Some(stream) => {
                info!(route = %route.name, subject, stream, "subject is captured by a JetStream stream");
                let (config, state, consumers) = look_at(&mut connector, &mut handle, stream, limit).await?;
                stream_caveats(route, stream, subject, &config, &state, &consumers)
            }
            None => Err(SinkError::config(format!(
                "route {:?}: no JetStream stream captures subject {subject:?}; create one whose subjects \
                 include it (e.g. `nats stream add EVENTS --subjects '{subject}'`) or fix routes[].destination",
                route.name
            ))),
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
    fn a_subject_holding_the_key_carries_a_caveat() {
        let route = |destination: &str| Route {
            name: "orders".into(),
            matcher: ferry_core::Glob::new("order.**").unwrap(),
            sink: "nats".into(),
            destination: destination.into(),
            routing_key: None,
        };
        let caveat = key_in_subject_caveat(&route("orders.{key}")).expect("a caveat");
        assert!(caveat.contains("\"orders.{key}\""), "{caveat}");
        // A dotted key is published deeper, where one-token readers miss it.
        assert!(caveat.contains("published to \"orders.a.b\""), "{caveat}");
        assert!(caveat.contains("filtering \"orders.*\" never see"), "{caveat}");
        assert!(caveat.contains("goes dead at once"), "{caveat}");
        assert_eq!(key_in_subject_caveat(&route("orders.{domain}.{type}")), None);
    }

    fn routed(destination: &str) -> Route {
        Route {
            name: "orders".into(),
            matcher: ferry_core::Glob::new("order.**").unwrap(),
            sink: "nats".into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    /// An interest stream drops what no consumer's filter matches: the
    /// filters decide, `filter_subjects` (NATS 2.10) as `filter_subject`.
    #[test]
    fn an_interest_stream_is_judged_by_its_consumers_filters() {
        let config: StreamConfig =
            serde_json::from_value(serde_json::json!({ "subjects": ["events.>"], "retention": "interest" })).unwrap();
        let state = StreamState { consumer_count: 1 };
        let consumer = |json: serde_json::Value| -> ConsumerConfig { serde_json::from_value(json).unwrap() };
        let judge = |destination: &str, consumers: &[ConsumerConfig]| {
            let route = routed(destination);
            let filter = if destination.contains('{') {
                template_filter(destination)
            } else {
                destination.to_owned()
            };
            stream_caveats(&route, "EVENTS", &filter, &config, &state, consumers)
        };
        let payments = consumer(serde_json::json!({ "filter_subject": "events.payment.>" }));
        let several = consumer(serde_json::json!({ "filter_subjects": ["events.refund.>", "events.order"] }));
        let everything = consumer(serde_json::json!({ "durable_name": "all" }));
        assert_eq!(everything.filters(), [">"]);
        assert_eq!(several.filters(), ["events.refund.>", "events.order"]);

        let err = judge("events.order", std::slice::from_ref(&payments)).unwrap_err();
        assert_eq!(err.kind, ferry_core::ErrorKind::Config);
        assert!(err.message.contains("\"events.payment.>\""), "{err}");
        assert!(err.message.contains("--filter 'events.order'"), "{err}");
        assert_eq!(
            judge("events.order", &[payments.clone(), several.clone()]),
            Ok(Vec::new())
        );
        assert_eq!(
            judge("events.payment.card", std::slice::from_ref(&payments)),
            Ok(Vec::new())
        );
        // A template: refused when none of its subjects is wanted, warned of
        // when some are.
        let err = judge("events.{domain}", std::slice::from_ref(&payments)).unwrap_err();
        assert!(err.message.contains("\"events.*\""), "{err}");
        let caveats = judge("events.{domain}", std::slice::from_ref(&several)).unwrap();
        assert!(caveats.len() == 1 && caveats[0].contains("only some"), "{caveats:?}");
        let caveats = judge("events.{domain}.{type}", std::slice::from_ref(&payments)).unwrap();
        assert!(caveats.len() == 1 && caveats[0].contains("only some"), "{caveats:?}");
        assert_eq!(judge("events.{domain}.{type}", &[payments, everything]), Ok(Vec::new()));
        // No consumer at all.
        let none = StreamState { consumer_count: 0 };
        let err = stream_caveats(&routed("events.order"), "EVENTS", "events.order", &config, &none, &[]).unwrap_err();
        assert!(err.message.contains("no consumer"), "{err}");
        // A work queue keeps what nobody wants yet.
        let queue = StreamConfig {
            retention: "workqueue".into(),
            ..StreamConfig::default()
        };
        assert_eq!(
            stream_caveats(&routed("events.order"), "EVENTS", "events.order", &queue, &none, &[]),
            Ok(Vec::new())
        );
    }

    /// Only the key, which the producer chooses freely, can make a first
    /// token NATS reserves: an event type starts with a lowercase letter or
    /// a digit, `{domain}` is its first segment and `{id}` a UUID.
    #[test]
    fn a_template_whose_first_token_the_key_makes_carries_a_caveat() {
        let caveat = first_token_caveat(&routed("{key}")).expect("a caveat");
        assert!(
            caveat.contains("key ({key})") && caveat.contains("_INBOX") && caveat.contains("_R_"),
            "{caveat}"
        );
        assert!(caveat.contains("\"events.{key}\""), "{caveat}");
        assert!(first_token_caveat(&routed("{key}{domain}.x")).is_some());
        assert_eq!(first_token_caveat(&routed("{domain}.x")), None);
        assert_eq!(first_token_caveat(&routed("{type}")), None);
        assert_eq!(first_token_caveat(&routed("{id}.{key}")), None);
        assert_eq!(first_token_caveat(&routed("{domain}{key}.x")), None);
        assert_eq!(first_token_caveat(&routed("v{key}")), None);
        assert_eq!(first_token_caveat(&routed("events.{type}")), None);
        assert_eq!(first_token_caveat(&routed("$KV.orders.{key}")), None);
    }

    fn interest(json: serde_json::Value) -> StreamConfig {
        let mut config: StreamConfig = serde_json::from_value(json).unwrap();
        config.retention = "interest".into();
        config
    }

    fn filtering(filters: &[&str]) -> Vec<ConsumerConfig> {
        filters
            .iter()
            .map(|f| ConsumerConfig {
                filter_subject: (*f).to_owned(),
                filter_subjects: None,
            })
            .collect()
    }

    fn judged(
        destination: &str,
        config: &StreamConfig,
        consumers: &[ConsumerConfig],
    ) -> Result<Vec<String>, SinkError> {
        let filter = if destination.contains('{') {
            template_filter(destination)
        } else {
            destination.to_owned()
        };
        let state = StreamState { consumer_count: 1 };
        stream_caveats(&routed(destination), "EVENTS", &filter, config, &state, consumers)
    }

    /// A stream that rewrites subjects stores them, and its consumers
    /// filter them, under others: comparing the published subject with
    /// those filters refused a stream that keeps every event.
    #[test]
    fn a_stream_that_rewrites_subjects_is_not_refused_for_its_consumers_filters() {
        let archive = interest(serde_json::json!({
            "subjects": ["events.>"],
            "subject_transform": { "src": "events.>", "dest": "archive.>" },
        }));
        let consumers = filtering(&["archive.>"]);
        for destination in ["events.order", "events.{domain}"] {
            let caveats = judged(destination, &archive, &consumers).expect("the stream keeps them");
            assert!(
                caveats.len() == 1 && caveats[0].contains("subject_transform") && caveats[0].contains("archive.>"),
                "{caveats:?}"
            );
        }
        // All subjects rewritten: an empty `src`.
        let all = interest(serde_json::json!({
            "subjects": ["events.>"],
            "subject_transform": { "dest": "archive.>" },
        }));
        assert!(judged("events.order", &all, &consumers).is_ok());
        // A transform of other subjects: compared as before.
        let other = interest(serde_json::json!({
            "subjects": ["events.>", "audit.>"],
            "subject_transform": { "src": "audit.>", "dest": "archive.>" },
        }));
        assert!(judged("events.order", &other, &consumers).is_err());
        // No consumer at all is refused, transform or not.
        let none = StreamState { consumer_count: 0 };
        assert!(stream_caveats(&routed("events.order"), "EVENTS", "events.order", &archive, &none, &[]).is_err());
    }

    /// Fixed tokens after a placeholder still end every subject rendered:
    /// `events.{key}.v1` never renders a subject `events.*.v2` matches.
    #[test]
    fn a_templates_fixed_tokens_after_a_placeholder_constrain_its_subjects() {
        let config = interest(serde_json::json!({ "subjects": ["events.>"] }));
        let err = judged("events.{key}.v1", &config, &filtering(&["events.*.v2"])).unwrap_err();
        assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
        assert!(err.message.contains("no consumer's filter"), "{err}");
        assert!(judged("events.{type}", &config, &filtering(&["events.*"])).is_err());
        assert!(judged("events.{domain}", &config, &filtering(&["events.*.>"])).is_err());
        assert_eq!(
            judged("events.{key}.v1", &config, &filtering(&["events.>"])),
            Ok(Vec::new())
        );
        assert_eq!(
            judged("events.{type}", &config, &filtering(&["events.*.>"])),
            Ok(Vec::new())
        );
        let caveats = judged("events.{key}.v1", &config, &filtering(&["events.*.v1"])).unwrap();
        assert!(caveats.len() == 1 && caveats[0].contains("only some"), "{caveats:?}");
        // A stream capturing none of the template's subjects holds nothing
        // of the route's: no consumer of it is asked to want them.
        let v2 = interest(serde_json::json!({ "subjects": ["events.*.v2"] }));
        assert_eq!(
            judged("events.{key}.v1", &v2, &filtering(&["events.*.v2"])),
            Ok(Vec::new())
        );
    }

    /// Several consumers may want, together, every subject none wants alone.
    #[test]
    fn consumers_together_may_want_every_subject() {
        let config = interest(serde_json::json!({ "subjects": ["events.>"] }));
        assert_eq!(
            judged("events.{key}", &config, &filtering(&["events.*", "events.*.>"])),
            Ok(Vec::new())
        );
        let several = vec![ConsumerConfig {
            filter_subject: String::new(),
            filter_subjects: Some(vec!["events.*".into(), "events.*.>".into()]),
        }];
        assert_eq!(judged("events.{key}", &config, &several), Ok(Vec::new()));
        let caveats = judged("events.{key}", &config, &filtering(&["events.*", "events.*.*.>"])).unwrap();
        assert!(caveats.len() == 1 && caveats[0].contains("together"), "{caveats:?}");
        // Of two stream subjects, each wanted by one consumer.
        let two = interest(serde_json::json!({ "subjects": ["events.order.>", "events.payment.>"] }));
        assert_eq!(
            judged(
                "events.{domain}.{type}",
                &two,
                &filtering(&["events.order.>", "events.payment.>"])
            ),
            Ok(Vec::new())
        );
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(NatsOptions::default().validate(), Ok(()));
        let field = |options: NatsOptions| options.validate().unwrap_err().split(':').next().unwrap().to_owned();
        assert_eq!(
            field(NatsOptions {
                url: "http://[::1".into(),
                ..NatsOptions::default()
            }),
            "url"
        );
        assert_eq!(
            field(NatsOptions {
                publish_timeout: Duration::ZERO,
                ..NatsOptions::default()
            }),
            "publish_timeout"
        );
        assert_eq!(
            field(NatsOptions {
                max_message_bytes: 0,
                ..NatsOptions::default()
            }),
            "max_message_bytes"
        );
    }

    #[test]
    fn debug_output_hides_the_password_and_a_token() {
        let options = NatsOptions {
            url: "nats://ferry:s3cr3t-pw@nats-host:4222".into(),
            ..NatsOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
        assert!(shown.contains("nats-host:4222"), "{shown}");
        assert!(shown.contains("publish_timeout: 10s"), "{shown}");
        let options = NatsOptions {
            url: "nats://tok-123@nats-host:4222".into(),
            ..NatsOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("tok-123"), "{shown}");
        assert!(shown.contains("nats-host:4222"), "{shown}");
    }
}
