//! What the relay's integration tests share: settings with short leases and
//! retries, a relay running in a task, and polling for a condition.

use std::time::Duration;

use ferry_core::RetryPolicy;
use ferry_relay::{RelaySettings, RunReport};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Test settings: short leases and retry delays, `max_attempts` attempts.
pub fn settings(id: &str, max_attempts: u32) -> RelaySettings {
    RelaySettings {
        batch_size: 200,
        lease: Duration::from_secs(3),
        retry: RetryPolicy {
            max_attempts,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(200),
            jitter: 0.2,
        },
        poll_interval: Duration::from_secs(60),
        shutdown_timeout: Duration::from_secs(5),
        ..RelaySettings::new(id)
    }
}

/// A relay running in a task until told to stop.
pub struct Running {
    pub stop: oneshot::Sender<()>,
    pub handle: JoinHandle<RunReport>,
}

impl Running {
    pub async fn stop(self) -> RunReport {
        let _ = self.stop.send(());
        self.handle.await.unwrap()
    }
}

/// Polls `cond` until it holds or `within` passes.
pub async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    eventually_async(what, within, async || cond()).await
}

/// [`eventually`] for a condition that must ask something (the database).
pub async fn eventually_async(what: &str, within: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
