use std::time::Duration;

use ferry_testkit::proxy::Proxy;
use ferry_testkit::rabbit::{TestTopology, amqp_url};
use serde_json::json;

use crate::support::{
    Overrides, PATIENCE, Stack, Tally, assert_interrupted, order, produce, produce_events, produce_from, published,
    streaming,
};

#[tokio::test]
async fn ten_thousand_events_over_a_hundred_keys_arrive_complete_and_in_order() {
    let s = Stack::new(TestTopology::create("e2e-all").await).await;
    produce(&s.pool, 10_000, 100).await;
    let cfg = s.config(&Overrides::default());
    let relay = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    tally.collect(&s.topo, 10_000, PATIENCE).await;
    assert_eq!(tally.unique(), 10_000, "lost events; relay log:\n{}", relay.log());
    assert_eq!(tally.assert_per_key_order(), 100);
    let status = relay.terminate();
    assert!(status.success(), "SIGTERM must exit 0, got {status:?}");
    // Nothing was in doubt, so nothing was sent twice.
    tally.collect(&s.topo, 10_001, Duration::from_millis(500)).await;
    assert_eq!(tally.duplicates(), 0);
    let st = s.status(&cfg).await;
    assert_eq!(published(&st, "orders"), (10_000, 0, 0));
    assert_eq!(
        st["leases"].as_array().unwrap().len(),
        0,
        "a clean shutdown hands its leases back"
    );
}

#[tokio::test]
async fn a_relay_killed_mid_drain_and_restarted_loses_nothing() {
    let s = Stack::new(TestTopology::create("e2e-kill").await).await;
    produce(&s.pool, 10_000, 100).await;
    let cfg = s.config(&Overrides::default());
    let first = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    let left = s.unrouted_at_most(8_000, &first).await;
    first.kill();
    assert_interrupted(left, "kill");
    // A new process; it waits out the dead relay's leases, then takes over.
    let second = s.spawn(&cfg, "relay-b");
    tally.collect(&s.topo, 10_000, PATIENCE).await;
    assert_eq!(tally.unique(), 10_000, "lost events; log:\n{}", second.log());
    tally.assert_per_key_order();
    // Only what was in flight at the kill can come twice: the batch whose
    // settle was being written and the batch being published, two batches
    // of 500 at most. Read what is still queued first: a duplicate can
    // arrive after the last first arrival.
    tally.collect(&s.topo, 10_001, Duration::from_secs(1)).await;
    assert!(tally.duplicates() <= 1_000, "{} duplicates", tally.duplicates());
    assert!(second.terminate().success());
    assert_eq!(published(&s.status(&cfg).await, "orders"), (10_000, 0, 0));
}

