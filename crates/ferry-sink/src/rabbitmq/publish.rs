//! One pipelined batch: spread over the link's channels by key, write every
//! message, await every confirm, then turn what the broker said into one
//! outcome per event. Where the broker closed a channel over one message,
//! [`super::resend`] settles the rest of the batch in the same call.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use ferry_core::{PublishOutcome, Route, SinkError, StoredEvent};
use lapin::options::BasicPublishOptions;
use lapin::{Channel, Confirmation};
use tokio::time::timeout_at;
use tracing::{debug, warn};

use super::UNROUTABLE_METRIC;
use super::connector::Connector;
use super::deadline::Deadline;
use super::message::Message;
use super::reply;
use super::resend;

/// What happened to one event on the wire.
pub(super) enum Fate {
    /// Decided without the broker: refused before sending.
    Decided(PublishOutcome),
    /// Not written because the channel failed earlier in the batch.
    NotSent(SinkError),
    Acked,
    Nacked,
    /// The publish or its confirm failed; the link is in doubt.
    Failed(lapin::Error),
    TimedOut,
}

/// At most this many exchanges found missing before are checked again in
/// one call: each check costs a few round trips (more where it must make
/// room for its channel, or reconnect), and a batch naming many of them
/// must not spend its time on checks. The rest wait for a later call.
const CHECKS_PER_CALL: usize = 4;

/// Publishes `events` (`prepared` in key order) by `deadline` and returns
/// one outcome each. `prepare` prepares an event again, for one sent a
/// second time.
pub(super) async fn publish_batch<P>(
    connector: &mut Connector,
    route: &Route,
    events: &[StoredEvent],
    mut prepared: Vec<Result<Message, SinkError>>,
    deadline: &Deadline,
    prepare: &P,
) -> Vec<PublishOutcome>
where
    P: Fn(&StoredEvent) -> Result<Message, SinkError> + Sync,
{
    let sink = route.sink.as_str();
    skip_missing_exchanges(connector, sink, events, &mut prepared, deadline).await;
    let channels = match connector.confirm_channels(sink).await {
        Ok(channels) => channels,
        Err(e) => return prepared.into_iter().map(|p| p.and(Err(e.clone()))).collect(),
    };
    let exchanges: Vec<Option<String>> = prepared
        .iter()
        .map(|p| p.as_ref().ok().map(|m| m.exchange.to_string()))
        .collect();
    let lanes = lanes(events, channels.len());
    let mut parts: Vec<Vec<Result<Message, SinkError>>> = channels.iter().map(|_| Vec::new()).collect();
    for (message, &lane) in prepared.into_iter().zip(&lanes) {
        parts[lane].push(message);
    }
    // The channels publish at once: RabbitMQ works each one in a process of
    // its own, so a batch spread over several uses more of its cores.
    let sent = futures::future::join_all(
        parts
            .into_iter()
            .zip(&channels)
            .map(|(part, channel)| send(channel, part, deadline)),
    )
    .await;
    drop(channels);
    let mut returned = HashMap::new();
    let mut lane_fates = Vec::with_capacity(sent.len());
    for (fates, back) in sent {
        returned.extend(back);
        lane_fates.push(fates.into_iter());
    }
    let fates: Vec<Fate> = lanes
        .iter()
        .map(|&lane| lane_fates[lane].next().expect("send() gives one fate per message"))
        .collect();
    if fates.iter().any(|f| matches!(f, Fate::Failed(_))) {
        // lapin writes method frames (the channel.close-ok) ahead of queued
        // publishes, so after the broker closes the channel it may still
        // send publishes on it, which RabbitMQ answers by closing the whole
        // connection (504 CHANNEL_ERROR). Start over on a fresh connection
        // rather than share one that may be about to die.
        connector.lost(SinkError::transient("the publishing channel failed"));
    }

    let timed_out = fates.iter().any(|f| matches!(f, Fate::TimedOut));
    let blocked = connector.blocked();
    // The broker closed a channel over one message it refused: the other
    // events that failed with it are sent again below, so that none fails
    // for a neighbour (and at the relay's next attempt, again).
    let closed = fates
        .iter()
        .any(|f| matches!(f, Fate::Failed(e) if reply::closed_channel(e)));
    let resending = closed && !blocked;
    let mut outcomes: Vec<Option<PublishOutcome>> = fates
        .into_iter()
        .zip(events)
        .zip(&exchanges)
        .map(|((fate, event), exchange)| match fate {
            Fate::Acked | Fate::Nacked => Some(confirmed(&fate, event, exchange.as_deref(), &returned)),
            Fate::Decided(outcome) => Some(outcome),
            Fate::TimedOut if blocked => Some(Err(connector.blocked_error(
                "no publisher confirm within the publish timeout, and the message may be stored once \
                 the alarm clears",
            ))),
            Fate::TimedOut => Some(Err(deadline.error("no publisher confirm from RabbitMQ"))),
            Fate::NotSent(_) if blocked => Some(Err(connector.blocked_error("not sent"))),
            Fate::Failed(_) | Fate::NotSent(_) if resending => None,
            Fate::NotSent(cause) => Some(Err(cause)),
            // The link failed, not one message: nothing a retry cannot cure.
            Fate::Failed(e) => Some(Err(SinkError::transient(
                reply::from_lapin("publishing to RabbitMQ", &e).message,
            ))),
        })
        .collect();

    if timed_out && !blocked {
        // Confirms still owed on this channel can no longer be matched to
        // events; start over on a fresh connection.
        connector.lost(SinkError::transient("publisher confirms timed out"));
    } else if timed_out {
        connector.keep_blocked();
    }
    if resending {
        resend::settle(connector, sink, events, &mut outcomes, prepare, deadline).await;
    }
    // A blocked connection is kept: the next batch is refused at once, not
    // sent to wait out its own timeout. Once the alarm clears lapin writes
    // what it holds, and the next batch waits for those confirms first.
    connector.discard_dead();
    outcomes
        .into_iter()
        .map(|outcome| {
            outcome.unwrap_or_else(|| {
                let what = "not confirmed: RabbitMQ closed the channel over another message of this batch, \
                            and sending this one again did not finish";
                Err(if deadline.passed() {
                    deadline.error(what)
                } else {
                    SinkError::transient(format!("{what}: the link failed meanwhile"))
                })
            })
        })
        .collect()
}

