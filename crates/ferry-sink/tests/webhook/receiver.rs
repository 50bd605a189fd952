//! A webhook receiver inside the test: an axum server on 127.0.0.1:0 that
//! verifies Standard Webhooks signatures with its own HMAC code and records
//! what arrived.
//!
//! - `POST /hook`: records the request and answers 200, or 500 for an event
//!   id in the reject list; waits while the gate is closed, and can hold the
//!   first requests until a number of them are in flight at once, and can
//!   answer each request a while after recording it.
//! - `POST|HEAD /status/{code}`: answers `code` (with `Retry-After` on 429
//!   and 503, `Location` on 3xx), recording nothing.
//! - anything else: 404.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::watch;

/// The date a 503 answers with in `Retry-After`.
pub const RETRY_DATE: &str = "Wed, 21 Oct 2037 07:28:00 GMT";

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Received {
    /// The `webhook-id` header.
    pub id: String,
    pub body: Vec<u8>,
    pub json: serde_json::Value,
    pub headers: BTreeMap<String, String>,
    /// Per configured receiver secret: did one of the signatures match it.
    pub signed_with: Vec<bool>,
    /// `webhook-timestamp` within five minutes of the receiver's clock.
    pub fresh: bool,
}

impl Received {
    pub fn key(&self) -> Option<String> {
        self.json.get("subject").and_then(|s| s.as_str()).map(str::to_owned)
    }
    pub fn seq(&self) -> i64 {
        self.json["data"]["seq"].as_i64().expect("a seq in the data")
    }
}

#[derive(Default)]
struct Counters {
    in_flight: usize,
    max_in_flight: usize,
    per_key: HashMap<String, usize>,
    max_per_key: usize,
}

struct Inner {
    keys: Vec<Vec<u8>>,
    received: Mutex<Vec<Received>>,
    counters: Mutex<Counters>,
    started: AtomicUsize,
    hold: Mutex<Option<usize>>,
    reject: Mutex<HashSet<String>>,
    gate: watch::Sender<bool>,
    /// How long a recorded `/hook` request waits for its answer.
    answer_after: Mutex<Duration>,
}

#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Inner>,
    addr: SocketAddr,
    read: Arc<Mutex<usize>>,
}

impl Receiver {
    /// Starts a receiver verifying with `secrets` (`whsec_...`).
    pub async fn start(secrets: &[&str]) -> Receiver {
        let keys = secrets
            .iter()
            .map(|s| STANDARD.decode(s.strip_prefix("whsec_").unwrap()).unwrap())
            .collect();
        let inner = Arc::new(Inner {
            keys,
            received: Mutex::default(),
            counters: Mutex::default(),
            started: AtomicUsize::new(0),
            hold: Mutex::new(None),
            reject: Mutex::default(),
            gate: watch::Sender::new(true),
            answer_after: Mutex::default(),
        });
        let app = Router::new()
            .route("/hook", post(hook))
            .route("/status/{code}", any(status))
            .with_state(Arc::clone(&inner));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver {
            inner,
            addr,
            read: Arc::default(),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Everything recorded so far, in arrival order.
    pub fn all(&self) -> Vec<Received> {
        self.inner.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.inner.received.lock().unwrap().len()
    }

    /// Waits until `n` more requests were recorded or `timeout` passed and
    /// returns them; each is returned once.
    pub async fn receive(&self, n: usize, timeout: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + timeout;
        let start = *self.read.lock().unwrap();
        while self.count() < start + n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let all = self.all();
        let end = all.len().min(start + n);
        *self.read.lock().unwrap() = end;
        all[start..end].to_vec()
    }

    /// Holds the first `n` `/hook` requests until `n` are in the handler at
    /// once (for at most five seconds), then a little longer, so whatever
    /// the sink lets through concurrently shows up in [`Self::max_in_flight`].
    pub fn hold_first(&self, n: usize) {
        *self.inner.hold.lock().unwrap() = Some(n);
    }

    /// The most requests that were in the handler at once, overall and for
    /// one key.
    pub fn max_in_flight(&self) -> (usize, usize) {
        let c = self.inner.counters.lock().unwrap();
        (c.max_in_flight, c.max_per_key)
    }

    pub fn in_flight(&self) -> usize {
        self.inner.counters.lock().unwrap().in_flight
    }

    /// Answers 500 to the event with this id.
    pub fn reject(&self, id: &str) {
        self.inner.reject.lock().unwrap().insert(id.to_owned());
    }

    /// Answers each `/hook` request `delay` after recording it, as a slow
    /// receiver does.
    pub fn answer_after(&self, delay: Duration) {
        *self.inner.answer_after.lock().unwrap() = delay;
    }

    /// While closed, `/hook` requests wait in the handler.
    pub fn set_gate(&self, open: bool) {
        self.inner.gate.send_replace(open);
    }
}

async fn hook(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let json: serde_json::Value = serde_json::from_slice(&body).expect("a JSON body");
    let key = json.get("subject").and_then(|s| s.as_str()).unwrap_or("").to_owned();
    {
        let mut c = inner.counters.lock().unwrap();
        c.in_flight += 1;
        c.max_in_flight = c.max_in_flight.max(c.in_flight);
        if !key.is_empty() {
            let n = c.per_key.entry(key.clone()).or_default();
            *n += 1;
            let n = *n;
            c.max_per_key = c.max_per_key.max(n);
        }
    }
    let started = inner.started.fetch_add(1, Ordering::SeqCst) + 1;
    let hold = *inner.hold.lock().unwrap();
    if let Some(n) = hold
        && started <= n
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while inner.counters.lock().unwrap().in_flight < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Widens the overlap so a missing limit shows as more in flight.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = inner.gate.subscribe().wait_for(|open| *open).await;

    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let id = text("webhook-id");
    let timestamp = text("webhook-timestamp");
    let signatures = text("webhook-signature");
    let signed_with = inner
        .keys
        .iter()
        .map(|key| {
            let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
            mac.update(format!("{id}.{timestamp}.").as_bytes());
            mac.update(&body);
            let expected = format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()));
            signatures.split(' ').any(|s| s == expected)
        })
        .collect();
    let fresh = timestamp
        .parse::<i64>()
        .is_ok_and(|t| (chrono::Utc::now().timestamp() - t).abs() <= 300);
    let rejected = inner.reject.lock().unwrap().contains(&id);
    if !rejected {
        inner.received.lock().unwrap().push(Received {
            id,
            body: body.to_vec(),
            json,
            headers: headers
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                .collect(),
            signed_with,
            fresh,
        });
    }
    let delay = *inner.answer_after.lock().unwrap();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    {
        let mut c = inner.counters.lock().unwrap();
        c.in_flight -= 1;
        if let Some(n) = c.per_key.get_mut(&key) {
            *n -= 1;
        }
    }
    if rejected {
        (StatusCode::INTERNAL_SERVER_ERROR, "rejected by the test").into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

async fn status(Path(code): Path<u16>) -> Response {
    let status = StatusCode::from_u16(code).unwrap();
    let mut response = (status, format!("answered {code} on purpose")).into_response();
    if status == StatusCode::NO_CONTENT || status.is_redirection() {
        response = status.into_response();
    }
    let headers = response.headers_mut();
    match code {
        429 => drop(headers.insert("retry-after", "7".parse().unwrap())),
        503 => drop(headers.insert("retry-after", RETRY_DATE.parse().unwrap())),
        300..=399 => drop(headers.insert("location", "https://moved.example/hook?token=s3cret".parse().unwrap())),
        _ => {}
    }
    response
}
