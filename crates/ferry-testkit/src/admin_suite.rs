//! The operator's view every store passes: status, list, show, and the
//! guardrails of requeue and cancel, down to a running relay delivering what
//! was requeued and never publishing what was cancelled.
//!
//! A store's test file implements [`AdminHarness`] on top of its
//! [`StoreHarness`] and expands [`admin_conformance!`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use ferry_core::{
    Claimed, Event, EventId, Glob, NO_ROUTE, Ownership, Recorded, RelayId, RetryPolicy, Route, RoutePlan, Sink,
    SinkError, Store, SystemClock, Transition,
};
use ferry_relay::{Relay, RelayError, RelaySettings, RunReport, plan_routes};
use ferry_store::{Action, Admin, AdminState, BlockedKeys, DeliverySummary, Filter, Gauges, Page, Target};
use serde_json::json;

use crate::mock_sink::MockSink;
use crate::store_suite::StoreHarness;

/// What the admin scenarios need beyond [`StoreHarness`]: raw reads to prove
/// a command changed nothing, and a way to take every lease away.
#[async_trait]
pub trait AdminHarness: StoreHarness<S: Admin + Clone> {
    /// Every delivery row as one line of text, in (seq, route) order.
    async fn snapshot(&self) -> Vec<String>;
    /// Clears every partition's owner and expiry, as if no relay ran.
    async fn release_partitions(&self);
    /// Lets every lease lapse, owner and token kept: as if its relay had
    /// lost the database for longer than the lease and no other had taken
    /// over yet.
    async fn expire_partitions(&self);
    /// How many failed attempts were recorded as the one that made a
    /// delivery dead.
    async fn dead_failures(&self) -> i64;
}

const ROUTE: &str = "orders";

fn orders_route() -> Route {
    Route {
        name: ROUTE.into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "mock".into(),
        destination: "d".into(),
        routing_key: None,
    }
}

/// A store whose `orders` deliveries are, by key: `kp` pending, `kr`
/// retrying (due in an hour), `kd` dead then a later pending one held back
/// by it, `kc` cancelled, `kpub` published; plus one `(no route)` event.
/// The fixture's relay still holds every partition's lease.
struct Fixture<'h, H: AdminHarness> {
    h: &'h H,
    owned: Ownership,
    ids: HashMap<&'static str, EventId>,
}

async fn fixture<H: AdminHarness>(h: &H) -> Fixture<'_, H> {
    let store = h.store();
    let names = ["p1", "r1", "d1", "d2", "c1", "pub1", "nr"];
    let events = vec![
        Event::new("order.created", json!({"n": 1})).key("kp"),
        Event::new("order.item.added", json!({"n": 2})).key("kr"),
        Event::new("order.created", json!({"n": 3}))
            .key("kd")
            .header("tenant", "acme"),
        Event::new("order.paid", json!({"n": 4})).key("kd"),
        Event::new("order.created", json!({"n": 5})).key("kc"),
        Event::new("order.shipped", json!({"n": 6})).key("kpub"),
        Event::new("audit.login.failed", json!({"n": 7})).key("kn"),
    ];
    let ids: HashMap<&'static str, EventId> = names.into_iter().zip(h.enqueue(events).await).collect();

    let relay = RelayId("fixture".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let now = Utc::now();
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &plan_routes(&[orders_route()], unrouted), now)
        .await
        .unwrap();
    let claimed = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    let seq = |name: &str| claimed.iter().find(|c| c.event.id == ids[name]).unwrap().event.seq;
    let outcomes = vec![
        Recorded {
            seq: seq("r1"),
            expected_attempts: 0,
            transition: Transition::Retry {
                attempts: 1,
                next_at: now + chrono::Duration::hours(1),
                error: "broker timeout".into(),
            },
        },
        Recorded {
            seq: seq("d1"),
            expected_attempts: 0,
            transition: Transition::Dead {
                attempts: 1,
                reason: "Payload Too Large for the queue".into(),
            },
        },
        Recorded {
            seq: seq("c1"),
            expected_attempts: 0,
            transition: Transition::Dead {
                attempts: 1,
                reason: "unroutable".into(),
            },
        },
        Recorded {
            seq: seq("pub1"),
            expected_attempts: 0,
            transition: Transition::Published { attempts: 1, at: now },
        },
    ];
    assert_eq!(store.record(&owned, ROUTE, &outcomes, now).await.unwrap(), 4);
    let f = Fixture { h, owned, ids };
    let cancel = Action::Cancel {
        reason: "replaced by a manual fix".into(),
    };
    let plan = store.plan(&cancel, &f.only(&["c1"])).await.unwrap();
    assert_eq!(plan.changes.len(), 1, "{plan:?}");
    store.apply(&cancel, "fixture", &plan.changes).await.unwrap();
    f
}

impl<H: AdminHarness> Fixture<'_, H> {
    fn store(&self) -> &H::S {
        self.h.store()
    }

    fn only(&self, names: &[&str]) -> Filter {
        Filter {
            ids: names.iter().map(|n| self.ids[n]).collect(),
            ..Filter::default()
        }
    }

    fn name_of(&self, id: EventId) -> &'static str {
        self.ids.iter().find(|(_, v)| **v == id).map(|(k, _)| *k).unwrap()
    }

    fn names(&self, targets: &[Target]) -> Vec<&'static str> {
        let mut out: Vec<_> = targets.iter().map(|t| self.name_of(t.event_id)).collect();
        out.sort();
        out
    }

    async fn list_names(&self, filter: Filter) -> Vec<&'static str> {
        let page = Page {
            after: None,
            limit: 100,
        };
        let got = self.store().list(&filter, &page).await.unwrap();
        let mut names: Vec<_> = got.deliveries.iter().map(|d| self.name_of(d.event_id)).collect();
        names.sort();
        names
    }

    async fn state(&self, name: &str, route: &str) -> Option<AdminState> {
        let view = self.store().show(self.ids[name]).await.unwrap().unwrap();
        view.deliveries.iter().find(|d| d.route == route).map(|d| d.state)
    }
}

