//! The suite itself under test: it must fail for sinks that break the contract.

use super::*;
use ferry_core::{Glob, SinkError, prepare_in_key_order};
use std::sync::{Arc, Mutex};

const LIMIT: usize = 1024;

#[derive(Clone, Copy, PartialEq)]
enum Flaw {
    None,
    DropsOne,
    Duplicates,
    Reorders,
    OkOnMissing,
    NoLimit,
    WrongId,
    NoHoldBack,
}

struct MemorySink {
    flaw: Flaw,
    delivered: Arc<Mutex<Vec<ReceivedMessage>>>,
}

#[async_trait]
impl Sink for MemorySink {
    fn kind(&self) -> &'static str {
        "memory"
    }
    fn admit(&self, _route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        if event.payload.len() > LIMIT && self.flaw != Flaw::NoLimit {
            Err(SinkError::permanent("too large"))
        } else {
            Ok(())
        }
    }
    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        if route.destination == "missing" {
            let outcome = if self.flaw == Flaw::OkOnMissing {
                Ok(())
            } else {
                Err(SinkError::permanent("no such destination"))
            };
            return events.iter().map(|_| outcome.clone()).collect();
        }
        let admitted: Vec<Result<(), SinkError>> = if self.flaw == Flaw::NoHoldBack {
            events.iter().map(|e| self.admit(route, e)).collect()
        } else {
            prepare_in_key_order(events, |e| self.admit(route, e))
        };
        let mut out = Vec::new();
        let mut batch = Vec::new();
        for (i, (e, admission)) in events.iter().zip(admitted).enumerate() {
            if let Err(refused) = admission {
                out.push(Err(refused));
                continue;
            }
            let id = if self.flaw == Flaw::WrongId {
                EventId::new()
            } else {
                e.id
            };
            let message = ReceivedMessage {
                id: id.to_string(),
                body: e.payload.to_vec(),
                key: e.key.clone(),
            };
            match (self.flaw, i) {
                (Flaw::DropsOne, 7) => {}
                (Flaw::Duplicates, 3) => batch.extend([message.clone(), message]),
                _ => batch.push(message),
            }
            out.push(Ok(()));
        }
        if self.flaw == Flaw::Reorders && batch.len() > 5 {
            batch.swap(0, 5);
        }
        self.delivered.lock().unwrap().extend(batch);
        out
    }
    async fn check(&self, route: &Route) -> Result<(), SinkError> {
        if route.destination == "missing" {
            Err(SinkError::config("no such destination"))
        } else {
            Ok(())
        }
    }
}

struct Harness {
    delivered: Arc<Mutex<Vec<ReceivedMessage>>>,
    read: Mutex<usize>,
}

fn route(destination: &str) -> Route {
    Route {
        name: "memory".into(),
        matcher: Glob::new("**").unwrap(),
        sink: "memory".into(),
        destination: destination.into(),
        routing_key: None,
    }
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route("good")
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route("missing"))
    }
    fn max_payload_bytes(&self) -> Option<usize> {
        Some(LIMIT)
    }
    async fn received(&self, n: usize, _timeout: Duration) -> Vec<ReceivedMessage> {
        let delivered = self.delivered.lock().unwrap();
        let mut read = self.read.lock().unwrap();
        let new: Vec<_> = delivered[*read..].iter().take(n).cloned().collect();
        *read += new.len();
        new
    }
}

async fn run_with(flaw: Flaw) {
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let sink = MemorySink {
        flaw,
        delivered: Arc::clone(&delivered),
    };
    run(
        &sink,
        &Harness {
            delivered,
            read: Mutex::new(0),
        },
    )
    .await;
}

#[tokio::test]
async fn a_correct_sink_passes() {
    run_with(Flaw::None).await;
}

#[tokio::test]
#[should_panic(expected = "never arrived")]
async fn catches_a_lost_event() {
    run_with(Flaw::DropsOne).await;
}

#[tokio::test]
#[should_panic(expected = "received twice")]
async fn catches_a_duplicate() {
    run_with(Flaw::Duplicates).await;
}

#[tokio::test]
#[should_panic(expected = "arrived after")]
async fn catches_a_key_out_of_order() {
    run_with(Flaw::Reorders).await;
}

#[tokio::test]
#[should_panic(expected = "reported published to a missing destination")]
async fn catches_success_reported_for_a_missing_destination() {
    run_with(Flaw::OkOnMissing).await;
}

#[tokio::test]
#[should_panic(expected = "passed a limit")]
async fn catches_an_unenforced_limit() {
    run_with(Flaw::NoLimit).await;
}

#[tokio::test]
#[should_panic(expected = "after a refused event of its key")]
async fn catches_an_event_sent_after_a_refused_one_of_its_key() {
    run_with(Flaw::NoHoldBack).await;
}

#[tokio::test]
#[should_panic(expected = "unknown id")]
async fn catches_a_message_id_that_is_not_the_event_id() {
    run_with(Flaw::WrongId).await;
}
