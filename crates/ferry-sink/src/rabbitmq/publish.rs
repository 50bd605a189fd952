//! One pipelined batch: spread over the link's channels by key, write every
//! message, await every confirm, then turn what the broker said into one
//! outcome per event.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use ferry_core::{ErrorKind, PublishOutcome, SinkError, StoredEvent};
use lapin::options::BasicPublishOptions;
use lapin::{Channel, Confirmation};
use tokio::time::{Instant, timeout, timeout_at};
use tracing::{debug, warn};

use super::UNROUTABLE_METRIC;
use super::connector::Connector;
use super::message::Message;
use super::reply::{self, NOT_FOUND};

/// What happened to one event on the wire.
enum Fate {
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

pub(super) async fn publish_batch(
    connector: &mut Connector,
    events: &[StoredEvent],
    prepared: Vec<Result<Message, SinkError>>,
    publish_timeout: Duration,
) -> Vec<PublishOutcome> {
    let channels = match connector.confirm_channels().await {
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
            .map(|(part, channel)| send(channel, part, publish_timeout)),
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

    let missing = missing_exchanges(connector, &fates, &exchanges).await;
    let doubtful_kind = shared_close_kind(&fates, &exchanges);
    let timed_out = fates.iter().any(|f| matches!(f, Fate::TimedOut));
    let blocked = connector.blocked();
    let outcomes: Vec<PublishOutcome> = fates
        .into_iter()
        .zip(events)
        .zip(&exchanges)
        .map(|((fate, event), exchange)| {
            if let Some(err) = returned.get(&event.id.to_string()) {
                // Nobody home at run time: no queue took the message.
                metrics::counter!(UNROUTABLE_METRIC, "exchange" => exchange.clone().unwrap_or_default()).increment(1);
                return Err(err.clone());
            }
            match fate {
                Fate::Decided(outcome) => outcome,
                Fate::Acked => Ok(()),
                Fate::Nacked => Err(SinkError::transient(
                    "RabbitMQ nacked the message: it could not be stored",
                )),
                Fate::TimedOut if blocked => Err(connector.blocked_error(&format!(
                    "no publisher confirm within {publish_timeout:?}, and the message may be stored once \
                     the alarm clears"
                ))),
                Fate::TimedOut => Err(SinkError::transient(format!(
                    "no publisher confirm from RabbitMQ within {publish_timeout:?}"
                ))),
                Fate::NotSent(_) if blocked => Err(connector.blocked_error("not sent")),
                Fate::NotSent(cause) => missing_error(exchange.as_deref(), &missing).unwrap_or(Err(cause)),
                Fate::Failed(e) => classify_failure(&e, exchange.as_deref(), &missing, doubtful_kind),
            }
        })
        .collect();

    if timed_out && !blocked {
        // Confirms still owed on this channel can no longer be matched to
        // events; start over on a fresh connection.
        connector.lost(SinkError::transient("publisher confirms timed out"));
    } else if timed_out {
        connector.keep_blocked();
    }
    // A blocked connection is kept: the next batch is refused at once, not
    // sent to wait out its own timeout. Once the alarm clears lapin writes
    // what it holds, and the next batch waits for those confirms first.
    connector.discard_dead();
    outcomes
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
async fn send(
    channel: &Channel,
    prepared: Vec<Result<Message, SinkError>>,
    publish_timeout: Duration,
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
            (Ok(message), None) => message,
        };
        let publish = channel.basic_publish(
            message.exchange,
            message.routing_key,
            options,
            &message.payload,
            message.properties,
        );
        match timeout(publish_timeout, publish).await {
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

    let deadline = Instant::now() + publish_timeout;
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
        let fate = match timeout_at(deadline, confirm).await {
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

/// After the broker closed the channel with 404 NOT_FOUND, finds out which of
/// the failed events' exchanges are missing. The close does not say which
/// publish caused it, and parsing its text would be guesswork; a passive
/// declare per distinct exchange answers exactly.
async fn missing_exchanges(
    connector: &mut Connector,
    fates: &[Fate],
    exchanges: &[Option<String>],
) -> HashMap<String, bool> {
    let not_found = fates
        .iter()
        .any(|f| matches!(f, Fate::Failed(e) if reply::reply_code(e) == Some(NOT_FOUND)));
    let mut missing = HashMap::new();
    if !not_found {
        return missing;
    }
    for (fate, exchange) in fates.iter().zip(exchanges) {
        let (Fate::Failed(_) | Fate::NotSent(_), Some(exchange)) = (fate, exchange) else {
            continue;
        };
        if exchange.is_empty() || missing.contains_key(exchange) {
            continue;
        }
        match connector.exchange_exists(exchange).await {
            Ok(exists) => {
                missing.insert(exchange.clone(), !exists);
            }
            // Unknown stays transient; the retry will ask again.
            Err(e) => {
                debug!(%e, "could not check exchanges after a 404");
                break;
            }
        }
    }
    missing
}

/// The kind of the broker's channel close, if it is not transient and every
/// failed event targeted the same exchange, so the close can only be theirs.
fn shared_close_kind(fates: &[Fate], exchanges: &[Option<String>]) -> Option<ErrorKind> {
    let mut code = None;
    let mut target: Option<&str> = None;
    for (fate, exchange) in fates.iter().zip(exchanges) {
        let Fate::Failed(e) = fate else { continue };
        code = code.or(reply::reply_code(e));
        match (target, exchange.as_deref()) {
            (None, Some(x)) => target = Some(x),
            (Some(t), Some(x)) if t != x => return None,
            _ => {}
        }
    }
    let kind = reply::reply_code_kind(code?);
    (kind != ErrorKind::Transient).then_some(kind)
}

fn classify_failure(
    err: &lapin::Error,
    exchange: Option<&str>,
    missing: &HashMap<String, bool>,
    shared_kind: Option<ErrorKind>,
) -> PublishOutcome {
    if let Some(outcome) = missing_error(exchange, missing) {
        return outcome;
    }
    if reply::reply_code(err) == Some(NOT_FOUND) {
        // This event's exchange exists (or could not be checked): another
        // publish in the batch made the broker close the channel.
        return Err(SinkError::transient(format!(
            "not confirmed: RabbitMQ closed the channel over another message ({err})"
        )));
    }
    let classified = reply::from_lapin("publishing to RabbitMQ", err);
    match (classified.kind, shared_kind) {
        (ErrorKind::Transient, _) => Err(classified),
        (_, Some(_)) => Err(classified),
        // The close might have been caused by another event's exchange.
        _ => Err(SinkError::transient(classified.message)),
    }
}

/// The error for an event whose exchange was found missing: transient,
/// since an application redeclaring its exchange (on a deploy, or a
/// non-durable one after a node restart) makes it missing for a moment, and
/// a permanent error would make every event of that moment dead on its
/// first attempt. A route to an exchange that is really gone ends dead
/// after `max_attempts`, with the fix in its reason; `ferry check` and the
/// relay's start refuse it as a configuration error.
fn missing_error(exchange: Option<&str>, missing: &HashMap<String, bool>) -> Option<PublishOutcome> {
    let exchange = exchange?;
    missing.get(exchange).copied().unwrap_or(false).then(|| {
        Err(SinkError::transient(format!(
            "exchange {exchange:?} does not exist; retried, and dead after max_attempts: declare it or fix \
             routes[].destination"
        )))
    })
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