fn all(states: &[AdminState]) -> Filter {
    Filter {
        states: states.to_vec(),
        ..Filter::default()
    }
}

/// Every state can be listed and filtered; pages walk each delivery once.
pub async fn list_shows_every_state_and_filters<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let list = |filter: Filter| f.list_names(filter);
    assert_eq!(list(all(&[AdminState::Pending])).await, ["d2", "p1"]);
    assert_eq!(list(all(&[AdminState::Retrying])).await, ["r1"]);
    assert_eq!(list(all(&[AdminState::Dead])).await, ["d1", "nr"]);
    assert_eq!(list(all(&[AdminState::Cancelled])).await, ["c1"]);
    assert_eq!(list(all(&[AdminState::Published])).await, ["pub1"]);
    let by = |f: fn(&mut Filter)| {
        let mut filter = Filter::default();
        f(&mut filter);
        filter
    };
    assert_eq!(
        list(by(|f| f.type_glob = Some(Glob::new("order.*").unwrap()))).await,
        ["c1", "d1", "d2", "p1", "pub1"]
    );
    assert_eq!(
        list(by(|f| f.type_glob = Some(Glob::new("**.added").unwrap()))).await,
        ["r1"]
    );
    assert_eq!(list(by(|f| f.key = Some("kd".into()))).await, ["d1", "d2"]);
    assert_eq!(list(by(|f| f.error = Some("too large".into()))).await, ["d1"]);
    assert_eq!(list(by(|f| f.route = Some(NO_ROUTE.into()))).await, ["nr"]);
    assert!(
        list(by(|f| f.since = Some(Utc::now() + chrono::Duration::hours(1))))
            .await
            .is_empty()
    );
    assert_eq!(
        list(by(|f| f.until = Some(Utc::now() + chrono::Duration::hours(1))))
            .await
            .len(),
        7
    );

    // Pages of two walk every delivery once, in outbox order.
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let got = f
            .store()
            .list(&Filter::default(), &Page { after, limit: 2 })
            .await
            .unwrap();
        assert!(got.deliveries.len() <= 2);
        seen.extend(got.deliveries.iter().map(|d| d.seq));
        match got.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 7);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
}

/// `show` has the headers, the payload, each failure and operator action.
pub async fn show_has_headers_failures_and_operator_actions<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let d1 = f.store().show(f.ids["d1"]).await.unwrap().unwrap();
    assert_eq!(d1.headers.get("tenant").map(String::as_str), Some("acme"));
    assert_eq!(d1.payload.as_deref(), Some(r#"{"n":3}"#));
    let orders = &d1.deliveries[0];
    assert_eq!((orders.route.as_str(), orders.state), (ROUTE, AdminState::Dead));
    assert_eq!(orders.failures.len(), 1);
    assert!(orders.failures[0].dead && orders.failures[0].error.contains("Too Large"));

    let c1 = f.store().show(f.ids["c1"]).await.unwrap().unwrap();
    let action = &c1.deliveries[0].actions[0];
    assert_eq!(
        (action.action.as_str(), action.from_state, action.reason.as_deref()),
        ("cancel", AdminState::Dead, Some("replaced by a manual fix"))
    );
    assert!(f.store().show(EventId::new()).await.unwrap().is_none());
}

/// Requeue takes dead, cancelled and (with the flag) published deliveries;
/// a dry run and a refused target change nothing.
pub async fn requeue_refuses_pending_retrying_and_published_and_dry_run_changes_nothing<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let requeue = Action::Requeue {
        include_published: false,
    };
    let before = h.snapshot().await;
    let plan = f.store().plan(&requeue, &Filter::default()).await.unwrap();
    assert_eq!(f.names(&plan.changes), ["c1", "d1", "nr"]);
    let refused: Vec<Target> = plan.refused.iter().map(|r| r.target.clone()).collect();
    assert_eq!(f.names(&refused), ["d2", "p1", "pub1", "r1"]);
    assert!(plan.refused.iter().all(|r| !r.reason.is_empty()));
    assert_eq!(h.snapshot().await, before, "planning (a dry run) changed deliveries");

    // A pending delivery slipped into the targets is refused at write time.
    let p1 = plan.refused.iter().find(|r| r.target.event_id == f.ids["p1"]).unwrap();
    let applied = f
        .store()
        .apply(&requeue, "ops", std::slice::from_ref(&p1.target))
        .await
        .unwrap();
    assert!(applied.changed.is_empty());
    assert!(applied.refused[0].reason.contains("in flight"), "{applied:?}");
    assert_eq!(h.snapshot().await, before);

    let applied = f.store().apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert_eq!(f.names(&applied.changed), ["c1", "d1", "nr"]);
    assert_eq!(f.state("d1", ROUTE).await, Some(AdminState::Pending));
    assert_eq!(f.state("c1", ROUTE).await, Some(AdminState::Pending));
    // The no-route event goes back to the router, for a route added since.
    let nr = f.store().show(f.ids["nr"]).await.unwrap().unwrap();
    assert!(nr.unrouted && nr.deliveries.is_empty(), "{nr:?}");

    // With the flag, a published delivery may go again.
    let again = Action::Requeue {
        include_published: true,
    };
    let plan = f.store().plan(&again, &f.only(&["pub1"])).await.unwrap();
    f.store().apply(&again, "ops", &plan.changes).await.unwrap();
    assert_eq!(f.state("pub1", ROUTE).await, Some(AdminState::Pending));
}

