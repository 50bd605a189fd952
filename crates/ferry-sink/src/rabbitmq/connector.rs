//! The one connection and the confirm-mode channels a sink reuses, and the
//! reconnect loop around them.
//!
//! lapin's own recovery (`enable_auto_recover`) replays topology and resumes
//! channels behind the caller's back, which leaves in-flight confirms in an
//! unclear state; Ferry instead treats any broken link as "everything in
//! flight failed transiently", drops it, and reconnects on the next call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferry_core::{ErrorKind, SinkError};
use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use super::reply::{self, NOT_FOUND};
use crate::backoff::Backoff;

struct Link {
    connection: Connection,
    /// The publishing channels, in confirm mode, one per lane; `None` where
    /// the broker closed it.
    channels: Vec<Option<Channel>>,
    /// A batch timed out on the channels while the broker blocked the
    /// connection: its publishes go out once the alarm clears, and their
    /// confirms and returns must come in before another batch's, or lapin
    /// could hand one of their returns to the new batch's confirm.
    owed: bool,
}

pub(crate) struct Connector {
    url: String,
    /// `url` without its password, for messages and logs.
    display_url: String,
    /// Bounds each connect, channel open and declare.
    timeout: Duration,
    link: Option<Link>,
    /// How many publishing channels a link holds.
    lanes: usize,
    backoff: Backoff,
    /// The broker refused the last connect for its credentials or vhost.
    refused: bool,
    /// Where each connection's negotiated frame size is told to the sink.
    frame_max: Arc<AtomicUsize>,
}

