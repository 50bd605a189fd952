//! The conformance suite every outbox store passes against the real database.
//!
//! A store's test file implements [`StoreHarness`] (a fresh database per
//! call) and expands [`store_conformance!`] to get one test per scenario.

use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use ferry_core::{
    Claimed, DirectBatch, DirectOutcome, DirectRecord, Event, EventId, NO_ROUTE, Ownership, Recorded, RelayId,
    RetryPolicy, RoutePlan, SinkError, Store, Transition, decide,
};
use serde_json::json;

/// What the suite needs beyond the [`Store`] trait: a way to produce events
/// through the store's own producer API, and to make leases lapse.
#[async_trait]
pub trait StoreHarness: Send + Sync {
    type S: Store;
    fn store(&self) -> &Self::S;
    /// Enqueues `events` in one transaction through the producer API.
    async fn enqueue(&self, events: Vec<Event>) -> Vec<EventId>;
    /// Makes every lease `relay` holds expire now.
    async fn expire_leases(&self, relay: &RelayId);
    /// Dead and pending-retry deliveries of `route`, for assertions.
    async fn delivery_state(&self, route: &str, id: EventId) -> Option<(String, u32)>;
    /// How many failed attempts the history holds for `route` and `id`.
    async fn failure_history(&self, route: &str, id: EventId) -> i64;
}

const LEASE: Duration = Duration::from_secs(30);

fn relay(name: &str) -> RelayId {
    RelayId(name.to_owned())
}

async fn own<H: StoreHarness>(h: &H, name: &str) -> Ownership {
    let mut o = h.store().tick(&relay(name), LEASE, &[]).await.expect("tick");
    o.relay = relay(name);
    o
}

fn order(n: usize, key: &str) -> Event {
    Event::new("order.item.created", json!({ "n": n })).key(key)
}

async fn route_all<H: StoreHarness>(h: &H, o: &Ownership, routes: &[&str]) -> u64 {
    route_all_at(h, o, routes, Utc::now()).await
}

/// [`route_all`] by a relay whose clock reads `now`.
async fn route_all_at<H: StoreHarness>(h: &H, o: &Ownership, routes: &[&str], now: chrono::DateTime<Utc>) -> u64 {
    let events = h.store().fetch_unrouted(o, 10_000).await.expect("fetch_unrouted");
    let plans = events
        .into_iter()
        .map(|event| {
            let routes = if event.event_type.starts_with("order.") {
                routes.iter().map(|r| r.to_string()).collect()
            } else {
                Vec::new()
            };
            RoutePlan { event, routes }
        })
        .collect::<Vec<_>>();
    h.store().route(o, &plans, now).await.expect("route")
}

async fn claim<H: StoreHarness>(h: &H, o: &Ownership, route: &str) -> Vec<Claimed> {
    h.store().claim(o, route, 10_000, Utc::now(), &[]).await.expect("claim")
}

fn outcome(c: &Claimed, result: Result<(), SinkError>) -> Recorded {
    let policy = RetryPolicy {
        base_delay: Duration::from_secs(3600),
        ..RetryPolicy::default()
    };
    Recorded {
        seq: c.event.seq,
        expected_attempts: c.attempts,
        transition: decide(c.attempts, &result, Utc::now(), &policy, 0.0),
    }
}

/// One relay alone takes every partition; a second one gets a fair share
/// once the first hands partitions back; a takeover bumps the fencing token.
pub async fn leases_are_shared_and_fenced<H: StoreHarness>(h: &H) {
    let a = own(h, "a").await;
    assert_eq!(
        a.leases.len() as u32,
        a.total_partitions,
        "a lone relay leases every partition"
    );
    assert!(a.total_partitions >= 2);
    let b = own(h, "b").await;
    assert!(b.leases.is_empty(), "nothing is free yet");
    assert_eq!(b.live_relays, 2);
    let fair = b.fair_share();
    let release = a.leases[fair..].to_vec();
    let a2 = h.store().tick(&relay("a"), LEASE, &release).await.unwrap();
    assert_eq!(a2.leases.len(), fair);
    let b2 = own(h, "b").await;
    assert_eq!(b2.leases.len(), a.leases.len() - fair, "b takes what a released");
    for (p, _) in &b2.leases {
        assert!(!a2.owns(*p), "partition {p} has two owners");
    }
    // b's leases lapse; a takes them over with new tokens.
    h.expire_leases(&relay("b")).await;
    let a3 = h.store().tick(&relay("a"), LEASE, &[]).await.unwrap();
    assert_eq!(
        a3.leases.len() as u32,
        a.total_partitions,
        "a takes the expired partitions"
    );
    for (p, token) in &b2.leases {
        let now = a3.leases.iter().find(|(q, _)| q == p).unwrap().1;
        assert!(now > *token, "takeover of {p} must bump the token");
    }
    h.store().leave(&relay("a"), &a3.leases).await.unwrap();
    let c = own(h, "c").await;
    assert_eq!(c.leases.len() as u32, a.total_partitions, "leave hands everything back");
}