#[tokio::test]
async fn two_relays_at_once_share_the_work_with_no_loss_duplicates_or_reordering() {
    let s = Stack::new(TestTopology::create("e2e-two").await).await;
    produce(&s.pool, 5_000, 100).await;
    let cfg = s.config(&Overrides {
        lease: Some("6s".into()),
        ..Overrides::default()
    });
    let a = s.spawn(&cfg, "relay-a");
    let b = s.spawn(&cfg, "relay-b");
    produce_from(&s.pool, 5_000, 5_000, 100).await;
    let mut tally = Tally::default();
    tally.collect(&s.topo, 10_000, PATIENCE).await;
    assert_eq!(tally.unique(), 10_000, "lost events; logs:\n{}\n{}", a.log(), b.log());
    tally.collect(&s.topo, 10_001, Duration::from_secs(1)).await;
    assert_eq!(tally.duplicates(), 0);
    tally.assert_per_key_order();
    let st = s.status(&cfg).await;
    let leases = st["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 2, "both relays hold leases: {leases:?}");
    assert!(a.terminate().success());
    assert!(b.terminate().success());
}

/// Leases are held by relay id: a second relay given the id of one that
/// runs would take the same leases and publish the same events. It waits,
/// saying why, and takes over once the first has stopped.
#[tokio::test]
async fn a_relay_given_the_id_of_a_running_one_waits_for_it_to_stop() {
    let s = Stack::new(TestTopology::create("e2e-same-id").await).await;
    produce(&s.pool, 1_000, 10).await;
    let cfg = s.config(&Overrides {
        lease: Some("4s".into()),
        ..Overrides::default()
    });
    let first = s.spawn(&cfg, "relay-same");
    let mut tally = Tally::default();
    tally.collect(&s.topo, 1_000, PATIENCE).await;
    assert_eq!(tally.unique(), 1_000, "lost events; log:\n{}", first.log());
    let second = s.spawn(&cfg, "relay-same");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !second.log().contains("another relay runs with the same id") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no word of the other relay; log:\n{}",
            second.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Waiting, the second publishes nothing beside the first.
    produce_from(&s.pool, 1_000, 1_000, 10).await;
    tally.collect(&s.topo, 2_000, PATIENCE).await;
    assert!(first.terminate().success());
    produce_from(&s.pool, 2_000, 1_000, 10).await;
    tally.collect(&s.topo, 3_000, PATIENCE).await;
    assert_eq!(tally.unique(), 3_000, "lost events; log:\n{}", second.log());
    tally.collect(&s.topo, 3_001, Duration::from_millis(500)).await;
    assert_eq!(tally.duplicates(), 0);
    tally.assert_per_key_order();
    assert!(second.terminate().success());
}

#[tokio::test]
async fn an_exchange_with_no_bound_queue_is_refused_and_marks_nothing_published() {
    let s = Stack::new(TestTopology::create_unbound("e2e-nobody").await).await;
    produce(&s.pool, 50, 5).await;
    // Nobody home: `check` and the relay at start name the route.
    let cfg = s.config(&Overrides::default());
    let check = s.ferry(&cfg, &["check"]);
    let said = String::from_utf8_lossy(&check.stdout);
    assert_eq!(check.status.code(), Some(1), "{said}");
    assert!(said.contains("route \"orders\" reaches nobody"), "{said}");
    assert!(said.contains("no queue is bound"), "{said}");
    let run = s.ferry(&cfg, &["run"]);
    let said = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{said}");
    assert!(said.contains("reaches nobody"), "{said}");

    // With the management API out of reach the relay starts, and the
    // unroutable publishes themselves are the signal.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = s.config(&Overrides {
        management_url: Some(format!("http://guest:guest@{closed}")),
        max_attempts: Some(3),
        ..Overrides::default()
    });
    let relay = s.spawn(&cfg, "relay-a");
    // Each key's first event is retried, then dead; the rest of the key
    // waits behind it.
    let st = s
        .status_until(&cfg, &relay, PATIENCE, |st| {
            let (published_n, _, dead) = published(st, "orders");
            assert_eq!(published_n, 0, "an unroutable event is never published");
            dead >= 5
        })
        .await;
    let reasons = st["dead_reasons"].to_string();
    assert!(reasons.contains("unroutable"), "{reasons}");
    assert_eq!(st["routes"][0]["blocked"]["keys"], 5);
    assert!(relay.terminate().success());
}

#[tokio::test]
async fn a_poison_event_is_dead_and_holds_back_only_its_own_key() {
    let s = Stack::new(TestTopology::create("e2e-poison").await).await;
    let mut events: Vec<_> = (0..500).map(|i| order(i / 10, &format!("k{}", i % 10))).collect();
    // k3's sixth event is over the sink's size limit.
    events[53] = ferry_core::Event::new(
        "order.item.created",
        json!({"key": "k3", "n": 5, "pad": "x".repeat(20_000)}),
    )
    .key("k3");
    produce_events(&s.pool, events).await;
    let cfg = s.config(&Overrides {
        max_message_bytes: Some(8_192),
        ..Overrides::default()
    });
    let relay = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    // 9 keys x 50, plus k3's five events before the poison.
    tally.collect(&s.topo, 455, PATIENCE).await;
    tally.collect(&s.topo, 456, Duration::from_secs(2)).await;
    assert_eq!(tally.unique(), 455, "log:\n{}", relay.log());
    tally.assert_per_key_order();
    // The batch is settled a moment after its events arrive.
    let st = s
        .status_until(&cfg, &relay, PATIENCE, |st| published(st, "orders") == (455, 44, 1))
        .await;
    assert!(
        st["dead_reasons"].to_string().contains("too large"),
        "{}",
        st["dead_reasons"]
    );
    assert!(relay.terminate().success());
}

