//! Settling a batch after the broker closed a channel over one message (a
//! missing exchange, a refused write, a message over its size limit).
//!
//! The close fails every unconfirmed publish on the channel, and does not
//! say which message caused it. Sent again together, the same message would
//! fail the same neighbours at every retry until their attempts ran out. So
//! the events left unsettled are sent again here, in batch order, on one
//! fresh channel: in runs that double while the broker takes them, and one
//! at a time after a close, so that the message a close follows alone is
//! known to be the one the broker refused. It fails; the rest go.

use std::collections::{HashMap, HashSet, VecDeque};

use ferry_core::{PublishOutcome, SinkError, StoredEvent};

use super::connector::Connector;
use super::deadline::Deadline;
use super::message::Message;
use super::publish::{Fate, confirmed, missing_error, send};
use super::reply::{self, ACCESS_REFUSED, NOT_FOUND};

/// The longest run sent at once: a close costs a run's unconfirmed
/// publishes, sent again one at a time.
const MAX_RUN: usize = 256;

/// Sends again the events whose `outcomes` are `None`, until `deadline`
/// (the call's, which also bounds each reconnect and channel open here);
/// those still unsettled then are left `None`. Keeps each key's order: an
/// event is held back behind an earlier failed event of its key.
pub(super) async fn settle<P>(
    connector: &mut Connector,
    sink: &str,
    events: &[StoredEvent],
    outcomes: &mut [Option<PublishOutcome>],
    prepare: &P,
    deadline: &Deadline,
) where
    P: Fn(&StoredEvent) -> Result<Message, SinkError> + Sync,
{
    let mut failed = Failed::default();
    let mut queue = VecDeque::new();
    for (i, event) in events.iter().enumerate() {
        match &outcomes[i] {
            Some(Ok(())) => {}
            Some(Err(_)) => failed.hold(i, event),
            None => queue.push_back(i),
        }
    }
    let mut missing: HashSet<String> = HashSet::new();
    let mut run = 1;
    while !queue.is_empty() && !deadline.passed() {
        let mut picked = Vec::with_capacity(run);
        let mut messages = Vec::with_capacity(run);
        while picked.len() < run
            && let Some(i) = queue.pop_front()
        {
            let event = &events[i];
            let refused = match failed.held_back(i, event) {
                Some(err) => Err(err),
                None => prepare(event).and_then(|m| {
                    if missing.contains(m.exchange.as_str()) {
                        Err(missing_error(m.exchange.as_str()))
                    } else {
                        Ok(m)
                    }
                }),
            };
            match refused {
                Ok(message) => {
                    picked.push((i, message.exchange.to_string()));
                    messages.push(Ok(message));
                }
                Err(err) => {
                    failed.hold(i, event);
                    outcomes[i] = Some(Err(err));
                }
            }
        }
        if picked.is_empty() {
            continue;
        }
        let channel = match connector.confirm_channels(sink).await {
            Ok(channels) => channels[0].clone(),
            Err(e) => {
                tracing::debug!(%e, "no channel to send the rest of a batch again");
                break;
            }
        };
        let (fates, returned) = send(&channel, messages, deadline).await;
        let alone = picked.len() == 1;
        let closed = fates
            .iter()
            .any(|f| matches!(f, Fate::Failed(e) if reply::closed_channel(e)));
        // The broker did not answer in time, or the link failed (and not
        // only the publishes after a close, on the closed channel): what is
        // not settled stays so.
        let lost = fates.iter().any(|f| match f {
            Fate::Failed(e) => !closed && !reply::closed_channel(e),
            Fate::TimedOut => true,
            _ => false,
        });
        let mut again = Vec::new();
        for ((i, exchange), fate) in picked.into_iter().zip(fates) {
            let event = &events[i];
            let outcome = match fate {
                Fate::Acked | Fate::Nacked => confirmed(&fate, event, Some(&exchange), &returned),
                Fate::Decided(outcome) => outcome,
                Fate::Failed(e) if alone && !lost => {
                    if reply::reply_code(&e) == Some(NOT_FOUND) {
                        connector.missing.remember(&exchange, std::time::Instant::now());
                        missing.insert(exchange.clone());
                    }
                    Err(refused(&e, &exchange, sink))
                }
                Fate::Failed(_) | Fate::NotSent(_) if closed && !lost => {
                    again.push(i);
                    continue;
                }
                Fate::TimedOut => Err(SinkError::transient(
                    "no publisher confirm from RabbitMQ before the batch's publish timeout",
                )),
                // Unsettled: reported by the caller.
                Fate::Failed(_) | Fate::NotSent(_) => continue,
            };
            if outcome.is_err() {
                failed.hold(i, event);
            }
            outcomes[i] = Some(outcome);
        }
        if lost {
            if connector.blocked() {
                // Kept through the alarm, as a first send's would be.
                connector.keep_blocked();
            } else {
                connector.lost(SinkError::transient("sending the rest of a batch again failed"));
            }
            break;
        }
        if closed {
            if alone {
                // Nothing else was in flight on it: the connection is sound.
                connector.forget_channel(&channel);
            } else {
                // lapin may still write queued publishes on the closed
                // channel, which RabbitMQ answers by closing the connection.
                connector.lost(SinkError::transient("the publishing channel failed"));
            }
            for i in again.into_iter().rev() {
                queue.push_front(i);
            }
            run = 1;
        } else {
            run = (run * 2).min(MAX_RUN);
        }
    }
}

