//! The one NATS connection a sink reuses, and the reconnect loop around it.
//!
//! async-nats reconnects on its own and then sends whatever publishes were
//! still queued in the client. After a connection loss that breaks per-key
//! order: the tail of a batch that sat in the old connection's write buffer
//! is lost, while later events of the same keys, still queued, go out on the
//! new connection and are stored first. So Ferry never lets a client
//! reconnect: each connection's I/O task runs on a small runtime of its own,
//! its reconnect callback never returns, and on a loss the sink drops the
//! whole runtime, queued publishes and all, then connects afresh with
//! [`Backoff`]. What reached the server is then always a prefix of what the
//! connection carried.

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_nats::{Client, ConnectOptions, Event, ServerError};
use ferry_core::{ErrorKind, SinkError};
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;
use tracing::{info, warn};

use super::codes;
use crate::backoff::Backoff;

/// Messages a PubAck subscription may buffer; a batch larger than this would
/// lose acks (and time out) rather than block the connection.
pub(crate) const SUBSCRIPTION_CAPACITY: usize = 65_536;

struct Link {
    client: Client,
    /// Becomes `true` once the connection is lost; it is never reused then.
    broken: watch::Receiver<bool>,
    /// Every permission the server refused on this connection, in order.
    denied: watch::Receiver<Denials>,
    /// Dropping it stops the connection's runtime, and with it every queued
    /// publish.
    _stop: oneshot::Sender<()>,
}

/// A connected client and the signal that its connection was lost.
pub(crate) struct Handle {
    pub(crate) client: Client,
    pub(crate) broken: watch::Receiver<bool>,
    pub(crate) denied: watch::Receiver<Denials>,
}

/// The permissions the server refused a connection, as far as they are
/// kept: a refused subject earns one `-ERR` per message, for as long as
/// events are sent to it.
#[derive(Debug, Default)]
pub(crate) struct Denials {
    /// How many there were.
    pub(crate) total: usize,
    /// The latest of them.
    recent: VecDeque<Denial>,
}

impl Denials {
    /// More than a batch of one subject's refusals: an inbox refusal among
    /// them is read before this many more arrive. async-nats itself keeps
    /// 128 connection events and drops the rest, so a burst of one
    /// subject's refusals can hide another's: that batch then waits out
    /// its publish timeout, as it would without this.
    const KEPT: usize = 1024;

    /// Adds one; `true` if it says something the one before did not.
    fn push(&mut self, denial: Denial) -> bool {
        let news = self.recent.back().is_none_or(|last| last.text != denial.text);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(denial);
        self.total += 1;
        news
    }

    /// Those after the first `seen`, as far as they are kept.
    pub(crate) fn since(&self, seen: usize) -> impl Iterator<Item = &Denial> {
        let new = self.total.saturating_sub(seen);
        self.recent.iter().skip(self.recent.len().saturating_sub(new))
    }
}

/// A permission the server refused this connection. The server says so
/// only in an `-ERR` on the connection: the publish itself is dropped and
/// its PubAck never comes, so without this a refused subject would look
/// like a slow JetStream until the publish timed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Denial {
    /// The server's words, e.g. `Permissions Violation for Publish to "a.b"`.
    pub(crate) text: String,
    /// The subject of a refused publish. `None` for a refused subscription
    /// (the PubAck inbox) or reply subject: then no PubAck can arrive.
    pub(crate) publish_to: Option<String>,
}

impl Denial {
    /// The denial an `-ERR` describes, if it is one.
    pub(crate) fn read(error: &str) -> Option<Denial> {
        const PUBLISH: &str = "permissions violation for publish to ";
        let lower = error.to_ascii_lowercase();
        if !lower.starts_with("permissions violation") {
            return None;
        }
        let publish_to = lower
            .starts_with(PUBLISH)
            .then(|| error[PUBLISH.len()..].trim().trim_matches('"').to_owned());
        Some(Denial {
            text: error.to_owned(),
            publish_to,
        })
    }

    /// Whether it stops what was sent to `subject`: a refused publish to
    /// that subject, or a refusal (of the inbox) that stops everything.
    pub(crate) fn stops(&self, subject: &str) -> bool {
        self.publish_to.as_deref().is_none_or(|refused| refused == subject)
    }

    /// The error for an event this denial stopped.
    pub(crate) fn error(&self) -> SinkError {
        match &self.publish_to {
            Some(subject) => SinkError::transient(format!(
                "NATS refused this connection's user to publish to {subject:?} ({}); nothing was stored: \
                 allow the subject in the user's publish permissions on the server",
                self.text
            )),
            None => SinkError::transient(format!(
                "NATS refused this connection's user a permission the sink needs ({}), so no PubAck can \
                 arrive (the message may be stored all the same): allow the user to subscribe to \
                 _INBOX.> on the server",
                self.text
            )),
        }
    }
}

