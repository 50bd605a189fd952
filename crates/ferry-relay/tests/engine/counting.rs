//! Each event counts once in the relay's totals (metrics and run report),
//! however often it is published.

use super::*;
use ferry_relay::metrics::{ENQUEUED, PUBLISHED};
use ferry_testkit::hooked::{AfterWrite, BeforeWrite, Hook};
use ferry_testkit::metrics::Counts;

const TYPE: &str = "order.item.created";

fn pass() -> Hook {
    Arc::new(|_| Box::pin(async { Ok(()) }))
}

/// Runs a relay on `store` until 10 deliveries are written as published;
/// its report.
async fn settle_ten(e: &Env, store: impl Store, id: &str) -> ferry_relay::RunReport {
    let relay = start_on(e, store, settings(id, 4), vec![route("orders", "order.**")]);
    eventually_async("10 deliveries written", Duration::from_secs(30), async || {
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'published'")
            .fetch_one(&e.pool)
            .await
            .unwrap();
        published == 10
    })
    .await;
    relay.stop().await
}

/// A direct batch whose settle the fence refuses stays unrouted and is
/// fetched and published again. It was counted at each publish: 20 events
/// enqueued and published for 10 committed.
#[tokio::test]
async fn events_published_again_after_a_refused_settle_count_once() {
    let e = env().await;
    let refused = Arc::new(AtomicBool::new(false));
    let before: BeforeWrite =
        Arc::new(move |method| (method == "settle" && !refused.swap(true, Ordering::SeqCst)).then_some(Ok(0)));
    let store = Hooked::new(PgStore::new(e.pool.clone()), pass()).answering_writes(before);
    let counts = Counts::by_label("type");
    // The relay's tasks run on this thread (a current-thread runtime).
    let _recording = metrics::set_default_local_recorder(&counts);
    produce(&e.pool, orders(10, 10)).await;
    let report = settle_ten(&e, store, "refused-settle").await;
    assert_eq!(
        report.refused, 10,
        "the first settle was not refused: the test proves nothing"
    );
    assert_eq!(e.sink.delivered("orders").len(), 20);
    assert_eq!(counts.get(ENQUEUED, TYPE), 10);
    assert_eq!(counts.get(PUBLISHED, TYPE), 10);
    assert_eq!(report.published, 10);
}

/// A settle that commits but whose answer is lost is sent again, and finds
/// nothing left to take: that is not a refusal (the lease was never lost),
/// and the events count once.
#[tokio::test]
async fn a_settle_whose_answer_was_lost_is_no_refusal() {
    let e = env().await;
    let lost = Arc::new(AtomicBool::new(false));
    let after: AfterWrite = Arc::new(move |method, _| {
        (method == "settle" && !lost.swap(true, Ordering::SeqCst))
            .then(|| ferry_core::StoreError::transient("connection reset after the commit"))
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), pass()).losing_write_answers(after);
    let counts = Counts::by_label("type");
    let _recording = metrics::set_default_local_recorder(&counts);
    produce(&e.pool, orders(10, 10)).await;
    let report = settle_ten(&e, store, "lost-settle").await;
    assert_eq!(report.refused, 0, "{report:?}");
    assert_eq!(report.published, 10);
    assert_eq!(e.sink.delivered("orders").len(), 10);
    assert_eq!(counts.get(ENQUEUED, TYPE), 10);
    assert_eq!(counts.get(PUBLISHED, TYPE), 10);
}

/// A route worker whose record the fence refuses leaves its deliveries
/// pending; they are claimed and published again. They were counted at
/// each publish.
#[tokio::test]
async fn deliveries_published_again_after_a_refused_record_count_once() {
    let e = env().await;
    produce(&e.pool, orders(10, 10)).await;
    // Every event waits for the route worker, as parked events do.
    sqlx::raw_sql(
        "INSERT INTO ferry.deliveries (seq, route, partition, key)
         SELECT u.seq, 'orders', u.partition, ev.key FROM ferry.unrouted u JOIN ferry.events ev USING (seq);
         DELETE FROM ferry.unrouted",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let refused = Arc::new(AtomicBool::new(false));
    let before: BeforeWrite =
        Arc::new(move |method| (method == "record" && !refused.swap(true, Ordering::SeqCst)).then_some(Ok(0)));
    let store = Hooked::new(PgStore::new(e.pool.clone()), pass()).answering_writes(before);
    let counts = Counts::by_label("type");
    let _recording = metrics::set_default_local_recorder(&counts);
    let report = settle_ten(&e, store, "refused-record").await;
    assert_eq!(
        report.refused, 10,
        "the first record was not refused: the test proves nothing"
    );
    assert_eq!(e.sink.delivered("orders").len(), 20);
    assert_eq!(counts.get(PUBLISHED, TYPE), 10);
    assert_eq!(report.published, 10);
}

/// A record that the store applies in part though the relay still holds
/// every partition: a delivery moved on while it was in flight (an
/// operator cancelled it). The whole batch was counted as published, the
/// cancelled delivery too, beside the refusal of its outcome.
#[tokio::test]
async fn a_delivery_cancelled_while_in_flight_is_not_counted_as_published() {
    let e = env().await;
    produce(&e.pool, orders(10, 10)).await;
    // Every event waits for the route worker, as parked events do.
    sqlx::raw_sql(
        "INSERT INTO ferry.deliveries (seq, route, partition, key)
         SELECT u.seq, 'orders', u.partition, ev.key FROM ferry.unrouted u JOIN ferry.events ev USING (seq);
         DELETE FROM ferry.unrouted",
    )
    .execute(&e.pool)
    .await
    .unwrap();
    let cancelled = Arc::new(AtomicBool::new(false));
    let hook: Hook = {
        let pool = e.pool.clone();
        Arc::new(move |method| {
            let cancel = method == "record" && !cancelled.swap(true, Ordering::SeqCst);
            let pool = pool.clone();
            Box::pin(async move {
                if cancel {
                    sqlx::query(
                        "UPDATE ferry.deliveries SET state = 'cancelled'
                          WHERE seq = (SELECT min(seq) FROM ferry.deliveries WHERE route = 'orders')",
                    )
                    .execute(&pool)
                    .await
                    .unwrap();
                }
                Ok(())
            })
        })
    };
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let counts = Counts::by_label("type");
    let _recording = metrics::set_default_local_recorder(&counts);
    let relay = start_on(&e, store, settings("cancelled", 4), vec![route("orders", "order.**")]);
    eventually_async("the others written", Duration::from_secs(30), async || {
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'published'")
            .fetch_one(&e.pool)
            .await
            .unwrap();
        published == 9
    })
    .await;
    let report = relay.stop().await;
    assert_eq!(
        report.refused, 1,
        "nothing was cancelled in flight: the test proves nothing"
    );
    assert_eq!(e.sink.delivered("orders").len(), 10);
    // Which nine the store wrote is not known: counted, they could include
    // the cancelled one.
    assert!(
        report.published <= 9,
        "{} counted as published, the cancelled delivery too",
        report.published
    );
    assert_eq!(counts.get(PUBLISHED, TYPE), report.published);
}
