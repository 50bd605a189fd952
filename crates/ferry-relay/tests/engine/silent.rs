//! The router and the route workers against a database connection that goes
//! silent mid-call: no answer, no error (a failover, a network drop, a proxy
//! that takes the bytes and never answers).

use std::collections::HashSet;
use std::future::Future;
use std::sync::Mutex;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{
    Claimed, DirectBatch, DirectRecord, Ownership, Partition, Recorded, RelayId, RoutePlan, StoreError, UnroutedEvent,
    WakeSource,
};
use ferry_relay::Progress;

use super::*;

/// `inner`, whose calls named in `state.before` never answer, once each, without
/// reaching the store, and whose writes named in `state.after` are applied, then
/// never answer, once each.
struct Silent<S> {
    inner: S,
    state: Arc<State>,
}

/// What to silence, and what the test saw.
#[derive(Default)]
struct State {
    before: Mutex<HashSet<&'static str>>,
    after: Mutex<HashSet<&'static str>>,
    /// The calls that went silent.
    hung: Mutex<Vec<&'static str>>,
    /// The relay's progress, and whether it showed the router failing when
    /// the router fetched again after its silent fetch.
    progress: Mutex<Option<Progress>>,
    failing_seen: AtomicBool,
}

impl<S: Store> Silent<S> {
    async fn call<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let state = &*self.state;
        if state.before.lock().unwrap().remove(op) {
            state.hung.lock().unwrap().push(op);
            return std::future::pending().await;
        }
        if op == "fetch_direct" && state.hung.lock().unwrap().contains(&"fetch_direct") {
            let failing = state
                .progress
                .lock()
                .unwrap()
                .as_ref()
                .and_then(Progress::router_failing_for);
            if failing.is_some() {
                state.failing_seen.store(true, Ordering::SeqCst);
            }
        }
        let answer = call.await;
        if answer.is_ok() && state.after.lock().unwrap().remove(op) {
            state.hung.lock().unwrap().push(op);
            return std::future::pending().await;
        }
        answer
    }
}

