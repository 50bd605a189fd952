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

/// Renewals that take 1.8 s of a 6 s lease (a database under load) keep
/// the lease view whole. The next renewal was sent a third of the lease
/// after the last one's answer, not after its start, so the view (which
/// runs from the start, for 4.8 s) lapsed for a while every cycle (the
/// next answer came 2 × 1.8 + 2 = 5.6 s after the last start) though the
/// database lease never did, and the publishes in flight then were
/// abandoned and sent again. Timed from the start, an answer comes 3.8 s
/// after it, and the tick is given up on only past 2.8 s: each leaves a
/// second for the database's own time on a busy machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_lease_renewals_abandon_no_publish() {
    let e = env().await;
    e.sink.delay_when(|_| Some(Duration::from_millis(400)));
    let store = Hooked::delaying(PgStore::new(e.pool.clone()), "tick", Duration::from_millis(1800));
    let s = RelaySettings {
        lease: Duration::from_secs(6),
        ..settings("slow-tick", 4)
    };
    let relay = start_on(&e, store, s, vec![route("orders", "order.**")]);
    // A publish in flight most of the time, for about 12 s: several
    // renewals.
    let mut ids = Vec::new();
    for i in 0..120 {
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

/// A tick handing partitions back whose connection goes silent (no
/// answer, no error) is given up on at the renewal bound, as a renewal is,
/// and the keeper goes on: it renews, and hands the partitions back again
/// under the tokens they were held by. It used to wait for the hand-back
/// however long it took (given up on, the release could run later and free
/// partitions taken again since, as it did not check the token): the relay
/// renewed nothing and worked nothing until it was restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_back_that_never_answers_is_given_up_on_and_renewals_go_on() {
    use ferry_testkit::hooked::{AfterTick, BeforeTick, Hook};
    let e = env().await;
    let hung = Arc::new(AtomicBool::new(false));
    // Ticks the store answered after the silent hand-back was sent.
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let before: BeforeTick = {
        let hung = hung.clone();
        Arc::new(move |release| {
            let silent = !release.is_empty() && !hung.swap(true, Ordering::SeqCst);
            Box::pin(async move {
                if silent {
                    std::future::pending::<()>().await;
                }
            })
        })
    };
    let after: AfterTick = {
        let (hung, answered) = (hung.clone(), answered.clone());
        Arc::new(move |_| {
            if hung.load(Ordering::SeqCst) {
                answered.fetch_add(1, Ordering::SeqCst);
            }
            None
        })
    };
    let pass: Hook = Arc::new(|_| Box::pin(async { Ok(()) }));
    let store = Hooked::new(PgStore::new(e.pool.clone()), pass)
        .before_ticks(before)
        .losing_tick_answers(after);
    let relay = start_on(
        &e,
        store,
        settings("silent-hand-back", 4),
        vec![route("orders", "order.**")],
    );
    eventually_async("every partition leased", Duration::from_secs(20), async || {
        leased(&e.pool, Some("silent-hand-back")).await == 32
    })
    .await;
    // Another live relay: this one's fair share halves, and it hands 16
    // partitions back.
    sqlx::query("INSERT INTO ferry.relays (id, heartbeat_at) VALUES ('elsewhere', now() + interval '1 hour')")
        .execute(&e.pool)
        .await
        .unwrap();
    eventually("a hand-back that never answers", Duration::from_secs(20), || {
        hung.load(Ordering::SeqCst)
    })
    .await;
    eventually(
        "renewals answered after the silent hand-back: the keeper waited on it",
        Duration::from_secs(30),
        || answered.load(Ordering::SeqCst) >= 2,
    )
    .await;
    eventually_async(
        "half the partitions handed back again",
        Duration::from_secs(20),
        async || leased(&e.pool, Some("silent-hand-back")).await == 16,
    )
    .await;
    relay.stop().await;
}