/// A plan is applied later (after a confirmation, batch by batch): a
/// delivery someone else moved on meanwhile is refused with both states,
/// never overwritten. One operator's cancel is not undone by another's
/// requeue planned before it, nor a requeue by a cancel.
pub async fn apply_refuses_a_delivery_changed_since_the_plan<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let requeue = Action::Requeue {
        include_published: false,
    };
    let cancel = Action::Cancel {
        reason: "handled by hand".into(),
    };
    let requeue_plan = f.store().plan(&requeue, &f.only(&["d1"])).await.unwrap();
    assert_eq!(f.names(&requeue_plan.changes), ["d1"]);
    let cancel_plan = f.store().plan(&cancel, &f.only(&["d1"])).await.unwrap();
    assert_eq!(f.names(&cancel_plan.changes), ["d1"]);
    let applied = f.store().apply(&cancel, "bob", &cancel_plan.changes).await.unwrap();
    assert_eq!(f.names(&applied.changed), ["d1"]);
    let before = h.snapshot().await;
    let applied = f.store().apply(&requeue, "alice", &requeue_plan.changes).await.unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert_eq!(applied.refused.len(), 1, "{applied:?}");
    let reason = &applied.refused[0].reason;
    assert!(
        reason.contains("changed since") && reason.contains("dead then, cancelled now"),
        "{reason}"
    );
    assert_eq!(applied.refused[0].target.state, AdminState::Cancelled);
    assert_eq!(h.snapshot().await, before, "a refused requeue changed deliveries");
    assert_eq!(f.state("d1", ROUTE).await, Some(AdminState::Cancelled));

    // A relay moves a delivery on too: a cancel planned while it was
    // retrying is refused once its last attempt made it dead.
    h.release_partitions().await;
    let cancel_plan = f.store().plan(&cancel, &f.only(&["r1"])).await.unwrap();
    assert_eq!(f.names(&cancel_plan.changes), ["r1"]);
    let relay = RelayId("other".into());
    let mut owned = f.store().tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let last_attempt = Recorded {
        seq: cancel_plan.changes[0].seq,
        expected_attempts: 1,
        transition: Transition::Dead {
            attempts: 2,
            reason: "rejected".into(),
        },
    };
    let now = Utc::now();
    assert_eq!(f.store().record(&owned, ROUTE, &[last_attempt], now).await.unwrap(), 1);
    let applied = f.store().apply(&cancel, "bob", &cancel_plan.changes).await.unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert!(
        applied.refused[0].reason.contains("retrying then, dead now"),
        "{applied:?}"
    );
    assert_eq!(f.state("r1", ROUTE).await, Some(AdminState::Dead));
}

/// Cancel refuses what a relay may be publishing; cancelling a dead head
/// unblocks its key.
pub async fn cancel_refuses_what_a_relay_may_hold_and_unblocks_the_key<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let cancel = Action::Cancel {
        reason: "obsolete".into(),
    };
    let before = h.snapshot().await;
    let plan = f.store().plan(&cancel, &all(&[])).await.unwrap();
    // p1 is due in a leased partition: a relay may be publishing it.
    assert_eq!(f.names(&plan.changes), ["d1", "d2", "nr", "r1"]);
    let refused: Vec<Target> = plan.refused.iter().map(|r| r.target.clone()).collect();
    assert_eq!(f.names(&refused), ["c1", "p1", "pub1"]);
    let p1 = plan.refused.iter().find(|r| r.target.event_id == f.ids["p1"]).unwrap();
    assert!(p1.reason.contains("in flight"), "{}", p1.reason);
    assert_eq!(h.snapshot().await, before);

    // Cancelling the dead head lets the later event of its key be claimed.
    let now = Utc::now();
    let claimable = |claimed: Vec<Claimed>| claimed.iter().any(|c| c.event.id == f.ids["d2"]);
    assert!(!claimable(
        f.store().claim(&f.owned, ROUTE, 100, now, &[]).await.unwrap()
    ));
    let head = plan.changes.iter().find(|t| t.event_id == f.ids["d1"]).unwrap();
    let applied = f
        .store()
        .apply(&cancel, "ops", std::slice::from_ref(head))
        .await
        .unwrap();
    assert_eq!(applied.changed.len(), 1);
    assert!(claimable(
        f.store().claim(&f.owned, ROUTE, 100, now, &[]).await.unwrap()
    ));

    // Now unblocked and due under a live lease, d2 is refused at write time.
    let d2 = plan.changes.iter().find(|t| t.event_id == f.ids["d2"]).unwrap();
    let applied = f.store().apply(&cancel, "ops", std::slice::from_ref(d2)).await.unwrap();
    assert!(applied.refused[0].reason.contains("in flight"), "{applied:?}");

    // Once no relay holds the partitions, pending deliveries can be cancelled.
    h.release_partitions().await;
    let plan = f.store().plan(&cancel, &f.only(&["p1", "d2"])).await.unwrap();
    let applied = f.store().apply(&cancel, "ops", &plan.changes).await.unwrap();
    assert_eq!(f.names(&applied.changed), ["d2", "p1"]);
}