#[async_trait]
impl<S: Store> Store for Silent<S> {
    async fn tick(
        &self,
        relay: &RelayId,
        lease: Duration,
        release: &[(Partition, i64)],
    ) -> Result<Ownership, StoreError> {
        self.call("tick", self.inner.tick(relay, lease, release)).await
    }
    async fn leave(&self, relay: &RelayId, held: &[(Partition, i64)]) -> Result<(), StoreError> {
        self.call("leave", self.inner.leave(relay, held)).await
    }
    async fn fetch_unrouted(&self, owned: &Ownership, limit: usize) -> Result<Vec<UnroutedEvent>, StoreError> {
        self.call("fetch_unrouted", self.inner.fetch_unrouted(owned, limit))
            .await
    }
    async fn route(&self, owned: &Ownership, plans: &[RoutePlan], now: DateTime<Utc>) -> Result<u64, StoreError> {
        self.call("route", self.inner.route(owned, plans, now)).await
    }
    async fn claim(
        &self,
        owned: &Ownership,
        route: &str,
        limit: usize,
        now: DateTime<Utc>,
        exclude: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        self.call("claim", self.inner.claim(owned, route, limit, now, exclude))
            .await
    }
    async fn record(
        &self,
        owned: &Ownership,
        route: &str,
        outcomes: &[Recorded],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        self.call("record", self.inner.record(owned, route, outcomes, now))
            .await
    }
    async fn next_due(
        &self,
        owned: &Ownership,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.call("next_due", self.inner.next_due(owned, route, now)).await
    }
    async fn fetch_direct(
        &self,
        owned: &Ownership,
        limit: usize,
        routes: &[String],
        down: &[String],
        exclude: &[i64],
    ) -> Result<Option<DirectBatch>, StoreError> {
        self.call(
            "fetch_direct",
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
        self.call("settle", self.inner.settle(owned, seqs, records, now)).await
    }
    async fn set_sleeping(&self, relay: &RelayId, sleeping: bool) -> Result<(), StoreError> {
        self.call("set_sleeping", self.inner.set_sleeping(relay, sleeping))
            .await
    }
    async fn producers_open(&self) -> Result<bool, StoreError> {
        self.call("producers_open", self.inner.producers_open()).await
    }
    async fn listen(&self) -> Result<Box<dyn WakeSource>, StoreError> {
        self.call("listen", self.inner.listen()).await
    }
}

/// The router's fetch of new events goes silent, then its settle of the
/// batch it published (applied, the answer never coming), and a route
/// worker's claim: each is given up on after a lease and retried, and
/// every event is delivered, once. The router used to wait on the silent
/// fetch for as long as the socket lived (about 15 minutes, or for ever
/// behind a proxy) while the lease keeper, on its own connections, went on
/// renewing: nothing was delivered, and the relay looked ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_calls_that_never_answer_are_given_up_on_and_every_event_is_delivered() {
    let e = env().await;
    let state = Arc::new(State {
        before: Mutex::new(["fetch_direct", "claim"].into()),
        after: Mutex::new(["settle"].into()),
        ..State::default()
    });
    let store = Silent {
        inner: PgStore::new(e.pool.clone()),
        state: state.clone(),
    };
    let settings = RelaySettings {
        lease: Duration::from_secs(2),
        ..settings("silent-calls", 4)
    };
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), e.sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(store, SystemClock, settings, vec![route("orders", "order.**")], sinks).unwrap();
    *state.progress.lock().unwrap() = Some(relay.progress());
    let (stop, rx) = oneshot::channel();
    let handle = tokio::spawn(async move {
        relay
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap()
    });
    let relay = Running { stop, handle };
    let ids = produce(&e.pool, orders(20, 4)).await;
    eventually("every event, past the silent calls", Duration::from_secs(60), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    let report = relay.stop().await;
    let mut hung = state.hung.lock().unwrap().clone();
    hung.sort();
    assert_eq!(hung, ["claim", "fetch_direct", "settle"], "the calls that went silent");
    assert!(
        state.failing_seen.load(Ordering::SeqCst),
        "the silent fetch, given up on, showed in the relay's progress"
    );
    let got = e.sink.delivered("orders");
    assert_eq!(
        got.len(),
        ids.len(),
        "published once each: the silent settle was applied"
    );
    assert_complete_and_ordered(&ids, &got);
    assert_eq!(report.published, ids.len() as u64, "{report:?}");
}

/// Through a network that goes silent (every open connection to the
/// database stops answering, new ones pass), the relay delivers what is
/// committed afterwards within a few leases. The calls in flight are given
/// up on; the pool pings each connection whose call was cut short before
/// lending it again, and that ping, unanswered, keeps the silent
/// connection out of use without holding up any later call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_network_gone_silent_holds_no_later_call_up() {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    let e = env().await;
    let direct: PgConnectOptions = e._db.url().parse().unwrap();
    let upstream = tokio::net::lookup_host((direct.get_host(), direct.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = ferry_testkit::proxy::Proxy::start(upstream).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(direct.host("127.0.0.1").port(proxy.addr().port()));
    let settings = RelaySettings {
        lease: Duration::from_secs(2),
        // The commit listener's own connection goes silent too, and is
        // found so only after a minute without a notification: till then the
        // router finds what it misses by polling.
        poll_interval: Duration::from_millis(500),
        ..settings("silent-network", 4)
    };
    let relay = start_on(&e, PgStore::new(pool), settings, vec![route("orders", "order.**")]);
    let mut ids = produce(&e.pool, orders(10, 2)).await;
    eventually("the first events", Duration::from_secs(30), || {
        e.sink.delivered("orders").len() >= 10
    })
    .await;
    for _ in 0..3 {
        proxy.silence();
        ids.extend(produce(&e.pool, orders(10, 2)).await);
        eventually(
            "the events committed after the silence",
            Duration::from_secs(60),
            || {
                let got = e.sink.delivered_ids("orders");
                ids.iter().all(|id| got.contains(id))
            },
        )
        .await;
    }
    relay.stop().await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}