/// A hand-back names the token each partition was held under, and frees a
/// partition only while that token holds: one taken again since, under a
/// new token, stays held. The release checked the owner alone, so a
/// hand-back that reached the database late (one the relay gave up on,
/// delivered when a silent connection recovered) freed a partition the
/// relay had taken again and was working, for another relay to take.
pub async fn a_release_under_an_old_lease_token_leaves_the_partition_held<H: StoreHarness>(h: &H) {
    let a = own(h, "a").await;
    assert!(a.leases.len() >= 2);
    let (p, t1) = a.leases[0];
    // a hands p back and, alone and below its fair share, takes it again
    // in the same tick: under a new token.
    let a2 = h.store().tick(&relay("a"), LEASE, &[(p, t1)]).await.unwrap();
    let t2 = a2.leases.iter().find(|(q, _)| *q == p).expect("p taken again").1;
    assert!(t2 > t1, "p was not released under its token ({t1}): still {t2}");
    let q = a2.leases[1];
    // b joins: a is above its fair share now, and takes back nothing it
    // frees.
    assert!(own(h, "b").await.leases.is_empty(), "nothing is free yet");
    // The first hand-back again, arriving late, with one made now.
    let a3 = h.store().tick(&relay("a"), LEASE, &[(p, t1), q]).await.unwrap();
    assert!(
        a3.leases.contains(&(p, t2)),
        "a release under the old token {t1} freed partition {p}, held under {t2}: {:?}",
        a3.leases
    );
    assert!(!a3.owns(q.0), "a release under the current token was not applied");
    let b = own(h, "b").await;
    assert_eq!(b.partitions(), vec![q.0], "b takes what a freed, and only that");
}

/// A relay's own lease that had expired is renewed under a new token. A
/// relay keeping its `relay.id` across a restart waits its old leases out,
/// then renews them: under the old token, a hand-back the earlier run gave
/// up on, reaching the database late, freed a partition the new run was
/// working, for another relay to take and publish beside it.
pub async fn a_renewed_expired_lease_is_fenced_against_an_old_release<H: StoreHarness>(h: &H) {
    let a = own(h, "a").await;
    assert!(a.leases.len() >= 2);
    let (p, t1) = a.leases[0];
    // The first run's leases lapse; the next run, under the same id, ticks
    // handing nothing back and renews them.
    h.expire_leases(&relay("a")).await;
    let a2 = h.store().tick(&relay("a"), LEASE, &[]).await.unwrap();
    assert_eq!(a2.partitions(), a.partitions(), "a renews its own leases");
    let t2 = a2.leases.iter().find(|(q, _)| *q == p).expect("p renewed").1;
    assert!(t2 > t1, "an expired lease of {p} was renewed under its old token {t1}");
    // b joins: a is above its fair share now, and takes back nothing it
    // frees.
    assert!(own(h, "b").await.leases.is_empty(), "nothing is free yet");
    // The first run's hand-back, arriving late.
    let a3 = h.store().tick(&relay("a"), LEASE, &[(p, t1)]).await.unwrap();
    assert!(
        a3.leases.contains(&(p, t2)),
        "a release under the token {t1} of a lapsed lease freed partition {p}, renewed under {t2}: {:?}",
        a3.leases
    );
    assert_eq!(a3.leases, a2.leases, "a renewal of live leases keeps their tokens");
    assert!(!own(h, "b").await.owns(p), "b took a partition a still holds");
}