/// The outcome of an acked or nacked message: a message RabbitMQ returned
/// (nobody home at run time, no queue took it) failed even if acked.
pub(super) fn confirmed(
    fate: &Fate,
    event: &StoredEvent,
    exchange: Option<&str>,
    returned: &HashMap<String, SinkError>,
) -> PublishOutcome {
    if let Some(err) = returned.get(&event.id.to_string()) {
        metrics::counter!(UNROUTABLE_METRIC, "exchange" => exchange.unwrap_or_default().to_owned()).increment(1);
        return Err(err.clone());
    }
    match fate {
        Fate::Acked => Ok(()),
        _ => Err(SinkError::transient(
            "RabbitMQ nacked the message: it could not be stored",
        )),
    }
}

/// Refuses, before sending, the events to exchanges found missing in an
/// earlier batch that a passive declare finds missing still (later events
/// of their keys are held back), and forgets those that exist again.
///
/// Only the exchanges the batch names are checked, the longest unchecked
/// first, at most [`CHECKS_PER_CALL`] of them and within half the call's
/// time, so that the batch keeps the other half. Those not checked are
/// taken as missing still, and checked in a later call.
async fn skip_missing_exchanges(
    connector: &mut Connector,
    sink: &str,
    events: &[StoredEvent],
    prepared: &mut [Result<Message, SinkError>],
    deadline: &Deadline,
) {
    let now = std::time::Instant::now();
    connector.missing.expire(now);
    if connector.missing.is_empty() {
        return;
    }
    let named: HashSet<&str> = prepared.iter().flatten().map(|m| m.exchange.as_str()).collect();
    let suspects = connector.missing.suspects_among(named, now);
    let checks = deadline.until(tokio::time::Instant::now() + deadline.left() / 2);
    connector.set_deadline(Some(checks.clone()));
    let mut missing = HashSet::new();
    for (n, exchange) in suspects.into_iter().enumerate() {
        if n >= CHECKS_PER_CALL || checks.passed() {
            missing.insert(exchange);
            continue;
        }
        match connector.exchange_exists(&exchange, sink).await {
            Ok(true) => connector.missing.forget(&exchange),
            Ok(false) => {
                connector.missing.remember(&exchange, std::time::Instant::now());
                missing.insert(exchange);
            }
            // Out of time for checks: as if not its turn.
            Err(_) if checks.passed() => {
                missing.insert(exchange);
            }
            // Unknown: sent, and settled if the broker refuses it.
            Err(e) => debug!(%e, exchange, "could not check an exchange found missing before"),
        }
    }
    connector.set_deadline(Some(deadline.clone()));
    if missing.is_empty() {
        return;
    }
    fail_in_key_order(events, prepared, |m| {
        let exchange = m.exchange.as_str();
        missing.contains(exchange).then(|| missing_error(exchange))
    });
}

