//! The demo's webhook receiver: a small HTTP server in the same process that
//! plays a downstream service. It is down (503) for a while on purpose,
//! refuses one malformed order for good (422), and checks what the
//! guarantees promise: every event at least once, in order per key.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// When the receiver answers 503, relative to its `outage_from` call.
#[derive(Debug, Clone, Copy)]
pub struct Outage {
    pub after: Duration,
    pub lasting: Duration,
}

/// What the receiver saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Event ids accepted (2xx), once each.
    pub accepted: HashSet<String>,
    /// Requests for an event already accepted: redeliveries, which
    /// at-least-once allows and a consumer deduplicates by `webhook-id`.
    pub duplicates: u64,
    /// Requests answered 503 while down.
    pub refused_while_down: u64,
    /// Events refused for good (the malformed order), by id.
    pub rejected: HashSet<String>,
    /// Events that arrived before an earlier event of their key: must stay 0.
    pub out_of_order: Vec<String>,
    /// Per accepted event, from its commit (the CloudEvents `time`) to its
    /// arrival here, in milliseconds.
    pub latencies_ms: Vec<f64>,
    /// The same, for events committed while the receiver was up and not
    /// about to go down: what the relay's own latency is.
    pub latencies_up_ms: Vec<f64>,
}

#[derive(Default)]
struct Inner {
    seen: Seen,
    /// Per key, the highest `step` accepted.
    last_step: HashMap<String, u64>,
    down: Option<(Instant, Instant)>,
    /// The outage in wall-clock time, widened at the front by the longest a
    /// delivery should take, to tell which events it could have delayed.
    down_wall: Option<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)>,
}

#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Mutex<Inner>>,
    pub addr: SocketAddr,
}

/// The CloudEvents fields the receiver reads.
#[derive(Deserialize)]
struct Envelope {
    id: String,
    subject: Option<String>,
    time: chrono::DateTime<chrono::Utc>,
    data: serde_json::Value,
}

impl Receiver {
    /// Binds a loopback port and serves until `stop` is cancelled.
    pub async fn start(stop: CancellationToken) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Mutex::new(Inner::default()));
        let app = Router::new()
            .route("/hooks/{domain}", post(accept))
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Ok(Self { inner, addr })
    }

    /// Schedules the outage, counted from now.
    pub fn schedule(&self, outage: Outage) {
        let from = Instant::now() + outage.after;
        let wall = chrono::Utc::now() + chrono::Duration::from_std(outage.after).unwrap_or_default();
        let lasting = chrono::Duration::from_std(outage.lasting).unwrap_or_default();
        let mut inner = self.inner.lock().expect("receiver state");
        inner.down = Some((from, from + outage.lasting));
        inner.down_wall = Some((wall - chrono::Duration::milliseconds(500), wall + lasting));
    }

    /// Whether the receiver is answering 503 right now.
    pub fn is_down(&self) -> bool {
        self.inner.lock().expect("receiver state").down_now(Instant::now())
    }

    pub fn seen(&self) -> Seen {
        self.inner.lock().expect("receiver state").seen.clone()
    }
}

impl Inner {
    fn down_now(&self, now: Instant) -> bool {
        matches!(self.down, Some((from, until)) if now >= from && now < until)
    }
}

async fn accept(State(inner): State<Arc<Mutex<Inner>>>, body: axum::body::Bytes) -> (StatusCode, String) {
    let mut inner = inner.lock().expect("receiver state");
    if inner.down_now(Instant::now()) {
        inner.seen.refused_while_down += 1;
        return (StatusCode::SERVICE_UNAVAILABLE, "down for maintenance".into());
    }
    let envelope: Envelope = match serde_json::from_slice(&body) {
        Ok(e) => e,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("not a CloudEvents body: {e}")),
    };
    if envelope.data["total_cents"].as_i64().is_some_and(|t| t < 0) {
        inner.seen.rejected.insert(envelope.id);
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "total_cents must not be negative".into(),
        );
    }
    if inner.seen.accepted.contains(&envelope.id) {
        inner.seen.duplicates += 1;
        return (StatusCode::OK, "already have it".into());
    }
    // Events of a key carry steps 1, 2, 3 in commit order; a step arriving
    // before its predecessor is an order violation.
    if let (Some(key), Some(step)) = (envelope.subject, envelope.data["step"].as_u64()) {
        let last = inner.last_step.get(&key).copied().unwrap_or(0);
        if step != last + 1 {
            inner
                .seen
                .out_of_order
                .push(format!("{key}: step {step} after step {last}"));
        }
        inner.last_step.insert(key, last.max(step));
    }
    let latency = (chrono::Utc::now() - envelope.time)
        .num_microseconds()
        .unwrap_or(i64::MAX) as f64
        / 1000.0;
    inner.seen.latencies_ms.push(latency);
    if !matches!(inner.down_wall, Some((from, until)) if envelope.time >= from && envelope.time <= until) {
        inner.seen.latencies_up_ms.push(latency);
    }
    inner.seen.accepted.insert(envelope.id);
    (StatusCode::OK, "ok".into())
}
