//! One connection's life: bind the durable pull consumer, then for each
//! message decode, run the inbox, and ack, nak with a delay, or dead-letter.

use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::{self, AckKind, Context};
use futures::StreamExt;
use sqlx::PgConnection;
use tokio::time::timeout;
use tracing::{debug, error, warn};

use super::{DEAD_CONSUMER_HEADER, DEAD_REASON_HEADER, DEAD_SUBJECT_HEADER, NatsConsumerOptions, decode, durable};
use crate::runner::Counters;
use crate::{HandlerError, Inbox, InboxError, Outcome, ReceivedEvent, metrics};

/// Why a session ended, other than by shutdown.
pub(super) enum Failure {
    /// The connection or the pull failed: connect again.
    Lost(String),
    /// What the server has contradicts what the runner needs: do not start.
    Refused(String),
    /// The inbox cannot use its table: do not go on.
    Inbox(InboxError),
}

impl From<String> for Failure {
    fn from(error: String) -> Self {
        Failure::Lost(error)
    }
}

pub(super) struct Session<'a, H> {
    inbox: &'a Inbox,
    options: &'a NatsConsumerOptions,
    handler: &'a H,
    counters: &'a Counters,
    started: bool,
}

impl<'a, H> Session<'a, H>
where
    H: AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
{
    pub(super) fn new(
        inbox: &'a Inbox,
        options: &'a NatsConsumerOptions,
        handler: &'a H,
        counters: &'a Counters,
    ) -> Self {
        Self {
            inbox,
            options,
            handler,
            counters,
            started: false,
        }
    }

    pub(super) fn started(&self) -> bool {
        self.started
    }

    /// Returns `Ok` on shutdown.
    pub(super) async fn run(&mut self, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> Result<(), Failure> {
        let o = self.options;
        let limit = o.timeout;
        let connect = async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(limit)
                .connect(o.url.as_str())
                .await
                .map_err(|e| format!("connecting: {e}"))?;
            let js = jetstream::new(client);
            let stream = js
                .get_stream(&o.stream)
                .await
                .map_err(|e| format!("stream {:?}: {e}", o.stream))?;
            let subjects = &stream.cached_info().config.subjects;
            if reads_its_own_dead_letters(subjects, o.filter_subject.as_deref(), &o.dead_letter_subject) {
                return Err(Failure::Refused(format!(
                    "dead_letter_subject {:?} is captured by stream {:?} (subjects {subjects:?}) and read by this \
                     consumer: every dead letter would come back to it and be dead-lettered again, without end; \
                     choose a subject no subject of the stream matches, or a filter_subject that excludes it",
                    o.dead_letter_subject, o.stream
                )));
            }
            match js.stream_by_subject(o.dead_letter_subject.as_str()).await {
                Ok(_) => {}
                Err(e) if matches!(e.kind(), GetStreamByNameErrorKind::NotFound) => {
                    return Err(Failure::Refused(format!(
                        "dead_letter_subject {:?} is captured by no stream: a message given up on could not be set \
                         aside and would come back for ever; add the subject to a stream (nats stream add), or name \
                         a subject a stream captures",
                        o.dead_letter_subject
                    )));
                }
                Err(e) => return Err(Failure::Lost(format!("finding the stream of dead_letter_subject: {e}"))),
            }
            let consumer = durable::bind(&stream, o).await?;
            let messages = consumer.messages().await.map_err(|e| format!("pulling: {e}"))?;
            Ok::<_, Failure>((js, messages))
        };
        let (js, mut messages) = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(()),
            c = timeout(limit, connect) => c.map_err(|_| format!("connecting took longer than {limit:?}"))??,
        };
        self.started = true;
        loop {
            let next = tokio::select! {
                biased;
                () = shutdown.as_mut() => return Ok(()),
                next = messages.next() => next,
            };
            match next {
                Some(Ok(message)) => self.handle(&js, message).await?,
                Some(Err(e)) => return Err(Failure::Lost(format!("pulling: {e}"))),
                None => return Err(Failure::Lost("the server ended the pull".into())),
            }
        }
    }

    /// One message; an error ends the session, and the server redelivers
    /// what was not acknowledged.
    async fn handle(&mut self, js: &Context, message: jetstream::Message) -> Result<(), Failure> {
        let consumer = self.inbox.consumer();
        let event = match decode(message.message.headers.as_ref(), &message.message.payload) {
            Ok(event) => event,
            Err(e) => {
                Counters::bump(&self.counters.malformed);
                metrics::malformed(consumer);
                warn!(consumer, subject = %message.message.subject, error = %e, "malformed message");
                return Ok(self.dead_letter(js, &message, &e.to_string()).await?);
            }
        };
        let handler = self.handler;
        let run = async |tx: &mut PgConnection, ev: &ReceivedEvent| handler(tx, ev).await;
        // A message delivered before may be one whose attempt the process
        // died in: the inbox marks the attempt's start first, to count it.
        let redelivered = message.info().map_or(true, |info| info.delivered > 1);
        let process = async {
            if redelivered {
                self.inbox.process_redelivered(&event, run).await
            } else {
                self.inbox.process(&event, run).await
            }
        };
        let outcome = tokio::select! {
            outcome = process => outcome,
            () = self.in_progress(&message) => unreachable!("reports progress until the attempt ends"),
        };
        match outcome {
            Ok(Outcome::Processed) => {
                Counters::bump(&self.counters.processed);
                self.settle(&message, AckKind::Ack).await?;
            }
            Ok(Outcome::Duplicate) => {
                Counters::bump(&self.counters.duplicates);
                self.settle(&message, AckKind::Ack).await?;
            }
            Ok(Outcome::Retry { delay, .. }) => {
                Counters::bump(&self.counters.retried);
                self.settle(&message, AckKind::Nak(Some(delay))).await?;
            }
            Ok(Outcome::InProgress { delay }) => {
                // Another attempt holds the event: the server hands the
                // message out again after `delay`, to whichever client.
                Counters::bump(&self.counters.in_progress);
                self.settle(&message, AckKind::Nak(Some(delay))).await?;
            }
            Ok(Outcome::Dead { reason, .. }) => {
                Counters::bump(&self.counters.dead);
                return Ok(self.dead_letter(js, &message, &reason).await?);
            }
            // Left unacknowledged: the server hands it out again after
            // `ack_wait`, once the table is fixed.
            Err(e @ InboxError::Schema(_)) => return Err(Failure::Inbox(e)),
            Err(e) => {
                Counters::bump(&self.counters.inbox_unavailable);
                warn!(consumer, event = %event.id, error = %e, "inbox unavailable; the message is redelivered later");
                let delay = self.options.database_retry_delay;
                self.settle(&message, AckKind::Nak(Some(delay))).await?;
            }
        }
        Ok(())
    }

    /// Tells the server, every half `ack_wait` while the inbox runs the
    /// message's attempt, that it is still being worked on (`+WPI`), which
    /// restarts its `ack_wait`: a handler that runs longer than `ack_wait`
    /// is not redelivered meanwhile, to be handled again (a duplicate, at
    /// best) by whichever client gets it. Never returns; a report that
    /// cannot be sent is left to the next tick, or to the ack.
    async fn in_progress(&self, message: &jetstream::Message) {
        // `interval` refuses a zero period.
        let every = (self.options.ack_wait / 2).max(Duration::from_millis(1));
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match timeout(self.options.timeout, message.ack_with(AckKind::Progress)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(error = %e, "reporting progress failed"),
                Err(_) => debug!("reporting progress timed out"),
            }
        }
    }

    /// Acks (or naks) and waits for the server to confirm it, so a lost ack
    /// surfaces here and not as a silent redelivery later.
    async fn settle(&self, message: &jetstream::Message, kind: AckKind) -> Result<(), String> {
        let limit = self.options.timeout;
        match timeout(limit, message.double_ack_with(kind)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("acknowledging: {e}")),
            Err(_) => Err(format!("acknowledging took longer than {limit:?}")),
        }
    }

    /// Publishes the message with its reason to the dead-letter subject and
    /// acknowledges it once JetStream stored the copy; otherwise naks it for
    /// a later attempt: never dropped.
    async fn dead_letter(&self, js: &Context, message: &jetstream::Message, reason: &str) -> Result<(), String> {
        let o = self.options;
        // The original's headers, but JetStream's own (`Nats-*`): the
        // server acts on them, and a producer's `Nats-Expected-Stream` or
        // `Nats-Rollup` would have the dead-letter stream refuse the copy
        // for ever, or purge earlier dead letters.
        let mut headers = async_nats::HeaderMap::new();
        if let Some(original) = &message.message.headers {
            for (name, values) in original.iter() {
                let text: &str = name.as_ref();
                if text.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("nats-")) {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        // A copy must not be dropped as a duplicate of the original, nor of
        // the copy another durable made of the same message into a shared
        // dead-letter stream; this durable's own retries of it may be.
        let copy_id = format!("dead-{}-{}", o.durable, message_id(message));
        headers.insert("Nats-Msg-Id", copy_id.as_str());
        headers.insert(DEAD_REASON_HEADER, header_text(reason));
        headers.insert(DEAD_CONSUMER_HEADER, o.durable.as_str());
        headers.insert(DEAD_SUBJECT_HEADER, message.message.subject.as_str());
        let stored = timeout(o.timeout, async {
            js.publish_with_headers(o.dead_letter_subject.clone(), headers, message.message.payload.clone())
                .await?
                .await
        })
        .await;
        match stored {
            Ok(Ok(_)) => self.settle(message, AckKind::Ack).await,
            Ok(Err(e)) if matches!(e.kind(), PublishErrorKind::StreamNotFound) => {
                error!(
                    subject = %o.dead_letter_subject,
                    "dead-lettering failed: no stream captures dead_letter_subject any more; add it to a stream \
                     (the message is redelivered until then)"
                );
                self.settle(message, AckKind::Nak(Some(o.database_retry_delay))).await
            }
            Ok(Err(e)) if too_large(&e) => {
                // Retrying cannot help: the copy never fits until an
                // operator makes room. The message waits meanwhile, unacked.
                error!(
                    subject = %o.dead_letter_subject,
                    bytes = message.message.payload.len(),
                    error = %e,
                    "dead-lettering failed: the copy is larger than the dead-letter stream or the server takes \
                     (max_msg_size, max_payload); raise the stream's max_msg_size or the server's max_payload \
                     (the message is redelivered until then)"
                );
                self.settle(message, AckKind::Nak(Some(o.database_retry_delay))).await
            }
            Ok(Err(e)) => {
                warn!(subject = %o.dead_letter_subject, error = %e, "dead-lettering failed; the message is redelivered later");
                self.settle(message, AckKind::Nak(Some(o.database_retry_delay))).await
            }
            Err(_) => {
                debug!(subject = %o.dead_letter_subject, "dead-lettering timed out");
                self.settle(message, AckKind::Nak(Some(o.database_retry_delay))).await
            }
        }
    }
}

/// Whether JetStream refused a copy for its size: the client's check of the
/// server's `max_payload`, or the stream's `max_msg_size` (or the size of
/// its headers).
fn too_large(e: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    if matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded) {
        return true;
    }
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|j| {
            matches!(
                j.error_code(),
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
            )
        })
}

