//! A relay whose database URL sets `statement_timeout`, meeting partition
//! rows that another transaction holds locked.

use super::*;

/// The relay restarts under the same id while an operator's batch (or
/// another relay's tick) holds the partition rows: its first lease request
/// waits on the rows it still owns and is cancelled by `statement_timeout`
/// (SQLSTATE 57014). That was classified permanent and `ferry run` exited;
/// it is a busy moment, retried until the lock goes, and then the backlog
/// drains.
#[tokio::test]
async fn a_first_lease_request_cut_short_by_statement_timeout_is_retried_until_the_lock_goes() {
    let e = env().await;
    let ids = produce(&e.pool, orders(50, 5)).await;
    let s = settings("waits", 4);
    // An earlier run of this relay left partitions leased to it.
    PgStore::new(e.pool.clone()).tick(&s.id, s.lease, &[]).await.unwrap();
    let mut locker = e.pool.begin().await.unwrap();
    sqlx::query("SELECT partition FROM ferry.partitions ORDER BY partition FOR UPDATE")
        .fetch_all(&mut *locker)
        .await
        .unwrap();

    let url = e._db.url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect(&format!("{url}{sep}options[statement_timeout]=100ms"))
        .await
        .unwrap();
    let ticks = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let hook: ferry_testkit::hooked::Hook = {
        let ticks = ticks.clone();
        Arc::new(move |called| {
            if called == "tick" {
                ticks.fetch_add(1, Ordering::SeqCst);
            }
            Box::pin(async { Ok(()) })
        })
    };
    let store = Hooked::new(PgStore::new(pool), hook);
    let relay = start_on(&e, store, s, vec![route("orders", "order.**")]);

    // Every lease request waits on the locked rows and is cancelled; the
    // relay keeps asking instead of ending.
    eventually(
        "three lease requests while the rows are locked",
        Duration::from_secs(60),
        || {
            assert!(
                !relay.handle.is_finished(),
                "the relay stopped on a statement timeout instead of retrying"
            );
            ticks.load(Ordering::SeqCst) >= 3
        },
    )
    .await;
    assert!(e.sink.delivered("orders").is_empty(), "no lease, no delivery");

    locker.rollback().await.unwrap();
    eventually("the backlog drained", Duration::from_secs(60), || {
        e.sink.delivered("orders").len() >= ids.len()
    })
    .await;
    let report = relay.stop().await;
    assert_complete_and_ordered(&ids, &e.sink.delivered("orders"));
    assert_eq!(report.published, ids.len() as u64);
}