/// A leave frees a lease only under the token it names. A relay's
/// hand-back at shutdown that reached the database late (given up on, its
/// relay.id restarted, the lease renewed under a new token since) freed
/// every lease of that id, for another relay to take while the new run
/// still worked them.
pub async fn a_late_leave_frees_no_lease_renewed_since<H: StoreHarness>(h: &H) {
    let a = own(h, "a").await;
    // The first run's leases lapse; the next run renews them.
    h.expire_leases(&relay("a")).await;
    let a2 = h.store().tick(&relay("a"), LEASE, &[]).await.unwrap();
    assert_eq!(a2.partitions(), a.partitions());
    // The first run's leave, arriving late.
    h.store().leave(&relay("a"), &a.leases).await.unwrap();
    assert!(
        own(h, "b").await.leases.is_empty(),
        "a late leave under the lapsed tokens {:?} freed leases renewed under {:?}",
        a.leases,
        a2.leases
    );
    let a3 = h.store().tick(&relay("a"), LEASE, &[]).await.unwrap();
    assert_eq!(a3.leases, a2.leases, "the renewed leases are still a's");
    // The next run's own leave hands them back.
    h.store().leave(&relay("a"), &a3.leases).await.unwrap();
    assert_eq!(
        own(h, "b").await.partitions(),
        a.partitions(),
        "leave hands back what it names"
    );
}

/// Events route once, in outbox order; unmatched events are dead `no route`;
/// deliveries come back per route in seq order with their payloads.
pub async fn routing_and_claiming_in_order<H: StoreHarness>(h: &H) {
    let mut events: Vec<Event> = (0..30).map(|i| order(i, &format!("k{}", i % 3))).collect();
    events.push(Event::new("user.account.created", json!({})).key("u1"));
    let ids = h.enqueue(events).await;
    let o = own(h, "a").await;
    assert_eq!(route_all(h, &o, &["r1", "r2"]).await, 31);
    assert_eq!(route_all(h, &o, &["r1", "r2"]).await, 0, "routing happens once");
    for route in ["r1", "r2"] {
        let c = claim(h, &o, route).await;
        assert_eq!(c.len(), 30);
        let seqs: Vec<i64> = c.iter().map(|c| c.event.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "claims come in seq order");
        assert_eq!(c.iter().map(|c| c.event.id).collect::<Vec<_>>(), ids[..30].to_vec());
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&c[7].event.payload).unwrap(),
            json!({"n": 7})
        );
        assert_eq!(c[7].event.key.as_deref(), Some("k1"));
        assert_eq!(c[0].attempts, 0);
        // Deliveries whose outcomes are still being recorded are skipped.
        let skip: Vec<i64> = seqs.iter().copied().step_by(2).collect();
        let rest = h
            .store()
            .claim(&o, route, 10_000, Utc::now(), &skip)
            .await
            .expect("claim");
        let rest: Vec<i64> = rest.iter().map(|c| c.event.seq).collect();
        let expected: Vec<i64> = seqs.iter().copied().filter(|s| !skip.contains(s)).collect();
        assert_eq!(rest, expected, "claim skips the excluded seqs and only those");
    }
    let dead = h.delivery_state(NO_ROUTE, ids[30]).await;
    assert_eq!(
        dead.map(|d| d.0),
        Some("dead".to_owned()),
        "no route is dead, never dropped"
    );
}

