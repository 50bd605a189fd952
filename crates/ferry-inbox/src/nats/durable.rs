//! The durable consumer: created with the settings the runner relies on, or,
//! when it exists already (created earlier, by hand or by another version),
//! checked against them. JetStream hands an existing durable over as it is,
//! whatever it was created with.
//!
//! - `ack_policy` must be `explicit`: with `all`, acknowledging a message
//!   also acknowledges every earlier one, so a message waiting out a delayed
//!   nak is lost when a later one is acknowledged; with `none` nothing is
//!   ever redelivered. It cannot be changed on an existing consumer, so the
//!   runner refuses to start.
//! - The filter decides which messages the durable reads; changing it would
//!   change what the consumer's progress means, so a mismatch is refused too.
//! - `ack_wait`, `max_deliver`, `max_ack_pending` and `headers_only` can be
//!   changed in place, and are set to the runner's: a smaller `max_deliver`
//!   would stop redeliveries silently, `headers_only` would hand over
//!   messages without their payload.
//! - `deliver_policy` only chose where the durable started; an existing one
//!   goes on from its own position, so it is left as it is.

use async_nats::jetstream::consumer::{self, AckPolicy, FromConsumer, PullConsumer, pull};
use async_nats::jetstream::stream::{ConsumerErrorKind, ConsumerUpdateErrorKind, Stream};
use tracing::info;

use super::NatsConsumerOptions;
use super::session::Failure;

