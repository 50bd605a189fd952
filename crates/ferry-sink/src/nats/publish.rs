//! One pipelined batch: publish every message with a reply subject on a
//! per-batch inbox, then await every PubAck, then turn the answers into one
//! outcome per event.

use std::time::Duration;

use async_nats::Subscriber;
use ferry_core::{PublishOutcome, SinkError};
use futures::{FutureExt, StreamExt};
use tokio::time::{Instant, timeout_at};
use tracing::debug;

use super::codes;
use super::connector::{Connector, Denial, Denials, Handle};
use super::message::Message;

/// What happened to one event on the wire.
enum Fate {
    /// Decided without a PubAck: refused before sending, or answered.
    Decided(PublishOutcome),
    /// Published; its PubAck has not come yet.
    Awaiting { subject: String },
}

pub(super) async fn publish_batch(
    connector: &mut Connector,
    prepared: Vec<Result<Message, SinkError>>,
    publish_timeout: Duration,
) -> Vec<PublishOutcome> {
    let Handle {
        client,
        mut broken,
        mut denied,
    } = match connector.handle_to_publish().await {
        Ok(handle) => handle,
        Err(e) => return prepared.into_iter().map(|p| p.and(Err(e.clone()))).collect(),
    };
    let deadline = Instant::now() + publish_timeout;
    // Denials before this batch were answered to earlier ones.
    let seen = denied.borrow_and_update().total;
    let inbox = client.new_inbox();
    let mut acks = match timeout_at(deadline, client.subscribe(format!("{inbox}.*"))).await {
        Ok(Ok(acks)) => acks,
        failed => {
            let cause = match failed {
                Ok(Err(e)) => format!("subscribing to the PubAck inbox: {e}"),
                _ => format!("subscribing to the PubAck inbox: no progress within {publish_timeout:?}"),
            };
            let e = connector.lost(SinkError::transient(cause));
            return prepared.into_iter().map(|p| p.and(Err(e.clone()))).collect();
        }
    };

    // Put the whole batch on the wire in order; async-nats queues each
    // publish for its I/O task, which writes them out in that order.
    let mut fates = Vec::with_capacity(prepared.len());
    let mut broken_cause: Option<SinkError> = None;
    for (i, message) in prepared.into_iter().enumerate() {
        let message = match (message, &broken_cause) {
            (Err(e), _) => {
                fates.push(Fate::Decided(Err(e)));
                continue;
            }
            (Ok(_), Some(cause)) => {
                fates.push(Fate::Decided(Err(cause.clone())));
                continue;
            }
            (Ok(message), None) => message,
        };
        let Message {
            subject,
            headers,
            payload,
        } = message;
        let reply = format!("{inbox}.{i}");
        let sent = client.publish_with_reply_and_headers(subject.clone(), reply, headers, payload);
        fates.push(match timeout_at(deadline, sent).await {
            Ok(Ok(())) => Fate::Awaiting { subject },
            Ok(Err(e)) => {
                let kind = codes::publish_error_kind(e.kind());
                let err = codes::error(kind, format!("publishing to NATS subject {subject:?}: {e}"));
                if err.is_transient() {
                    broken_cause = Some(SinkError::transient(format!(
                        "not sent: the NATS connection failed earlier in this batch ({e})"
                    )));
                }
                Fate::Decided(Err(err))
            }
            Err(_) => {
                broken_cause = Some(SinkError::transient(
                    "not sent: queueing an earlier message of this batch timed out",
                ));
                Fate::Decided(Err(SinkError::transient(format!(
                    "publishing to NATS: the client did not take the message within {publish_timeout:?}"
                ))))
            }
        });
    }

    let ended = collect_acks(&mut acks, &mut fates, &mut broken, &mut denied, seen, deadline).await;
    drop(acks);
    let lost = match ended {
        Ended::AllAnswered => None,
        Ended::Disconnected => Some(SinkError::transient(
            "the connection to NATS was lost before the PubAck arrived; the message may or may not be stored",
        )),
        Ended::TimedOut => Some(SinkError::transient(format!(
            "no PubAck from JetStream within {publish_timeout:?}; the message may or may not be stored"
        ))),
    };
    if let Some(cause) = lost.clone().or(broken_cause) {
        // Queued publishes of this batch must never go out later, after
        // events that are retried ahead of them: drop the whole connection.
        connector.lost(cause);
    }
    let outcomes: Vec<PublishOutcome> = fates
        .into_iter()
        .map(|fate| match fate {
            Fate::Decided(outcome) => outcome,
            Fate::Awaiting { .. } => Err(lost.clone().unwrap_or_else(|| SinkError::transient("no PubAck"))),
        })
        .collect();
    outcomes
}

enum Ended {
    AllAnswered,
    Disconnected,
    TimedOut,
}

/// Matches PubAcks to events by the index in their reply subject until every
/// published event is answered, the connection is lost or the deadline passes.
/// An event the server refused permission for (its denials after the first
/// `seen`) is answered by the refusal.
async fn collect_acks(
    acks: &mut Subscriber,
    fates: &mut [Fate],
    broken: &mut tokio::sync::watch::Receiver<bool>,
    denied: &mut tokio::sync::watch::Receiver<Denials>,
    mut seen: usize,
    deadline: Instant,
) -> Ended {
    let mut waiting = fates.iter().filter(|f| matches!(f, Fate::Awaiting { .. })).count();
    let mut denials_open = true;
    while waiting > 0 {
        let next = tokio::select! {
            biased;
            changed = denied.changed(), if denials_open => {
                if changed.is_err() {
                    // The connection's task ended; `broken` says so.
                    denials_open = false;
                    continue;
                }
                let denials: Vec<Denial> = {
                    let all = denied.borrow_and_update();
                    let since = all.since(seen).cloned().collect();
                    seen = all.total;
                    since
                };
                for denial in &denials {
                    waiting -= refuse(fates, denial);
                }
                continue;
            }
            next = timeout_at(deadline, acks.next()) => next,
            _ = broken.wait_for(|lost| *lost) => {
                // Acks that arrived before the loss still count.
                while let Some(Some(message)) = acks.next().now_or_never() {
                    waiting -= record(fates, &message);
                }
                return if waiting == 0 { Ended::AllAnswered } else { Ended::Disconnected };
            }
        };
        match next {
            Ok(Some(message)) => waiting -= record(fates, &message),
            Ok(None) => return Ended::Disconnected,
            Err(_) => return Ended::TimedOut,
        }
    }
    Ended::AllAnswered
}

/// Answers every awaiting event `denial` stopped; returns how many.
fn refuse(fates: &mut [Fate], denial: &Denial) -> usize {
    let mut answered = 0;
    for fate in fates.iter_mut() {
        let Fate::Awaiting { subject } = fate else { continue };
        if denial.stops(subject) {
            *fate = Fate::Decided(Err(denial.error()));
            answered += 1;
        }
    }
    answered
}

/// Records one reply; returns 1 if it answered an awaiting event.
fn record(fates: &mut [Fate], message: &async_nats::Message) -> usize {
    let index = message
        .subject
        .rsplit('.')
        .next()
        .and_then(|token| token.parse::<usize>().ok());
    let Some(fate) = index.and_then(|i| fates.get_mut(i)) else {
        debug!(subject = %message.subject, "ignoring a reply that matches no event");
        return 0;
    };
    let Fate::Awaiting { subject } = fate else { return 0 };
    let outcome = codes::pub_ack(subject, message.status, &message.payload);
    *fate = Fate::Decided(outcome);
    1
}