pub(crate) struct Connector {
    url: String,
    display_url: String,
    /// Bounds each connect.
    timeout: Duration,
    link: Option<Link>,
    backoff: Backoff,
    /// The server's `max_payload`, `0` until the first connect.
    max_payload: Arc<AtomicUsize>,
}

impl Connector {
    pub(crate) fn new(url: String, timeout: Duration, reconnect_max_delay: Duration) -> Self {
        Self {
            display_url: ferry_core::redact::url(&url),
            url,
            timeout,
            link: None,
            backoff: Backoff::new(reconnect_max_delay),
            max_payload: Arc::new(AtomicUsize::new(0)),
        }
    }

    pub(crate) fn max_payload(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.max_payload)
    }

    pub(crate) fn display_url(&self) -> &str {
        &self.display_url
    }

    /// The client, connecting if needed. While a backoff is pending this
    /// fails at once, so a publish against a down server returns promptly.
    pub(crate) async fn handle(&mut self) -> Result<Handle, SinkError> {
        if self.link.as_ref().is_some_and(|l| *l.broken.borrow()) {
            warn!(url = %self.display_url, "NATS connection lost; reconnecting");
            self.link = None;
        }
        if self.link.is_none() {
            self.link = Some(self.connect().await?);
        }
        let link = self.link.as_ref().expect("just set");
        Ok(Handle {
            client: link.client.clone(),
            broken: link.broken.clone(),
            denied: link.denied.clone(),
        })
    }

    /// [`Connector::handle`] for a publish. A login the server refuses is a
    /// configuration error to `check`, which runs before a relay starts,
    /// but transient here: a server restarting, its auth callout or its
    /// account resolver may refuse a user for a moment, and each batch
    /// that met the refusal would go dead.
    pub(crate) async fn handle_to_publish(&mut self) -> Result<Handle, SinkError> {
        self.handle().await.map_err(|e| match e.kind {
            ErrorKind::Config => SinkError::transient(format!(
                "{}; retried, as a server may refuse a login for a moment (`ferry check` reports it as a \
                 configuration error): fix sinks.<nats>.url if it persists",
                e.message
            )),
            _ => e,
        })
    }

    /// Abandons the connection after a failure whose state is unknown and
    /// returns `error`. The next call connects at once.
    pub(crate) fn lost(&mut self, error: SinkError) -> SinkError {
        if self.link.take().is_some() {
            warn!(url = %self.display_url, %error, "dropping NATS connection");
        }
        error
    }

    /// Flushes what the client still holds, then stops the connection.
    pub(crate) async fn close(&mut self) {
        let Some(link) = self.link.take() else { return };
        if !matches!(timeout(self.timeout, link.client.flush()).await, Ok(Ok(()))) {
            warn!(url = %self.display_url, "NATS did not confirm the final flush");
        }
        info!(url = %self.display_url, "closed NATS connection");
    }

    async fn connect(&mut self) -> Result<Link, SinkError> {
        let now = Instant::now();
        if let Err(wait) = self.backoff.ready(now) {
            return Err(SinkError::transient(format!(
                "not connected to NATS at {}; next attempt in {wait:?} (last error: {})",
                self.display_url,
                self.backoff.last_error().unwrap_or("none")
            )));
        }
        let error = match timeout(self.timeout, self.spawn_connection()).await {
            Ok(Ok(link)) => {
                self.backoff.succeeded();
                let max_payload = link.client.server_info().max_payload;
                self.max_payload.store(max_payload, Ordering::Relaxed);
                info!(url = %self.display_url, max_payload, "connected to NATS");
                crate::connected("nats");
                return Ok(link);
            }
            Ok(Err(e)) => e,
            Err(_) => SinkError::transient(format!(
                "connecting to NATS at {}: no answer within {:?}",
                self.display_url, self.timeout
            )),
        };
        let delay = self.backoff.failed(now, error.message.clone());
        warn!(%error, retry_in = ?delay, "NATS connection failed");
        Err(error)
    }

    /// Connects on a thread with its own single-threaded runtime, which runs
    /// the client's I/O task until the link's stop sender is dropped.
    async fn spawn_connection(&self) -> Result<Link, SinkError> {
        let (broken_tx, broken) = watch::channel(false);
        let broken_tx = Arc::new(broken_tx);
        let (denied_tx, denied) = watch::channel(Denials::default());
        let denied_tx = Arc::new(denied_tx);
        let asked = AtomicBool::new(false);
        // async-nats ignores credentials embedded in the URL; pass them on.
        let options = match credentials(&self.url) {
            Ok(Some(Credentials::UserPassword(user, password))) => {
                ConnectOptions::with_user_and_password(user, password)
            }
            Ok(Some(Credentials::Token(token))) => ConnectOptions::with_token(token),
            Ok(None) => ConnectOptions::new(),
            Err(e) => {
                return Err(SinkError::config(format!(
                    "sinks.nats.url {:?} is not a NATS URL: {e}",
                    self.display_url
                )));
            }
        };
        let options = options
            .name("ferry")
            .connection_timeout(self.timeout)
            .subscription_capacity(SUBSCRIPTION_CAPACITY)
            .event_callback(move |event| {
                let broken_tx = Arc::clone(&broken_tx);
                let denied_tx = Arc::clone(&denied_tx);
                async move {
                    match event {
                        Event::Disconnected | Event::Closed => {
                            broken_tx.send_replace(true);
                        }
                        Event::ServerError(ServerError::Other(error)) => {
                            if let Some(denial) = Denial::read(&error) {
                                let text = denial.text.clone();
                                let mut news = false;
                                denied_tx.send_modify(|all| news = all.push(denial));
                                if news {
                                    warn!(error = %text, "NATS refused a permission");
                                }
                            }
                        }
                        _ => {}
                    }
                }
            })
            // Never reconnect this client; see the module docs. async-nats
            // asks this callback before the first connect too: let that one
            // through to the default server selection.
            .reconnect_to_server_callback(move |_, _| {
                let first = !asked.swap(true, Ordering::SeqCst);
                async move {
                    if !first {
                        std::future::pending::<()>().await;
                    }
                    None
                }
            });
        let url = self.url.clone();
        let display_url = self.display_url.clone();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("ferry-nats".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(SinkError::transient(format!("starting a NATS runtime: {e}"))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let connected = options.connect(url.as_str()).await.map_err(|e| {
                        codes::error(
                            codes::connect_error_kind(e.kind()),
                            format!("connecting to NATS at {display_url}: {e}"),
                        )
                    });
                    let ok = connected.is_ok();
                    // If the caller gave up, the client is dropped right here.
                    if ready_tx.send(connected).is_ok() && ok {
                        let _ = stop_rx.await;
                    }
                });
                // Dropping the runtime cancels the client's I/O task.
            })
            .map_err(|e| SinkError::transient(format!("starting a NATS thread: {e}")))?;
        let client = ready_rx
            .await
            .map_err(|_| SinkError::transient("the NATS connection thread ended"))??;
        Ok(Link {
            client,
            broken,
            denied,
            _stop: stop_tx,
        })
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Credentials {
    UserPassword(String, String),
    Token(String),
}