#[tokio::test]
async fn a_rabbitmq_connection_cut_mid_drain_loses_nothing() {
    let topo = TestTopology::create("e2e-cut-amqp").await;
    let s = Stack::new(topo).await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap()).unwrap();
    let url = amqp_url().replace("127.0.0.1:5672", &proxy.addr().to_string());
    assert_ne!(url, amqp_url(), "the AMQP URL must go through the proxy");
    produce(&s.pool, 5_000, 50).await;
    let cfg = s.config(&Overrides {
        amqp_url: Some(url),
        ..Overrides::default()
    });
    let relay = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    let left = s.unrouted_at_most(4_000, &relay).await;
    proxy.cut();
    assert_interrupted(left, "first cut");
    let left = s.unrouted_at_most(2_500, &relay).await;
    // Down for a while: connections are refused, then come back.
    proxy.set_refuse(true);
    proxy.cut();
    assert_interrupted(left, "outage");
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set_refuse(false);
    tally.collect(&s.topo, 5_000, PATIENCE).await;
    assert_eq!(tally.unique(), 5_000, "lost events; log:\n{}", relay.log());
    tally.assert_per_key_order();
    // An event can reach the queue before its outcome is known: one whose
    // confirm was lost in a cut is retried (and may come twice). Wait for
    // those retries to be recorded.
    s.status_until(&cfg, &relay, PATIENCE, |st| published(st, "orders") == (5_000, 0, 0))
        .await;
    // Repeated at most: what each of the two cuts met in flight, a few
    // batches of 500, not the backlog.
    tally.collect(&s.topo, 10_000, Duration::from_millis(500)).await;
    assert!(tally.duplicates() <= 2_000, "{} duplicates", tally.duplicates());
    assert!(relay.terminate().success());
}

#[tokio::test]
async fn a_database_connection_cut_mid_drain_loses_nothing() {
    let s = Stack::new(TestTopology::create("e2e-cut-pg").await).await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).unwrap();
    let url = s.db.url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, s.db.url(), "the database URL must go through the proxy");
    produce(&s.pool, 5_000, 50).await;
    let cfg = s.config(&Overrides {
        db_url: Some(url),
        ..Overrides::default()
    });
    let relay = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    let left = s.unrouted_at_most(4_000, &relay).await;
    proxy.cut();
    assert_interrupted(left, "first cut");
    let left = s.unrouted_at_most(2_500, &relay).await;
    proxy.set_refuse(true);
    proxy.cut();
    assert_interrupted(left, "outage");
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.set_refuse(false);
    tally.collect(&s.topo, 5_000, PATIENCE).await;
    assert_eq!(tally.unique(), 5_000, "lost events; log:\n{}", relay.log());
    tally.assert_per_key_order();
    // Repeated at most: what the two cuts left unsettled, a few batches of
    // 500, not the backlog.
    tally.collect(&s.topo, 10_000, Duration::from_millis(500)).await;
    assert!(tally.duplicates() <= 2_000, "{} duplicates", tally.duplicates());
    let log = relay.log();
    assert!(relay.terminate().success());
    // A batch confirmed while the database was unreachable may not have been
    // settled or recorded before the relay's lease lapsed: it stays unrouted
    // or pending and the next relay publishes it again (a duplicate the
    // contract allows). Nothing may be dead, and every event is published or
    // still waiting.
    let direct = s.config(&Overrides::default());
    let status = s.status(&direct).await;
    let (published, pending, dead) = published(&status, "orders");
    let unrouted = status["unrouted"].as_u64().unwrap();
    assert_eq!(
        (published + pending + unrouted, dead),
        (5_000, 0),
        "{published} published, {pending} pending, {unrouted} unrouted; log:\n{log}"
    );
}

#[tokio::test]
async fn in_wal_mode_a_relay_killed_mid_stream_and_restarted_loses_nothing() {
    let s = Stack::new(TestTopology::create("e2e-wal").await).await;
    // Committed before the slot exists: swept into the table path.
    produce(&s.pool, 500, 50).await;
    let cfg = s.config(&Overrides {
        wal: true,
        ..Overrides::default()
    });
    let first = s.spawn(&cfg, "relay-a");
    streaming(&s).await;
    let check = s.ferry(&cfg, &["check"]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "ferry check failed:\n{report}");
    assert!(report.contains("ok   wal_level: logical"), "{report}");
    assert!(
        report.contains(&format!("ok   replication slot {}: streaming", s.db.name())),
        "{report}"
    );
    // Produced while the relay streams, in many small transactions.
    let producer = {
        let pool = s.pool.clone();
        tokio::spawn(async move {
            for t in 0..95 {
                produce_from(&pool, 500 + t * 50, 50, 50).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut tally = Tally::default();
    tally.collect(&s.topo, 1_500, PATIENCE).await;
    assert!(
        tally.unique() >= 1_500,
        "the first relay made no progress:\n{}",
        first.log()
    );
    first.kill();
    producer.await.unwrap();
    let second = s.spawn(&cfg, "relay-b");
    tally.collect(&s.topo, 5_250, PATIENCE).await;
    assert_eq!(tally.unique(), 5_250, "lost events; log:\n{}", second.log());
    tally.assert_per_key_order();
    assert!(second.terminate().success());
    assert_eq!(published(&s.status(&cfg).await, "orders"), (5_250, 0, 0));
}
