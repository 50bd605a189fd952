use std::time::Duration;

use ferry_core::{RelayId, RetryPolicy};

/// How a relay behaves; the CLI builds this from the `[relay]` config section.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    pub id: RelayId,
    /// Events fetched and published, and deliveries claimed, per round trip.
    pub batch_size: usize,
    /// How long a partition lease lasts without renewal. Renewed every third.
    pub lease: Duration,
    pub retry: RetryPolicy,
    /// The fallback poll when idle, in case a notification was missed.
    pub poll_interval: Duration,
    /// On shutdown, how long to wait for in-flight publishes to be confirmed.
    pub shutdown_timeout: Duration,
    /// The router publishes each route's share of a batch at once and
    /// settles when all are done; a route's share that takes longer counts
    /// as failed (its events go to the route's worker, and may arrive
    /// twice), so one slow destination holds the others up for at most this.
    /// Keep it at least twice every sink's own publish timeout.
    pub direct_publish_timeout: Duration,
}

impl RelaySettings {
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: RelayId(id.into()),
            batch_size: 500,
            lease: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            poll_interval: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(10),
            direct_publish_timeout: Duration::from_secs(30),
        }
    }

    /// Work stops this long before a lease would expire unrenewed, so a relay
    /// cut off from its database never publishes under a lease another relay
    /// may already hold.
    pub(crate) fn lease_margin(&self) -> Duration {
        self.lease / 5
    }

    /// Renewals start this long after one another, each timed from the
    /// start of the one before, not from its answer.
    pub(crate) fn renew_every(&self) -> Duration {
        self.lease / 3
    }

    /// How long a renewal may go unanswered before it is given up on and
    /// sent again. A renewal starts [`renew_every`](Self::renew_every) after
    /// the one before, whose view lasts the lease less its margin: answered
    /// within this, it renews the view before the view lapses (a later
    /// answer finds the work paused already). Without a bound, a connection
    /// gone silent held the keeper until the kernel dropped the socket, and
    /// every worker and the router stopped with it. A tick handing
    /// partitions back is bounded alike: its release names the token each
    /// partition was held under, so run late it frees none this relay took
    /// again since.
    pub(crate) fn tick_timeout(&self) -> Duration {
        self.lease
            .saturating_sub(self.lease_margin())
            .saturating_sub(self.renew_every())
    }

    /// How long any other store call (a fetch, a claim, a write) may go
    /// unanswered before it is given up on as failed, and retried: one
    /// lease. Without a bound, a connection gone silent (a failover, a
    /// network drop) held the router or a route worker until the kernel
    /// dropped the socket, about 15 minutes, while the lease keeper, on
    /// connections of its own, went on renewing: no other relay took the
    /// partitions over, nothing was delivered, and no step failed to say
    /// so. A lease is what the relay's other timings are counted in, and
    /// ample for an honest statement (a fetch or a settle of a full batch
    /// on a large backlog takes a fraction of a second); after it, the
    /// relay works again, or reports the failure, within another lease.
    pub(crate) fn store_timeout(&self) -> Duration {
        self.lease
    }
}