/// A failed delivery holds back later deliveries of its key on its route
/// only; other keys and other routes flow; publishing it releases the key.
pub async fn a_failure_blocks_only_its_key_and_route<H: StoreHarness>(h: &H) {
    let events = vec![
        order(0, "a"),
        order(1, "b"),
        order(2, "a"),
        order(3, "b"),
        order(4, "a"),
    ];
    let ids = h.enqueue(events).await;
    let o = own(h, "a").await;
    route_all(h, &o, &["r1", "r2"]).await;
    let c = claim(h, &o, "r1").await;
    assert_eq!(c.len(), 5);
    // a's first event fails; everything else succeeds.
    let rec: Vec<Recorded> = c
        .iter()
        .map(|c| {
            outcome(
                c,
                if c.event.id == ids[0] {
                    Err(SinkError::transient("down"))
                } else {
                    Ok(())
                },
            )
        })
        .collect();
    // Pretend only the failure and b's events were published, as a relay would
    // after holding a's later events back.
    let (failed, rest): (Vec<_>, Vec<_>) = rec.into_iter().partition(|r| r.seq == c[0].event.seq);
    let b_only: Vec<Recorded> = rest
        .into_iter()
        .filter(|r| r.seq == c[1].event.seq || r.seq == c[3].event.seq)
        .collect();
    assert_eq!(h.store().record(&o, "r1", &failed, Utc::now()).await.unwrap(), 1);
    assert_eq!(h.store().record(&o, "r1", &b_only, Utc::now()).await.unwrap(), 2);
    assert!(
        claim(h, &o, "r1").await.is_empty(),
        "a's later events wait behind its failure"
    );
    assert_eq!(claim(h, &o, "r2").await.len(), 5, "another route is not held back");
    let due = h.store().next_due(&o, "r1", Utc::now()).await.unwrap();
    assert!(due.is_some_and(|d| d > Utc::now()), "the retry time is reported");
    // Once due, the failed one comes first and alone for its key.
    let later = Utc::now() + chrono::Duration::hours(2);
    let c2 = h.store().claim(&o, "r1", 100, later, &[]).await.unwrap();
    assert_eq!(c2.iter().map(|c| c.event.id).collect::<Vec<_>>(), vec![ids[0]]);
    assert_eq!(c2[0].attempts, 1);
    let ok: Vec<Recorded> = c2.iter().map(|c| outcome(c, Ok(()))).collect();
    assert_eq!(h.store().record(&o, "r1", &ok, Utc::now()).await.unwrap(), 1);
    let c3 = claim(h, &o, "r1").await;
    assert_eq!(
        c3.iter().map(|c| c.event.id).collect::<Vec<_>>(),
        vec![ids[2], ids[4]],
        "the key moves on in order"
    );
}

/// A dead delivery keeps its key blocked; it stays dead with its reason.
pub async fn dead_blocks_its_key<H: StoreHarness>(h: &H) {
    let ids = h.enqueue(vec![order(0, "a"), order(1, "a"), order(2, "c")]).await;
    let o = own(h, "a").await;
    route_all(h, &o, &["r1"]).await;
    let c = claim(h, &o, "r1").await;
    let rec = vec![outcome(&c[0], Err(SinkError::permanent("unroutable")))];
    h.store().record(&o, "r1", &rec, Utc::now()).await.unwrap();
    assert_eq!(h.delivery_state("r1", ids[0]).await, Some(("dead".into(), 1)));
    let later = Utc::now() + chrono::Duration::days(30);
    let c2 = h.store().claim(&o, "r1", 100, later, &[]).await.unwrap();
    assert_eq!(
        c2.iter().map(|c| c.event.id).collect::<Vec<_>>(),
        vec![ids[2]],
        "only the other key flows"
    );
}

/// A delivery never attempted (new, parked behind its key, requeued) is due
/// at once, whatever clock wrote its next attempt time: only failed and dead
/// deliveries hold a key back, so were it not due, a later delivery of its
/// key written by a slower clock would go first. Here a relay whose clock
/// runs ten minutes ahead routes a key's first event and one on time its
/// second; a requeue, which writes the database's time, is the same case.
pub async fn a_never_attempted_delivery_is_due_whatever_clock_wrote_it<H: StoreHarness>(h: &H) {
    let first = h.enqueue(vec![order(0, "a")]).await;
    let o = own(h, "a").await;
    route_all_at(h, &o, &["r1"], Utc::now() + chrono::Duration::minutes(10)).await;
    let second = h.enqueue(vec![order(1, "a")]).await;
    route_all(h, &o, &["r1"]).await;
    let claimed = claim(h, &o, "r1").await;
    assert_eq!(
        claimed.iter().map(|c| c.event.id).collect::<Vec<_>>(),
        vec![first[0], second[0]],
        "the key's events in order, the first one due"
    );
    // Nothing waits for a time: no failed delivery is pending.
    assert_eq!(h.store().next_due(&o, "r1", Utc::now()).await.unwrap(), None);
}