/// The user and password, or the token, embedded in `url`, percent-decoded.
fn credentials(url: &str) -> Result<Option<Credentials>, String> {
    let addr = async_nats::ServerAddr::from_str(url).map_err(|e| e.to_string())?;
    Ok(match (addr.username(), addr.password()) {
        (Some(user), Some(password)) => Some(Credentials::UserPassword(
            percent_decode(user)?,
            percent_decode(password)?,
        )),
        (Some(token), None) => Some(Credentials::Token(percent_decode(token)?)),
        _ => None,
    })
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or("a truncated %-escape")?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| "an invalid %-escape")?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "credentials that are not UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_violations_are_read_from_the_servers_errors() {
        assert_eq!(
            Denial::read(r#"Permissions Violation for Publish to "orders.eu""#),
            Some(Denial {
                text: r#"Permissions Violation for Publish to "orders.eu""#.into(),
                publish_to: Some("orders.eu".into()),
            })
        );
        let inbox = Denial::read(r#"Permissions Violation for Subscription to "_INBOX.x.*""#).unwrap();
        assert_eq!(inbox.publish_to, None);
        assert!(
            inbox.error().message.contains("subscribe to _INBOX.>"),
            "{}",
            inbox.error()
        );
        assert_eq!(Denial::read("Maximum Payload Violation"), None);
        // Kept in a bounded window; what came since a reading is found.
        let mut all = Denials::default();
        let one = |s: &str| Denial::read(&format!("Permissions Violation for Publish to \"{s}\"")).unwrap();
        assert!(all.push(one("a")));
        assert!(!all.push(one("a")), "the same refusal again is not news");
        for _ in 0..Denials::KEPT {
            all.push(one("b"));
        }
        assert!(all.push(one("c")));
        assert_eq!(all.total, Denials::KEPT + 3);
        let seen = all.total - 2;
        let since: Vec<_> = all.since(seen).map(|d| d.publish_to.clone().unwrap()).collect();
        assert_eq!(since, ["b", "c"]);
        assert_eq!(all.since(0).count(), Denials::KEPT);
        assert_eq!(Denial::read("Authorization Violation"), None);
    }

    #[test]
    fn credentials_come_from_the_url() {
        assert_eq!(credentials("nats://127.0.0.1:4222"), Ok(None));
        assert_eq!(
            credentials("nats://ferry:p%40ss%3Aw@host:4222"),
            Ok(Some(Credentials::UserPassword("ferry".into(), "p@ss:w".into())))
        );
        assert_eq!(
            credentials("nats://s3cret@host:4222"),
            Ok(Some(Credentials::Token("s3cret".into())))
        );
        assert!(credentials("nats://u:%zz@host").is_err());
    }
}
