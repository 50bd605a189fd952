//! Requeueing a `(no route)` delivery sends its event back to the router,
//! which may now give it a route (a route added since is why it is
//! requeued): a later event of its key that took that route first would
//! reach the consumer before it. Run by each store's admin tests.

use std::time::Duration;

use chrono::Utc;
use ferry_core::{Event, EventId, Glob, NO_ROUTE, Ownership, Recorded, RelayId, Route, Store, Transition};
use ferry_relay::plan_routes;
use ferry_store::{Action, Admin, AdminState, Filter, Target};
use ferry_testkit::admin_suite::AdminHarness;
use serde_json::json;

fn route(name: &str, glob: &str) -> Route {
    Route {
        name: name.into(),
        matcher: Glob::new(glob).unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    }
}

/// Routes every unrouted event with `routes`, as a relay with that config.
async fn route_all<H: AdminHarness>(h: &H, owned: &Ownership, routes: &[Route]) {
    let unrouted = h.store().fetch_unrouted(owned, 100).await.unwrap();
    h.store()
        .route(owned, &plan_routes(routes, unrouted), Utc::now())
        .await
        .unwrap();
}

fn only(ids: &[EventId]) -> Filter {
    Filter {
        ids: ids.to_vec(),
        ..Filter::default()
    }
}

fn ids_of(targets: &[Target]) -> Vec<EventId> {
    targets.iter().map(|t| t.event_id).collect()
}

