//! A broker that refuses channels: a user's `max-channels` limit (a node's
//! channel limit, as on Amazon MQ, is refused the same way: 530 NOT_ALLOWED,
//! closing the connection).

use std::collections::HashSet;
use std::time::Duration;

use ferry_core::{ErrorKind, Route, Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::TestTopology;
use ferry_testkit::sink_suite::ARRIVAL_TIMEOUT;

use crate::support::{LIMIT, expect_err, ids, keyed, received_ids, route};
use crate::user::TestUser;

fn sink_with_channels(url: String, channels: usize) -> RabbitMqSink {
    RabbitMqSink::new(RabbitMqOptions {
        url,
        channels,
        max_message_bytes: LIMIT,
        ..RabbitMqOptions::default()
    })
}

/// Publishes `events` as a relay would, sending the failed ones again
/// until all are published; every failure on the way must be transient.
async fn publish_until_published(sink: &RabbitMqSink, to: &Route, events: &[StoredEvent]) {
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    let mut pending = events.to_vec();
    while !pending.is_empty() {
        let outcomes = sink.publish(to, &pending).await;
        let mut failed = Vec::new();
        for (event, outcome) in pending.iter().zip(&outcomes) {
            if let Err(e) = outcome {
                assert_eq!(e.kind, ErrorKind::Transient, "event {}: {e}", event.seq);
                failed.push(event.clone());
            }
        }
        pending = failed;
        assert!(
            tokio::time::Instant::now() < deadline,
            "still failing: {:?}",
            outcomes.iter().find(|o| o.is_err())
        );
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn a_user_channel_limit_gets_a_batch_over_the_channels_it_allows() {
    let topology = TestTopology::create("chan-limit").await;
    let user = TestUser::create(".*").await;
    user.limit_channels(1).await;
    // Two channels configured, one allowed: RabbitMQ refuses the second
    // with 530 NOT_ALLOWED, which is no fault of the events.
    let sink = sink_with_channels(user.url(), 2);
    let to = route(topology.exchange(), None);

    let first = keyed(40, |seq| format!("k{}", seq % 5));
    let outcomes = sink.publish(&to, &first).await;
    for outcome in outcomes.iter().filter(|o| o.is_err()) {
        expect_err(outcome, ErrorKind::Transient, "");
    }
    publish_until_published(&sink, &to, &first).await;
    // The sink remembers the limit: the next batch goes at once.
    let second = keyed(40, |seq| format!("j{}", seq % 5));
    let outcomes = sink.publish(&to, &second).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let mut wanted = ids(&first);
    wanted.extend(ids(&second));
    let mut seen = HashSet::new();
    while !wanted.is_subset(&seen) {
        let more = topology.receive(wanted.len() - seen.len(), ARRIVAL_TIMEOUT).await;
        assert!(
            !more.is_empty(),
            "{} events never arrived",
            wanted.difference(&seen).count()
        );
        seen.extend(received_ids(&more));
    }

    // check says the sink publishes over fewer channels, and how to fix it.
    let caveats = sink.check_with_caveats(&to).await.expect("the route checks");
    assert!(
        caveats
            .iter()
            .any(|c| c.contains("sinks.rabbit.channels") && c.contains("max-channels")),
        "{caveats:?}"
    );
    sink.close().await;
    user.delete().await;
    topology.delete().await;
}

#[tokio::test]
async fn a_user_allowed_no_channel_fails_transiently_naming_the_limit() {
    let topology = TestTopology::create("chan-none").await;
    let user = TestUser::create(".*").await;
    user.limit_channels(0).await;
    let sink = sink_with_channels(user.url(), 2);
    let to = route(topology.exchange(), None);

    for _ in 0..2 {
        let outcomes = sink.publish(&to, &keyed(5, |seq| format!("k{seq}"))).await;
        for outcome in &outcomes {
            expect_err(outcome, ErrorKind::Transient, "channel limit");
            expect_err(outcome, ErrorKind::Transient, "max-channels");
            expect_err(outcome, ErrorKind::Transient, "sinks.rabbit.channels");
        }
    }
    let err = sink.check(&to).await.expect_err("no channel");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains("sinks.rabbit.channels"), "{err}");
    sink.close().await;
    user.delete().await;
    topology.delete().await;
}
