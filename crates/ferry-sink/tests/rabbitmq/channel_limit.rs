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

#[tokio::test]
async fn a_channel_limit_raised_again_gets_the_configured_channels_used_after_a_cool_down() {
    // A refusal may be brief: another connection of the same user in a
    // rolling deploy, or RabbitMQ counting closed channels a moment late.
    let topology = TestTopology::create("chan-back").await;
    let user = TestUser::create(".*").await;
    user.limit_channels(1).await;
    let sink = sink_with_channels(user.url(), 2).with_channels_retry_after(Duration::from_millis(300));
    let to = route(topology.exchange(), None);
    publish_until_published(&sink, &to, &keyed(20, |seq| format!("k{}", seq % 5))).await;
    let caveats = sink.check_with_caveats(&to).await.expect("the route checks");
    assert!(
        caveats.iter().any(|c| c.contains("sinks.rabbit.channels")),
        "the shortfall is reported while it lasts: {caveats:?}"
    );

    user.limit_channels(10).await;
    // Once the cool-down passed, the sink tries the two configured again,
    // gets them, and has nothing left to report.
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    let mut round = 0;
    loop {
        round += 1;
        let events = keyed(20, |seq| format!("r{round}-{}", seq % 5));
        publish_until_published(&sink, &to, &events).await;
        let caveats = sink.check_with_caveats(&to).await.expect("the route checks");
        // (The test user may not ask the management API: a caveat of its own.)
        if !caveats.iter().any(|c| c.contains("sinks.rabbit.channels")) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still publishing over fewer channels than configured: {caveats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And publishes over both: the broker counts two channels open on the
    // sink's connection (its statistics come a few seconds late).
    while user.channels_open().await != 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the broker counts {} channels of the sink's, not 2",
            user.channels_open().await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sink.close().await;
    user.delete().await;
    topology.delete().await;
}