/// E1 of key `k` matches no route and is dead as `(no route)`; the operator
/// adds a route for its type, and E2 of `k` takes it. Until E2's outcome is
/// known E1's requeue is refused as maybe in flight, once E2 is published
/// as out of order, at plan and at write time; `--out-of-order` sends it.
/// A `(no route)` delivery whose key has nothing later goes back freely.
pub async fn a_no_route_requeue_is_refused_once_a_later_event_of_its_key_went_ahead<H: AdminHarness>(h: &H) {
    let store = h.store();
    let relay = RelayId("router".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let orders = route("orders", "order.**");
    let ids = h
        .enqueue(vec![
            Event::new("audit.login.failed", json!({ "n": 1 })).key("k"),
            Event::new("audit.login.failed", json!({ "n": 2 })).key("solo"),
        ])
        .await;
    let (e1, solo) = (ids[0], ids[1]);
    route_all(h, &owned, std::slice::from_ref(&orders)).await;
    let view = store.show(e1).await.unwrap().unwrap();
    assert_eq!(
        (view.deliveries[0].route.as_str(), view.deliveries[0].state),
        (NO_ROUTE, AdminState::Dead)
    );

    let audit = route("audit", "audit.**");
    let e2 = h
        .enqueue(vec![Event::new("audit.login.failed", json!({ "n": 3 })).key("k")])
        .await[0];
    let requeue = Action::Requeue {
        include_published: false,
    };
    // Not routed yet: a relay may be publishing it straight from the outbox.
    let plan = store.plan(&requeue, &only(&[e1])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    assert!(plan.refused[0].reason.contains("may be in flight"), "{plan:?}");
    // Pending on its new route with nothing before it: the same.
    route_all(h, &owned, &[orders.clone(), audit.clone()]).await;
    let plan = store.plan(&requeue, &only(&[e1])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    assert!(plan.refused[0].reason.contains("may be in flight"), "{plan:?}");

    let now = Utc::now();
    let claimed = store.claim(&owned, "audit", 100, now, &[]).await.unwrap();
    let seq = claimed.iter().find(|c| c.event.id == e2).expect("e2 claimed").event.seq;
    let published = Recorded {
        seq,
        expected_attempts: 0,
        transition: Transition::Published { attempts: 1, at: now },
    };
    assert_eq!(store.record(&owned, "audit", &[published], now).await.unwrap(), 1);

    let plan = store.plan(&requeue, &only(&[e1, solo])).await.unwrap();
    assert_eq!(ids_of(&plan.changes), [solo], "{plan:?}");
    assert_eq!(
        ids_of(&plan.refused.iter().map(|r| r.target.clone()).collect::<Vec<_>>()),
        [e1]
    );
    let reason = &plan.refused[0].reason;
    assert!(
        reason.contains("later event of its key was published") && reason.contains("--out-of-order"),
        "{reason}"
    );
    // Slipped into the targets anyway, it is refused at write time.
    let before = h.snapshot().await;
    let applied = store
        .apply(&requeue, "ops", std::slice::from_ref(&plan.refused[0].target))
        .await
        .unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert!(applied.refused[0].reason.contains("out of order"), "{applied:?}");
    assert_eq!(h.snapshot().await, before, "a refused requeue changed deliveries");
    let applied = store.apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert_eq!(ids_of(&applied.changed), [solo], "{applied:?}");
    assert!(store.show(solo).await.unwrap().unwrap().unrouted);

    // Asked for, it goes back to the router, named as out of order.
    let anyway = Action::RequeueOutOfOrder {
        include_published: false,
    };
    let plan = store.plan(&anyway, &only(&[e1])).await.unwrap();
    assert_eq!(ids_of(&plan.changes), [e1], "{plan:?}");
    assert_eq!(
        ids_of(&plan.out_of_order.iter().map(|r| r.target.clone()).collect::<Vec<_>>()),
        [e1]
    );
    let applied = store.apply(&anyway, "ops", &plan.changes).await.unwrap();
    assert_eq!(ids_of(&applied.changed), [e1], "{applied:?}");
    let view = store.show(e1).await.unwrap().unwrap();
    assert!(view.unrouted && view.deliveries.is_empty(), "{view:?}");
}

/// E1 of key `k` is dead as `(no route)`; a route is added, and E2 of `k`
/// dies on it. Requeued together, E1's checks see E2 dead, neither in
/// flight nor published, but E2 goes out at once on its route while E1
/// waits for the router: E1 is refused, at plan and at write time, unless
/// `--out-of-order`.
pub async fn a_no_route_requeue_is_refused_beside_a_later_event_of_its_key<H: AdminHarness>(h: &H) {
    let store = h.store();
    let relay = RelayId("router".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let orders = route("orders", "order.**");
    let e1 = h
        .enqueue(vec![Event::new("audit.login.failed", json!({ "n": 1 })).key("k")])
        .await[0];
    route_all(h, &owned, std::slice::from_ref(&orders)).await;
    let audit = route("audit", "audit.**");
    let e2 = h
        .enqueue(vec![Event::new("audit.login.failed", json!({ "n": 2 })).key("k")])
        .await[0];
    route_all(h, &owned, &[orders, audit]).await;
    let now = Utc::now();
    let claimed = store.claim(&owned, "audit", 100, now, &[]).await.unwrap();
    let seq = claimed.iter().find(|c| c.event.id == e2).expect("e2 claimed").event.seq;
    let dead = Recorded {
        seq,
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: "rejected".into(),
        },
    };
    assert_eq!(store.record(&owned, "audit", &[dead], now).await.unwrap(), 1);

    let requeue = Action::Requeue {
        include_published: false,
    };
    let plan = store.plan(&requeue, &only(&[e1, e2])).await.unwrap();
    assert_eq!(ids_of(&plan.changes), [e2], "{plan:?}");
    assert_eq!(
        ids_of(&plan.refused.iter().map(|r| r.target.clone()).collect::<Vec<_>>()),
        [e1]
    );
    let reason = &plan.refused[0].reason;
    assert!(
        reason.contains("requeued with it") && reason.contains("--out-of-order"),
        "{reason}"
    );
    // Slipped into the targets anyway, it is refused at write time.
    let both = [plan.refused[0].target.clone(), plan.changes[0].clone()];
    let before = h.snapshot().await;
    let anyway = Action::RequeueOutOfOrder {
        include_published: false,
    };
    let applied = store.apply(&requeue, "ops", &both).await.unwrap();
    assert_eq!(ids_of(&applied.changed), [e2], "{applied:?}");
    assert_eq!(
        ids_of(&applied.refused.iter().map(|r| r.target.clone()).collect::<Vec<_>>()),
        [e1]
    );
    assert!(applied.refused[0].reason.contains("requeued with it"), "{applied:?}");
    let view = store.show(e1).await.unwrap().unwrap();
    assert!(!view.unrouted && view.deliveries[0].route == NO_ROUTE, "{view:?}");
    assert_ne!(h.snapshot().await, before);

    // Asked for, it goes back to the router.
    let plan = store.plan(&anyway, &only(&[e1])).await.unwrap();
    let applied = store.apply(&anyway, "ops", &plan.changes).await.unwrap();
    assert_eq!(ids_of(&applied.changed), [e1], "{applied:?}");
    assert!(store.show(e1).await.unwrap().unwrap().unrouted);
}
