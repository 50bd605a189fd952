//! One event type routed to RabbitMQ, Redis Streams and a webhook at once,
//! with the webhook's receiver down for the first part of the run: the two
//! destinations that are up get everything while it is down, and it gets
//! everything once it comes up.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use ferry_testkit::rabbit::{TestTopology, amqp_url};

use crate::support::{PATIENCE, Stack, Tally, produce};

const EVENTS: usize = 2_000;
const KEYS: usize = 50;
const REDIS: &str = "127.0.0.1:6379";

/// `(event id, key, index within the key)` of one arrival.
type Arrival = (String, String, u64);
/// What the webhook receiver got, in arrival order.
type Received = Arc<Mutex<Vec<Arrival>>>;

#[tokio::test]
async fn one_event_fans_out_to_three_sinks_and_a_down_webhook_delays_none_of_the_others() {
    let s = Stack::new(TestTopology::create("e2e-fanout").await).await;
    let stream = format!("ferry-e2e-fanout-{:08x}", rand::random::<u32>());
    let _cleanup = DeleteOnDrop(stream.clone());
    // The consumer's group comes first: a stream nobody reads is refused.
    redis_command(&["XGROUP", "CREATE", &stream, "readers", "0", "MKSTREAM"]);
    // A port nothing listens on: connections to it are refused until the
    // receiver binds it in the second part.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = fanout_config(&s, &stream, port);
    produce(&s.pool, EVENTS, KEYS).await;
    let relay = s.spawn(&cfg, "relay-fanout");

    // Part one: the webhook is down, and the other two get everything.
    let mut rabbit = Tally::default();
    rabbit.collect(&s.topo, EVENTS, PATIENCE).await;
    assert_eq!(
        rabbit.unique(),
        EVENTS,
        "RabbitMQ is missing events; log:\n{}",
        relay.log()
    );
    assert_eq!(rabbit.assert_per_key_order(), KEYS);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while redis_len(&stream) < EVENTS as i64 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let entries = redis_entries(&stream);
    assert_per_key_order("Redis", &entries, EVENTS);
    let all = (EVENTS as u64, 0, 0, 0);
    let st = s
        .status_until(&cfg, &relay, PATIENCE, |st| {
            let (_, pending, retrying, _) = route(st, "to-hook");
            route(st, "to-rabbit") == all && route(st, "to-redis") == all && pending + retrying == EVENTS as u64
        })
        .await;
    let (published, pending, retrying, dead) = route(&st, "to-hook");
    assert_eq!((published, dead), (0, 0), "the webhook was never reachable: {st}");
    assert_eq!(
        pending + retrying,
        EVENTS as u64,
        "every webhook delivery is still owed: {st}"
    );
    assert!(
        blocked_keys(&st, "to-hook") > 0,
        "failed keys hold their later events back: {st}"
    );

    // Part two: the receiver comes up and gets all of them.
    let received = Arc::new(Mutex::new(Vec::<(String, String, u64)>::new()));
    let app = Router::new().route("/hook", post(hook)).with_state(received.clone());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    s.status_until(&cfg, &relay, PATIENCE, |st| route(st, "to-hook").0 == EVENTS as u64)
        .await;
    let hooked = received.lock().unwrap().clone();
    assert_per_key_order("the webhook", &hooked, EVENTS);

    // Nothing was lost or sent again elsewhere meanwhile.
    rabbit.collect(&s.topo, EVENTS + 1, Duration::from_millis(500)).await;
    assert_eq!((rabbit.unique(), rabbit.duplicates()), (EVENTS, 0));
    assert_eq!(redis_len(&stream), EVENTS as i64, "Redis got an event twice");
    assert!(relay.terminate().success());
    let st = s.status(&cfg).await;
    for name in ["to-rabbit", "to-redis", "to-hook"] {
        assert_eq!(route(&st, name), (EVENTS as u64, 0, 0, 0), "{name}: {st}");
    }
    server.abort();
    let Stack { topo, .. } = s;
    topo.delete().await;
}