/// The stream sequence, unique per stored message, for the dead copy's id.
fn message_id(message: &jetstream::Message) -> String {
    message
        .info()
        .map(|i| format!("{}-{}", i.stream, i.stream_sequence))
        .unwrap_or_else(|_| uuid::Uuid::now_v7().to_string())
}

/// Whether dead letters published to `dead` land in the stream with
/// `subjects` and pass the consumer's `filter`.
fn reads_its_own_dead_letters(subjects: &[String], filter: Option<&str>, dead: &str) -> bool {
    let filter = filter.filter(|f| !f.is_empty());
    subjects.iter().any(|s| subject_matches(s, dead)) && filter.is_none_or(|f| subject_matches(f, dead))
}

/// Whether the literal `subject` matches the NATS subject `pattern` (`*` is
/// one token, a final `>` one or more).
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let (mut p, mut s) = (pattern.split('.'), subject.split('.'));
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// `reason` as a header value: NATS headers end at a line break (the client
/// panics on one), so CR and LF become spaces, and a long reason (a
/// panic's backtrace) is cut like every dead letter's.
fn header_text(reason: &str) -> String {
    crate::runner::bounded_reason(reason).replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_too_large_is_told_from_other_refusals() {
        use async_nats::jetstream::context::PublishError;
        let api = |err_code: u64| {
            let body = format!(r#"{{"code":400,"err_code":{err_code},"description":"refused"}}"#);
            let error: async_nats::jetstream::Error = serde_json::from_str(&body).unwrap();
            PublishError::with_source(PublishErrorKind::Other, error)
        };
        assert!(too_large(&api(10054)), "the stream's max_msg_size");
        assert!(too_large(&api(10097)), "the stream's header limit");
        assert!(too_large(&PublishError::new(PublishErrorKind::MaxPayloadExceeded)));
        assert!(!too_large(&api(10077)), "a storage failure is not about size");
        assert!(!too_large(&PublishError::new(PublishErrorKind::TimedOut)));
    }

    #[test]
    fn a_reason_becomes_one_bounded_line() {
        assert_eq!(header_text("a\r\nb\nc"), "a  b c");
        let long = "é".repeat(5000);
        let cut = header_text(&long);
        assert!(cut.len() <= 4096 && cut.chars().all(|c| c == 'é'), "{}", cut.len());
    }

    #[test]
    fn subjects_match_as_nats_matches_them() {
        assert!(subject_matches("billing.>", "billing.dead"));
        assert!(subject_matches("billing.>", "billing.dead.x"));
        assert!(!subject_matches("billing.>", "billing"));
        assert!(subject_matches("billing.*", "billing.dead"));
        assert!(!subject_matches("billing.*", "billing.dead.x"));
        assert!(subject_matches("billing.dead", "billing.dead"));
        assert!(!subject_matches("billing.orders", "billing.dead"));
        assert!(!subject_matches("billing.dead.x", "billing.dead"));
    }

    #[test]
    fn a_consumer_reads_its_dead_letters_only_if_the_stream_and_its_filter_take_them() {
        let subjects = ["billing.>".to_owned()];
        assert!(reads_its_own_dead_letters(&subjects, None, "billing.dead"));
        assert!(reads_its_own_dead_letters(&subjects, Some(""), "billing.dead"));
        assert!(!reads_its_own_dead_letters(
            &subjects,
            Some("billing.orders"),
            "billing.dead"
        ));
        assert!(reads_its_own_dead_letters(&subjects, Some("billing.*"), "billing.dead"));
        assert!(!reads_its_own_dead_letters(&subjects, None, "dead.billing"));
    }
}
