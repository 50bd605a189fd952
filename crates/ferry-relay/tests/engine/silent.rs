//! The router and the route workers against a database connection that goes
//! silent mid-call: no answer, no error (a failover, a network drop, a proxy
//! that takes the bytes and never answers).

use std::collections::HashSet;
use std::sync::Mutex;

use ferry_relay::Progress;
use ferry_testkit::hooked::{Hook, Hooked};

use super::*;

/// What to silence, and what the test saw: the calls named in `before`
/// never answer, once each, without reaching the store; the writes named in
/// `after` are applied, then never answer, once each.
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

/// `inner`, silenced as `state` says.
fn silent<S: Store>(inner: S, state: &Arc<State>) -> Hooked<S> {
    let before = state.clone();
    let hook: Hook = Arc::new(move |op| {
        let state = before.clone();
        Box::pin(async move {
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
            Ok(())
        })
    });
    let after = state.clone();
    Hooked::new(inner, hook).silencing_write_answers(Arc::new(move |op| {
        let silenced = after.after.lock().unwrap().remove(op);
        if silenced {
            after.hung.lock().unwrap().push(op);
        }
        silenced
    }))
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
    let store = silent(PgStore::new(e.pool.clone()), &state);
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