/// A relay whose lease lapsed (it lost the database for longer than the
/// lease) may still be publishing what it claimed, and may come back with
/// its outcome. Cancel takes such a delivery, since no live lease holds it,
/// and revokes the lapsed lease in the same transaction: the late outcome is
/// refused, so it cannot overwrite a requeue that followed (marking the
/// event dead again, or published with no new delivery), even once the
/// relay holds the partition again.
pub async fn a_cancel_under_a_lapsed_lease_revokes_it_and_the_late_outcome_is_refused<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let now = Utc::now();
    let claimed = f.store().claim(&f.owned, ROUTE, 100, now, &[]).await.unwrap();
    let p1 = claimed.iter().find(|c| c.event.id == f.ids["p1"]).unwrap().event.seq;
    h.expire_partitions().await;
    let cancel = Action::Cancel {
        reason: "obsolete".into(),
    };
    let plan = f.store().plan(&cancel, &f.only(&["p1"])).await.unwrap();
    let applied = f.store().apply(&cancel, "ops", &plan.changes).await.unwrap();
    assert_eq!(f.names(&applied.changed), ["p1"], "{applied:?}");
    let requeue = Action::Requeue {
        include_published: false,
    };
    let plan = f.store().plan(&requeue, &f.only(&["p1"])).await.unwrap();
    let applied = f.store().apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert_eq!(f.names(&applied.changed), ["p1"], "{applied:?}");
    let late = [Recorded {
        seq: p1,
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: "rejected by the broker".into(),
        },
    }];
    assert_eq!(
        f.store().record(&f.owned, ROUTE, &late, now).await.unwrap(),
        0,
        "the lapsed holder's outcome overwrote the requeue"
    );
    // Its relay takes the partition again, under a new token.
    f.store()
        .tick(&f.owned.relay, Duration::from_secs(300), &[])
        .await
        .unwrap();
    assert_eq!(f.store().record(&f.owned, ROUTE, &late, now).await.unwrap(), 0);
    assert_eq!(f.state("p1", ROUTE).await, Some(AdminState::Pending));
}

/// `changes_since` (what `ferry tail` follows) lists outcomes only.
pub async fn changes_since_lists_outcomes_not_new_deliveries<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let changes = f
        .store()
        .changes_since(Utc::now() - chrono::Duration::hours(1), None, 100)
        .await
        .unwrap();
    let mut names: Vec<_> = changes.iter().map(|c| f.name_of(c.event_id)).collect();
    names.sort();
    assert_eq!(names, ["c1", "d1", "nr", "pub1", "r1"]);
    let published = changes.iter().find(|c| c.state == AdminState::Published).unwrap();
    assert!(published.latency_seconds().unwrap() >= 0.0);
    assert!(
        f.store()
            .changes_since(Utc::now() + chrono::Duration::hours(1), None, 100)
            .await
            .unwrap()
            .is_empty()
    );
}

/// Outcomes recorded together share their change time. A follower paging
/// through them a page at a time, from its last change, must see every one.
pub async fn changes_since_pages_through_changes_that_share_a_time<H: AdminHarness>(h: &H) {
    let f = fixture(h).await;
    let mut from = Utc::now() - chrono::Duration::hours(1);
    let mut after: Option<(i64, String)> = None;
    let mut names = Vec::new();
    loop {
        let page = f
            .store()
            .changes_since(from, after.as_ref().map(|(s, r)| (*s, r.as_str())), 1)
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        names.push(f.name_of(last.event_id));
        from = last.updated_at;
        after = Some((last.seq, last.route.clone()));
        assert!(names.len() <= 5, "the same change came back: {names:?}");
    }
    names.sort();
    assert_eq!(names, ["c1", "d1", "nr", "pub1", "r1"]);
}

fn plan_orders(events: Vec<ferry_core::UnroutedEvent>) -> Vec<RoutePlan> {
    events
        .into_iter()
        .map(|event| {
            let routes = if event.event_type.starts_with("order.") {
                vec![ROUTE.to_string()]
            } else {
                vec![]
            };
            RoutePlan { event, routes }
        })
        .collect()
}

/// Status counts each state, waiting work, blocked keys, dead reasons and
/// leases. A dead `(no route)` delivery holds no key (no relay claims on
/// that name), so it blocks nothing, in the status or the gauges.
pub async fn status_counts_states_and_blocked_keys<H: AdminHarness>(h: &H)
where
    H::S: Gauges,
{
    let store = h.store();
    h.enqueue(vec![
        Event::new("order.created", json!({})).key("a"),
        Event::new("order.created", json!({})).key("a"),
        Event::new("user.created", json!({})).key("u"),
        Event::new("order.created", json!({})).key("b"),
        Event::new("order.created", json!({})).key("c"),
    ])
    .await;
    let before = store.status().await.unwrap();
    assert_eq!(before.unrouted, 5);
    assert!(before.oldest_unrouted_seconds.is_some_and(|s| s >= 0.0));
    let relay = RelayId("r".into());
    let mut owned = store.tick(&relay, Duration::from_secs(30), &[]).await.unwrap();
    owned.relay = relay;
    let events = store.fetch_unrouted(&owned, 10).await.unwrap();
    store.route(&owned, &plan_orders(events), Utc::now()).await.unwrap();
    let c = store.claim(&owned, ROUTE, 10, Utc::now(), &[]).await.unwrap();
    let dead = Recorded {
        seq: c[0].event.seq,
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: "unroutable".into(),
        },
    };
    // Key a: its head dead. Key b: published. Key c: due, under this lease.
    let published = Recorded {
        seq: c[2].event.seq,
        expected_attempts: 0,
        transition: Transition::Published {
            attempts: 1,
            at: Utc::now(),
        },
    };
    store
        .record(&owned, ROUTE, &[dead, published], Utc::now())
        .await
        .unwrap();
    let s = store.status().await.unwrap();
    assert_eq!(s.unrouted, 0);
    let orders = s.routes.iter().find(|r| r.route == ROUTE).unwrap();
    assert_eq!((orders.pending, orders.dead, orders.published), (2, 1, 1));
    assert_eq!(orders.published_last_hour, 1);
    // a's second event is held back behind its dead head: not in flight.
    assert_eq!(orders.in_flight, 1);
    assert!(orders.oldest_pending_seconds.is_some_and(|a| a >= 0.0), "{orders:?}");
    assert_eq!(
        s.routes
            .iter()
            .find(|r| r.route == NO_ROUTE)
            .unwrap()
            .oldest_pending_seconds,
        None,
        "a route with nothing pending has no oldest pending event"
    );
    assert!(
        s.leases[0].oldest_lease_seconds.is_some_and(|a| a >= 0.0),
        "{:?}",
        s.leases
    );
    assert_eq!(orders.blocked.keys, 1);
    assert_eq!(orders.blocked.waiting, 1);
    assert!(orders.blocked.oldest_since.is_some());
    let none = s.routes.iter().find(|r| r.route == NO_ROUTE).unwrap();
    assert_eq!(none.dead, 1);
    assert_eq!(
        none.blocked,
        BlockedKeys::default(),
        "a (no route) delivery holds no key"
    );
    let gauges = store.gauges().await.unwrap();
    let none = gauges.routes.iter().find(|r| r.route == NO_ROUTE).unwrap();
    assert_eq!((none.dead, none.blocked_keys), (1, 0), "{none:?}");
    let orders = gauges.routes.iter().find(|r| r.route == ROUTE).unwrap();
    assert_eq!(orders.blocked_keys, 1);
    assert!(s.dead_reasons.iter().any(|d| d.reason.contains("no route")));
    assert!(s.dead_reasons.iter().any(|d| d.reason == "unroutable"));
    assert!(s.needs_attention());
    assert_eq!(s.leases.len(), 1);
    assert_eq!(s.leases[0].partitions, 32);
    assert!(s.leases[0].expires_in_seconds.is_some_and(|e| e > 0.0 && e <= 30.0));
    assert_eq!(s.partitions, 32);
    assert_eq!(h.dead_failures().await, 1, "the failure is in the history");
}

