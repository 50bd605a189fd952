//! Least-privilege ACL users and Redis Cluster nodes in `check` and in a
//! publish. A user that may only XADD can publish, so `check` must not stop
//! a relay from starting because it is refused the commands it looks with;
//! a cluster node redirects keys it does not serve, which the sink does not
//! follow, so `check` refuses a cluster of several shards, warns of one of
//! one shard, and a redirect says what it means.

use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_sink::redis::RedisOptions;
use ferry_testkit::redis_server::RedisServer;
use tokio::time::Instant;

use crate::support::{TestStream, expect_err, keyed, redis_url, route, sink_with};

/// An ACL user of the shared server, deleted when dropped (a failed test
/// included).
struct AclUser {
    name: String,
}

impl AclUser {
    /// A uniquely named user with password `pw` and `rules`.
    fn create(rules: &[&str]) -> AclUser {
        // No ':' in it, which would end the user name in the URL.
        let user = AclUser {
            name: format!("ferry-acl-{}", uuid::Uuid::now_v7().simple()),
        };
        user.set(rules);
        user
    }

    fn set(&self, rules: &[&str]) {
        let mut cmd = ::redis::cmd("ACL");
        cmd.arg("SETUSER").arg(&self.name).arg("on").arg(">pw");
        for rule in rules {
            cmd.arg(*rule);
        }
        let _: () = cmd.query(&mut admin()).expect("ACL SETUSER");
    }

    /// The shared server's URL, logging in as this user.
    fn url(&self) -> String {
        let mut url = ::redis::parse_redis_url(&redis_url()).expect("a Redis URL");
        url.set_username(&self.name).unwrap();
        url.set_password(Some("pw")).unwrap();
        url.to_string()
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        let _: Result<i64, _> = ::redis::cmd("ACL").arg("DELUSER").arg(&self.name).query(&mut admin());
    }
}

fn admin() -> ::redis::Connection {
    ::redis::Client::open(redis_url())
        .unwrap()
        .get_connection()
        .expect("connect to Redis")
}

/// `ACL SETUSER x on >pw ~* +xadd`: PING, INFO, TYPE and XINFO are refused
/// with NOPERM. `check` took that for a configuration error, so `ferry run`
/// refused to start ("routes reach no destination") though every publish
/// would have gone through. Now each blind spot is a caveat naming the
/// command and the grant; XADD refused is still an error naming its grant.
#[tokio::test]
async fn a_user_that_may_only_xadd_passes_check_with_caveats_and_publishes() {
    let stream = TestStream::new("xaddonly").await;
    let user = AclUser::create(&["~*", "+xadd"]);
    let sink = sink_with(RedisOptions {
        url: user.url(),
        ..RedisOptions::default()
    });
    let to = route("test", &stream.key);
    let caveats = sink.check_with_caveats(&to).await.expect("publishing needs only XADD");
    assert_eq!(caveats.len(), 2, "{caveats:?}");
    let name = &user.name;
    assert!(
        caveats[0].contains("refuses this user INFO") && caveats[0].contains(&format!("ACL SETUSER {name} +info")),
        "{caveats:?}"
    );
    assert!(caveats[0].contains("Redis Cluster"), "{caveats:?}");
    assert!(
        caveats[1].contains("refuses this user TYPE")
            && caveats[1].contains(&format!("ACL SETUSER {name} +type +xinfo|groups ~{}", stream.key)),
        "{caveats:?}"
    );
    sink.check(&to).await.expect("what `ferry run` asks");
    let events = keyed(2, |seq| format!("k{seq}"));
    assert_eq!(sink.publish(&to, &events).await, vec![Ok(()), Ok(())]);
    assert_eq!(stream.len().await, 2);

    // Allowed TYPE but not XINFO: the consumer groups are what it misses.
    user.set(&["+type"]);
    let caveats = sink.check_with_caveats(&to).await.expect("publishing needs only XADD");
    assert_eq!(caveats.len(), 2, "{caveats:?}");
    assert!(caveats[1].contains("refuses this user XINFO GROUPS"), "{caveats:?}");
    assert!(caveats[1].contains("+xinfo|groups"), "{caveats:?}");

    // XADD itself refused: every event fails, naming the grant.
    user.set(&["-xadd"]);
    for outcome in sink.publish(&to, &events).await {
        expect_err(&outcome, ErrorKind::Config, "NOPERM");
        expect_err(&outcome, ErrorKind::Config, "+xadd");
    }
    assert_eq!(stream.len().await, 2);
    sink.close().await;
    stream.delete().await;
}

