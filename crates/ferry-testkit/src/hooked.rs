//! A store wrapper for fault tests: every call runs a hook first, which can
//! fail it (a relay whose process died) or delay it (a slow write), then
//! goes to the wrapped store. Every method of [`Store`] is forwarded, the
//! direct-delivery ones included, so the relay sees the same store it would
//! see without the wrapper.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectRecord, Ownership, Partition, Recorded, RelayId, RoutePlan, Store, StoreError,
    UnroutedEvent, WakeSource,
};
use futures::future::BoxFuture;

/// Runs before each call, given the method's name; an error is returned in
/// place of the call.
pub type Hook = Arc<dyn Fn(&'static str) -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync>;

/// Runs after a `tick` the store answered, given the partitions it handed
/// back with their tokens; an error returned replaces the answer, as when
/// the connection drops after the commit.
pub type AfterTick = Arc<dyn Fn(&[(Partition, i64)]) -> Option<StoreError> + Send + Sync>;

/// Runs before a `tick` reaches the store (after the hook), given the
/// partitions it hands back with their tokens: it can hold the tick up, as
/// a slow database would, or for ever, as a connection gone silent would,
/// and see whether the caller waited for it (a future dropped half way was
/// given up on).
pub type BeforeTick = Arc<dyn Fn(&[(Partition, i64)]) -> BoxFuture<'static, ()> + Send + Sync>;

/// Runs before a fenced write (`settle` or `record`, by name) reaches the
/// store; an answer returned is given in its place and the store is not
/// called, as when the fence refused it all (`Ok(0)`).
pub type BeforeWrite = Arc<dyn Fn(&'static str) -> Option<Result<u64, StoreError>> + Send + Sync>;

/// Runs after a fenced write (`settle` or `record`, by name) the store
/// answered, given how many items it applied; an error returned replaces
/// the answer, as when the connection drops after the commit.
pub type AfterWrite = Arc<dyn Fn(&'static str, u64) -> Option<StoreError> + Send + Sync>;

/// Runs after a fenced write (`settle` or `record`, by name) the store
/// applied: `true` holds its answer back for ever, as a connection gone
/// silent after the commit does.
pub type SilenceAfterWrite = Arc<dyn Fn(&'static str) -> bool + Send + Sync>;

/// `inner`, with `hook` run before every call.
#[derive(Clone)]
pub struct Hooked<S> {
    pub inner: S,
    pub hook: Hook,
    pub after_tick: Option<AfterTick>,
    pub before_tick: Option<BeforeTick>,
    pub before_write: Option<BeforeWrite>,
    pub after_write: Option<AfterWrite>,
    pub silence_after_write: Option<SilenceAfterWrite>,
}

impl<S> Hooked<S> {
    pub fn new(inner: S, hook: Hook) -> Self {
        Self {
            inner,
            hook,
            after_tick: None,
            before_tick: None,
            before_write: None,
            after_write: None,
            silence_after_write: None,
        }
    }

    /// Answers the writes `before` says to in the store's place, writing
    /// nothing.
    pub fn answering_writes(mut self, before: BeforeWrite) -> Self {
        self.before_write = Some(before);
        self
    }

    /// Loses the answer of the writes `after` says to: the store wrote, the
    /// caller gets the error.
    pub fn losing_write_answers(mut self, after: AfterWrite) -> Self {
        self.after_write = Some(after);
        self
    }

    /// Never answers the writes `after` says to, once the store applied
    /// them.
    pub fn silencing_write_answers(mut self, after: SilenceAfterWrite) -> Self {
        self.silence_after_write = Some(after);
        self
    }

    /// A fenced write, with `before_write` and `after_write` around it.
    async fn write(
        &self,
        method: &'static str,
        call: impl std::future::Future<Output = Result<u64, StoreError>>,
    ) -> Result<u64, StoreError> {
        (self.hook)(method).await?;
        if let Some(answer) = self.before_write.as_ref().and_then(|before| before(method)) {
            return answer;
        }
        let applied = call.await?;
        if self.silence_after_write.as_ref().is_some_and(|silence| silence(method)) {
            return std::future::pending().await;
        }
        match self.after_write.as_ref().and_then(|after| after(method, applied)) {
            Some(lost) => Err(lost),
            None => Ok(applied),
        }
    }

    /// Runs `before` ahead of every tick, given what it hands back.
    pub fn before_ticks(mut self, before: BeforeTick) -> Self {
        self.before_tick = Some(before);
        self
    }

    /// Loses the answer of the ticks `after` says to: the store did the
    /// work, the caller gets the error.
    pub fn losing_tick_answers(mut self, after: AfterTick) -> Self {
        self.after_tick = Some(after);
        self
    }

    /// Delays every call of `method` by `delay`.
    pub fn delaying(inner: S, method: &'static str, delay: Duration) -> Self {
        let hook: Hook = Arc::new(move |called| {
            Box::pin(async move {
                if called == method {
                    tokio::time::sleep(delay).await;
                }
                Ok(())
            })
        });
        Self::new(inner, hook)
    }
}

#[async_trait]
impl<S: Store> Store for Hooked<S> {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        (self.hook)("tick").await?;
        if let Some(before) = &self.before_tick {
            before(release).await;
        }
        let answer = self.inner.tick(relay, lease, release).await;
        match self.after_tick.as_ref().and_then(|after| after(release)) {
            Some(lost) => Err(lost),
            None => answer,
        }
    }
    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        (self.hook)("leave").await?;
        self.inner.leave(relay, held).await
    }
    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError> {
        (self.hook)("fetch_unrouted").await?;
        self.inner.fetch_unrouted(owned, limit).await
    }
    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError> {
        (self.hook)("route").await?;
        self.inner.route(owned, plans, now).await
    }
    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        (self.hook)("fetch_direct").await?;
        self.inner.fetch_direct(owned, limit, routes, down, exclude).await
    }
    async fn settle(
        &self,
        owned: &Ownership,
        seqs: &[i64],
        records: &[DirectRecord],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        self.write("settle", self.inner.settle(owned, seqs, records, now)).await
    }
    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        (self.hook)("claim").await?;
        self.inner.claim(owned, route, limit, now, exclude).await
    }
    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        self.write("record", self.inner.record(owned, route, outcomes, now))
            .await
    }
    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        (self.hook)("next_due").await?;
        self.inner.next_due(owned, route, now).await
    }
    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        (self.hook)("set_sleeping").await?;
        self.inner.set_sleeping(relay, sleeping).await
    }
    async fn producers_open(&self) -> Result<bool, StoreError> {
        (self.hook)("producers_open").await?;
        self.inner.producers_open().await
    }
    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        (self.hook)("listen").await?;
        self.inner.listen().await
    }
}