/// The durable named in the options, created or checked (and brought in line
/// where JetStream allows it).
pub(super) async fn bind(stream: &Stream, o: &NatsConsumerOptions) -> Result<PullConsumer, Failure> {
    let wanted = pull::Config {
        durable_name: Some(o.durable.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: o.ack_wait,
        max_deliver: o.max_deliver,
        max_ack_pending: o.max_ack_pending,
        filter_subject: o.filter_subject.clone().unwrap_or_default(),
        ..Default::default()
    };
    let name = &o.durable;
    let stream_name = &stream.cached_info().config.name;
    let consumer = match stream.get_or_create_consumer(name, wanted).await {
        Ok(consumer) => consumer,
        Err(e) if matches!(e.kind(), ConsumerErrorKind::InvalidConsumerType) => {
            return Err(Failure::Refused(format!(
                "durable consumer {name:?} of stream {stream_name:?} is a push consumer; the runner pulls: \
                 delete it (nats consumer rm {stream_name} {name}) to let the runner create it, or choose another \
                 durable name"
            )));
        }
        Err(e) => return Err(Failure::Lost(format!("durable consumer {name:?}: {e}"))),
    };
    let existing = &consumer.cached_info().config;
    if let Some(why) = refusal(existing, o) {
        return Err(Failure::Refused(format!(
            "durable consumer {name:?} of stream {stream_name:?} {why}; JetStream cannot change that on an existing \
             consumer: delete it (nats consumer rm {stream_name} {name}) to let the runner create it, or choose \
             another durable name"
        )));
    }
    let changes = changes(existing, o);
    if changes.is_empty() {
        return Ok(consumer);
    }
    let mut updated = pull::Config::try_from_consumer_config(existing.clone())
        .map_err(|e| Failure::Lost(format!("durable consumer {name:?}: {e}")))?;
    updated.ack_wait = o.ack_wait;
    updated.max_deliver = o.max_deliver;
    updated.max_ack_pending = o.max_ack_pending;
    updated.headers_only = false;
    match stream.update_consumer(updated).await {
        Ok(consumer) => {
            info!(stream = %stream_name, durable = %name, changes = %changes.join(", "), "durable consumer brought in line with the runner's settings");
            Ok(consumer)
        }
        Err(e) if matches!(e.kind(), ConsumerUpdateErrorKind::JetStream(_)) => Err(Failure::Refused(format!(
            "durable consumer {name:?} of stream {stream_name:?} differs from the runner's settings ({}) and \
             JetStream refused to update it ({e}): align it by hand, or delete it (nats consumer rm {stream_name} \
             {name}) to let the runner create it",
            changes.join(", ")
        ))),
        Err(e) => Err(Failure::Lost(format!("updating durable consumer {name:?}: {e}"))),
    }
}

/// Why the existing durable cannot be used, if it cannot.
fn refusal(existing: &consumer::Config, o: &NatsConsumerOptions) -> Option<String> {
    match existing.ack_policy {
        AckPolicy::Explicit => {}
        AckPolicy::All => {
            return Some(
                "has ack_policy \"all\", where acknowledging a message acknowledges every earlier one too (a \
                 message waiting to be retried would be lost); the runner needs \"explicit\""
                    .into(),
            );
        }
        AckPolicy::None => {
            return Some(
                "has ack_policy \"none\", where nothing is ever redelivered (a failed message would be lost); the \
                 runner needs \"explicit\""
                    .into(),
            );
        }
    }
    let have = filters(existing);
    let want: Vec<String> = o.filter_subject.iter().filter(|f| !f.is_empty()).cloned().collect();
    if have != want {
        return Some(format!(
            "reads {} but filter_subject is {}",
            describe(&have),
            o.filter_subject
                .as_deref()
                .filter(|f| !f.is_empty())
                .map_or("unset (every subject of the stream)".to_owned(), |f| format!("{f:?}"))
        ));
    }
    None
}

/// The settings JetStream can change in place that differ, as `name: old -> new`.
fn changes(existing: &consumer::Config, o: &NatsConsumerOptions) -> Vec<String> {
    let mut changes = Vec::new();
    if existing.ack_wait != o.ack_wait {
        changes.push(format!("ack_wait: {:?} -> {:?}", existing.ack_wait, o.ack_wait));
    }
    if existing.max_deliver != o.max_deliver {
        changes.push(format!("max_deliver: {} -> {}", existing.max_deliver, o.max_deliver));
    }
    if existing.max_ack_pending != o.max_ack_pending {
        changes.push(format!(
            "max_ack_pending: {} -> {}",
            existing.max_ack_pending, o.max_ack_pending
        ));
    }
    if existing.headers_only {
        changes.push("headers_only: true -> false".into());
    }
    changes
}

/// The subjects a consumer filters on; empty for every subject of its stream.
fn filters(config: &consumer::Config) -> Vec<String> {
    if !config.filter_subjects.is_empty() {
        return config.filter_subjects.clone();
    }
    Some(config.filter_subject.clone())
        .filter(|f| !f.is_empty())
        .into_iter()
        .collect()
}

fn describe(filters: &[String]) -> String {
    match filters {
        [] => "every subject of the stream".into(),
        [one] => format!("only {one:?}"),
        many => format!("only {many:?}"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn options() -> NatsConsumerOptions {
        NatsConsumerOptions::new("nats://x", "ORDERS", "billing", "billing.dead")
    }

    fn matching(o: &NatsConsumerOptions) -> consumer::Config {
        consumer::Config {
            durable_name: Some(o.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: o.ack_wait,
            max_deliver: o.max_deliver,
            max_ack_pending: o.max_ack_pending,
            ..Default::default()
        }
    }

    #[test]
    fn a_durable_created_as_the_runner_creates_it_is_taken_as_it_is() {
        let o = options();
        assert_eq!(refusal(&matching(&o), &o), None);
        assert!(changes(&matching(&o), &o).is_empty());
    }

    #[test]
    fn another_ack_policy_or_filter_is_refused_and_limits_are_changed() {
        let mut o = options();
        let mut c = matching(&o);
        c.ack_policy = AckPolicy::All;
        assert!(refusal(&c, &o).unwrap().contains("ack_policy \"all\""));
        c.ack_policy = AckPolicy::None;
        assert!(refusal(&c, &o).unwrap().contains("ack_policy \"none\""));

        let mut c = matching(&o);
        c.filter_subject = "orders.paid".into();
        assert!(
            refusal(&c, &o)
                .unwrap()
                .contains("reads only \"orders.paid\" but filter_subject is unset")
        );
        o.filter_subject = Some("orders.paid".into());
        assert_eq!(refusal(&c, &o), None);
        c.filter_subject = String::new();
        c.filter_subjects = vec!["orders.paid".into(), "orders.sent".into()];
        assert!(refusal(&c, &o).is_some());

        let mut c = matching(&o);
        c.max_deliver = 3;
        c.ack_wait = Duration::from_secs(5);
        c.headers_only = true;
        assert_eq!(
            changes(&c, &o),
            [
                "ack_wait: 5s -> 30s",
                "max_deliver: 3 -> -1",
                "headers_only: true -> false"
            ]
        );
    }
}