fn fanout_config(s: &Stack, stream: &str, port: u16) -> PathBuf {
    let text = format!(
        r#"
[database]
url = "{db}"
max_connections = 6

[relay]
batch_size = 500
lease = "5s"
max_attempts = 1000
backoff_base = "50ms"
backoff_max = "1s"
poll_interval = "30s"
shutdown_timeout = "10s"

[log]
level = "warn"

[sinks.rabbit]
kind = "rabbitmq"
url = "{amqp}"
publish_timeout = "2s"

[sinks.redis]
kind = "redis"
url = "redis://{REDIS}"
publish_timeout = "2s"

[sinks.hooks]
kind = "webhook"
timeout = "2s"

[[routes]]
name = "to-rabbit"
match = "order.**"
sink = "rabbit"
destination = "{exchange}"
routing_key = "{{type}}"

[[routes]]
name = "to-redis"
match = "order.**"
sink = "redis"
destination = "{stream}"

[[routes]]
name = "to-hook"
match = "order.**"
sink = "hooks"
destination = "http://127.0.0.1:{port}/hook"
"#,
        db = s.db.url(),
        amqp = amqp_url(),
        exchange = s.topo.exchange(),
    );
    let path = s.dir.path().join("ferry-fanout.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Records `(id, key, n)` of each request and answers 200.
async fn hook(State(received): State<Received>, body: Bytes) -> StatusCode {
    let event: serde_json::Value = serde_json::from_slice(&body).expect("a CloudEvents JSON body");
    let id = event["id"].as_str().expect("id").to_owned();
    let key = event["data"]["key"].as_str().expect("data.key").to_owned();
    let n = event["data"]["n"].as_u64().expect("data.n");
    received.lock().unwrap().push((id, key, n));
    StatusCode::OK
}

/// `(published, pending, retrying, dead)` of a route in `ferry status --json`.
fn route(status: &serde_json::Value, name: &str) -> (u64, u64, u64, u64) {
    let r = route_json(status, name);
    let n = |field: &str| r[field].as_u64().unwrap();
    (n("published"), n("pending"), n("retrying"), n("dead"))
}

fn blocked_keys(status: &serde_json::Value, name: &str) -> u64 {
    route_json(status, name)["blocked"]["keys"].as_u64().unwrap()
}

fn route_json<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    status["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == name)
        .unwrap_or_else(|| panic!("route {name} in status: {status}"))
}

/// Every one of `total` events arrived, and per key the first arrivals
/// are in production order.
fn assert_per_key_order(at: &str, arrivals: &[Arrival], total: usize) {
    let mut seen = HashSet::new();
    let mut next: HashMap<&str, u64> = HashMap::new();
    for (id, key, n) in arrivals {
        if !seen.insert(id) {
            continue;
        }
        let expected = next.entry(key).or_insert(0);
        assert_eq!(*n, *expected, "{at}, key {key}: got event {n}, expected {expected}");
        *expected += 1;
    }
    assert_eq!(seen.len(), total, "{at} is missing events");
    assert_eq!(next.len(), KEYS, "{at}: keys seen");
}

/// Deletes the stream however the test ends.
struct DeleteOnDrop(String);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        // No panic here: this may run while the test is already panicking.
        if let Ok(mut conn) = TcpStream::connect(REDIS) {
            let key = &self.0;
            let _ = conn.write_all(format!("*2\r\n$3\r\nDEL\r\n${}\r\n{key}\r\n", key.len()).as_bytes());
            let _ = BufReader::new(conn).read_line(&mut String::new());
        }
    }
}

fn redis_len(stream: &str) -> i64 {
    match redis_command(&["XLEN", stream]) {
        Resp::Int(n) => n,
        other => panic!("XLEN answered {other:?}"),
    }
}

/// `(id, key, n)` of every entry, in stream order.
fn redis_entries(stream: &str) -> Vec<Arrival> {
    let Resp::Array(entries) = redis_command(&["XRANGE", stream, "-", "+"]) else {
        panic!("XRANGE answered no array");
    };
    entries
        .into_iter()
        .map(|entry| {
            let Resp::Array(mut parts) = entry else {
                panic!("an entry is [id, fields]")
            };
            let Some(Resp::Array(fields)) = parts.pop() else {
                panic!("an entry has fields")
            };
            let fields: HashMap<String, Vec<u8>> = fields
                .chunks(2)
                .map(|pair| match pair {
                    [Resp::Bulk(name), Resp::Bulk(value)] => {
                        (String::from_utf8_lossy(name).into_owned(), value.clone())
                    }
                    other => panic!("field pair {other:?}"),
                })
                .collect();
            let payload: serde_json::Value = serde_json::from_slice(&fields["payload"]).unwrap();
            (
                String::from_utf8_lossy(&fields["id"]).into_owned(),
                payload["key"].as_str().unwrap().to_owned(),
                payload["n"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// A RESP2 reply; just enough of the protocol to count and read a stream
/// without a Redis client among this crate's dependencies.
#[derive(Debug)]
enum Resp {
    Int(i64),
    Bulk(Vec<u8>),
    Nil,
    Array(Vec<Resp>),
}

fn redis_command(args: &[&str]) -> Resp {
    let mut conn = TcpStream::connect(REDIS).expect("Redis at 127.0.0.1:6379");
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    conn.write_all(request.as_bytes()).unwrap();
    read_reply(&mut BufReader::new(conn))
}

fn read_reply(r: &mut impl BufRead) -> Resp {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let (kind, rest) = line.trim_end().split_at(1);
    match kind {
        "+" => Resp::Bulk(rest.as_bytes().to_vec()),
        "-" => panic!("Redis error: {rest}"),
        ":" => Resp::Int(rest.parse().unwrap()),
        "$" => match rest.parse::<i64>().unwrap() {
            -1 => Resp::Nil,
            len => {
                let mut buf = vec![0; len as usize + 2];
                r.read_exact(&mut buf).unwrap();
                buf.truncate(len as usize);
                Resp::Bulk(buf)
            }
        },
        "*" => match rest.parse::<i64>().unwrap() {
            -1 => Resp::Nil,
            len => Resp::Array((0..len).map(|_| read_reply(r)).collect()),
        },
        other => panic!("unexpected RESP type {other:?}"),
    }
}
