//! Every store call the relay makes, bounded in time.
//!
//! A connection can go silent: the database fails over, the network drops,
//! a proxy takes the bytes and never answers. No error comes; the call
//! waits until the kernel gives the socket up (about 15 minutes of
//! retransmissions) or, behind such a proxy, for ever. The lease keeper
//! bounds its renewals, so the leases stayed renewed and no other relay
//! took over, while the router or a route worker waited on its fetch,
//! claim or write: nothing was delivered, and no step failed to say so.
//! Through [`Bounded`], such a call fails after
//! [`store_timeout`](crate::RelaySettings::store_timeout) with a transient
//! error, which each caller already retries. The retry does not meet the
//! silent connection again: the pool tests a connection whose call was cut
//! short (a ping) before it lends it again, and one that does not answer
//! is never lent again.
//!
//! A write given up on (`route`, `record`, `settle`) may still have been
//! applied, or may still be applied later, when the connection recovers:
//! its outcome is unknown, as when the answer of a committed write is
//! lost. The callers retry it under the same fence (the lease tokens, each
//! delivery's attempt count, the events still unrouted), so it lands at
//! most once, and they count what a retry finds done already as written
//! by the attempt given up on.

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectRecord, Ownership, Partition, Recorded, RelayId, RoutePlan, Store, StoreError,
    UnroutedEvent, WakeSource,
};

/// `inner`, with each call given up on after `limit`.
pub(crate) struct Bounded<S> {
    inner: S,
    limit: Duration,
}

impl<S: Store> Bounded<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        Self { inner, limit }
    }

    /// Runs `call` (the store's `op`), failing it transiently if it does
    /// not answer within the limit.
    async fn bounded<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.limit, call).await {
            Ok(answer) => answer,
            Err(_) => Err(timed_out(op, self.limit)),
        }
    }
}

/// The error of a call given up on.
fn timed_out(op: &str, limit: Duration) -> StoreError {
    StoreError::transient(format!(
        "the database did not answer {op} within {limit:?} (relay.lease): the connection may have gone silent \
         (a failover, a network drop); given up on and retried, on another connection. A write given up on may \
         have been applied; its retry is fenced. If the database is healthy and this statement is just slow, \
         raise relay.lease"
    ))
}

#[async_trait]
impl<S: Store> Store for Bounded<S> {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        // The lease keeper bounds its ticks more tightly.
        self.bounded("a lease renewal", self.inner.tick(relay, lease, release))
            .await
    }

    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        self.bounded("the hand-back of the leases", self.inner.leave(relay, held))
            .await
    }

    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError> {
        self.bounded("the fetch of new events", self.inner.fetch_unrouted(owned, limit))
            .await
    }

    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError> {
        self.bounded("the routing of new events", self.inner.route(owned, plans, now))
            .await
    }

    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        self.bounded("a claim", self.inner.claim(owned, route, limit, now, exclude))
            .await
    }

    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        self.bounded(
            "the recording of outcomes",
            self.inner.record(owned, route, outcomes, now),
        )
        .await
    }

    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.bounded(
            "the read of the next retry's time",
            self.inner.next_due(owned, route, now),
        )
        .await
    }

    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        self.bounded(
            "the fetch of new events",
            self.inner.fetch_direct(owned, limit, routes, down, exclude),
        )
        .await
    }

    async fn settle(
        &self,
        owned: &Ownership,
        seqs: &[i64],
        records: &[DirectRecord],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        self.bounded(
            "the settling of published events",
            self.inner.settle(owned, seqs, records, now),
        )
        .await
    }

    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        self.bounded(
            "the request for notifications",
            self.inner.set_sleeping(relay, sleeping),
        )
        .await
    }

    async fn producers_open(&self) -> Result<bool, StoreError> {
        self.bounded("the look for open producers", self.inner.producers_open())
            .await
    }

    /// Only the subscription is bounded: the stream it returns waits, by
    /// design, as long as nothing is committed. One that stops on a silent
    /// connection costs wake-ups, not work: the router and the workers
    /// still poll (`relay.poll_interval`).
    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        self.bounded("the subscription to commit notifications", self.inner.listen())
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_given_up_on_says_what_how_long_and_what_to_do() {
        let e = timed_out("a claim", Duration::from_secs(30));
        assert_eq!(e.kind, ferry_core::ErrorKind::Transient);
        for part in ["a claim", "30s", "relay.lease", "retried"] {
            assert!(e.message.contains(part), "{part:?} in {}", e.message);
        }
    }
}