/// A Redis Cluster node: `check` says so, with the fix, before any event
/// goes dead to a redirect. A caveat, not a refusal: this node serves every
/// slot, as a cluster of one shard does, and publishes fine.
#[tokio::test]
async fn check_warns_of_a_redis_cluster_node() {
    let node = RedisServer::start(&["--cluster-enabled", "yes"]);
    let mut admin = ::redis::Client::open(node.url()).unwrap().get_connection().unwrap();
    let _: () = ::redis::cmd("CLUSTER")
        .arg(&["ADDSLOTSRANGE", "0", "16383"][..])
        .query(&mut admin)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = ::redis::cmd("CLUSTER").arg("INFO").query(&mut admin).unwrap();
        if info.lines().any(|l| l.trim() == "cluster_state:ok") {
            break;
        }
        assert!(Instant::now() < deadline, "the node did not take its slots: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _: () = ::redis::cmd("XGROUP")
        .arg(&["CREATE", "orders", "billing", "0", "MKSTREAM"][..])
        .query(&mut admin)
        .unwrap();
    let sink = sink_with(RedisOptions {
        url: node.url(),
        ..RedisOptions::default()
    });
    let to = route("test", "orders");
    let caveats = sink
        .check_with_caveats(&to)
        .await
        .expect("a cluster of one shard publishes");
    assert!(
        caveats
            .iter()
            .any(|c| c.contains("Redis Cluster node") && c.contains("point sinks.redis.url at")),
        "{caveats:?}"
    );
    for outcome in sink.publish(&to, &keyed(2, |_| "k".into())).await {
        outcome.expect("this node serves every slot");
    }
    sink.close().await;
}

/// A key another cluster node serves is answered `MOVED <slot> <node>`:
/// the event failed with that text alone.
#[tokio::test]
async fn a_cluster_redirect_names_the_cluster_and_the_fix() {
    let first = RedisServer::start(&["--cluster-enabled", "yes"]);
    let second = RedisServer::start(&["--cluster-enabled", "yes"]);
    let connect = |server: &RedisServer| ::redis::Client::open(server.url()).unwrap().get_connection().unwrap();
    let (mut a, mut b) = (connect(&first), connect(&second));
    let _: () = ::redis::cmd("CLUSTER")
        .arg(&["ADDSLOTSRANGE", "0", "8191"][..])
        .query(&mut a)
        .unwrap();
    let _: () = ::redis::cmd("CLUSTER")
        .arg(&["ADDSLOTSRANGE", "8192", "16383"][..])
        .query(&mut b)
        .unwrap();
    let port = second.port().to_string();
    let _: () = ::redis::cmd("CLUSTER")
        .arg(&["MEET", "127.0.0.1", &port][..])
        .query(&mut a)
        .unwrap();
    // A key in the second node's half, by the first node's own hashing.
    let key = (0..)
        .map(|n| format!("orders-{n}"))
        .find(|key| {
            let slot: u16 = ::redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut a).unwrap();
            slot >= 8192
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = ::redis::cmd("CLUSTER").arg("INFO").query(&mut a).unwrap();
        if info.lines().any(|l| l.trim() == "cluster_state:ok") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the two nodes did not form a cluster: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sink = sink_with(RedisOptions {
        url: first.url(),
        ..RedisOptions::default()
    });
    let to = route("test", &key);
    // Two shards: `check` refuses the node before any event goes dead.
    let err = sink.check(&to).await.expect_err("a cluster of two shards");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(
        err.message.contains("cluster_size:2") && err.message.contains("point sinks.redis.url at"),
        "{err}"
    );
    for outcome in sink.publish(&to, &keyed(1, |_| "k".into())).await {
        expect_err(&outcome, ErrorKind::Config, "MOVED");
        expect_err(
            &outcome,
            ErrorKind::Config,
            "Redis Cluster, which the sink does not support",
        );
        expect_err(&outcome, ErrorKind::Config, "point sinks.redis.url at");
    }
    sink.close().await;
}