impl Connector {
    /// A connector whose links publish over `lanes` channels (at least one).
    pub(crate) fn new(
        url: String,
        timeout: Duration,
        reconnect_max_delay: Duration,
        lanes: usize,
        frame_max: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            frame_max,
            display_url: ferry_core::redact::url(&url),
            url,
            timeout,
            link: None,
            lanes: lanes.max(1),
            backoff: Backoff::new(reconnect_max_delay),
            refused: false,
        }
    }

    /// The publishing channels, one per lane, connecting or reopening them
    /// if needed. Never waits out a backoff: while one is pending this fails
    /// at once, so a publish against a down broker returns promptly.
    pub(crate) async fn confirm_channels(&mut self) -> Result<Vec<Channel>, SinkError> {
        self.connection().await?;
        if self.blocked() {
            return Err(self.blocked_error("not sent"));
        }
        self.settle_owed().await?;
        let link = self.link.as_mut().expect("connection() leaves a link");
        let mut channels = Vec::with_capacity(link.channels.len());
        for lane in 0..link.channels.len() {
            if let Some(channel) = &link.channels[lane] {
                channels.push(channel.clone());
                continue;
            }
            let opened = timeout(self.timeout, async {
                let channel = link.connection.create_channel().await?;
                channel.confirm_select(ConfirmSelectOptions::default()).await?;
                Ok::<_, lapin::Error>(channel)
            })
            .await;
            match opened {
                Ok(Ok(channel)) => {
                    debug!(channel = channel.id(), lane, "opened confirm channel");
                    link.channels[lane] = Some(channel.clone());
                    channels.push(channel);
                }
                Ok(Err(e)) if lane > 0 && matches!(e.kind(), lapin::ErrorKind::ChannelsLimitReached) => {
                    // The broker (or the URL's channel_max) allows fewer
                    // channels than configured: publish over those open,
                    // leaving one free for the passive declares that check
                    // exchanges.
                    let keep = (lane - 1).max(1);
                    warn!(
                        url = %self.display_url,
                        configured = link.channels.len(),
                        publishing_over = keep,
                        "RabbitMQ allows no more channels on this connection; lower the sink's channels"
                    );
                    link.channels.truncate(keep);
                    channels.truncate(keep);
                    break;
                }
                Ok(Err(e)) => return Err(self.lost(reply::from_lapin("opening a confirm channel", &e))),
                // Blocked meanwhile: lapin writes nothing until the alarm clears.
                Err(_) if self.blocked() => return Err(self.blocked_error("not sent")),
                Err(_) => return Err(self.lost(self.timed_out("opening a confirm channel"))),
            }
        }
        Ok(channels)
    }

    /// Whether `exchange` exists, asked with a passive declare on a throwaway
    /// channel: a failed passive declare makes the broker close the channel,
    /// which must not be the publishing one.
    pub(crate) async fn exchange_exists(&mut self, exchange: &str) -> Result<bool, SinkError> {
        let Ok(name) = ShortString::try_new(exchange) else {
            return Err(SinkError::config(format!(
                "exchange name is {} bytes, AMQP allows at most 255; shorten routes[].destination",
                exchange.len()
            )));
        };
        let limit = self.timeout;
        self.connection().await?;
        if self.blocked() {
            return Err(self.blocked_error(&format!("exchange {exchange:?} not checked")));
        }
        let connection = &self.link.as_ref().expect("connection() leaves a link").connection;
        let declared = timeout(limit, async {
            let channel = connection.create_channel().await?;
            let options = ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            };
            // The kind is ignored by a passive declare.
            let result = channel
                .exchange_declare(name, ExchangeKind::Topic, options, FieldTable::default())
                .await;
            // Dropping the last handle closes the channel if the broker has not.
            drop(channel);
            result
        })
        .await;
        match declared {
            Ok(Ok(())) => Ok(true),
            Ok(Err(e)) if reply::reply_code(&e) == Some(NOT_FOUND) => Ok(false),
            Ok(Err(e)) => {
                self.discard_dead();
                Err(reply::from_lapin(&format!("checking exchange {exchange:?}"), &e))
            }
            Err(_) if self.blocked() => Err(self.blocked_error(&format!("exchange {exchange:?} not checked"))),
            Err(_) => Err(self.lost(self.timed_out(&format!("checking exchange {exchange:?}")))),
        }
    }

    /// Drops whatever lapin reports as no longer open: a channel the broker
    /// closed is reopened on the next call, a dead connection reconnected.
    pub(crate) fn discard_dead(&mut self) {
        let Some(link) = &mut self.link else { return };
        if !link.connection.status().connected() {
            warn!(url = %self.display_url, "RabbitMQ connection lost; reconnecting on next use");
            self.link = None;
        } else {
            for (lane, slot) in link.channels.iter_mut().enumerate() {
                if slot.as_ref().is_some_and(|c| !c.status().connected()) {
                    debug!(lane, "publishing channel closed; reopening on next use");
                    *slot = None;
                }
            }
        }
    }

    /// Abandons the link after a failure whose state is unknown (a timeout, an
    /// error mid-handshake) and returns `error` for the caller to report. The
    /// next call reconnects at once: only failed attempts back off.
    /// Whether the broker blocked the link's connection for a resource
    /// alarm (memory or disk). It reads nothing from a blocked connection,
    /// and lapin writes nothing to it, until the alarm clears; a new
    /// connection would be blocked at its first publish, so it is kept.
    pub(crate) fn blocked(&self) -> bool {
        self.link
            .as_ref()
            .is_some_and(|link| link.connection.status().blocked())
    }

    /// Keeps a blocked connection whose batch timed out: see [`Link::owed`].
    pub(crate) fn keep_blocked(&mut self) {
        if let Some(link) = &mut self.link {
            link.owed = true;
        }
    }

    /// Waits for the confirms a batch left owed while the connection was
    /// blocked (its returns are drained with them), or gives the connection
    /// up if they do not come.
    async fn settle_owed(&mut self) -> Result<(), SinkError> {
        let Some(link) = self.link.as_mut().filter(|link| link.owed) else {
            return Ok(());
        };
        let channels: Vec<Channel> = link.channels.iter().flatten().cloned().collect();
        let settled = timeout(self.timeout, async {
            for channel in &channels {
                channel.wait_for_confirms().await?;
            }
            Ok::<_, lapin::Error>(())
        })
        .await;
        match settled {
            Ok(Ok(())) => {
                link.owed = false;
                Ok(())
            }
            Ok(Err(e)) => Err(self.lost(reply::from_lapin("settling confirms owed since the alarm", &e))),
            Err(_) => Err(self.lost(self.timed_out("settling confirms owed since the alarm"))),
        }
    }

    /// `what` happened because the connection is blocked.
    pub(crate) fn blocked_error(&self, what: &str) -> SinkError {
        SinkError::transient(format!(
            "{what}: RabbitMQ at {} has blocked publishing on this connection for a resource alarm \
             (memory or disk; rabbitmq-diagnostics alarms names it); it resumes when the alarm clears",
            self.display_url
        ))
    }

    pub(crate) fn lost(&mut self, error: SinkError) -> SinkError {
        if self.link.take().is_some() {
            warn!(url = %self.display_url, %error, "dropping RabbitMQ connection");
        }
        error
    }

    pub(crate) fn timed_out(&self, what: &str) -> SinkError {
        SinkError::transient(format!(
            "{what}: no answer from RabbitMQ at {} within {:?}",
            self.display_url, self.timeout
        ))
    }

    /// Closes the channels and the connection, waiting for the broker's
    /// close-ok at most `timeout` each.
    pub(crate) async fn close(&mut self) {
        let Some(link) = self.link.take() else { return };
        for channel in link.channels.into_iter().flatten() {
            if let Ok(Err(e)) = timeout(self.timeout, channel.close(200, "OK".into())).await {
                debug!(error = %e, "closing a confirm channel");
            }
        }
        match timeout(self.timeout, link.connection.close(200, "OK".into())).await {
            Ok(Ok(())) => info!(url = %self.display_url, "closed RabbitMQ connection"),
            Ok(Err(e)) => debug!(error = %e, "closing the RabbitMQ connection"),
            Err(_) => warn!(url = %self.display_url, "RabbitMQ did not answer connection.close"),
        }
    }

    /// `err` as a configuration error when the broker refused the last
    /// connect for its credentials or vhost: at start-up that is a broken
    /// `url`, to fix before a relay runs. Publishing keeps such a refusal
    /// transient, as a broker restarting may refuse a user for a moment.
    pub(crate) fn refusal_is_config(&self, err: SinkError) -> SinkError {
        if self.refused && err.kind == ErrorKind::Transient {
            SinkError::config(format!(
                "{}; RabbitMQ refused the user or the vhost: fix sinks.<rabbitmq>.url",
                err.message
            ))
        } else {
            err
        }
    }

    /// Connects unless connected: what the broker negotiates (its frame
    /// size) is then known. A failure is left to the publish that follows,
    /// which meets it again and reports it.
    pub(crate) async fn connect_if_needed(&mut self) {
        let _ = self.connection().await;
    }

    async fn connection(&mut self) -> Result<&Connection, SinkError> {
        self.discard_dead();
        if self.link.is_none() {
            let connection = self.connect().await?;
            self.link = Some(Link {
                connection,
                channels: vec![None; self.lanes],
                owed: false,
            });
        }
        Ok(&self.link.as_ref().expect("just set").connection)
    }

    async fn connect(&mut self) -> Result<Connection, SinkError> {
        let now = Instant::now();
        if let Err(wait) = self.backoff.ready(now) {
            return Err(SinkError::transient(format!(
                "not connected to RabbitMQ at {}; next attempt in {wait:?} (last error: {})",
                self.display_url,
                self.backoff.last_error().unwrap_or("none")
            )));
        }
        let properties = ConnectionProperties::default().with_connection_name("ferry".into());
        let error = match timeout(self.timeout, Connection::connect(&self.url, properties)).await {
            Ok(Ok(connection)) => {
                self.refused = false;
                let frame_max = connection.configuration().frame_max();
                if frame_max > 0 {
                    self.frame_max.store(frame_max as usize, Ordering::Relaxed);
                }
                self.backoff.succeeded();
                info!(url = %self.display_url, "connected to RabbitMQ");
                crate::connected("rabbitmq");
                return Ok(connection);
            }
            Ok(Err(e)) => {
                self.refused =
                    reply::reply_code(&e).is_some_and(|code| reply::reply_code_kind(code) == ErrorKind::Config);
                format!("connecting to RabbitMQ at {}: {e}", self.display_url)
            }
            Err(_) => {
                self.refused = false;
                format!(
                    "connecting to RabbitMQ at {}: no answer within {:?}",
                    self.display_url, self.timeout
                )
            }
        };
        let delay = self.backoff.failed(now, error.clone());
        warn!(%error, retry_in = ?delay, "RabbitMQ connection failed");
        Err(SinkError::transient(error))
    }
}
