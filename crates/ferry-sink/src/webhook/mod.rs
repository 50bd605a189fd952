//! The webhook sink: one signed HTTP POST per event, CloudEvents 1.0 in
//! structured mode, signed per the Standard Webhooks convention.
//!
//! Each event is POSTed to the route's destination URL (a template such as
//! `https://hooks.example/{domain}` is allowed) with
//! `content-type: application/cloudevents+json` and the body
//! `{"id","type","source","time","subject","specversion":"1.0","datacontenttype","data"}`
//! (`data_base64` instead of `data` when the payload is not JSON, no
//! `subject` when the event has no key). The headers `webhook-id` (the event
//! id), `webhook-timestamp` (unix seconds) and, when secrets are configured,
//! `webhook-signature` let the receiver verify the request and drop
//! duplicates. The event's own headers travel as HTTP headers.
//!
//! Only a 2xx answer counts as published. Redirects are not followed.
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use ferry_sink::webhook::{WebhookOptions, WebhookSink};
//!
//! let sink = WebhookSink::new(WebhookOptions {
//!     secrets: vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()],
//!     timeout: Duration::from_secs(5),
//!     ..WebhookOptions::default()
//! })?;
//! # Ok::<(), ferry_core::SinkError>(())
//! ```

mod client;
mod message;
mod signature;
mod status;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_core::{PublishOutcome, Route, Sink, SinkError, StoredEvent, redact};
use futures::future::join_all;
use reqwest::header::{HeaderMap, HeaderValue};
use tokio::sync::Semaphore;

pub use message::{CONTENT_TYPE, SPEC_VERSION};
pub use signature::{MIN_SECRET_BYTES, SECRET_PREFIX};
pub use status::{parse_retry_after, status_kind};

use crate::backoff::Backoff;
use ferry_core::prepare_in_key_order;
use message::{Destination, Request};
use signature::{SigningKey, signature_header};

/// Limiters of idle destinations are forgotten once there are this many.
const MAX_IDLE_LIMITERS: usize = 1024;
/// The most requests in flight per destination URL (`concurrency`).
pub const MAX_CONCURRENCY: usize = 1024;
/// The longest an unreachable endpoint is left alone between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// The share of `timeout` kept free at the end of a batch's bound for the
/// work around the requests (preparing, signing, collecting the outcomes).
const BOUND_MARGIN_DIVISOR: u32 = 10;

/// How a [`WebhookSink`] signs and sends.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookOptions {
    /// Signing secrets as `whsec_<base64>`. Each one adds a signature to
    /// `webhook-signature`, so a receiver can rotate its secret. Empty (the
    /// default) sends unsigned requests.
    pub secrets: Vec<String>,
    /// Bound on one request, from connecting to the end of the response.
    /// It also bounds a batch: its requests start within the first
    /// `timeout` (less a tenth), so a publish ends within twice it, the
    /// least the relay allows a publish (`ferry run` sizes
    /// `relay.direct_publish_timeout` so). Events of a key not started by
    /// then are held back (`SinkError::held_back`) for a later batch.
    /// Default 10 s.
    pub timeout: Duration,
    /// Requests in flight at once per destination URL. Default 8.
    pub concurrency: usize,
    /// Request bodies (the payload in its CloudEvents envelope) larger than
    /// this are refused, permanently, before sending. Default 1 MiB.
    pub max_body_bytes: usize,
    /// The CloudEvents `source` attribute. Default `"ferry"`.
    pub source: String,
    /// Headers sent with every request, e.g. `Authorization`; they win over
    /// an event's header of the same name. Default none.
    pub headers: BTreeMap<String, String>,
    /// The longest an endpoint's `Retry-After` (on a 408, 425, 429 or 5xx)
    /// pauses every request to that URL, not only the refused one's (a
    /// 409's delays only its own event). Keep
    /// it at most the relay's longest retry delay (`relay.backoff_max`,
    /// which `ferry run` passes): a retry scheduled inside the pause would
    /// spend an attempt without being sent. Zero turns the pause off.
    /// Default 5 min, the relay's default longest delay.
    pub max_pause: Duration,
    /// How many bytes of an error response's body the failure's message
    /// quotes (it becomes the delivery's last error, in the outbox table and
    /// the logs). Zero quotes none, for receivers whose error bodies may
    /// echo personal data. Default 256; at most the first 64 KiB of a body
    /// are read.
    pub error_response_bytes: usize,
}

