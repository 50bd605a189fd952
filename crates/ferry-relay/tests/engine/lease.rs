//! The lease keeper against a database that answers late, or not at all.

use super::*;

/// A renewal whose connection goes silent (no answer, no error: a network
/// partition) is given up on and sent again. The keeper used to wait on it
/// until the kernel dropped the socket; the lease view ran out meanwhile,
/// and the router and every worker stopped with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_renewal_that_never_answers_is_sent_again() {
    let e = env().await;
    let hang = Arc::new(AtomicBool::new(false));
    let hung = Arc::new(AtomicBool::new(false));
    let hook: ferry_testkit::hooked::Hook = {
        let (hang, hung) = (hang.clone(), hung.clone());
        Arc::new(move |called| {
            let silent = called == "tick" && hang.swap(false, Ordering::SeqCst);
            let hung = hung.clone();
            Box::pin(async move {
                if silent {
                    hung.store(true, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                }
                Ok(())
            })
        })
    };
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let relay = start_on(&e, store, settings("silent-tick", 4), vec![route("orders", "order.**")]);
    let mut ids = produce(&e.pool, orders(5, 2)).await;
    eventually("the first events", Duration::from_secs(30), || {
        e.sink.delivered("orders").len() >= 5
    })
    .await;
    hang.store(true, Ordering::SeqCst);
    eventually("a renewal that never answers", Duration::from_secs(10), || {
        hung.load(Ordering::SeqCst)
    })
    .await;
    // Past the 3 s lease: the view the last answered renewal granted has
    // run out, unless a later renewal answered.
    tokio::time::sleep(Duration::from_secs(4)).await;
    ids.extend(produce(&e.pool, orders(5, 2)).await);
    eventually(
        "the events committed after the silent renewal",
        Duration::from_secs(30),
        || {
            let got = e.sink.delivered_ids("orders");
            ids.iter().all(|id| got.contains(id))
        },
    )
    .await;
    relay.stop().await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}

/// Renewals that take 600 ms of a 2 s lease (a database under load) keep
/// the lease view whole. The next renewal was sent a third of the lease
/// after the last one's answer, not after its start, so the view (which
/// runs from the start) lapsed for a while every cycle though the database
/// lease never did, and the publishes in flight then were abandoned and
/// sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_lease_renewals_abandon_no_publish() {
    let e = env().await;
    e.sink.delay_when(|_| Some(Duration::from_millis(400)));
    let store = Hooked::delaying(PgStore::new(e.pool.clone()), "tick", Duration::from_millis(600));
    let s = RelaySettings {
        lease: Duration::from_secs(2),
        ..settings("slow-tick", 4)
    };
    let relay = start_on(&e, store, s, vec![route("orders", "order.**")]);
    // A publish in flight most of the time, for about 5 s: several
    // renewals.
    let mut ids = Vec::new();
    for i in 0..50 {
        ids.extend(
            produce(
                &e.pool,
                vec![Event::new("order.item.created", json!({ "n": i })).key(format!("k{}", i % 5))],
            )
            .await,
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eventually("every event", Duration::from_secs(60), || {
        let got = e.sink.delivered_ids("orders");
        ids.iter().all(|id| got.contains(id))
    })
    .await;
    let report = relay.stop().await;
    assert_eq!(
        e.sink.attempts(),
        ids.len() as u64,
        "publishes abandoned as the lease view lapsed, and sent again"
    );
    assert_eq!(report.refused, 0);
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
}