/// Outcomes are refused under a lost lease and for a delivery that moved on.
pub async fn stale_outcomes_are_refused<H: StoreHarness>(h: &H) {
    h.enqueue(vec![order(0, "a"), order(1, "b")]).await;
    let a = own(h, "a").await;
    route_all(h, &a, &["r1"]).await;
    let c = claim(h, &a, "r1").await;
    assert_eq!(c.len(), 2);
    // a's leases lapse and b takes over.
    h.expire_leases(&relay("a")).await;
    let b = own(h, "b").await;
    assert!(!b.is_empty());
    let rec: Vec<Recorded> = c.iter().map(|c| outcome(c, Ok(()))).collect();
    assert_eq!(
        h.store().record(&a, "r1", &rec, Utc::now()).await.unwrap(),
        0,
        "a lost its lease"
    );
    // b records; a stale attempt count is refused too.
    let cb = claim(h, &b, "r1").await;
    assert_eq!(cb.len(), 2, "b sees the deliveries a could not record");
    let mut stale = outcome(&cb[0], Ok(()));
    stale.expected_attempts += 1;
    assert_eq!(h.store().record(&b, "r1", &[stale], Utc::now()).await.unwrap(), 0);
    let rec: Vec<Recorded> = cb.iter().map(|c| outcome(c, Ok(()))).collect();
    assert_eq!(h.store().record(&b, "r1", &rec, Utc::now()).await.unwrap(), 2);
    assert_eq!(
        h.store().record(&b, "r1", &rec, Utc::now()).await.unwrap(),
        0,
        "recording twice is refused"
    );
    assert!(claim(h, &b, "r1").await.is_empty());
}

/// A relay that holds no lease sees no work and can write none: at each
/// step, work a leaseholder sees and may write is refused to it.
pub async fn no_lease_no_work<H: StoreHarness>(h: &H) {
    h.enqueue(vec![order(0, "a"), order(1, "b")]).await;
    let empty = Ownership {
        relay: relay("x"),
        ..Ownership::default()
    };
    let o = own(h, "a").await;
    let unrouted = h.store().fetch_unrouted(&o, 100).await.unwrap();
    assert_eq!(unrouted.len(), 2);
    assert!(h.store().fetch_unrouted(&empty, 100).await.unwrap().is_empty());
    let routes = ["r1".to_string(), "r2".to_string()];
    let direct_batch = h.store().fetch_direct(&empty, 100, &routes, &[], &[]).await.unwrap();
    assert!(direct_batch.is_none_or(|b| b.events.is_empty()));

    let now = Utc::now();
    let plans: Vec<RoutePlan> = unrouted
        .iter()
        .map(|event| RoutePlan {
            event: event.clone(),
            routes: vec!["r1".into()],
        })
        .collect();
    assert_eq!(
        h.store().route(&empty, &plans, now).await.unwrap(),
        0,
        "routed without a lease"
    );
    let seqs: Vec<i64> = unrouted.iter().map(|e| e.seq).collect();
    let records: Vec<DirectRecord> = unrouted
        .iter()
        .map(|e| DirectRecord {
            seq: e.seq,
            key: e.key.clone(),
            route: "r1".into(),
            outcome: DirectOutcome::Published { at: now },
        })
        .collect();
    if h.store()
        .fetch_direct(&o, 100, &routes, &[], &[])
        .await
        .unwrap()
        .is_some()
    {
        assert_eq!(
            h.store().settle(&empty, &seqs, &records, now).await.unwrap(),
            0,
            "settled without a lease"
        );
    }
    assert_eq!(h.store().fetch_unrouted(&o, 100).await.unwrap().len(), 2);

    assert_eq!(h.store().route(&o, &plans, now).await.unwrap(), 2);
    let claimed = claim(h, &o, "r1").await;
    assert_eq!(claimed.len(), 2);
    assert!(claim(h, &empty, "r1").await.is_empty());
    let rec: Vec<Recorded> = claimed.iter().map(|c| outcome(c, Ok(()))).collect();
    assert_eq!(
        h.store().record(&empty, "r1", &rec, now).await.unwrap(),
        0,
        "recorded without a lease"
    );
    assert_eq!(h.store().record(&o, "r1", &rec, now).await.unwrap(), 2);
}

/// Retries get the attempt count and error; max attempts makes a delivery dead.
pub async fn retries_count_attempts<H: StoreHarness>(h: &H) {
    let ids = h.enqueue(vec![order(0, "a")]).await;
    let o = own(h, "a").await;
    route_all(h, &o, &["r1"]).await;
    let policy = RetryPolicy {
        max_attempts: 3,
        base_delay: Duration::from_secs(1),
        ..RetryPolicy::default()
    };
    let mut now = Utc::now();
    for attempt in 1..=3u32 {
        let c = h.store().claim(&o, "r1", 10, now, &[]).await.unwrap();
        assert_eq!(c.len(), 1, "attempt {attempt}");
        assert_eq!(c[0].attempts, attempt - 1);
        let t = decide(c[0].attempts, &Err(SinkError::transient("timeout")), now, &policy, 0.0);
        let rec = Recorded {
            seq: c[0].event.seq,
            expected_attempts: c[0].attempts,
            transition: t.clone(),
        };
        assert_eq!(h.store().record(&o, "r1", &[rec], now).await.unwrap(), 1);
        if let Transition::Retry { next_at, .. } = t {
            now = next_at;
        }
    }
    assert_eq!(h.delivery_state("r1", ids[0]).await, Some(("dead".into(), 3)));
}