impl Default for WebhookOptions {
    fn default() -> Self {
        Self {
            secrets: Vec::new(),
            timeout: Duration::from_secs(10),
            concurrency: 8,
            max_body_bytes: 1024 * 1024,
            source: "ferry".into(),
            headers: BTreeMap::new(),
            max_pause: Duration::from_secs(300),
            error_response_bytes: 256,
        }
    }
}

impl std::fmt::Debug for WebhookOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values are often credentials (`Authorization`), so only
        // their names are shown.
        let headers = redact::header_values(self.headers.keys());
        f.debug_struct("WebhookOptions")
            .field("secrets", &format_args!("[{} hidden]", self.secrets.len()))
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("source", &self.source)
            .field("headers", &headers)
            .field("max_pause", &self.max_pause)
            .field("error_response_bytes", &self.error_response_bytes)
            .finish()
    }
}

/// POSTs events to HTTP endpoints.
///
/// Within a batch, the events of one key are sent one after another, each
/// once the previous one was answered with a 2xx; once one fails, the later
/// ones of its key are held back (`SinkError::held_back`) and not sent. Events of
/// different keys, and events without a key, go out concurrently, at most
/// `concurrency` at a time per destination URL.
///
/// A batch ends within twice `timeout`: no request starts once one could
/// outlast that, and the events not started yet are held back too, so the
/// relay records the ones answered 2xx instead of abandoning the whole batch
/// (and sending them again) when its publish bound passes.
pub struct WebhookSink {
    options: WebhookOptions,
    keys: Vec<SigningKey>,
    headers: HeaderMap,
    client: reqwest::Client,
    /// How many CA certificates were loaded; https needs at least one.
    roots: usize,
    limiters: Mutex<HashMap<String, Arc<Endpoint>>>,
}

/// Per destination URL: the concurrency limit, the backoff that makes
/// requests to an endpoint that just failed to connect fail fast instead of
/// each waiting out its own timeout, and the pause its last `Retry-After`
/// asked for.
struct Endpoint {
    slots: Semaphore,
    backoff: Mutex<Outages>,
    /// Until when the endpoint asked to be left alone, and its answer then.
    /// A 2xx to a request already in flight does not end it.
    quiet: Mutex<Option<(Instant, String)>>,
}

/// An endpoint's backoff, escalated once per outage rather than once per
/// failed request: the requests in flight when a receiver stalls all time
/// out together, and counting each would jump the pause to its cap at once
/// (`concurrency` 8: 200 ms to 10 s), refusing every request meanwhile.
struct Outages {
    backoff: Backoff,
    /// Bumped at each escalation. A request takes it when it is sent; its
    /// failure escalates only if no failure did since it was sent, so the
    /// requests of one wave that fail together count as one outage.
    generation: u64,
}

impl Endpoint {
    /// The generation a request sent now carries, or how long the endpoint
    /// is left alone and the failure that started the pause.
    fn may_send(&self, now: Instant) -> Result<u64, (Duration, String)> {
        let outages = lock(&self.backoff);
        match outages.backoff.ready(now) {
            Ok(()) => Ok(outages.generation),
            Err(wait) => Err((wait, outages.backoff.last_error().unwrap_or("unreachable").to_owned())),
        }
    }

    /// A request sent at `generation` failed to connect or to be answered
    /// in time: the pause grows unless an outage was already counted since
    /// it was sent.
    fn failed(&self, generation: u64, now: Instant, error: &str) {
        let mut outages = lock(&self.backoff);
        if outages.generation == generation {
            outages.backoff.failed(now, error);
            outages.generation = outages.generation.wrapping_add(1);
        }
    }

    fn succeeded(&self) {
        lock(&self.backoff).backoff.succeeded();
    }

    fn backing_off(&self, now: Instant) -> bool {
        lock(&self.backoff).backoff.ready(now).is_err()
    }

    /// How much of its pause is left, and why, if any.
    fn quiet_left(&self, now: Instant) -> Option<(Duration, String)> {
        let quiet = lock(&self.quiet);
        let (until, why) = quiet.as_ref()?;
        (*until > now).then(|| (*until - now, why.clone()))
    }

    fn keep_quiet(&self, now: Instant, delay: Duration, why: &str) {
        let until = now + delay;
        let mut quiet = lock(&self.quiet);
        if quiet.as_ref().is_none_or(|(current, _)| *current < until) {
            *quiet = Some((until, why.to_owned()));
        }
    }
}