/// A key is blocked since its head first failed, not since its last retry:
/// each failed attempt rewrites the delivery's `updated_at`, and the age
/// read from it fell back to the retry interval at every attempt, so a key
/// blocked for hours read as blocked for minutes.
pub async fn a_blocked_keys_age_runs_from_its_heads_first_failure<H: AdminHarness>(h: &H)
where
    H::S: Gauges,
{
    let store = h.store();
    h.enqueue(vec![
        Event::new("order.created", json!({"n": 1})).key("kb"),
        Event::new("order.paid", json!({"n": 2})).key("kb"),
    ])
    .await;
    let relay = RelayId("aging".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let now = Utc::now();
    let first_failure = now - chrono::Duration::minutes(40);
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &plan_routes(&[orders_route()], unrouted), first_failure)
        .await
        .unwrap();
    let head = store.claim(&owned, ROUTE, 1, first_failure, &[]).await.unwrap()[0]
        .event
        .seq;
    let retry = |attempts: u32, at| Recorded {
        seq: head,
        expected_attempts: attempts - 1,
        transition: Transition::Retry {
            attempts,
            next_at: at + chrono::Duration::seconds(1),
            error: "broker timeout".into(),
        },
    };
    // Failed 40 minutes ago, and again every 10 minutes since.
    for (attempts, minutes_ago) in [(1, 40), (2, 30), (3, 20), (4, 10), (5, 0)] {
        let at = now - chrono::Duration::minutes(minutes_ago);
        assert_eq!(
            store.record(&owned, ROUTE, &[retry(attempts, at)], at).await.unwrap(),
            1
        );
    }
    let s = store.status().await.unwrap();
    let orders = s.routes.iter().find(|r| r.route == ROUTE).unwrap();
    assert_eq!((orders.blocked.keys, orders.blocked.waiting), (1, 1));
    let since = orders.blocked.oldest_since.expect("a blocked key");
    assert!(
        (since - first_failure).num_seconds().abs() <= 5,
        "blocked since {since}, first failure {first_failure}"
    );
    let gauges = store.gauges().await.unwrap();
    let age = gauges
        .routes
        .iter()
        .find(|r| r.route == ROUTE)
        .unwrap()
        .oldest_blocked_seconds;
    assert!(age.is_some_and(|a| (a - 2400.0).abs() < 60.0), "{age:?}");
}

/// A relay that holds every partition, and `events` routed to `orders` and
/// claimed by it: each event's id and seq, in outbox order.
async fn claimed<H: AdminHarness>(h: &H, events: Vec<Event>) -> (Ownership, Vec<(EventId, i64)>) {
    let store = h.store();
    let ids = h.enqueue(events).await;
    let relay = RelayId("keyed".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let now = Utc::now();
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &plan_routes(&[orders_route()], unrouted), now)
        .await
        .unwrap();
    let claimed = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    let seqs = ids
        .iter()
        .map(|id| (*id, claimed.iter().find(|c| c.event.id == *id).unwrap().event.seq))
        .collect();
    (owned, seqs)
}

fn dead_at(seq: i64, reason: &str) -> Recorded {
    Recorded {
        seq,
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: reason.into(),
        },
    }
}

fn ids_of(targets: &[Target]) -> Vec<EventId> {
    targets.iter().map(|t| t.event_id).collect()
}

fn only_ids(ids: &[EventId]) -> Filter {
    Filter {
        ids: ids.to_vec(),
        ..Filter::default()
    }
}

