//! Retention and gauges every store passes, driven through the relay's own
//! store calls and a clock moved forward past the retention windows, so no
//! scenario needs to rewrite a store's timestamps.
//!
//! A store's test file implements [`RetentionHarness`] on top of its
//! [`StoreHarness`] and expands [`retention_conformance!`].

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{Event, EventId, Ownership, Recorded, RelayId, RoutePlan, Store, Transition};
use ferry_store::{Action, Admin, Filter, Gauges, PurgeOptions, Retention, RetentionRules, purge, read_archive};
use serde_json::json;

use crate::store_suite::StoreHarness;

/// What the retention scenarios need beyond [`StoreHarness`]: raw reads of
/// what is left after a purge.
#[async_trait]
pub trait RetentionHarness: StoreHarness<S: Retention + Gauges + Admin> {
    /// The id of every event stored.
    async fn event_ids(&self) -> BTreeSet<EventId>;
    /// How many failed attempts are stored, of any event.
    async fn failures(&self) -> i64;
    /// How many operators' actions (requeues, cancellations) are logged, of
    /// any event.
    async fn admin_actions(&self) -> i64;
}

const DAY: Duration = Duration::from_secs(86_400);

/// Published events go after a week, dead and cancelled ones after a month;
/// `batch_size` events per batch.
pub fn rules(batch_size: usize) -> RetentionRules {
    RetentionRules {
        published: 7 * DAY,
        settled: Some(30 * DAY),
        batch_size,
        pause: Duration::ZERO,
    }
}

fn later(days: i64) -> DateTime<Utc> {
    Utc::now() + chrono::Duration::days(days)
}

async fn own<H: RetentionHarness>(h: &H) -> Ownership {
    let relay = RelayId("r".into());
    let mut owned = h.store().tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    owned
}

/// Routes everything: `order.*` to `orders`, `file.*` to `files`, `audit.*`
/// to `audit`, the rest nowhere (dead, `no route`).
async fn route_all<H: RetentionHarness>(h: &H, o: &Ownership) {
    let events = h.store().fetch_unrouted(o, 1000).await.unwrap();
    let plans: Vec<RoutePlan> = events
        .into_iter()
        .map(|event| {
            let routes = match event.event_type.split('.').next() {
                Some("order") => vec!["orders".to_owned()],
                Some("file") => vec!["files".to_owned()],
                Some("audit") => vec!["audit".to_owned()],
                _ => Vec::new(),
            };
            RoutePlan { event, routes }
        })
        .collect();
    h.store().route(o, &plans, Utc::now()).await.unwrap();
}

/// Records `transition` for `id` on `route`, as the relay would.
async fn settle<H: RetentionHarness>(h: &H, o: &Ownership, route: &str, id: EventId, transition: Transition) {
    let claimed = h.store().claim(o, route, 1000, later(1), &[]).await.unwrap();
    let c = claimed.iter().find(|c| c.event.id == id).expect("claimable");
    let rec = Recorded {
        seq: c.event.seq,
        expected_attempts: c.attempts,
        transition,
    };
    assert_eq!(h.store().record(o, route, &[rec], Utc::now()).await.unwrap(), 1);
}

fn published() -> Transition {
    Transition::Published {
        attempts: 1,
        at: Utc::now(),
    }
}

fn dead(reason: &str) -> Transition {
    Transition::Dead {
        attempts: 1,
        reason: reason.into(),
    }
}

fn set(ids: &[EventId]) -> BTreeSet<EventId> {
    ids.iter().copied().collect()
}

