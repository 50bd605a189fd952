//! The admin view of the PostgreSQL store against a real database: the
//! shared admin suite (listing, history, status, and the guardrails of
//! requeue and cancel, down to a running relay).

use ferry_testkit::pg_store::PgHarness;

ferry_testkit::admin_conformance!(PgHarness::create());

#[path = "shared/no_route.rs"]
mod no_route;

#[tokio::test]
async fn a_no_route_requeue_is_refused_once_a_later_event_of_its_key_went_ahead() {
    let h = PgHarness::create().await;
    no_route::a_no_route_requeue_is_refused_once_a_later_event_of_its_key_went_ahead(&h).await;
}

#[tokio::test]
async fn a_no_route_requeue_is_refused_beside_a_later_event_of_its_key() {
    let h = PgHarness::create().await;
    no_route::a_no_route_requeue_is_refused_beside_a_later_event_of_its_key(&h).await;
}

/// A relay records a later event of a key as published while an operator
/// requeues the key's cancelled head: the requeue waits on the partition's
/// lock until the outcome commits, then judges what its key published
/// from that one state (refused: published after it), rather than reading
/// what was published and writing its change in two states, between which
/// the later event could be published unseen.
#[tokio::test]
async fn a_requeue_waits_for_an_outcome_being_recorded_on_its_keys_partition() {
    use std::time::Duration;

    use chrono::Utc;
    use ferry_core::{Event, Glob, Recorded, RelayId, Route, Store, Transition};
    use ferry_store::{Action, Admin, Filter};
    use ferry_testkit::store_suite::StoreHarness;
    use serde_json::json;

    let h = PgHarness::create().await;
    let store = h.store();
    let ids = h
        .enqueue(vec![
            Event::new("order.updated", json!({ "n": 1 })).key("kx"),
            Event::new("order.updated", json!({ "n": 2 })).key("kx"),
        ])
        .await;
    let relay = RelayId("relay".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let route = Route {
        name: "orders".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    };
    let now = Utc::now();
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &ferry_relay::plan_routes(&[route], unrouted), now)
        .await
        .unwrap();
    let claimed = store.claim(&owned, "orders", 100, now, &[]).await.unwrap();
    let seq = |i: usize| claimed.iter().find(|c| c.event.id == ids[i]).unwrap().event.seq;
    let dead = Recorded {
        seq: seq(0),
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: "rejected".into(),
        },
    };
    assert_eq!(store.record(&owned, "orders", &[dead], now).await.unwrap(), 1);
    let only_head = Filter {
        ids: vec![ids[0]],
        ..Filter::default()
    };
    let cancel = Action::Cancel {
        reason: "unblock".into(),
    };
    let plan = store.plan(&cancel, &only_head).await.unwrap();
    store.apply(&cancel, "ops", &plan.changes).await.unwrap();
    let requeue = Action::Requeue {
        include_published: false,
    };
    let plan = store.plan(&requeue, &only_head).await.unwrap();
    let head = plan.refused[0].target.clone();

    // The relay's outcome for the later event, recorded but not committed.
    let mut relay_tx = h.pool.begin().await.unwrap();
    let recorded: i64 = sqlx::query_scalar(
        "SELECT ferry.record_outcomes($1, $2, $3, 'orders', ARRAY[$4::bigint], ARRAY[0], ARRAY['published'],
                                      ARRAY[1], ARRAY[NULL::timestamptz], ARRAY[NULL::text],
                                      ARRAY[$5::timestamptz], $5)",
    )
    .bind(&owned.relay.0)
    .bind(owned.partitions())
    .bind(owned.tokens())
    .bind(seq(1))
    .bind(now)
    .fetch_one(&mut *relay_tx)
    .await
    .unwrap();
    assert_eq!(recorded, 1);

    let applying = tokio::spawn({
        let store = store.clone();
        async move { store.apply(&requeue, "ops", &[head]).await.unwrap() }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&h.pool)
        .await
        .unwrap();
        if waiting > 0 || applying.is_finished() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the requeue neither waited nor finished"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay_tx.commit().await.unwrap();
    let applied = applying.await.unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert!(
        applied.refused[0]
            .reason
            .contains("later event of its key was published"),
        "{applied:?}"
    );
}

/// A requeue of old dead events reads every delivery after the oldest one
/// to keep their keys' order. It used to do that holding the partition
/// locks, which every relay's lease renewal waits for: relays stalled past
/// their lease. Held up in those reads (here by a lock on a table they
/// read), a requeue now lets a relay's tick through.
#[tokio::test]
async fn a_relay_tick_is_not_held_up_by_a_requeue_reading_its_keys() {
    use std::time::Duration;

    use chrono::Utc;
    use ferry_core::{Event, Glob, Recorded, RelayId, Route, Store, Transition};
    use ferry_store::{Action, Admin, Filter};
    use ferry_testkit::store_suite::StoreHarness;
    use serde_json::json;

    let h = PgHarness::create().await;
    let store = h.store();
    let ids = h
        .enqueue(vec![Event::new("order.updated", json!({ "n": 1 })).key("kx")])
        .await;
    let relay = RelayId("relay".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay.clone();
    let route = Route {
        name: "orders".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    };
    let now = Utc::now();
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &ferry_relay::plan_routes(&[route], unrouted), now)
        .await
        .unwrap();
    let claimed = store.claim(&owned, "orders", 100, now, &[]).await.unwrap();
    let dead = Recorded {
        seq: claimed[0].event.seq,
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: "rejected".into(),
        },
    };
    assert_eq!(store.record(&owned, "orders", &[dead], now).await.unwrap(), 1);
    let requeue = Action::Requeue {
        include_published: false,
    };
    let filter = Filter {
        ids: vec![ids[0]],
        ..Filter::default()
    };
    let plan = store.plan(&requeue, &filter).await.unwrap();
    assert_eq!(plan.changes.len(), 1, "{plan:?}");

    let mut holder = h.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ferry.unrouted IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let applying = tokio::spawn({
        let store = store.clone();
        async move { store.apply(&requeue, "ops", &plan.changes).await.unwrap() }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&h.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(!applying.is_finished(), "the requeue did not wait for the table");
        assert!(tokio::time::Instant::now() < deadline, "the requeue never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A lease renewal that had to wait would fail here rather than hang.
    let mut conn = h.pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '5s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let renewed: Vec<(i32,)> =
        sqlx::query_as("SELECT partition FROM ferry.relay_tick($1, interval '300 seconds', '{}'::int[])")
            .bind(&relay.0)
            .fetch_all(&mut *conn)
            .await
            .expect("the relay's tick waited for the requeue");
    assert!(!renewed.is_empty());
    sqlx::query("RESET lock_timeout").execute(&mut *conn).await.unwrap();
    drop(conn);
    holder.rollback().await.unwrap();
    let applied = applying.await.unwrap();
    assert_eq!(applied.changed.len(), 1, "{applied:?}");
}
