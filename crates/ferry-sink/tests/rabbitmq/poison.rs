//! One event the broker answers by closing its channel (a missing exchange,
//! a write the user may not make) must fail alone: not the other keys'
//! events beside it on the channel, at any attempt.

use std::collections::HashSet;

use ferry_core::{ErrorKind, PublishOutcome, Route, Sink, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::{TestTopology, amqp_url, unique_name};
use ferry_testkit::sink_suite::{ARRIVAL_TIMEOUT, QUIET_PERIOD, event};
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;

use crate::support::{LIMIT, expect_err, ids, received_ids, route};
use crate::user::TestUser;

/// One channel, so that the refused event shares it with the others.
fn one_channel_sink(url: String) -> RabbitMqSink {
    RabbitMqSink::new(RabbitMqOptions {
        url,
        channels: 1,
        max_message_bytes: LIMIT,
        ..RabbitMqOptions::default()
    })
}

fn to(exchange: &str, seq: i64, key: &str) -> StoredEvent {
    event(
        seq,
        &format!("{exchange}.item.created"),
        Some(key),
        json!({ "seq": seq }),
    )
}

/// Round `round`'s new events: 20 to `good` over four keys, one to `bad`
/// (key `b`) among them, and one to `good` with key `b` after it.
fn fresh(round: i64, good: &str, bad: &str) -> Vec<StoredEvent> {
    (0..20)
        .map(|i| {
            let seq = round * 100 + i;
            match i {
                5 => to(bad, seq, "b"),
                12 => to(good, seq, "b"),
                _ => to(good, seq, &format!("g{}", i % 4)),
            }
        })
        .collect()
}

/// Publishes three rounds as a relay would: each round's batch is what
/// failed before plus new events. Every time, the first event of key `b`
/// fails as `bad` says, the later ones are held back behind it, and every
/// other event is published. Returns the published events.
async fn three_rounds(
    sink: &RabbitMqSink,
    templated: &Route,
    good: &str,
    bad: &str,
    expect_bad: impl Fn(&PublishOutcome),
) -> Vec<StoredEvent> {
    let mut pending: Vec<StoredEvent> = Vec::new();
    let mut published = Vec::new();
    for round in 0..3 {
        let batch: Vec<StoredEvent> = pending.drain(..).chain(fresh(round, good, bad)).collect();
        let outcomes = sink.publish(templated, &batch).await;
        let mut first_b = true;
        for (e, outcome) in batch.iter().zip(&outcomes) {
            if e.key.as_deref() == Some("b") {
                if first_b {
                    expect_bad(outcome);
                    first_b = false;
                } else {
                    expect_err(outcome, ErrorKind::Transient, "held back");
                }
                pending.push(e.clone());
            } else {
                assert_eq!(outcome, &Ok(()), "round {round}: event {} of key {:?}", e.seq, e.key);
                published.push(e.clone());
            }
        }
    }
    published
}

/// Each of `events` arrived at least once (a message stored but not
/// confirmed before a channel close may arrive twice), and nothing else.
async fn expect_arrived(topology: &TestTopology, events: &[StoredEvent]) {
    let wanted = ids(events);
    let mut seen = HashSet::new();
    let deadline = tokio::time::Instant::now() + ARRIVAL_TIMEOUT;
    while !wanted.is_subset(&seen) && tokio::time::Instant::now() < deadline {
        let left = deadline - tokio::time::Instant::now();
        seen.extend(received_ids(&topology.receive(wanted.len() - seen.len(), left).await));
    }
    assert!(
        wanted.is_subset(&seen),
        "{} events never arrived",
        wanted.difference(&seen).count()
    );
    assert!(seen.is_subset(&wanted), "an event of key b arrived");
}

#[tokio::test]
async fn a_missing_exchange_fails_only_its_own_events_at_every_attempt() {
    let topology = TestTopology::create("poison-404").await;
    let missing = unique_name("poison-missing");
    let sink = one_channel_sink(amqp_url());
    let templated = route("{domain}", None);
    let published = three_rounds(&sink, &templated, topology.exchange(), &missing, |outcome| {
        // Transient by design (an exchange being redeclared is missing for
        // a moment); dead after max_attempts, with the fix named.
        expect_err(outcome, ErrorKind::Transient, "does not exist");
        expect_err(outcome, ErrorKind::Transient, "routes[].destination");
    })
    .await;
    expect_arrived(&topology, &published).await;
    sink.close().await;
    topology.delete().await;
}

#[tokio::test]
async fn an_exchange_the_user_may_not_write_fails_only_its_own_events_at_every_attempt() {
    let topology = TestTopology::create("poison-403").await;
    let forbidden = TestTopology::create("poison-nowrite").await;
    let user = TestUser::create(&format!("^{}$", topology.exchange())).await;
    let sink = one_channel_sink(user.url());
    let templated = route("{domain}", None);
    let published = three_rounds(
        &sink,
        &templated,
        topology.exchange(),
        forbidden.exchange(),
        |outcome| {
            expect_err(outcome, ErrorKind::Config, "ACCESS_REFUSED");
            expect_err(outcome, ErrorKind::Config, "write access");
        },
    )
    .await;
    expect_arrived(&topology, &published).await;
    assert!(
        forbidden.receive(1, QUIET_PERIOD).await.is_empty(),
        "a refused write arrived"
    );
    sink.close().await;
    user.delete().await;
    forbidden.delete().await;
    topology.delete().await;
}

#[tokio::test]
async fn an_exchange_found_missing_is_checked_again_not_sent_to_until_it_exists() {
    let counts = ferry_testkit::metrics::Counts::by_label("kind");
    // The test's runtime has one thread, so a thread-local recorder sees all.
    let _recorder = metrics::set_default_local_recorder(&counts);
    let topology = TestTopology::create("poison-later").await;
    let missing = unique_name("poison-later-missing");
    let sink = one_channel_sink(amqp_url());
    let templated = route("{domain}", None);
    let batch = |round| fresh(round, topology.exchange(), &missing);

    let outcomes = sink.publish(&templated, &batch(0)).await;
    expect_err(&outcomes[5], ErrorKind::Transient, "does not exist");
    let connections = counts.get(ferry_sink::CONNECTIONS_METRIC, "rabbitmq");
    // Found missing before: refused before sending, so no channel (and no
    // connection) is lost to it.
    for round in 1..3 {
        let outcomes = sink.publish(&templated, &batch(round)).await;
        expect_err(&outcomes[5], ErrorKind::Transient, "does not exist");
        expect_err(&outcomes[12], ErrorKind::Transient, "held back");
        let others: Vec<_> = outcomes
            .iter()
            .enumerate()
            .filter(|(i, _)| ![5, 12].contains(i))
            .collect();
        assert!(others.iter().all(|(_, o)| o.is_ok()), "round {round}: {others:?}");
    }
    assert_eq!(
        counts.get(ferry_sink::CONNECTIONS_METRIC, "rabbitmq"),
        connections,
        "a known missing exchange cost a connection"
    );

    // Declared meanwhile (with no queue: its events come back unroutable):
    // the next batch sends to it.
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("the test broker");
    let channel = connection.create_channel().await.unwrap();
    let options = ExchangeDeclareOptions::default();
    channel
        .exchange_declare(
            missing.as_str().into(),
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let outcomes = sink.publish(&templated, &batch(3)).await;
    expect_err(&outcomes[5], ErrorKind::Transient, "unroutable");
    channel
        .exchange_delete(missing.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let _ = connection.close(200, "OK".into()).await;
    sink.close().await;
    topology.delete().await;
}