/// Nothing goes before its window or in a dry run; past the windows,
/// published then dead events go, each archived before it is deleted, with
/// its failure history and the operator's requeue of it; pending and
/// held-back events stay.
pub async fn settled_events_go_after_their_window_archived_first<H: RetentionHarness>(h: &H) {
    let published_ids = h
        .enqueue(
            (0..10)
                .map(|i| Event::new("order.created", json!({"n": i})).key("a"))
                .collect(),
        )
        .await;
    let blob = h
        .enqueue(vec![Event::bytes(
            "file.blob.stored",
            vec![0u8, 159, 146, 150],
            "application/octet-stream",
        )])
        .await[0];
    let failing = h
        .enqueue(vec![
            Event::new("order.created", json!({})).key("b"),
            Event::new("order.paid", json!({})).key("b"),
        ])
        .await;
    let pending = h.enqueue(vec![Event::new("order.created", json!({})).key("c")]).await;
    let unroutable = h.enqueue(vec![Event::new("user.account.created", json!({}))]).await;
    let o = own(h).await;
    route_all(h, &o).await;
    for id in &published_ids {
        settle(h, &o, "orders", *id, published()).await;
    }
    settle(h, &o, "files", blob, published()).await;
    // Two rounds of failures, the second after a requeue: attempt numbers
    // repeat, and the archive keeps them in the order they happened.
    let retry = Transition::Retry {
        attempts: 1,
        next_at: Utc::now(),
        error: "first".into(),
    };
    settle(h, &o, "orders", failing[0], retry).await;
    settle(
        h,
        &o,
        "orders",
        failing[0],
        Transition::Dead {
            attempts: 2,
            reason: "second".into(),
        },
    )
    .await;
    let requeue = Action::Requeue {
        include_published: false,
    };
    let only = Filter {
        ids: vec![failing[0]],
        ..Filter::default()
    };
    let plan = h.store().plan(&requeue, &only).await.unwrap();
    assert_eq!(plan.changes.len(), 1, "{plan:?}");
    h.store().apply(&requeue, "test", &plan.changes).await.unwrap();
    settle(h, &o, "orders", failing[0], dead("broker said no")).await;
    let everything = h.event_ids().await;
    assert_eq!(h.admin_actions().await, 1, "the requeue is logged");

    // A dry run counts and deletes nothing; before the window, nothing goes.
    let dry = PurgeOptions {
        dry_run: true,
        ..PurgeOptions::default()
    };
    let report = purge(h.store(), &rules(4), &dry, later(8)).await.unwrap();
    assert_eq!(report.events, 11);
    assert_eq!(h.event_ids().await, everything);
    let report = purge(h.store(), &rules(4), &PurgeOptions::default(), Utc::now())
        .await
        .unwrap();
    assert_eq!(report.events, 0);

    // Past the published window: published events go, archived first.
    let dir = tempfile::tempdir().unwrap();
    let archived = PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let report = purge(h.store(), &rules(4), &archived, later(8)).await.unwrap();
    let mut gone = published_ids.clone();
    gone.push(blob);
    assert_eq!((report.events, report.archived), (11, 11));
    let kept: BTreeSet<EventId> = everything.difference(&set(&gone)).copied().collect();
    assert_eq!(h.event_ids().await, kept);
    let archive = read_archive(&report.archive_file.expect("an archive file")).unwrap();
    assert_eq!(
        archive.iter().map(|e| EventId(e.id)).collect::<BTreeSet<_>>(),
        set(&gone),
        "archived and deleted differ"
    );
    let b = archive.iter().find(|e| e.id == blob.0).unwrap();
    assert_eq!(
        b.payload_bytes(),
        Some(vec![0u8, 159, 146, 150]),
        "bytes archived exactly"
    );
    assert_eq!(b.deliveries[0].state, "published");

    // Past the settled window, dead events go too, with their failure
    // history; what is still pending or held back stays.
    let report = purge(h.store(), &rules(4), &archived, later(31)).await.unwrap();
    assert_eq!(report.events, 2, "the dead event and the one with no route");
    let mut stay = vec![failing[1]];
    stay.extend(&pending);
    assert_eq!(h.event_ids().await, set(&stay));
    let archive = read_archive(&report.archive_file.unwrap()).unwrap();
    let d = archive.iter().find(|e| e.id == failing[0].0).unwrap();
    let history: Vec<(i32, &str, bool)> = d.deliveries[0]
        .failures
        .iter()
        .map(|f| (f.attempt, f.error.as_str(), f.dead))
        .collect();
    assert_eq!(
        history,
        [(1, "first", false), (2, "second", true), (1, "broker said no", true)]
    );
    let actions: Vec<(&str, &str, &str, i32, Option<&str>)> = d.deliveries[0]
        .actions
        .iter()
        .map(|a| {
            (
                a.action.as_str(),
                a.actor.as_str(),
                a.from_state.as_str(),
                a.attempts,
                a.reason.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [("requeue", "test", "dead", 2, None)],
        "the operator's requeue is archived"
    );
    assert!(archive.iter().any(|e| e.id == unroutable[0].0));
    assert_eq!(h.failures().await, 0, "failures go with their events");
    assert_eq!(h.admin_actions().await, 0, "operators' actions go with their events");
}

/// Without a settled window, dead and cancelled events stay however old
/// they get, with the operator's cancellation; with one, they go, the
/// cancellation with them.
pub async fn dead_events_stay_without_a_settled_window<H: RetentionHarness>(h: &H) {
    let ids = h
        .enqueue(
            (0..3)
                .map(|i| Event::new("order.created", json!({})).key(format!("k{i}")))
                .collect(),
        )
        .await;
    let o = own(h).await;
    route_all(h, &o).await;
    for id in &ids {
        settle(h, &o, "orders", *id, dead("unroutable")).await;
    }
    let cancel = Action::Cancel {
        reason: "obsolete".into(),
    };
    let only = Filter {
        ids: vec![ids[0]],
        ..Filter::default()
    };
    let plan = h.store().plan(&cancel, &only).await.unwrap();
    assert_eq!(
        h.store()
            .apply(&cancel, "ops", &plan.changes)
            .await
            .unwrap()
            .changed
            .len(),
        1
    );
    let keep_dead = RetentionRules {
        settled: None,
        ..rules(10)
    };
    let report = purge(h.store(), &keep_dead, &PurgeOptions::default(), later(3650))
        .await
        .unwrap();
    assert_eq!(report.events, 0);
    assert_eq!(h.event_ids().await, set(&ids));
    assert_eq!(h.admin_actions().await, 1, "the cancellation stays with its event");

    let dir = tempfile::tempdir().unwrap();
    let archived = PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let report = purge(h.store(), &rules(10), &archived, later(3650)).await.unwrap();
    assert_eq!(report.events, 3);
    assert_eq!(h.admin_actions().await, 0, "the cancellation goes with its event");
    let archive = read_archive(&report.archive_file.unwrap()).unwrap();
    let c = archive.iter().find(|e| e.id == ids[0].0).unwrap();
    let actions: Vec<(&str, &str, Option<&str>)> = c.deliveries[0]
        .actions
        .iter()
        .map(|a| (a.action.as_str(), a.from_state.as_str(), a.reason.as_deref()))
        .collect();
    assert_eq!(actions, [("cancel", "dead", Some("obsolete"))]);
}

/// A dead head cancelled to unblock its key, whose later event was then
/// published and, a week on, deleted by retention: requeued, the head would
/// reach the destination after that event, so the requeue is refused as if
/// the event were still there, and `--out-of-order` still sends it. Alike
/// for a `(no route)` head, whose key's later event went to any route.
pub async fn a_requeue_after_a_purge_keeps_its_keys_order<H: RetentionHarness>(h: &H) {
    let ids = h
        .enqueue(vec![
            Event::new("order.created", json!({})).key("k"),
            Event::new("order.paid", json!({})).key("k"),
            Event::new("user.account.created", json!({})).key("n"),
            Event::new("order.created", json!({})).key("n"),
            Event::new("order.created", json!({})).key("solo"),
        ])
        .await;
    let [head, later_one, unrouted_head, later_elsewhere, solo] = ids[..] else {
        unreachable!()
    };
    let o = own(h).await;
    route_all(h, &o).await;
    settle(h, &o, "orders", head, dead("rejected")).await;
    let cancel = Action::Cancel {
        reason: "unblock".into(),
    };
    let plan = h.store().plan(&cancel, &only(&[head])).await.unwrap();
    assert_eq!(
        h.store()
            .apply(&cancel, "ops", &plan.changes)
            .await
            .unwrap()
            .changed
            .len(),
        1
    );
    for id in [later_one, later_elsewhere, solo] {
        settle(h, &o, "orders", id, published()).await;
    }
    let keep_dead = RetentionRules {
        settled: None,
        ..rules(10)
    };
    let report = purge(h.store(), &keep_dead, &PurgeOptions::default(), later(8))
        .await
        .unwrap();
    assert_eq!(report.events, 3, "{report:?}");
    assert_eq!(h.event_ids().await, set(&[head, unrouted_head]));

    let requeue = Action::Requeue {
        include_published: false,
    };
    let targets = only(&[head, unrouted_head]);
    let plan = h.store().plan(&requeue, &targets).await.unwrap();
    assert!(plan.changes.is_empty(), "{plan:?}");
    let reasons: Vec<(EventId, &str)> = plan
        .refused
        .iter()
        .map(|r| (r.target.event_id, r.reason.as_str()))
        .collect();
    assert_eq!(reasons.len(), 2, "{plan:?}");
    assert_eq!(reasons[0].0, head);
    assert!(
        reasons[0]
            .1
            .contains("later event of its key was published on this route"),
        "{plan:?}"
    );
    assert_eq!(reasons[1].0, unrouted_head);
    assert!(reasons[1].1.contains("published since (on some route)"), "{plan:?}");
    // Slipped into the targets anyway, they are refused at write time.
    let refused: Vec<_> = plan.refused.iter().map(|r| r.target.clone()).collect();
    let applied = h.store().apply(&requeue, "ops", &refused).await.unwrap();
    assert!(applied.changed.is_empty(), "{applied:?}");
    assert!(
        applied.refused.iter().all(|r| r.reason.contains("out of order")),
        "{applied:?}"
    );

    let anyway = Action::RequeueOutOfOrder {
        include_published: false,
    };
    let plan = h.store().plan(&anyway, &targets).await.unwrap();
    assert_eq!(plan.changes.len(), 2, "{plan:?}");
    assert_eq!(plan.out_of_order.len(), 2, "{plan:?}");
    let applied = h.store().apply(&anyway, "ops", &plan.changes).await.unwrap();
    assert_eq!(applied.changed.len(), 2, "{applied:?}");
}

fn only(ids: &[EventId]) -> Filter {
    Filter {
        ids: ids.to_vec(),
        ..Filter::default()
    }
}

/// The gauges count unrouted events, each state per route, blocked keys and
/// expired leases, with the age of the oldest waiting work.
pub async fn gauges_count_the_work_left<H: RetentionHarness>(h: &H) {
    let empty = h.store().gauges().await.unwrap();
    assert_eq!((empty.unrouted, empty.routes.len(), empty.expired_leases), (0, 0, 0));
    let events = h
        .enqueue(vec![
            Event::new("order.created", json!({})).key("r"),
            Event::new("order.paid", json!({})).key("r"),
            Event::new("order.created", json!({})).key("d"),
            Event::new("order.created", json!({})).key("p"),
            Event::new("audit.entry.written", json!({})).key("c"),
        ])
        .await;
    let g = h.store().gauges().await.unwrap();
    assert_eq!(g.unrouted, 5);
    assert!(g.oldest_unrouted_seconds.is_some());
    let o = own(h).await;
    route_all(h, &o).await;
    assert_eq!(h.store().gauges().await.unwrap().unrouted, 0);
    let retry = Transition::Retry {
        attempts: 1,
        next_at: later(1),
        error: "timeout".into(),
    };
    settle(h, &o, "orders", events[0], retry).await;
    settle(h, &o, "orders", events[2], dead("no")).await;
    // A dead delivery an operator cancels is settled: it blocks nothing.
    settle(h, &o, "audit", events[4], dead("no")).await;
    let cancel = Action::Cancel {
        reason: "obsolete".into(),
    };
    let only = Filter {
        ids: vec![events[4]],
        ..Filter::default()
    };
    let plan = h.store().plan(&cancel, &only).await.unwrap();
    assert_eq!(
        h.store()
            .apply(&cancel, "ops", &plan.changes)
            .await
            .unwrap()
            .changed
            .len(),
        1
    );
    // Committed since the router last ran.
    h.enqueue(
        (0..4)
            .map(|i| Event::new("order.created", json!({})).key(format!("u{i}")))
            .collect(),
    )
    .await;

    let g = h.store().gauges().await.unwrap();
    assert_eq!(g.unrouted, 4);
    assert!(g.oldest_unrouted_seconds.is_some());
    let orders = g.routes.iter().find(|r| r.route == "orders").unwrap();
    assert_eq!(
        (
            orders.pending,
            orders.retrying,
            orders.dead,
            orders.cancelled,
            orders.blocked_keys
        ),
        (3, 1, 1, 0, 2),
        "keys r and d are blocked"
    );
    assert!(orders.oldest_pending_seconds.is_some() && orders.oldest_blocked_seconds.is_some());
    let audit = g.routes.iter().find(|r| r.route == "audit").unwrap();
    assert_eq!((audit.pending, audit.cancelled, audit.blocked_keys), (0, 1, 0));
    assert_eq!(audit.oldest_pending_seconds, None);
    assert_eq!(g.expired_leases, 0);
    h.expire_leases(&RelayId("r".into())).await;
    assert_eq!(h.store().gauges().await.unwrap().expired_leases, 32);
}

/// Expands to one `#[tokio::test]` per retention scenario; `$make` is an
/// async expression giving a fresh [`RetentionHarness`].
#[macro_export]
macro_rules! retention_conformance {
    ($make:expr) => {
        $crate::retention_conformance!(@tests $make;
            settled_events_go_after_their_window_archived_first,
            dead_events_stay_without_a_settled_window,
            a_requeue_after_a_purge_keeps_its_keys_order,
            gauges_count_the_work_left
        );
    };
    (@tests $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let h = $make.await;
                $crate::retention_suite::$name(&h).await;
            }
        )*
    };
}