impl WebhookSink {
    /// Validates the options (secrets, headers, limits) and builds the HTTP
    /// client; errors are configuration errors naming the field.
    pub fn new(options: WebhookOptions) -> Result<Self, SinkError> {
        let keys = options
            .secrets
            .iter()
            .enumerate()
            .map(|(i, s)| SigningKey::parse(s, i))
            .collect::<Result<Vec<_>, _>>()?;
        let headers = message::configured_headers(&options.headers)?;
        if options.concurrency == 0 {
            return Err(SinkError::config(
                "concurrency is 0; allow at least 1 request in flight",
            ));
        }
        // Far past what one endpoint serves in parallel; and tokio's
        // semaphore panics past `usize::MAX >> 3`, at the first send.
        if options.concurrency > MAX_CONCURRENCY {
            return Err(SinkError::config(format!(
                "concurrency is {}; allow at most {MAX_CONCURRENCY} requests in flight per URL",
                options.concurrency
            )));
        }
        if options.timeout.is_zero() {
            return Err(SinkError::config("timeout is 0; give a bound such as 10s"));
        }
        let (client, roots) = client::build(options.timeout)?;
        Ok(Self {
            options,
            keys,
            headers,
            client,
            roots,
            limiters: Mutex::new(HashMap::new()),
        })
    }

    pub fn options(&self) -> &WebhookOptions {
        &self.options
    }

    fn prepare(&self, destination: &Destination<'_>, event: &StoredEvent) -> Result<Request, SinkError> {
        let opts = &self.options;
        let request = Request::prepare(destination, event, &opts.source, &self.headers, opts.max_body_bytes)?;
        self.require_roots(destination.route(), request.url.scheme())?;
        Ok(request)
    }

    /// An https destination needs CA certificates to verify its receiver;
    /// without any, every delivery would fail (dead at its first attempt).
    fn require_roots(&self, route: &Route, scheme: &str) -> Result<(), SinkError> {
        if scheme == "https" && self.roots == 0 {
            return Err(SinkError::config(format!(
                "route {:?}: no CA certificates were found for https; set SSL_CERT_FILE to a PEM bundle",
                route.name
            )));
        }
        Ok(())
    }

    /// The limiter shared by every request to `url`.
    fn limiter(&self, url: &str) -> Arc<Endpoint> {
        let mut limiters = lock(&self.limiters);
        if let Some(limiter) = limiters.get(url) {
            return Arc::clone(limiter);
        }
        // Templated URLs can name endless destinations; forget idle ones,
        // but not the pause or the backoff of one that asked for it.
        if limiters.len() >= MAX_IDLE_LIMITERS {
            let now = Instant::now();
            limiters.retain(|_, l| Arc::strong_count(l) > 1 || l.quiet_left(now).is_some() || l.backing_off(now));
        }
        let limiter = Arc::new(Endpoint {
            slots: Semaphore::new(self.options.concurrency),
            backoff: Mutex::new(Outages {
                backoff: Backoff::new(MAX_BACKOFF),
                generation: 0,
            }),
            quiet: Mutex::new(None),
        });
        limiters.insert(url.to_owned(), Arc::clone(&limiter));
        limiter
    }

    /// The last moment a request of a batch that began at `began` may start:
    /// the relay gives a publish at least twice `timeout`, and a request may
    /// take all of one `timeout`.
    fn start_by(&self, began: Instant) -> Instant {
        let timeout = self.options.timeout;
        began + timeout - timeout / BOUND_MARGIN_DIVISOR
    }

