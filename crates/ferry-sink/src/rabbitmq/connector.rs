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

use super::deadline::Deadline;
use super::lanes::Lanes;
use super::missing::MissingExchanges;
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
    /// Bounds each connect, channel open and declare outside a publish
    /// call (`check`, `close`).
    timeout: Duration,
    /// The current publish call's deadline: within a call it bounds every
    /// step instead of `timeout`, and no step starts once it passed.
    deadline: Option<Deadline>,
    link: Option<Link>,
    /// How many publishing channels a link holds: the sink's `channels`
    /// setting, or fewer for a while after the broker refused one.
    lanes: Lanes,
    /// Exchanges found missing, checked again before events go to them.
    pub(crate) missing: MissingExchanges,
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
            deadline: None,
            link: None,
            lanes: Lanes::new(lanes, super::lanes::RETRY_AFTER),
            missing: MissingExchanges::default(),
            backoff: Backoff::new(reconnect_max_delay),
            refused: false,
        }
    }

    /// Bounds every step until `deadline` (one publish call's), or each by
    /// the timeout again (`None`).
    pub(crate) fn set_deadline(&mut self, deadline: Option<Deadline>) {
        self.deadline = deadline;
    }

    /// How long the broker may take over the next step, `what`: the timeout,
    /// or what is left of the call's deadline; an error once it passed, so
    /// that the step does not start.
    fn bound(&self, what: &str) -> Result<Duration, SinkError> {
        match &self.deadline {
            None => Ok(self.timeout),
            Some(deadline) if deadline.passed() => Err(deadline.error(what)),
            Some(deadline) => Ok(deadline.left().min(self.timeout)),
        }
    }

    /// Whether a connect given `bound` was cut short by the call's deadline:
    /// given clearly less than the timeout, not just what the call's first
    /// moments took from it. Running out of such a bound says nothing of
    /// the broker, so it costs no backoff.
    fn cut_short(&self, bound: Duration) -> bool {
        self.deadline.is_some() && bound < self.timeout.mul_f64(0.9)
    }

    /// How long after a channel-limit refusal the configured number of
    /// channels is tried again.
    pub(crate) fn set_channels_retry_after(&mut self, after: Duration) {
        self.lanes.set_retry_after(after);
    }

    /// The publishing channels, one per lane, connecting or reopening them
    /// if needed. Never waits out a backoff: while one is pending this fails
    /// at once, so a publish against a down broker returns promptly.
    ///
    /// Where the broker refuses a channel (a user's `max-channels`, a node's
    /// channel limit, the negotiated `channel_max`), the sink publishes over
    /// fewer and warns, trying the configured number again after a
    /// cool-down ([`Lanes`]); only when it refuses the first is this an
    /// error, transient and naming the limit and `sinks.<sink>.channels`.
    pub(crate) async fn confirm_channels(&mut self, sink: &str) -> Result<Vec<Channel>, SinkError> {
        if self.lanes.retry_due(Instant::now()) {
            info!(
                url = %self.display_url,
                channels = self.lanes.configured(),
                "trying the configured number of RabbitMQ channels again after a channel-limit refusal"
            );
            let lanes = self.lanes.current();
            if let Some(link) = &mut self.link {
                link.channels.resize(lanes, None);
            }
        }
        // Each refusal past the first channel lowers the lanes, so this ends.
        loop {
            self.connection().await?;
            if self.blocked() {
                return Err(self.blocked_error("not sent"));
            }
            self.settle_owed().await?;
            match self.open_lanes().await? {
                Ok(channels) => {
                    self.lanes.opened(channels.len());
                    return Ok(channels);
                }
                Err((lane, refusal)) if lane > 0 => self.fewer_lanes(lane, &refusal),
                Err((_, refusal)) => {
                    let error = self.limit_error("opening a publishing channel", &refusal, sink);
                    return Err(self.lost(error));
                }
            }
        }
    }

    /// Opens the lanes' missing channels: the inner error is the lane whose
    /// channel the broker refused for a channel limit, and the refusal.
    async fn open_lanes(&mut self) -> Result<Result<Vec<Channel>, (usize, lapin::Error)>, SinkError> {
        let lanes = self.link.as_ref().expect("connection() leaves a link").channels.len();
        let mut channels = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let bound = self.bound("publishing channel not opened")?;
            let link = self.link.as_mut().expect("connection() leaves a link");
            if let Some(channel) = &link.channels[lane] {
                channels.push(channel.clone());
                continue;
            }
            let opened = timeout(bound, async {
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
                Ok(Err(e)) if reply::channel_refused(&e) => return Ok(Err((lane, e))),
                Ok(Err(e)) => return Err(self.lost(reply::from_lapin("opening a confirm channel", &e))),
                // Blocked meanwhile: lapin writes nothing until the alarm clears.
                Err(_) if self.blocked() => return Err(self.blocked_error("not sent")),
                Err(_) => return Err(self.lost(self.timed_out("opening a confirm channel", bound))),
            }
        }
        Ok(Ok(channels))
    }

    /// The broker allows `lane` channels, not one more: publish over one
    /// fewer, leaving one free for the passive declares that check
    /// exchanges (over the one, with none free, when it allows only one).
    /// Kept until the cool-down passes ([`Lanes`]), not met again on every
    /// reconnect: RabbitMQ answers the refusal by closing the connection.
    fn fewer_lanes(&mut self, lane: usize, refusal: &lapin::Error) {
        let keep = self.lanes.refused(lane, refusal.to_string(), Instant::now());
        warn!(
            url = %self.display_url,
            configured = self.lanes.configured(),
            publishing_over = keep,
            refusal = %refusal,
            "RabbitMQ allows fewer channels than the sink's channels setting; publishing over those it allows"
        );
        let Some(link) = &mut self.link else { return };
        if matches!(refusal.kind(), lapin::ErrorKind::ChannelsLimitReached) {
            // lapin refused it itself: the connection is fine.
            link.channels.truncate(keep);
        } else {
            // RabbitMQ refuses a channel by closing the connection.
            self.link = None;
        }
    }

    /// The error for a channel refused for a channel limit, naming the fix.
    fn limit_error(&self, what: &str, refusal: &lapin::Error, sink: &str) -> SinkError {
        SinkError::transient(format!(
            "{what}: RabbitMQ at {} refused a channel for a channel limit ({refusal}); raise the user's \
             max-channels limit (rabbitmqctl set_user_limits) or the broker's channel_max, or lower \
             sinks.{sink}.channels (now {}), and look for other connections of the same user holding channels",
            self.display_url,
            self.lanes.configured()
        ))
    }

    /// When the broker allowed fewer channels than configured, what to tell
    /// the operator, naming the setting.
    pub(crate) fn shortfall(&self, sink: &str) -> Option<String> {
        let refusal = self.lanes.refusal()?;
        let spare = if self.lanes.spare() {
            ""
        } else {
            ", with none spare for checking exchanges"
        };
        Some(format!(
            "RabbitMQ allows fewer channels than sinks.{sink}.channels = {} ({refusal}): publishing over {}{spare}; \
             raise the user's max-channels limit or the broker's channel_max, or lower sinks.{sink}.channels",
            self.lanes.configured(),
            self.lanes.current()
        ))
    }

    /// Whether `exchange` exists, asked with a passive declare on a throwaway
    /// channel: a failed passive declare makes the broker close the channel,
    /// which must not be the publishing one.
    pub(crate) async fn exchange_exists(&mut self, exchange: &str, sink: &str) -> Result<bool, SinkError> {
        let Ok(name) = ShortString::try_new(exchange) else {
            return Err(SinkError::config(format!(
                "exchange name is {} bytes, AMQP allows at most 255; shorten routes[].destination",
                exchange.len()
            )));
        };
        // A refused channel costs the connection; the second try is on a
        // fresh one, where the publishing channels are not open yet.
        for attempt in 0..2 {
            self.connection().await?;
            if self.blocked() {
                return Err(self.blocked_error(&format!("exchange {exchange:?} not checked")));
            }
            self.make_room().await;
            let bound = self.bound(&format!("exchange {exchange:?} not checked"))?;
            match self.declare_passive(name.clone(), bound).await {
                Ok(Ok(())) => return Ok(true),
                Ok(Err(e)) if reply::reply_code(&e) == Some(NOT_FOUND) => return Ok(false),
                Ok(Err(e)) if reply::channel_refused(&e) => {
                    self.lanes.no_spare(Instant::now());
                    let error = self.limit_error(&format!("checking exchange {exchange:?}"), &e, sink);
                    let error = self.lost(error);
                    if attempt == 1 {
                        return Err(error);
                    }
                }
                Ok(Err(e)) => {
                    self.discard_dead();
                    return Err(reply::from_lapin(&format!("checking exchange {exchange:?}"), &e));
                }
                Err(_) if self.blocked() => {
                    return Err(self.blocked_error(&format!("exchange {exchange:?} not checked")));
                }
                Err(_) => {
                    let error = self.timed_out(&format!("checking exchange {exchange:?}"), bound);
                    return Err(self.lost(error));
                }
            }
        }
        unreachable!("the second attempt returns")
    }

    async fn declare_passive(
        &self,
        name: ShortString,
        bound: Duration,
    ) -> Result<Result<(), lapin::Error>, tokio::time::error::Elapsed> {
        let connection = &self.link.as_ref().expect("connection() leaves a link").connection;
        timeout(bound, async {
            let channel = connection.create_channel().await?;
            let options = ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            };
            // The kind is ignored by a passive declare.
            let result = channel
                .exchange_declare(name, ExchangeKind::Topic, options, FieldTable::default())
                .await;
            if result.is_ok() {
                // Closed before the publishing channels reopen: where the
                // broker allows no spare channel, this one is in the way.
                let _ = channel.close(200, "OK".into()).await;
            }
            result
        })
        .await
    }

    /// Where the broker allows no channel beyond the publishing ones, closes
    /// those (idle between batches; reopened by the next) to free one for a
    /// passive declare. Not while confirms are owed on them.
    async fn make_room(&mut self) {
        if self.lanes.spare() {
            return;
        }
        let Ok(bound) = self.bound("") else { return };
        let Some(link) = self.link.as_mut().filter(|link| !link.owed) else {
            return;
        };
        for slot in &mut link.channels {
            if let Some(channel) = slot.take() {
                let _ = timeout(bound, channel.close(200, "OK".into())).await;
            }
        }
    }

    /// Forgets a publishing channel the broker closed, so that the next call
    /// opens a fresh one even if lapin has not marked it closed yet.
    pub(crate) fn forget_channel(&mut self, channel: &Channel) {
        let Some(link) = &mut self.link else { return };
        for slot in &mut link.channels {
            if slot.as_ref().is_some_and(|c| c.id() == channel.id()) {
                *slot = None;
            }
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
    ///
    /// Whatever fails here is an earlier batch's, met before this one sent
    /// anything: the broker closing a channel over one of its messages (404
    /// for an exchange gone meanwhile, 403 for a permission) says nothing
    /// of the events now waiting, so they fail transiently, never with
    /// that message's permanent or configuration error.
    async fn settle_owed(&mut self) -> Result<(), SinkError> {
        if !self.link.as_ref().is_some_and(|link| link.owed) {
            return Ok(());
        }
        let bound = self.bound("not sent while confirms owed since the alarm are awaited")?;
        let Some(link) = self.link.as_mut() else { return Ok(()) };
        let channels: Vec<Channel> = link.channels.iter().flatten().cloned().collect();
        let settled = timeout(bound, async {
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
            Ok(Err(e)) => Err(self.lost(SinkError::transient(format!(
                "not sent: settling the publisher confirms an earlier batch left owed (sent while RabbitMQ \
                 blocked the connection) failed, over a message of that batch, not of this one ({e}); \
                 reconnecting, and this batch is retried"
            )))),
            Err(_) => Err(self.lost(self.timed_out("settling confirms owed since the alarm", bound))),
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

    /// Abandons the link after a failure whose state is unknown (a timeout, an
    /// error mid-handshake) and returns `error` for the caller to report. The
    /// next call reconnects at once: only failed attempts back off.
    pub(crate) fn lost(&mut self, error: SinkError) -> SinkError {
        if self.link.take().is_some() {
            warn!(url = %self.display_url, %error, "dropping RabbitMQ connection");
        }
        error
    }

    /// `what` got no answer within `bound`: the timeout, or what was left
    /// of the call's deadline, which then says so.
    pub(crate) fn timed_out(&self, what: &str, bound: Duration) -> SinkError {
        let what = format!(
            "{what}: no answer from RabbitMQ at {} within {bound:?}",
            self.display_url
        );
        match &self.deadline {
            Some(deadline) if bound < self.timeout => deadline.error(&what),
            _ => SinkError::transient(what),
        }
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
                channels: vec![None; self.lanes.current()],
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
        let bound = self.bound("not connected to RabbitMQ")?;
        let properties = ConnectionProperties::default().with_connection_name("ferry".into());
        let error = match timeout(bound, Connection::connect(&self.url, properties)).await {
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
            // Cut short by the call's deadline: no sign of a broker down,
            // so no backoff; the next call connects with its full time.
            Err(_) if self.cut_short(bound) => {
                self.refused = false;
                return Err(self.timed_out("connecting", bound));
            }
            Err(_) => {
                self.refused = false;
                format!(
                    "connecting to RabbitMQ at {}: no answer within {:?}",
                    self.display_url, self.timeout
                )
            }
        };
        // From the failure, not the attempt's start: a connect that waited
        // out the whole timeout is otherwise due again at once.
        let delay = self.backoff.failed(Instant::now(), error.clone());
        warn!(%error, retry_in = ?delay, "RabbitMQ connection failed");
        Err(SinkError::transient(error))
    }
}

#[cfg(test)]
mod tests {
    use lapin::BasicProperties;
    use lapin::options::BasicPublishOptions;

    use super::*;

    /// A batch sent while the broker blocked the connection leaves confirms
    /// owed; once the alarm clears the broker closes a channel over one of
    /// its messages, to an exchange gone meanwhile (404). The next batch,
    /// which sent nothing yet, meets that close while settling: it is
    /// retried, not dead over another message's reply. The alarm itself is
    /// not raised (it would block every client of the broker): the owed
    /// state it leaves is set as `publish_batch` sets it.
    #[tokio::test]
    async fn an_earlier_batchs_channel_close_met_while_settling_is_transient_for_the_next() {
        let mut connector = Connector::new(
            ferry_testkit::rabbit::amqp_url(),
            Duration::from_secs(5),
            Duration::from_secs(1),
            1,
            Arc::new(AtomicUsize::new(0)),
        );
        let channels = connector.confirm_channels("rabbit").await.expect("connected");
        let gone = ferry_testkit::rabbit::unique_name("gone");
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let _unconfirmed = channels[0]
            .basic_publish(
                gone.as_str().into(),
                "k".into(),
                options,
                b"{}",
                BasicProperties::default(),
            )
            .await
            .expect("written");
        connector.keep_blocked();
        let err = connector
            .settle_owed()
            .await
            .expect_err("the channel was closed over that message");
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(err.message.contains("an earlier batch left owed"), "{err}");
        assert!(err.message.contains("not of this one"), "{err}");
        assert!(err.message.contains("NOT_FOUND"), "{err}");
        assert!(connector.link.is_none(), "the connection in doubt is dropped");
        // The next call starts over on a fresh connection, owing nothing.
        let channels = connector.confirm_channels("rabbit").await.expect("reconnected");
        assert!(channels.iter().all(|c| c.status().connected()));
        connector.close().await;
    }
}
