//! `wait_replicas`: a batch counts as delivered only once that many replicas
//! hold it. Runs a primary and a replica of its own (`redis-server` from
//! the PATH, or `FERRY_TEST_REDIS_SERVER`), on free ports, without
//! persistence.

use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ferry_core::{ErrorKind, Sink};
use ferry_sink::redis::RedisOptions;
use ferry_testkit::redis_server::RedisServer;

use crate::support::{expect_err, keyed, route, sink_with};

/// A connection to a test's own server.
async fn connect(server: &RedisServer) -> MultiplexedConnection {
    ::redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the test's redis-server")
}

async fn info(conn: &mut MultiplexedConnection, field: &str) -> String {
    let info: String = ::redis::cmd("INFO").arg("replication").query_async(conn).await.unwrap();
    info.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{field}:")).map(str::to_owned))
        .unwrap_or_default()
}

async fn xlen(conn: &mut MultiplexedConnection, key: &str) -> u64 {
    ::redis::cmd("XLEN").arg(key).query_async(conn).await.unwrap()
}

#[tokio::test]
async fn a_batch_counts_only_once_the_replicas_asked_for_hold_it() {
    let primary = RedisServer::start(&[]);
    let mut admin = connect(&primary).await;
    let key = &crate::support::unique("replicas");
    let _: () = ::redis::cmd("XGROUP")
        .arg(&["CREATE", key, "billing", "0", "MKSTREAM"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let sink = |publish_timeout| {
        sink_with(RedisOptions {
            url: primary.url(),
            publish_timeout,
            wait_replicas: 1,
            ..RedisOptions::default()
        })
    };
    // No replica will confirm: WAIT waits out half of this.
    let alone = sink(Duration::from_secs(4));
    let route = route("orders", key);

    // No replica: check refuses, and a batch the primary alone holds is
    // reported failed (to be sent again), though it is in the stream.
    let err = alone.check(&route).await.expect_err("no replica");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains("0 connected replica(s)"), "{err}");
    // The shortfall does not hide a route that reaches nobody.
    let nobody = alone
        .check(&crate::support::route("nobody", &crate::support::unique("nobody")))
        .await
        .expect_err("no such stream");
    assert_eq!(nobody.kind, ErrorKind::Config, "{nobody}");
    assert!(nobody.message.contains("reaches nobody"), "{nobody}");
    let events = keyed(3, |seq| format!("k{seq}"));
    for outcome in alone.publish(&route, &events).await {
        expect_err(&outcome, ErrorKind::Transient, "0 of 1 replicas confirmed");
    }
    assert_eq!(xlen(&mut admin, key).await, 3);

    // With a replica in sync, the same batch is delivered, and the replica
    // holds every entry sent: three unconfirmed, three refused WAIT and
    // three confirmed.
    let replica = RedisServer::start(&["--replicaof", "127.0.0.1", &primary.port().to_string()]);
    let mut copy = connect(&replica).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while info(&mut copy, "master_link_status").await != "up" || info(&mut admin, "connected_slaves").await != "1" {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica did not come in sync"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    alone.close().await;

    // A user Redis does not allow WAIT: check names it, and a batch is not
    // taken for confirmed.
    let _: () = ::redis::cmd("ACL")
        .arg(&["SETUSER", "nowait", "on", "nopass", "~*", "&*", "+@all", "-wait"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let refused = sink_with(RedisOptions {
        url: format!("redis://nowait:x@127.0.0.1:{}", primary.port()),
        wait_replicas: 1,
        ..RedisOptions::default()
    });
    let err = refused.check(&route).await.expect_err("WAIT is refused");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("refuses WAIT"), "{err}");
    for outcome in refused.publish(&route, &events).await {
        expect_err(&outcome, ErrorKind::Transient, "WAIT failed (NOPERM");
    }
    refused.close().await;
    // A hardened user (no @dangerous commands, so no INFO) may still WAIT:
    // check counts the replicas by WAIT's answer instead.
    let _: () = ::redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "hardened",
                "on",
                "nopass",
                "~*",
                "&*",
                "+@all",
                "-@dangerous",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .unwrap();
    let hardened = sink_with(RedisOptions {
        url: format!("redis://hardened:x@127.0.0.1:{}", primary.port()),
        wait_replicas: 1,
        ..RedisOptions::default()
    });
    hardened
        .check(&route)
        .await
        .expect("INFO refused, WAIT counts one replica");
    hardened.close().await;
    // Room for the replica's confirmation on a loaded machine.
    let sink = sink(Duration::from_secs(30));
    sink.check(&route).await.expect("a replica is connected");
    let outcomes = sink.publish(&route, &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(xlen(&mut copy, key).await, 9, "the replica holds what was confirmed");
    sink.close().await;
}

#[tokio::test]
async fn an_abandoned_batch_does_not_leave_its_wait_on_the_connection() {
    let primary = RedisServer::start(&[]);
    let mut admin = connect(&primary).await;
    let key = &crate::support::unique("abandoned");
    // No replica: the batch's WAIT blocks its connection for 30 s.
    let sink = sink_with(RedisOptions {
        url: primary.url(),
        publish_timeout: Duration::from_secs(60),
        wait_replicas: 1,
        ..RedisOptions::default()
    });
    let route = route("orders", key);
    let events = keyed(2, |seq| format!("k{seq}"));
    let waiting = |admin: &mut MultiplexedConnection| {
        let mut admin = admin.clone();
        async move {
            let clients: String = ::redis::cmd("CLIENT")
                .arg("LIST")
                .query_async(&mut admin)
                .await
                .unwrap();
            clients.lines().filter(|l| l.contains("cmd=wait")).count()
        }
    };
    // The relay gives up on the batch (its bound passed, or it stopped).
    let mut publish = Box::pin(sink.publish(&route, &events));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        tokio::select! {
            _ = &mut publish => panic!("WAIT returned without a replica"),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if waiting(&mut admin).await == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the batch's WAIT never blocked");
    }
    drop(publish);
    // The next request goes on a new connection, not behind the abandoned
    // WAIT's remaining 30 s: check answers (the stream has no group) long
    // before that.
    let answered = tokio::time::timeout(Duration::from_secs(15), sink.check(&route)).await;
    let err = answered
        .expect("check waited behind the abandoned WAIT")
        .expect_err("no group");
    assert!(err.message.contains("reaches nobody"), "{err}");
    assert_eq!(xlen(&mut admin, key).await, 2, "what was sent is stored");
    sink.close().await;
}

/// After a failover behind one address (a managed Redis's endpoint), the
/// connection open to the old primary reaches a replica, which refuses
/// every XADD with READONLY. The sink replaced the connection only on I/O
/// errors, so it kept that one, and every batch failed until its events
/// went dead. A READONLY reply now puts the connection in doubt: the next
/// batch connects anew.
#[tokio::test]
async fn a_connection_that_reaches_a_replica_is_replaced() {
    let server = RedisServer::start(&[]);
    let other = RedisServer::start(&[]);
    let mut admin = connect(&server).await;
    let key = &crate::support::unique("demoted");
    let sink = sink_with(RedisOptions {
        url: server.url(),
        ..RedisOptions::default()
    });
    let route = route("orders", key);
    assert!(
        sink.publish(&route, &keyed(2, |seq| format!("k{seq}")))
            .await
            .iter()
            .all(Result::is_ok)
    );
    let connections = |info: String| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix("total_connections_received:").map(str::to_owned))
            .and_then(|n| n.parse::<u64>().ok())
            .expect("total_connections_received")
    };
    let stats = async |conn: &mut MultiplexedConnection| {
        let info: String = ::redis::cmd("INFO").arg("stats").query_async(conn).await.unwrap();
        connections(info)
    };
    // The server becomes a replica of another: it refuses writes.
    let _: () = ::redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(other.port())
        .query_async(&mut admin)
        .await
        .unwrap();
    for outcome in sink.publish(&route, &keyed(2, |seq| format!("k{seq}"))).await {
        expect_err(&outcome, ErrorKind::Transient, "READONLY");
    }
    let before = stats(&mut admin).await;
    // Promoted again, as the new primary would be.
    let _: () = ::redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        sink.publish(&route, &keyed(2, |seq| format!("k{seq}")))
            .await
            .iter()
            .all(Result::is_ok)
    );
    assert_eq!(
        stats(&mut admin).await,
        before + 1,
        "the connection that reached a replica was kept"
    );
    sink.close().await;
}