/// Fails the prepared messages `refuse` says to, and holds back the later
/// events of their keys, as [`ferry_core::prepare_in_key_order`] does.
fn fail_in_key_order(
    events: &[StoredEvent],
    prepared: &mut [Result<Message, SinkError>],
    refuse: impl Fn(&Message) -> Option<SinkError>,
) {
    let mut failed: HashMap<&str, &StoredEvent> = HashMap::new();
    for (event, message) in events.iter().zip(prepared.iter_mut()) {
        let key = event.key.as_deref();
        if let Some(first) = key.and_then(|k| failed.get(k)) {
            if message.is_ok() {
                *message = Err(SinkError::held_back_behind(first));
            }
            continue;
        }
        if let Some(err) = message.as_ref().ok().and_then(&refuse) {
            *message = Err(err);
        }
        if let (Err(_), Some(key)) = (&message, key) {
            failed.insert(key, event);
        }
    }
}

/// The lane (channel) of each event: all events of a key share one, so the
/// broker keeps their order as one channel's publishes reach a queue in the
/// order sent; events without a key have no order to keep and are dealt out
/// in turn.
fn lanes(events: &[StoredEvent], n: usize) -> Vec<usize> {
    let n = n.max(1);
    events
        .iter()
        .enumerate()
        .map(|(i, event)| match &event.key {
            Some(key) => {
                let mut hasher = DefaultHasher::new();
                key.hash(&mut hasher);
                (hasher.finish() % n as u64) as usize
            }
            None => i % n,
        })
        .collect()
}

/// Writes one lane's messages in slice order, then awaits their confirms. Returns each
/// event's fate and the errors for messages the broker returned, by message
/// id.
///
/// Returned messages are matched by message id rather than by the confirm
/// lapin attached them to: lapin hands the oldest pending `basic.return` to
/// whichever confirm it resolves next, and it resolves a multiple-ack in hash
/// order, so a return can ride on a neighbour's confirm. Every return arrives
/// before its own ack, so once all confirms of the batch are in, every return
/// has been handed to one of them.
///
/// Nothing is written once `deadline` passed, and confirms not in by then
/// time out.
pub(super) async fn send(
    channel: &Channel,
    prepared: Vec<Result<Message, SinkError>>,
    deadline: &Deadline,
) -> (Vec<Fate>, HashMap<String, SinkError>) {
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let mut in_flight = Vec::with_capacity(prepared.len());
    let mut broken: Option<SinkError> = None;
    for message in prepared {
        let message = match (message, &broken) {
            (Err(e), _) => {
                in_flight.push(Err(Fate::Decided(Err(e))));
                continue;
            }
            // After a failed write the channel is gone; later messages stay unsent.
            (Ok(_), Some(cause)) => {
                in_flight.push(Err(Fate::NotSent(cause.clone())));
                continue;
            }
            (Ok(_), None) if deadline.passed() => {
                let cause = deadline.error("not sent");
                broken = Some(cause.clone());
                in_flight.push(Err(Fate::NotSent(cause)));
                continue;
            }
            (Ok(message), None) => message,
        };
        let publish = channel.basic_publish(
            message.exchange,
            message.routing_key,
            options,
            &message.payload,
            message.properties,
        );
        match timeout_at(deadline.at(), publish).await {
            Ok(Ok(confirm)) => in_flight.push(Ok(confirm)),
            Ok(Err(e)) => {
                broken = Some(SinkError::transient(format!(
                    "not sent: the channel failed earlier in this batch ({e})"
                )));
                in_flight.push(Err(Fate::Failed(e)));
            }
            Err(_) => {
                broken = Some(SinkError::transient(
                    "not sent: writing an earlier message of this batch timed out",
                ));
                in_flight.push(Err(Fate::TimedOut));
            }
        }
    }

    let mut returned = HashMap::new();
    let mut fates = Vec::with_capacity(in_flight.len());
    for entry in in_flight {
        let confirm = match entry {
            Ok(confirm) => confirm,
            Err(fate) => {
                fates.push(fate);
                continue;
            }
        };
        // timeout_at polls the confirm before the clock, so confirms that are
        // already in still count after the deadline has passed.
        let fate = match timeout_at(deadline.at(), confirm).await {
            Ok(Ok(Confirmation::Ack(back))) => {
                record_return(&mut returned, back);
                Fate::Acked
            }
            Ok(Ok(Confirmation::Nack(back))) => {
                record_return(&mut returned, back);
                Fate::Nacked
            }
            Ok(Ok(Confirmation::NotRequested)) => Fate::Decided(Err(SinkError::transient(
                "the channel is not in confirm mode; nothing was confirmed",
            ))),
            Ok(Err(e)) => Fate::Failed(e),
            Err(_) => Fate::TimedOut,
        };
        fates.push(fate);
    }
    (fates, returned)
}