    /// Sends one request, unless it cannot start by `start_by` (waiting for
    /// a slot included): then it is held back, not sent.
    async fn send(&self, route: &Route, request: &Request, start_by: Instant) -> PublishOutcome {
        let endpoint = self.limiter(request.url.as_str());
        let acquired = tokio::time::timeout_at(start_by.into(), endpoint.slots.acquire()).await;
        let _permit = match acquired {
            Ok(permit) if Instant::now() <= start_by => permit.expect("limiters are never closed"),
            _ => {
                return Err(SinkError::held_back(format!(
                    "held back: not sent in this batch, since a request started now could outlast the \
                     batch's bound (twice sinks.{}.timeout, {} ms)",
                    route.sink,
                    (self.options.timeout * 2).as_millis()
                )));
            }
        };
        let generation = match endpoint.may_send(Instant::now()) {
            Ok(generation) => generation,
            Err((wait, last)) => {
                return Err(SinkError::transient(format!(
                    "not sent, next attempt in {} ms; the last one failed: {last}",
                    wait.as_millis()
                ))
                // The relay's next attempt waits as long: one made sooner would
                // be refused here again and spend an attempt unsent.
                .with_retry_after(wait));
            }
        };
        // A 429 or 503 with Retry-After speaks for the endpoint, not for one
        // event: the requests after it wait too, rather than each earning
        // its own refusal from a receiver that is shedding load.
        if let Some((left, why)) = endpoint.quiet_left(Instant::now()) {
            return Err(SinkError::transient(format!(
                "not sent: the endpoint asked to be left alone for {} ms more; it answered: {why}",
                left.as_millis()
            ))
            .with_retry_after(left));
        }
        let timestamp = chrono::Utc::now().timestamp();
        let mut headers = request.headers.clone();
        headers.insert("webhook-id", header_value(&request.id));
        headers.insert("webhook-timestamp", header_value(&timestamp.to_string()));
        if !self.keys.is_empty() {
            let signature = signature_header(&self.keys, &request.id, timestamp, &request.body);
            headers.insert("webhook-signature", header_value(&signature));
        }
        let sent = self
            .client
            .post(request.url.clone())
            .headers(headers)
            .body(request.body.clone())
            .send()
            .await;
        match sent {
            Ok(response) => {
                endpoint.succeeded();
                // A 409 is about this event (its id is being handled), not
                // the endpoint: its Retry-After delays this event alone.
                let one_event = response.status() == reqwest::StatusCode::CONFLICT;
                let outcome = client::outcome("POST", &request.url, response, self.options.error_response_bytes).await;
                if let Err(e) = &outcome
                    && !one_event
                    && let Some(delay) = e.retry_after.map(|d| d.min(self.options.max_pause))
                    && !delay.is_zero()
                {
                    endpoint.keep_quiet(Instant::now(), delay, &e.message);
                }
                outcome
            }
            Err(e) => {
                // A reset on a pooled connection says little about the
                // endpoint; failing to connect or to get an answer in time does.
                let endpoint_down = e.is_connect() || e.is_timeout();
                let err = client::transport_error("POST", &request.url, e, &route.sink);
                if endpoint_down {
                    endpoint.failed(generation, Instant::now(), &err.message);
                }
                Err(err)
            }
        }
    }

    /// Sends one key's events in order, holding back the rest after a
    /// failure, or once the batch's time for starting requests is over.
    async fn send_chain(
        &self,
        route: &Route,
        events: &[StoredEvent],
        prepared: &[Result<Request, SinkError>],
        chain: &[usize],
        start_by: Instant,
    ) -> Vec<(usize, PublishOutcome)> {
        let mut out = Vec::with_capacity(chain.len());
        // Why the rest of the chain is held back, once it is.
        let mut stopped: Option<SinkError> = None;
        for &i in chain {
            let outcome = match (&prepared[i], &stopped) {
                (Err(e), _) => Err(e.clone()),
                (Ok(_), Some(why)) => Err(why.clone()),
                (Ok(request), None) => self.send(route, request, start_by).await,
            };
            if let (Err(e), None) = (&outcome, &stopped) {
                stopped = Some(if e.held_back {
                    e.clone()
                } else {
                    SinkError::held_back_behind(&events[i])
                });
            }
            out.push((i, outcome));
        }
        out
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Ids, timestamps and base64 signatures are visible ASCII.
fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).expect("visible ASCII is a valid header value")
}

/// Indices of `events` grouped by key in batch order; each keyless event is
/// a group of its own.
fn chains(events: &[StoredEvent]) -> Vec<Vec<usize>> {
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut by_key: HashMap<&str, usize> = HashMap::new();
    for (i, event) in events.iter().enumerate() {
        match event.key.as_deref() {
            Some(key) => match by_key.get(key) {
                Some(&chain) => chains[chain].push(i),
                None => {
                    by_key.insert(key, chains.len());
                    chains.push(vec![i]);
                }
            },
            None => chains.push(vec![i]),
        }
    }
    chains
}

/// Chains ordered longest first; chains of one length keep batch order.
fn longest_first(mut chains: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    chains.sort_by_key(|chain| std::cmp::Reverse(chain.len()));
    chains
}

