use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use ferry_core::Event;
use ferry_store::postgres::enqueue_batch;
use ferry_testkit::pg::TestDb;
use ferry_testkit::process::dies_with_test;
use ferry_testkit::rabbit::{Received, TestTopology, amqp_url};
use serde_json::json;
use sqlx::PgPool;

pub const BIN: &str = env!("CARGO_BIN_EXE_ferry");
/// How long a test waits for what must happen.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// A database with the ferry schema, a RabbitMQ topology and a config dir.
pub struct Stack {
    pub db: TestDb,
    pub pool: PgPool,
    pub topo: TestTopology,
    pub dir: tempfile::TempDir,
}

impl Stack {
    pub async fn new(topo: TestTopology) -> Stack {
        Self::on(TestDb::create().await, topo).await
    }

    /// A stack whose database is `db`, on whatever server that is.
    pub async fn on(db: TestDb, topo: TestTopology) -> Stack {
        let pool = db.pool().await;
        let stack = Stack {
            db,
            pool,
            topo,
            dir: tempfile::tempdir().unwrap(),
        };
        let out = stack.ferry(&stack.config(&Overrides::default()), &["migrate"]);
        assert!(
            out.status.success(),
            "migrate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stack
    }

    /// Writes a config file and returns its path.
    pub fn config(&self, o: &Overrides) -> PathBuf {
        let db_url = o.db_url.clone().unwrap_or_else(|| self.db.url().to_owned());
        let amqp = o.amqp_url.clone().unwrap_or_else(amqp_url);
        let routing_key = o.routing_key.as_deref().unwrap_or("{type}");
        let text = format!(
            r#"
[database]
url = "{db_url}"
max_connections = 6

[relay]
batch_size = 500
lease = "{lease}"
max_attempts = {max_attempts}
backoff_base = "50ms"
backoff_max = "1s"
poll_interval = "30s"
shutdown_timeout = "10s"
{wal}

[log]
level = "warn"

[sinks.rabbit]
kind = "rabbitmq"
url = "{amqp}"
publish_timeout = "2s"
max_message_bytes = {max_bytes}
{management}

[[routes]]
name = "orders"
match = "order.**"
sink = "rabbit"
destination = "{exchange}"
routing_key = "{routing_key}"
"#,
            lease = o.lease.as_deref().unwrap_or("3s"),
            max_attempts = o.max_attempts.unwrap_or(1000),
            max_bytes = o.max_message_bytes.unwrap_or(1 << 20),
            exchange = self.topo.exchange(),
            wal = if o.wal {
                // Slot names are server-wide: one per test database.
                format!("mode = \"wal\"\nwal_slot = \"{}\"", self.db.name())
            } else {
                String::new()
            },
            management = o
                .management_url
                .as_ref()
                .map(|u| format!("management_url = \"{u}\""))
                .unwrap_or_default(),
        );
        let path = self.dir.path().join(format!("ferry-{}.toml", rand::random::<u32>()));
        std::fs::write(&path, text).unwrap();
        path
    }

    pub fn ferry(&self, config: &Path, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("--config")
            .arg(config)
            .args(args)
            .output()
            .expect("run ferry")
    }

    pub fn spawn(&self, config: &Path, id: &str) -> Relay {
        let log = self.dir.path().join(format!("{id}.log"));
        let mut command = Command::new(BIN);
        command
            .arg("--config")
            .arg(config)
            .arg("run")
            .env("FERRY_RELAY__ID", id)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let child = dies_with_test(&mut command).spawn().expect("spawn ferry run");
        Relay { child, log }
    }

    pub async fn status(&self, config: &Path) -> serde_json::Value {
        let out = self.ferry(config, &["status", "--json"]);
        assert!(
            out.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Polls `ferry status` until `done` holds for it (a batch is settled a
    /// moment after its events reach the destination); panics with the last
    /// status and the relay's log after `within`.
    pub async fn status_until(
        &self,
        config: &Path,
        relay: &Relay,
        within: Duration,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let st = self.status(config).await;
            if done(&st) {
                return st;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "status never got there: {st}\nlog:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the relay has settled all but `left` events of the
    /// outbox (the rest still unrouted) and returns how many were unrouted
    /// then: read a moment before the caller's fault, so that the caller can
    /// check the fault met work still to do (a relay that drained the whole
    /// backlog first would make a fault test prove nothing).
    pub async fn unrouted_at_most(&self, left: i64, relay: &Relay) -> i64 {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let now: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
                .fetch_one(&self.pool)
                .await
                .unwrap();
            if now <= left {
                return now;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no progress: {now} events unrouted; relay log:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Asserts that a fault met a backlog of at least 500 events (`left`, read
/// just before it).
pub fn assert_interrupted(left: i64, fault: &str) {
    assert!(
        left >= 500,
        "the relay had all but drained the backlog before the {fault} ({left} left): the fault interrupted nothing"
    );
}

#[derive(Default)]
pub struct Overrides {
    pub db_url: Option<String>,
    pub amqp_url: Option<String>,
    pub lease: Option<String>,
    pub max_attempts: Option<u32>,
    pub max_message_bytes: Option<usize>,
    pub routing_key: Option<String>,
    /// RabbitMQ's management API, asked for bindings at start.
    pub management_url: Option<String>,
    /// WAL streaming mode, with a slot named after the test database.
    pub wal: bool,
}

/// A running `ferry run` process.
pub struct Relay {
    child: Child,
    log: PathBuf,
}

impl Relay {
    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's pid with a valid signal.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let status = wait_exit(&mut self.child, Duration::from_secs(30));
        assert!(
            status.is_some(),
            "ferry did not exit after SIGTERM; log:\n{}",
            self.log()
        );
        status.unwrap()
    }

    /// SIGKILL: no chance to release leases or record outcomes.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running (it has not exited on its own).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

/// A route's (published, pending, dead) counts in `ferry status --json`;
/// zeros while the route has no deliveries yet.
pub fn published(status: &serde_json::Value, route: &str) -> (u64, u64, u64) {
    let Some(r) = status["routes"]
        .as_array()
        .and_then(|routes| routes.iter().find(|r| r["route"] == route))
    else {
        return (0, 0, 0);
    };
    let count = |state: &str| r[state].as_u64().unwrap();
    (count("published"), count("pending"), count("dead"))
}

/// Waits until a relay streams from the test database's slot, past its
/// start-up sweep.
pub async fn streaming(s: &Stack) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if ferry_store::postgres::wal::streaming(&s.pool, s.db.name())
            .await
            .unwrap()
        {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no relay streams from the slot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_exit(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Commits `n` events over `keys` keys, 500 per transaction. Each payload
/// carries its key and its index within the key, so order can be checked.
pub async fn produce(pool: &PgPool, n: usize, keys: usize) {
    produce_from(pool, 0, n, keys).await
}

/// Like [`produce`], continuing each key's numbering at `start / keys`.
pub async fn produce_from(pool: &PgPool, start: usize, n: usize, keys: usize) {
    produce_events(
        pool,
        (start..start + n)
            .map(|i| order(i / keys, &format!("k{}", i % keys)))
            .collect(),
    )
    .await
}

pub fn order(n: usize, key: &str) -> Event {
    Event::new(
        "order.item.created",
        json!({ "key": key, "n": n, "pad": "x".repeat(400) }),
    )
    .key(key)
}

pub async fn produce_events(pool: &PgPool, events: Vec<Event>) {
    for chunk in events.chunks(500) {
        let mut tx = pool.begin().await.unwrap();
        enqueue_batch(&mut tx, chunk.to_vec()).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// Everything a consumer saw, checked against the contract.
#[derive(Default)]
pub struct Tally {
    pub messages: Vec<Received>,
}

impl Tally {
    /// Receives until `unique` distinct events arrived or `within` passed.
    pub async fn collect(&mut self, topo: &TestTopology, unique: usize, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while self.unique() < unique && tokio::time::Instant::now() < deadline {
            let got = topo.receive(unique - self.unique(), Duration::from_millis(500)).await;
            self.messages.extend(got);
        }
    }

    pub fn unique(&self) -> usize {
        self.messages
            .iter()
            .filter_map(|m| m.message_id.as_deref())
            .collect::<HashSet<_>>()
            .len()
    }

    pub fn duplicates(&self) -> usize {
        self.messages.len() - self.unique()
    }

    /// Per key, first arrivals are in production order; returns keys seen.
    pub fn assert_per_key_order(&self) -> usize {
        let mut seen = HashSet::new();
        let mut next: HashMap<String, u64> = HashMap::new();
        for m in &self.messages {
            let id = m.message_id.clone().expect("every message has an id");
            if !seen.insert(id) {
                continue;
            }
            let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
            let key = body["key"].as_str().unwrap().to_owned();
            let n = body["n"].as_u64().unwrap();
            let expected = next.entry(key.clone()).or_insert(0);
            assert_eq!(n, *expected, "key {key}: got event {n}, expected {expected}");
            *expected += 1;
        }
        next.len()
    }
}