/// An operator cancels a dead head to unblock its key, the key's later
/// events are published, and later the head is requeued: it would reach
/// the consumer after them. That requeue is refused, at plan and at write
/// time, saying why, unless the operator asks for it out of order. A later
/// event still waiting unheld (maybe in flight), or not routed yet with
/// nothing to queue behind, refuses it too.
pub async fn a_requeue_that_would_break_its_keys_order_is_refused_unless_asked_for<H: AdminHarness>(h: &H) {
    let store = h.store();
    let events = (1..=3)
        .map(|n| Event::new("order.updated", json!({ "n": n })).key("ko"))
        .collect();
    let (owned, keyed) = claimed(h, events).await;
    let [(e1, s1), (e2, s2), _] = keyed[..] else {
        panic!("{keyed:?}")
    };
    let now = Utc::now();
    assert_eq!(
        store
            .record(&owned, ROUTE, &[dead_at(s1, "rejected")], now)
            .await
            .unwrap(),
        1
    );
    let requeue = Action::Requeue {
        include_published: false,
    };
    // Dead, with the rest of its key held back behind it: the normal case.
    let plan = store.plan(&requeue, &only_ids(&[e1])).await.unwrap();
    assert_eq!(ids_of(&plan.changes), [e1], "{plan:?}");

    // Cancelled to unblock the key; the key's next event is published.
    let cancel = Action::Cancel {
        reason: "unblock".into(),
    };
    let plan = store.plan(&cancel, &only_ids(&[e1])).await.unwrap();
    store.apply(&cancel, "ops", &plan.changes).await.unwrap();
    let next = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    assert!(next.iter().any(|c| c.event.seq == s2), "{next:?}");
    let published = Recorded {
        seq: s2,
        expected_attempts: 0,
        transition: Transition::Published { attempts: 1, at: now },
    };
    assert_eq!(store.record(&owned, ROUTE, &[published], now).await.unwrap(), 1);

    let before = h.snapshot().await;
    let plan = store.plan(&requeue, &only_ids(&[e1])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
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
    let applied = store
        .apply(&requeue, "ops", std::slice::from_ref(&plan.refused[0].target))
        .await
        .unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert!(applied.refused[0].reason.contains("out of order"), "{applied:?}");
    assert_eq!(h.snapshot().await, before, "a refused requeue changed deliveries");

    // Sending e2 again: e3 waits with nothing holding it back, so a relay
    // may be publishing it now.
    let again = Action::Requeue {
        include_published: true,
    };
    let plan = store.plan(&again, &only_ids(&[e2])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    assert!(plan.refused[0].reason.contains("may be in flight"), "{plan:?}");

    // Asked for, it goes, and the plan says it is out of order.
    let anyway = Action::RequeueOutOfOrder {
        include_published: false,
    };
    let plan = store.plan(&anyway, &only_ids(&[e1])).await.unwrap();
    assert_eq!(ids_of(&plan.changes), [e1], "{plan:?}");
    assert_eq!(
        ids_of(&plan.out_of_order.iter().map(|r| r.target.clone()).collect::<Vec<_>>()),
        [e1]
    );
    assert!(plan.out_of_order[0].reason.contains("published"), "{plan:?}");
    let applied = store.apply(&anyway, "ops", &plan.changes).await.unwrap();
    assert_eq!(ids_of(&applied.changed), [e1], "{applied:?}");
    let view = store.show(e1).await.unwrap().unwrap();
    assert_eq!(view.deliveries[0].state, AdminState::Pending);

    // A later event of a cancelled head's key not routed yet, with nothing
    // pending or dead to queue behind, may be published straight away.
    let (owned, keyed) = claimed(h, vec![Event::new("order.updated", json!({})).key("ku")]).await;
    let (u1, seq) = keyed[0];
    store
        .record(&owned, ROUTE, &[dead_at(seq, "rejected")], now)
        .await
        .unwrap();
    let plan = store.plan(&cancel, &only_ids(&[u1])).await.unwrap();
    store.apply(&cancel, "ops", &plan.changes).await.unwrap();
    h.enqueue(vec![Event::new("order.updated", json!({})).key("ku")]).await;
    let plan = store.plan(&requeue, &only_ids(&[u1])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    assert!(plan.refused[0].reason.contains("may be in flight"), "{plan:?}");
}

/// Dead deliveries of a key, each holding back the rest, requeue together
/// in outbox order without any flag, and so does a dead head whose later
/// delivery waits to retry behind it; the key then goes in its order.
pub async fn dead_deliveries_of_a_key_requeue_together_in_its_order<H: AdminHarness>(h: &H) {
    let store = h.store();
    let events = ["kq", "kq", "kq", "kg", "kg", "kg"]
        .iter()
        .map(|key| Event::new("order.updated", json!({})).key(*key))
        .collect();
    let (owned, keyed) = claimed(h, events).await;
    let seq = |i: usize| keyed[i].1;
    let now = Utc::now();
    let retry = Recorded {
        seq: seq(4),
        expected_attempts: 0,
        transition: Transition::Retry {
            attempts: 1,
            next_at: now + chrono::Duration::hours(1),
            error: "broker timeout".into(),
        },
    };
    let outcomes = [
        dead_at(seq(0), "rejected"),
        dead_at(seq(1), "rejected"),
        dead_at(seq(3), "rejected"),
        retry,
    ];
    assert_eq!(store.record(&owned, ROUTE, &outcomes, now).await.unwrap(), 4);
    let requeue = Action::Requeue {
        include_published: false,
    };
    let plan = store.plan(&requeue, &dead_only()).await.unwrap();
    assert!(plan.refused.is_empty() && plan.out_of_order.is_empty(), "{plan:?}");
    let want = [keyed[0].0, keyed[1].0, keyed[3].0];
    assert_eq!(ids_of(&plan.changes), want, "in outbox order");
    let applied = store.apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert!(applied.refused.is_empty(), "{applied:?}");
    assert_eq!(ids_of(&applied.changed).len(), 3);

    // kq goes in its order; kg's head goes, its retry waits for its time.
    let claimed = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    let order: Vec<EventId> = claimed.iter().map(|c| c.event.id).collect();
    assert_eq!(order, [keyed[0].0, keyed[1].0, keyed[2].0, keyed[3].0], "{claimed:?}");
}

/// A key's published deliveries sent again together (`--include-published`)
/// go in their order, the last one last: none is refused for the later
/// ones, which are sent again after it. One left out is a later event the
/// earlier ones would arrive after, and refuses them.
pub async fn published_deliveries_of_a_key_replay_together_in_its_order<H: AdminHarness>(h: &H) {
    let store = h.store();
    let events = (1..=4)
        .map(|n| Event::new("order.updated", json!({ "n": n })).key("kr"))
        .collect();
    let (owned, keyed) = claimed(h, events).await;
    let now = Utc::now();
    let published: Vec<Recorded> = keyed
        .iter()
        .map(|(_, seq)| Recorded {
            seq: *seq,
            expected_attempts: 0,
            transition: Transition::Published { attempts: 1, at: now },
        })
        .collect();
    assert_eq!(store.record(&owned, ROUTE, &published, now).await.unwrap(), 4);
    let replay = Action::Requeue {
        include_published: true,
    };
    let ids: Vec<EventId> = keyed.iter().map(|(id, _)| *id).collect();

    // The first three without the fourth: it was published after them.
    let plan = store.plan(&replay, &only_ids(&ids[..3])).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    assert_eq!(plan.refused.len(), 3, "{plan:?}");

    let plan = store.plan(&replay, &only_ids(&ids)).await.unwrap();
    assert!(plan.refused.is_empty() && plan.out_of_order.is_empty(), "{plan:?}");
    assert_eq!(ids_of(&plan.changes), ids, "in outbox order");
    let applied = store.apply(&replay, "ops", &plan.changes).await.unwrap();
    assert!(applied.refused.is_empty(), "{applied:?}");
    assert_eq!(ids_of(&applied.changed), ids);
    let claimed = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    let order: Vec<EventId> = claimed.iter().map(|c| c.event.id).collect();
    assert_eq!(order, ids, "{claimed:?}");
}

/// `--error` matches "in any case", beyond ASCII too, in every store:
/// SQLite's `lower()` folds ASCII only, so "échec" missed "Échec".
pub async fn the_error_filter_matches_in_any_case_beyond_ascii<H: AdminHarness>(h: &H) {
    let store = h.store();
    let events = ["ka", "kb"]
        .iter()
        .map(|key| Event::new("order.updated", json!({})).key(*key))
        .collect();
    let (owned, keyed) = claimed(h, events).await;
    let outcomes = [
        dead_at(keyed[0].1, "Échec de livraison : ÉCHÉANCE DÉPASSÉE"),
        dead_at(keyed[1].1, "broker timeout"),
    ];
    store.record(&owned, ROUTE, &outcomes, Utc::now()).await.unwrap();
    for text in ["échec", "ÉCHEC DE", "échéance dépassée", "Livraison"] {
        let filter = Filter {
            error: Some(text.into()),
            ..Filter::default()
        };
        let page = Page { after: None, limit: 10 };
        let listed = store.list(&filter, &page).await.unwrap();
        let ids: Vec<EventId> = listed.deliveries.iter().map(|d| d.event_id).collect();
        assert_eq!(ids, [keyed[0].0], "list --error {text:?}");
        let requeue = Action::Requeue {
            include_published: false,
        };
        let plan = store.plan(&requeue, &filter).await.unwrap();
        assert_eq!(ids_of(&plan.changes), [keyed[0].0], "requeue --error {text:?}");
    }
}

/// Polls `cond` until it holds or `within` passes.
async fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<RunReport, RelayError>>,
);

/// A relay publishing `orders` to `sink`, until the sender fires.
fn start_relay<S: Store + Clone>(store: &S, sink: &Arc<MockSink>) -> Running {
    let settings = RelaySettings {
        lease: Duration::from_secs(3),
        retry: RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(100),
            jitter: 0.2,
        },
        // Long: an operator's action must wake the relay by notification,
        // not wait for a poll.
        poll_interval: Duration::from_secs(600),
        ..RelaySettings::new("admin-test")
    };
    let sinks: HashMap<String, Arc<dyn Sink>> = [("mock".to_string(), sink.clone() as Arc<dyn Sink>)].into();
    let relay = Relay::new(store.clone(), SystemClock, settings, vec![orders_route()], sinks).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    (stop, running)
}

/// Waits until `dead` lists something, and returns it.
async fn wait_for_dead<S: Admin>(store: &S, dead: &Filter) -> Vec<DeliverySummary> {
    for _ in 0..500 {
        let now = store
            .list(dead, &Page { after: None, limit: 10 })
            .await
            .unwrap()
            .deliveries;
        if !now.is_empty() {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no delivery went dead");
}

/// Five `hot` events, the first refused by the sink (so it goes dead and
/// holds the rest of its key back), and twenty of other keys.
async fn hot_and_cold<H: AdminHarness>(h: &H, sink: &MockSink) -> (Vec<EventId>, Vec<EventId>) {
    let keyed: Vec<Event> = (0..5)
        .map(|i| Event::new("order.item.created", json!({ "i": i })).key("hot"))
        .collect();
    let others: Vec<Event> = (0..20)
        .map(|i| Event::new("order.item.created", json!({ "o": i })).key(format!("k{i}")))
        .collect();
    let hot = h.enqueue(keyed).await;
    let cold = h.enqueue(others).await;
    let poison = hot[0];
    // Refused before sending, so the rest of its key is held back strictly.
    sink.refuse_when(move |ev| (ev.id == poison).then(|| SinkError::permanent("payload too large")));
    (hot, cold)
}

fn dead_only() -> Filter {
    all(&[AdminState::Dead])
}

/// A dead event an operator requeues is delivered by a running relay, once,
/// with the rest of its key after it in commit order.
pub async fn a_requeued_dead_event_is_delivered_by_a_running_relay_in_key_order<H: AdminHarness>(h: &H) {
    let store = h.store();
    let sink = Arc::new(MockSink::new());
    let (hot, cold) = hot_and_cold(h, &sink).await;
    let poison = hot[0];
    let (stop, running) = start_relay(store, &sink);

    // Other keys flow; the hot key is held back behind its dead head.
    eventually("other keys delivered", Duration::from_secs(20), || {
        cold.iter().all(|id| sink.delivered_ids(ROUTE).contains(id))
    })
    .await;
    let dead = dead_only();
    let dead_now = wait_for_dead(store, &dead).await;
    assert_eq!(dead_now.iter().map(|d| d.event_id).collect::<Vec<_>>(), [poison]);
    assert!(hot.iter().all(|id| !sink.delivered_ids(ROUTE).contains(id)));

    // The broker accepts it now; an operator requeues.
    sink.refuse_when(|_| None);
    let requeue = Action::Requeue {
        include_published: false,
    };
    let plan = store.plan(&requeue, &dead).await.unwrap();
    assert_eq!(plan.changes.len(), 1);
    let applied = store.apply(&requeue, "ops", &plan.changes).await.unwrap();
    assert_eq!(applied.changed.len(), 1);

    eventually("the hot key delivered", Duration::from_secs(20), || {
        hot.iter().all(|id| sink.delivered_ids(ROUTE).contains(id))
    })
    .await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    // Each event exactly once, and the hot key in its commit order.
    let delivered = sink.delivered_ids(ROUTE);
    assert_eq!(
        delivered.len(),
        hot.len() + cold.len(),
        "lost or duplicated: {delivered:?}"
    );
    let hot_order: Vec<EventId> = delivered.iter().copied().filter(|id| hot.contains(id)).collect();
    assert_eq!(hot_order, hot);
    // The failed attempt survives the fresh attempt count.
    let view = store.show(poison).await.unwrap().unwrap();
    let orders = &view.deliveries[0];
    assert_eq!(orders.state, AdminState::Published);
    assert_eq!(orders.failures.len(), 1);
    assert_eq!(orders.actions[0].action, "requeue");
}

/// Cancelling a dead head under a running relay lets its key flow; a cancel
/// racing the relay never cancels what it delivers, nor loses the rest.
pub async fn cancelling_a_dead_head_lets_its_key_flow_and_never_cancels_what_is_delivered<H: AdminHarness>(h: &H) {
    let store = h.store();
    let sink = Arc::new(MockSink::new());
    let (hot, cold) = hot_and_cold(h, &sink).await;
    let (stop, running) = start_relay(store, &sink);
    let dead = dead_only();
    wait_for_dead(store, &dead).await;
    let cancel = Action::Cancel {
        reason: "superseded".into(),
    };
    let plan = store.plan(&cancel, &dead).await.unwrap();
    assert_eq!(plan.changes.len(), 1);
    store.apply(&cancel, "ops", &plan.changes).await.unwrap();

    // Racing the relay that now publishes the rest of the key: whatever
    // cancel changes must stay undelivered, whatever it refuses must arrive.
    let rest = Filter {
        key: Some("hot".into()),
        states: vec![AdminState::Pending],
        ..Filter::default()
    };
    let plan = store.plan(&cancel, &rest).await.unwrap();
    let applied = store.apply(&cancel, "ops", &plan.changes).await.unwrap();
    let cancelled: Vec<EventId> = applied.changed.iter().map(|t| t.event_id).collect();
    let expected: Vec<EventId> = cold
        .iter()
        .chain(&hot[1..])
        .copied()
        .filter(|id| !cancelled.contains(id))
        .collect();
    eventually("the rest of the hot key delivered", Duration::from_secs(20), || {
        expected.iter().all(|id| sink.delivered_ids(ROUTE).contains(id))
    })
    .await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    let delivered = sink.delivered_ids(ROUTE);
    assert_eq!(delivered.len(), expected.len(), "lost or duplicated: {delivered:?}");
    assert!(!delivered.contains(&hot[0]), "the cancelled head was published");
    assert!(
        cancelled.iter().all(|id| !delivered.contains(id)),
        "a delivery was cancelled under a relay that published it"
    );
    let hot_order: Vec<EventId> = delivered.iter().copied().filter(|id| hot.contains(id)).collect();
    let want: Vec<EventId> = hot[1..].iter().copied().filter(|id| !cancelled.contains(id)).collect();
    assert_eq!(hot_order, want);
}

/// Expands to one `#[tokio::test]` per admin scenario; `$make` is an async
/// expression giving a fresh [`AdminHarness`].
#[macro_export]
macro_rules! admin_conformance {
    ($make:expr) => {
        $crate::admin_conformance!(@tests $make;
            list_shows_every_state_and_filters,
            show_has_headers_failures_and_operator_actions,
            requeue_refuses_pending_retrying_and_published_and_dry_run_changes_nothing,
            a_requeue_that_would_break_its_keys_order_is_refused_unless_asked_for,
            dead_deliveries_of_a_key_requeue_together_in_its_order,
            published_deliveries_of_a_key_replay_together_in_its_order,
            the_error_filter_matches_in_any_case_beyond_ascii,
            cancel_refuses_what_a_relay_may_hold_and_unblocks_the_key,
            apply_refuses_a_delivery_changed_since_the_plan,
            a_cancel_under_a_lapsed_lease_revokes_it_and_the_late_outcome_is_refused,
            changes_since_lists_outcomes_not_new_deliveries,
            changes_since_pages_through_changes_that_share_a_time,
            status_counts_states_and_blocked_keys,
            a_blocked_keys_age_runs_from_its_heads_first_failure,
            a_requeued_dead_event_is_delivered_by_a_running_relay_in_key_order,
            cancelling_a_dead_head_lets_its_key_flow_and_never_cancels_what_is_delivered
        );
    };
    (@tests $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let h = $make.await;
                $crate::admin_suite::$name(&h).await;
            }
        )*
    };
}