impl std::fmt::Debug for WebhookSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookSink")
            .field("secrets", &self.keys.len())
            .field("timeout", &self.options.timeout)
            .field("concurrency", &self.options.concurrency)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Sink for WebhookSink {
    fn kind(&self) -> &'static str {
        "webhook"
    }

    fn admit(&self, route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        self.prepare(&Destination::new(route), event).map(drop)
    }

    /// `publish` prepares the batch in key order before it sends any of it.
    fn admits_in_publish(&self) -> bool {
        true
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let start_by = self.start_by(Instant::now());
        let destination = Destination::new(route);
        let prepared = prepare_in_key_order(events, |event| self.prepare(&destination, event));
        let chains = longest_first(chains(events));
        // `concurrency` senders, each taking the longest chain left and
        // sending it in order: a key with many events starts early instead
        // of queueing each of its requests behind every other key's, which
        // left the batch's tail to one request at a time.
        let next = AtomicUsize::new(0);
        let senders = self.options.concurrency.min(chains.len());
        let sent = join_all((0..senders).map(|_| async {
            let mut out = Vec::new();
            while let Some(chain) = chains.get(next.fetch_add(1, Ordering::Relaxed)) {
                out.extend(self.send_chain(route, events, &prepared, chain, start_by).await);
            }
            out
        }))
        .await;
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
        for (i, outcome) in sent.into_iter().flatten() {
            outcomes[i] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every event belongs to one chain"))
            .collect()
    }

    /// A fixed URL is checked with a `HEAD` request: any HTTP answer, even
    /// 404 or 405, shows the receiver is reachable; only a transport failure
    /// (refused, timed out, TLS) fails the check. A template whose host
    /// depends on the event is only checked for being an http(s) URL, and
    /// an https one for having CA certificates to verify it with.
    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        for caveat in self.check_with_caveats(route).await? {
            tracing::warn!(route = %route.name, "{caveat}");
        }
        Ok(())
    }

    /// Any answer to a `HEAD` proves a server listens, so it passes. A 404
    /// or 410 also says the path may not exist, a 3xx that the endpoint
    /// moved and a 401 or 403 that it wants credentials (a delivery answered
    /// so goes dead); but many servers answer `HEAD` on a POST-only path
    /// differently from `POST`, so these are caveats, not failures.
    ///
    /// A template's host, when fixed, is probed at its root (`HEAD /`), so
    /// a receiver that is down fails the check; a host that is itself a
    /// template is not contacted. Either is said in a caveat.
    async fn check_with_caveats(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        let mut destination = route.destination.clone();
        let mut templated = None;
        if destination.contains('{') {
            let scheme = destination.split("://").next().unwrap_or_default().to_owned();
            if !matches!(scheme.as_str(), "http" | "https") {
                return Err(SinkError::config(format!(
                    "route {:?}: destination {:?} must start with http:// or https:// \
                     (routes[].destination)",
                    route.name,
                    redact::url(&destination)
                )));
            }
            // Checked before anything is skipped: a templated host is not
            // probed, but no https delivery could be made without roots.
            self.require_roots(route, &scheme)?;
            let authority = destination[scheme.len() + 3..]
                .split(['/', '?', '#'])
                .next()
                .unwrap_or_default();
            if authority.contains('{') {
                return Ok(vec![
                    "the URL's host is a template, known per event: not contacted; only its scheme was checked"
                        .to_owned(),
                ]);
            }
            destination = format!("{scheme}://{authority}/");
            templated =
                Some("the URL's path is a template, known per event: only its host was probed (HEAD /)".to_owned());
        }
        let destination = destination.as_str();
        let url = message::parse_url(destination).map_err(|problem| {
            SinkError::config(format!(
                "route {:?}: destination {:?} {problem}; routes[].destination must be an http:// or \
                 https:// URL",
                route.name,
                redact::url(destination)
            ))
        })?;
        self.require_roots(route, url.scheme())?;
        match self.client.head(url.clone()).headers(self.headers.clone()).send().await {
            Ok(response) => {
                let status = response.status();
                // A gateway's answer for the receiver behind it: down, as a
                // delivery would find it (retried), not reachable.
                if matches!(status.as_u16(), 502..=504) {
                    return Err(SinkError::transient(format!(
                        "route {:?}: the webhook endpoint {} answered HEAD with {status}: the receiver (or a \
                         proxy in front of it) is unavailable, and deliveries answered so are retried; start \
                         or fix the receiver",
                        route.name,
                        redact::url(url.as_str())
                    )));
                }
                tracing::info!(
                    route = %route.name,
                    url = %redact::url(url.as_str()),
                    %status,
                    "webhook endpoint reachable (HEAD answered)"
                );
                // The root's answer says nothing of the templated paths.
                if let Some(caveat) = templated {
                    return Ok(vec![caveat]);
                }
                Ok(match status.as_u16() {
                    300..=399 => {
                        let location = client::location(&url, response.headers());
                        vec![format!(
                            "the endpoint answered HEAD with {status} to {location:?}: redirects are not \
                             followed, and a delivery answered so goes dead; point routes[].destination at \
                             the Location"
                        )]
                    }
                    401 | 403 => vec![format!(
                        "the endpoint answered HEAD with {status}: it may want credentials, and a delivery \
                         answered so goes dead; give the receiver's in sinks.{}.headers (an Authorization \
                         header, say) if it needs them (some servers refuse HEAD alone)",
                        route.sink
                    )],
                    404 | 410 => vec![format!(
                        "the endpoint answered HEAD with {status}: the path may not exist, and a delivery \
                         answered so goes dead; make sure routes[].destination is the receiver's path (some \
                         servers answer 404 to HEAD on a path that takes only POST)"
                    )],
                    _ => Vec::new(),
                })
            }
            Err(e) => {
                let err = client::transport_error("HEAD", &url, e, &route.sink);
                Err(SinkError::transient(format!(
                    "route {:?}: the webhook endpoint is unreachable: {}; start the receiver or fix \
                     routes[].destination",
                    route.name, err.message
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::fixtures::event as ev;
    use ferry_core::ErrorKind;

    #[test]
    fn chains_keep_key_order_and_split_keyless_events() {
        let events = [
            ev(Some("a")),
            ev(None),
            ev(Some("b")),
            ev(Some("a")),
            ev(None),
            ev(Some("b")),
        ];
        assert_eq!(chains(&events), vec![vec![0, 3], vec![1], vec![2, 5], vec![4]]);
    }

    #[test]
    fn the_longest_chains_are_sent_first_and_ties_keep_batch_order() {
        let events = [
            ev(Some("a")),
            ev(Some("b")),
            ev(Some("c")),
            ev(Some("b")),
            ev(Some("c")),
            ev(Some("b")),
        ];
        assert_eq!(longest_first(chains(&events)), vec![vec![1, 3, 5], vec![2, 4], vec![0]]);
    }

    #[test]
    fn options_are_validated_naming_the_field() {
        let err = WebhookSink::new(WebhookOptions {
            secrets: vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(), "nope".into()],
            ..WebhookOptions::default()
        })
        .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.starts_with("secrets[1]"), "{err}");
        let err = WebhookSink::new(WebhookOptions {
            concurrency: 0,
            ..WebhookOptions::default()
        })
        .unwrap_err();
        assert!(err.message.starts_with("concurrency"), "{err}");
        let err = WebhookSink::new(WebhookOptions {
            concurrency: usize::MAX,
            ..WebhookOptions::default()
        })
        .unwrap_err();
        assert!(err.message.contains("at most 1024"), "{err}");
        let err = WebhookSink::new(WebhookOptions {
            timeout: Duration::ZERO,
            ..WebhookOptions::default()
        })
        .unwrap_err();
        assert!(err.message.starts_with("timeout"), "{err}");
        let err = WebhookSink::new(WebhookOptions {
            headers: [("bad header".to_owned(), "x".to_owned())].into(),
            ..WebhookOptions::default()
        })
        .unwrap_err();
        assert!(err.message.starts_with("headers.bad header"), "{err}");
        assert!(WebhookSink::new(WebhookOptions::default()).is_ok());
    }

    #[test]
    fn debug_output_hides_the_signing_secrets_and_the_header_values() {
        let options = WebhookOptions {
            secrets: vec!["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()],
            timeout: Duration::from_secs(7),
            headers: [("Authorization".to_owned(), "Bearer tok-123".to_owned())].into(),
            ..WebhookOptions::default()
        };
        let shown = format!("{options:?}");
        assert!(!shown.contains("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), "{shown}");
        assert!(!shown.contains("tok-123"), "{shown}");
        assert!(shown.contains("[1 hidden]"), "{shown}");
        assert!(shown.contains("Authorization"), "{shown}");
        assert!(shown.contains("7s"), "{shown}");
    }

    fn route(destination: &str) -> Route {
        Route {
            name: "hooks".into(),
            matcher: ferry_core::Glob::new("**").unwrap(),
            sink: "web".into(),
            destination: destination.into(),
            routing_key: None,
        }
    }

    /// Without CA certificates (a distroless image, no `SSL_CERT_FILE`),
    /// every https delivery is a config error, dead at its first attempt: the
    /// check must fail for a templated host too, not only warn that it was
    /// not contacted.
    #[tokio::test]
    async fn an_https_destination_without_ca_certificates_fails_the_check_templated_or_not() {
        let mut sink = WebhookSink::new(WebhookOptions::default()).unwrap();
        sink.roots = 0;
        for destination in [
            "https://{tenant}.hooks.example/in",
            "https://hooks.example/in/{domain}",
            "https://hooks.example/in",
        ] {
            let err = sink
                .check_with_caveats(&route(destination))
                .await
                .expect_err(destination);
            assert_eq!(err.kind, ErrorKind::Config, "{destination}: {err}");
            assert!(
                err.message.contains("no CA certificates") && err.message.contains("SSL_CERT_FILE"),
                "{destination}: {err}"
            );
            assert!(sink.check(&route(destination)).await.is_err(), "{destination}");
        }
        // http needs no roots; its templated host is still not contacted.
        let caveats = sink
            .check_with_caveats(&route("http://{tenant}.hooks.example/in"))
            .await
            .expect("http needs no CA certificates");
        assert!(
            caveats.len() == 1 && caveats[0].contains("not contacted"),
            "{caveats:?}"
        );
    }

    /// A stall past `timeout` with `concurrency` requests in flight fails
    /// them all at once: one outage, one step of the backoff, not eight
    /// (which jumped the pause from 200 ms to its 10 s cap).
    #[test]
    fn the_backoff_escalates_once_per_outage_not_once_per_failed_request() {
        let sink = WebhookSink::new(WebhookOptions::default()).unwrap();
        let endpoint = sink.limiter("http://h/hook");
        let now = Instant::now();
        let wave: Vec<u64> = (0..8).map(|_| endpoint.may_send(now).unwrap()).collect();
        for &generation in &wave {
            endpoint.failed(generation, now, "timed out");
        }
        let pause = |at| endpoint.may_send(at).expect_err("backing off").0;
        assert_eq!(pause(now), crate::backoff::BASE_DELAY, "one step for the whole wave");

        // The next wave, sent once the pause is over, fails too: one more step.
        let later = now + crate::backoff::BASE_DELAY;
        let next: Vec<u64> = (0..3).map(|_| endpoint.may_send(later).unwrap()).collect();
        for &generation in &next {
            endpoint.failed(generation, later, "timed out");
        }
        assert_eq!(pause(later), 2 * crate::backoff::BASE_DELAY);
        // A straggler of the first wave failing now adds nothing.
        endpoint.failed(wave[0], later, "timed out");
        assert_eq!(pause(later), 2 * crate::backoff::BASE_DELAY);

        // An answer ends the outage; the next failure starts from the base.
        endpoint.succeeded();
        let again = endpoint.may_send(later).expect("an answer ends the pause");
        endpoint.failed(again, later, "could not connect");
        assert_eq!(pause(later), crate::backoff::BASE_DELAY);
    }

    #[test]
    fn idle_limiters_are_forgotten() {
        let sink = WebhookSink::new(WebhookOptions::default()).unwrap();
        let held = sink.limiter("http://h/held");
        for i in 0..MAX_IDLE_LIMITERS + 10 {
            sink.limiter(&format!("http://h/{i}"));
        }
        assert!(sink.limiters.lock().unwrap().len() <= MAX_IDLE_LIMITERS);
        assert!(
            Arc::ptr_eq(&held, &sink.limiter("http://h/held")),
            "a limiter in use was dropped"
        );
        // One that asked for a pause keeps it, idle or not.
        sink.limiter("http://h/paused")
            .keep_quiet(Instant::now(), Duration::from_secs(60), "HTTP 429");
        for i in 0..2 * MAX_IDLE_LIMITERS {
            sink.limiter(&format!("http://h/more/{i}"));
        }
        assert!(
            sink.limiter("http://h/paused").quiet_left(Instant::now()).is_some(),
            "a paused endpoint was forgotten, and its pause with it"
        );
    }
}