/// A sleeping relay is woken by a commit in one of its partitions.
pub async fn a_sleeping_relay_is_notified<H: StoreHarness>(h: &H) {
    let o = own(h, "a").await;
    let mut source = h.store().listen().await.expect("listen");
    h.store().set_sleeping(&relay("a"), true).await.unwrap();
    h.enqueue(vec![order(0, "a")]).await;
    let got = tokio::time::timeout(Duration::from_secs(10), source.wait())
        .await
        .expect("a notification");
    let wake = got.expect("listener ok").expect("a partition");
    assert!(matches!(wake, ferry_core::Wake::Events(_)), "{wake:?}");
    assert!(o.owns(wake.partition()));
    assert_eq!(h.store().fetch_unrouted(&o, 10).await.unwrap().len(), 1);
}

async fn fetch_direct<H: StoreHarness>(h: &H, o: &Ownership, down: &[&str], exclude: &[i64]) -> DirectBatch {
    let routes = ["r1".to_string(), "r2".to_string()];
    let down: Vec<String> = down.iter().map(|r| r.to_string()).collect();
    h.store()
        .fetch_direct(o, 10_000, &routes, &down, exclude)
        .await
        .expect("fetch_direct")
        .expect("the store has a direct path")
}

fn direct(seq: i64, key: &str, route: &str, outcome: DirectOutcome) -> DirectRecord {
    DirectRecord {
        seq,
        key: Some(key.to_owned()),
        route: route.to_owned(),
        outcome,
    }
}

