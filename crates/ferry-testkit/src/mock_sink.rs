//! A scripted in-memory sink for engine tests: it records what it was given,
//! in order, and fails on command.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use ferry_core::{EventId, PublishOutcome, Route, Sink, SinkError, StoredEvent, prepare_in_key_order};

type Script = Box<dyn Fn(&StoredEvent) -> Option<SinkError> + Send + Sync>;
type Delay = Box<dyn Fn(&StoredEvent) -> Option<std::time::Duration> + Send + Sync>;

/// Records every event it confirms, per route, in publish order.
#[derive(Default)]
pub struct MockSink {
    delivered: Mutex<HashMap<String, Vec<StoredEvent>>>,
    script: Mutex<Option<Script>>,
    admission: Mutex<Option<Script>>,
    delay: Mutex<Option<Delay>>,
    admits_in_publish: AtomicBool,
    down: AtomicBool,
    attempts: AtomicU64,
    closed: AtomicBool,
    close_delay: Mutex<Option<std::time::Duration>>,
}

impl MockSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// Fails each event for which `f` returns an error.
    pub fn fail_when(&self, f: impl Fn(&StoredEvent) -> Option<SinkError> + Send + Sync + 'static) {
        *self.script.lock().unwrap() = Some(Box::new(f));
    }

    /// Holds a publish for the longest delay `f` returns for its events, as
    /// a slow destination would: the caller's task goes on meanwhile.
    pub fn delay_when(&self, f: impl Fn(&StoredEvent) -> Option<std::time::Duration> + Send + Sync + 'static) {
        *self.delay.lock().unwrap() = Some(Box::new(f));
    }

    /// Refuses each event for which `f` returns an error before sending it,
    /// as a sink does for a payload over the destination's limit.
    pub fn refuse_when(&self, f: impl Fn(&StoredEvent) -> Option<SinkError> + Send + Sync + 'static) {
        *self.admission.lock().unwrap() = Some(Box::new(f));
    }

    /// Applies the admission in `publish`, as the shipped sinks do: a refused
    /// event's later events of its key come back held back, unsent.
    pub fn admit_in_publish(&self) {
        self.admits_in_publish.store(true, Ordering::SeqCst);
    }

    /// While down, every publish fails transiently, as a broker outage would.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Events confirmed on `route`, in order (duplicates included).
    pub fn delivered(&self, route: &str) -> Vec<StoredEvent> {
        self.delivered.lock().unwrap().get(route).cloned().unwrap_or_default()
    }

    pub fn delivered_ids(&self, route: &str) -> Vec<EventId> {
        self.delivered(route).iter().map(|e| e.id).collect()
    }

    /// Whether the relay has closed it.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Makes `close` take `delay`, as flushing a client's queue to a slow
    /// broker does.
    pub fn delay_close(&self, delay: std::time::Duration) {
        *self.close_delay.lock().unwrap() = Some(delay);
    }

    /// Publish attempts, successful or not.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Sink for MockSink {
    fn kind(&self) -> &'static str {
        "mock"
    }

    fn admit(&self, _route: &Route, event: &StoredEvent) -> Result<(), SinkError> {
        match self.admission.lock().unwrap().as_ref().and_then(|f| f(event)) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    fn admits_in_publish(&self) -> bool {
        self.admits_in_publish.load(Ordering::SeqCst)
    }

    async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        self.attempts.fetch_add(events.len() as u64, Ordering::SeqCst);
        let delay = self
            .delay
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|f| events.iter().filter_map(f).max());
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let down = self.down.load(Ordering::SeqCst);
        let admitted = if self.admits_in_publish() {
            prepare_in_key_order(events, |e| self.admit(route, e))
        } else {
            vec![Ok(()); events.len()]
        };
        let script = self.script.lock().unwrap();
        let mut delivered = self.delivered.lock().unwrap();
        let log = delivered.entry(route.name.clone()).or_default();
        events
            .iter()
            .zip(admitted)
            .map(|(e, admission)| {
                admission?;
                if down {
                    return Err(SinkError::transient("mock destination is down"));
                }
                if let Some(err) = script.as_ref().and_then(|f| f(e)) {
                    return Err(err);
                }
                log.push(e.clone());
                Ok(())
            })
            .collect()
    }

    async fn close(&self) {
        let delay = *self.close_delay.lock().unwrap();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        self.closed.store(true, Ordering::SeqCst);
    }

    async fn check(&self, _route: &Route) -> Result<(), SinkError> {
        if self.down.load(Ordering::SeqCst) {
            Err(SinkError::transient("mock destination is down"))
        } else {
            Ok(())
        }
    }
}
