//! Helpers for the RabbitMQ tests.

pub mod proxy;

use std::collections::HashSet;

use ferry_core::{ErrorKind, Glob, PublishOutcome, Route, StoredEvent};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::rabbit::Received;
use ferry_testkit::sink_suite::event;
use serde_json::json;

/// The payload limit the test sinks are configured with.
pub const LIMIT: usize = 64 * 1024;

pub fn sink_at(url: String) -> RabbitMqSink {
    RabbitMqSink::new(RabbitMqOptions {
        url,
        max_message_bytes: LIMIT,
        ..RabbitMqOptions::default()
    })
}

pub fn route(destination: &str, routing_key: Option<&str>) -> Route {
    Route {
        name: "test".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "rabbit".into(),
        destination: destination.into(),
        routing_key: routing_key.map(str::to_owned),
    }
}

/// `n` JSON events of type `test.item.created`, keyed by `key(seq)`.
pub fn keyed(n: i64, key: impl Fn(i64) -> String) -> Vec<StoredEvent> {
    (0..n)
        .map(|seq| event(seq, "test.item.created", Some(&key(seq)), json!({ "seq": seq })))
        .collect()
}

pub fn ids(events: &[StoredEvent]) -> HashSet<String> {
    events.iter().map(|e| e.id.to_string()).collect()
}

pub fn received_ids(received: &[Received]) -> HashSet<String> {
    received
        .iter()
        .map(|r| r.message_id.clone().expect("a message id"))
        .collect()
}

/// `outcome` is an error of `kind` whose message contains `text`.
pub fn expect_err(outcome: &PublishOutcome, kind: ErrorKind, text: &str) {
    match outcome {
        Ok(()) => panic!("reported published; expected a {kind} error mentioning {text:?}"),
        Err(e) => {
            assert_eq!(e.kind, kind, "{e}");
            assert!(e.message.contains(text), "{e} should mention {text:?}");
        }
    }
}