/// Direct delivery: new events come with their payloads in outbox order;
/// settling writes their delivery rows once; a failed or parked delivery
/// holds its key back on its route (and only there) for the events after it;
/// a route asked about as down is reported busy while it has pending rows.
pub async fn direct_delivery_settles_once_and_holds_keys<H: StoreHarness>(h: &H) {
    let ids = h.enqueue(vec![order(0, "a"), order(1, "b"), order(2, "c")]).await;
    let o = own(h, "a").await;
    let batch = fetch_direct(h, &o, &["r1"], &[]).await;
    assert_eq!(batch.events.iter().map(|c| c.event.id).collect::<Vec<_>>(), ids);
    assert_eq!(batch.events[1].event.payload.as_ref(), br#"{"n":1}"#);
    assert!(batch.held.iter().all(Vec::is_empty) && batch.held.len() == 3);
    assert!(batch.busy.is_empty(), "nothing pending yet");
    let seqs: Vec<i64> = batch.events.iter().map(|c| c.event.seq).collect();
    let skipped = fetch_direct(h, &o, &[], &seqs[..2]).await;
    assert_eq!(skipped.events.len(), 1, "excluded events are skipped");

    let now = Utc::now();
    let records = vec![
        direct(seqs[0], "a", "r1", DirectOutcome::Published { at: now }),
        direct(seqs[0], "a", "r2", DirectOutcome::Published { at: now }),
        direct(
            seqs[1],
            "b",
            "r1",
            DirectOutcome::Retry {
                next_at: now + chrono::Duration::hours(1),
                error: "down".into(),
            },
        ),
        direct(seqs[1], "b", "r2", DirectOutcome::Published { at: now }),
        direct(seqs[2], "c", "r1", DirectOutcome::Parked),
        direct(seqs[2], "c", "r2", DirectOutcome::Published { at: now }),
    ];
    assert_eq!(h.store().settle(&o, &seqs, &records, now).await.unwrap(), 3);
    assert_eq!(
        h.store().settle(&o, &seqs, &records, now).await.unwrap(),
        0,
        "settled once"
    );
    assert!(fetch_direct(h, &o, &[], &[]).await.events.is_empty());
    assert_eq!(h.delivery_state("r1", ids[1]).await, Some(("pending".into(), 1)));
    assert_eq!(h.delivery_state("r1", ids[2]).await, Some(("pending".into(), 0)));
    // The parked delivery is the route worker's to claim, due now; the
    // failed one waits for its retry.
    let c = claim(h, &o, "r1").await;
    assert_eq!(c.iter().map(|c| c.event.id).collect::<Vec<_>>(), vec![ids[2]]);

    let later = h.enqueue(vec![order(3, "a"), order(4, "b"), order(5, "c")]).await;
    let batch = fetch_direct(h, &o, &["r1", "r2"], &[]).await;
    assert_eq!(batch.events.iter().map(|c| c.event.id).collect::<Vec<_>>(), later);
    assert_eq!(
        batch.held,
        vec![vec![], vec!["r1".to_string()], vec!["r1".to_string()]],
        "b and c wait on r1 only"
    );
    assert_eq!(batch.busy, vec!["r1".to_string()], "r1 has pending rows, r2 none");
}

/// Settling under a lost lease writes nothing; the next owner gets the
/// events again.
pub async fn direct_settle_is_fenced<H: StoreHarness>(h: &H) {
    let ids = h.enqueue(vec![order(0, "a")]).await;
    let a = own(h, "a").await;
    let batch = fetch_direct(h, &a, &[], &[]).await;
    let seq = batch.events[0].event.seq;
    h.expire_leases(&relay("a")).await;
    let b = own(h, "b").await;
    let records = vec![direct(seq, "a", "r1", DirectOutcome::Published { at: Utc::now() })];
    assert_eq!(h.store().settle(&a, &[seq], &records, Utc::now()).await.unwrap(), 0);
    assert_eq!(h.delivery_state("r1", ids[0]).await, None);
    let again = fetch_direct(h, &b, &[], &[]).await;
    assert_eq!(again.events.iter().map(|c| c.event.id).collect::<Vec<_>>(), ids);
    assert_eq!(h.store().settle(&b, &[seq], &records, Utc::now()).await.unwrap(), 1);
}

/// A settlement that names one delivery twice writes it once, the first
/// outcome, and still takes its events: the store must not fail the batch
/// (its events would be published again and again).
pub async fn a_delivery_repeated_in_a_settlement_is_written_once<H: StoreHarness>(h: &H) {
    let ids = h.enqueue(vec![order(0, "a"), order(1, "b")]).await;
    let o = own(h, "a").await;
    let batch = fetch_direct(h, &o, &[], &[]).await;
    let seqs: Vec<i64> = batch.events.iter().map(|c| c.event.seq).collect();
    let now = Utc::now();
    let records = vec![
        direct(seqs[0], "a", "r1", DirectOutcome::Published { at: now }),
        direct(seqs[1], "b", "r1", DirectOutcome::Published { at: now }),
        direct(
            seqs[0],
            "a",
            "r1",
            DirectOutcome::Dead {
                attempts: 1,
                reason: "repeated".into(),
            },
        ),
    ];
    assert_eq!(h.store().settle(&o, &seqs, &records, now).await.unwrap(), 2);
    assert_eq!(h.delivery_state("r1", ids[0]).await, Some(("published".into(), 1)));
    assert_eq!(h.delivery_state("r1", ids[1]).await, Some(("published".into(), 1)));
    assert_eq!(
        h.failure_history("r1", ids[0]).await,
        0,
        "the repeat that was not written left a failure in the history"
    );
    assert!(fetch_direct(h, &o, &[], &[]).await.events.is_empty());
}

/// Expands to one `#[tokio::test]` per scenario; `$make` is an async
/// expression giving a fresh harness.
#[macro_export]
macro_rules! store_conformance {
    ($make:expr) => {
        $crate::store_conformance!(@tests $make;
            leases_are_shared_and_fenced,
            a_release_under_an_old_lease_token_leaves_the_partition_held,
            a_renewed_expired_lease_is_fenced_against_an_old_release,
            a_late_leave_frees_no_lease_renewed_since,
            routing_and_claiming_in_order,
            a_failure_blocks_only_its_key_and_route,
            dead_blocks_its_key,
            a_never_attempted_delivery_is_due_whatever_clock_wrote_it,
            stale_outcomes_are_refused,
            no_lease_no_work,
            retries_count_attempts,
            a_sleeping_relay_is_notified,
            direct_delivery_settles_once_and_holds_keys,
            direct_settle_is_fenced,
            a_delivery_repeated_in_a_settlement_is_written_once
        );
    };
    (@tests $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let h = $make.await;
                $crate::store_suite::$name(&h).await;
            }
        )*
    };
}