/// The error for the message a channel close followed alone: the broker
/// refused that message.
fn refused(err: &lapin::Error, exchange: &str, sink: &str) -> SinkError {
    match reply::reply_code(err) {
        Some(NOT_FOUND) => missing_error(exchange),
        Some(ACCESS_REFUSED) => SinkError::config(format!(
            "RabbitMQ refused the message ({err}): grant the user of sinks.{sink}.url write access to \
             exchange {exchange:?}, or fix routes[].destination"
        )),
        // Over the broker's max_message_size: that message can never pass.
        // Other 406s (a policy changed under the exchange) stay transient,
        // as reply_code_kind has them.
        _ if reply::too_large(err) => SinkError::permanent(format!(
            "RabbitMQ refused the message as too large ({err}): set sinks.{sink}.max_message_bytes to at \
             most the broker's max_message_size, so such events are refused before sending"
        )),
        _ => reply::from_lapin("RabbitMQ refused the message", err),
    }
}

/// The first failed event of each key, by its place in the batch: it holds
/// back the key's later events, never its earlier ones.
#[derive(Default)]
struct Failed<'a> {
    first: HashMap<&'a str, (usize, &'a StoredEvent)>,
}

impl<'a> Failed<'a> {
    fn hold(&mut self, at: usize, event: &'a StoredEvent) {
        let Some(key) = event.key.as_deref() else { return };
        let first = self.first.entry(key).or_insert((at, event));
        if at < first.0 {
            *first = (at, event);
        }
    }

    fn held_back(&self, at: usize, event: &StoredEvent) -> Option<SinkError> {
        let &(first_at, first) = self.first.get(event.key.as_deref()?)?;
        (first_at < at).then(|| SinkError::held_back_behind(first))
    }
}

#[cfg(test)]
mod tests {
    use super::{Failed, refused};
    use crate::limits::fixtures::event;
    use ferry_core::ErrorKind;
    use lapin::ErrorKind as LapinErrorKind;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    fn closed_with(soft: AMQPSoftError, text: &str) -> lapin::Error {
        lapin::Error::from(LapinErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(soft),
            text.into(),
        )))
    }

    #[test]
    fn a_lone_406_is_permanent_only_for_a_message_over_the_size_limit() {
        for text in [
            "PRECONDITION_FAILED - message size 17000000 is larger than configured max size 16777216",
            "PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912",
        ] {
            let err = refused(
                &closed_with(AMQPSoftError::PRECONDITIONFAILED, text),
                "orders",
                "rabbit",
            );
            assert_eq!(err.kind, ErrorKind::Permanent, "{err}");
            assert!(err.message.contains("sinks.rabbit.max_message_bytes"), "{err}");
        }
        // The same code for other reasons, e.g. a policy changed meanwhile:
        // transient, as reply_code_kind has 406.
        for text in [
            "PRECONDITION_FAILED - unknown delivery tag 7",
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'orders' in vhost '/'",
        ] {
            let err = refused(
                &closed_with(AMQPSoftError::PRECONDITIONFAILED, text),
                "orders",
                "rabbit",
            );
            assert_eq!(err.kind, ErrorKind::Transient, "{err}");
            assert!(err.message.contains(text), "{err}");
        }
        let err = refused(
            &closed_with(AMQPSoftError::NOTFOUND, "NOT_FOUND - no exchange 'orders' in vhost '/'"),
            "orders",
            "rabbit",
        );
        assert_eq!(err.kind, ErrorKind::Transient, "{err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
        let err = refused(
            &closed_with(AMQPSoftError::ACCESSREFUSED, "ACCESS_REFUSED - write access"),
            "orders",
            "rabbit",
        );
        assert_eq!(err.kind, ErrorKind::Config, "{err}");
    }

    #[test]
    fn a_failure_holds_back_only_the_later_events_of_its_key() {
        let a0 = event(Some("a"));
        let a1 = event(Some("a"));
        let a2 = event(Some("a"));
        let b = event(Some("b"));
        let none = event(None);
        let mut failed = Failed::default();
        failed.hold(1, &a1);
        failed.hold(4, &none);
        assert!(failed.held_back(0, &a0).is_none(), "earlier than the failure");
        assert!(failed.held_back(2, &a2).is_some());
        assert!(failed.held_back(3, &b).is_none());
        assert!(failed.held_back(5, &none).is_none(), "no key, no order");
        // A failure found later at an earlier place holds back from there.
        failed.hold(0, &a0);
        let err = failed.held_back(1, &a1).expect("held back behind a0");
        assert!(err.message.contains(&a0.id.to_string()), "{err}");
    }
}