fn record_return(returned: &mut HashMap<String, SinkError>, message: Option<lapin::message::BasicReturnMessage>) {
    let Some(message) = message else { return };
    let delivery = &message.delivery;
    let err = reply::returned(
        delivery.exchange.as_str(),
        delivery.routing_key.as_str(),
        message.reply_code,
        message.reply_text.as_str(),
    );
    match delivery.properties.message_id() {
        Some(id) => {
            returned.insert(id.to_string(), err);
        }
        None => warn!(%err, "RabbitMQ returned a message without a message id"),
    }
}

/// The error for an event whose exchange was found missing: transient,
/// since an application redeclaring its exchange (on a deploy, or a
/// non-durable one after a node restart) makes it missing for a moment, and
/// a permanent error would make every event of that moment dead on its
/// first attempt. A route to an exchange that is really gone ends dead
/// after `max_attempts`, with the fix in its reason; `ferry check` and the
/// relay's start refuse it as a configuration error.
pub(super) fn missing_error(exchange: &str) -> SinkError {
    SinkError::transient(format!(
        "exchange {exchange:?} does not exist; retried, and dead after max_attempts: declare it or fix \
         routes[].destination"
    ))
}

#[cfg(test)]
mod tests {
    use super::lanes;
    use crate::limits::fixtures::event;

    #[test]
    fn a_keys_events_share_a_lane_and_keys_spread_over_all_lanes() {
        let events: Vec<_> = (0..400).map(|i| event(Some(&format!("k{}", i % 40)))).collect();
        let assigned = lanes(&events, 4);
        let mut lane_of = std::collections::HashMap::new();
        for (e, &lane) in events.iter().zip(&assigned) {
            assert!(lane < 4);
            let first = *lane_of.entry(e.key.clone()).or_insert(lane);
            assert_eq!(first, lane, "key {:?} changed lanes", e.key);
        }
        let used: std::collections::HashSet<_> = assigned.iter().collect();
        assert_eq!(used.len(), 4, "40 keys left a lane unused: {used:?}");
        // The same keys land the same way in the next batch.
        assert_eq!(lanes(&events, 4), assigned);
    }

    #[test]
    fn events_without_a_key_are_dealt_out_in_turn() {
        let events: Vec<_> = (0..5).map(|_| event(None)).collect();
        assert_eq!(lanes(&events, 2), [0, 1, 0, 1, 0]);
        assert_eq!(lanes(&events, 1), [0; 5]);
        assert_eq!(lanes(&events, 0), [0; 5], "no lanes means one");
    }
}
