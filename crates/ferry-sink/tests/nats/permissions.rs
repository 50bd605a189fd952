//! A NATS user without a permission the sink needs. The server drops the
//! publish (or the PubAck subscription) and says so only in an `-ERR` on
//! the connection, so a sink that waits for PubAcks alone reports a slow
//! JetStream after its whole publish timeout. These tests run a nats-server
//! of their own, with users, on a free port (`FERRY_TEST_NATS_SERVER` names
//! the program; default `nats-server` on the PATH, then /usr/sbin).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_sink::nats::{NatsOptions, NatsSink};
use serde_json::json;

use crate::support::{api, expect_err, keyed, route};

struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    /// `narrow` may publish to `ok.>` and the JetStream API only; `blind`
    /// to `ok.>` only; `deaf` may publish anywhere and subscribe to
    /// nothing; `admin` may do all.
    fn start() -> Server {
        // Another process may take the free port before the server binds
        // it; the server then exits, and another port is tried.
        for _ in 0..5 {
            if let Some(server) = Server::try_start() {
                return server;
            }
        }
        panic!("nats-server did not listen on a free port in five tries");
    }

    fn try_start() -> Option<Server> {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("nats.conf");
        std::fs::write(&config, Server::config(port, dir.path(), "")).unwrap();
        let child = Command::new(program())
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server (set FERRY_TEST_NATS_SERVER to its path)");
        let mut server = Server { child, port, _dir: dir };
        for _ in 0..400 {
            if let Ok(Some(_)) = server.child.try_wait() {
                return None;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("nats-server did not listen on port {port} in 20 s");
    }

    /// The server's configuration, with `more` users beside the four.
    fn config(port: u16, dir: &std::path::Path, more: &str) -> String {
        format!(
            r#"listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{store}" }}
authorization {{
  users = [
    {more}
    {{ user: admin, password: admin }}
    {{ user: narrow, password: narrow, permissions: {{
        publish: {{ allow: ["ok.>", "$JS.API.>"] }}, subscribe: {{ allow: ["_INBOX.>"] }} }} }}
    {{ user: deaf, password: deaf, permissions: {{ subscribe: {{ deny: [">"] }} }} }}
    {{ user: blind, password: blind, permissions: {{
        publish: {{ allow: ["ok.>"] }}, subscribe: {{ allow: ["_INBOX.>"] }} }} }}
  ]
}}
"#,
            store = dir.join("js").display()
        )
    }

    /// Adds a user with every permission and has the server reload its
    /// configuration (SIGHUP).
    fn add_user(&self, user: &str) {
        let more = format!("{{ user: {user}, password: {user} }}");
        std::fs::write(
            self._dir.path().join("nats.conf"),
            Server::config(self.port, self._dir.path(), &more),
        )
        .unwrap();
        let status = Command::new("kill")
            .arg("-HUP")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "signal nats-server to reload");
    }

    fn url(&self, user: &str) -> String {
        format!("nats://{user}:{user}@127.0.0.1:{}", self.port)
    }

    fn sink(&self, user: &str) -> NatsSink {
        NatsSink::new(NatsOptions {
            url: self.url(user),
            // Long, so that a test which waited it out would show.
            publish_timeout: Duration::from_secs(30),
            ..NatsOptions::default()
        })
    }

    /// A memory stream capturing `ok.>` and `no.>`, made as `admin`.
    async fn stream(&self) -> async_nats::Client {
        let admin = async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin".into())
            .connect(format!("127.0.0.1:{}", self.port))
            .await
            .expect("connect as admin");
        let config = json!({
            "name": "PERMS",
            "subjects": ["ok.>", "no.>"],
            "storage": "memory",
            "num_replicas": 1,
            "duplicate_window": 600_000_000_000u64,
        });
        let answer = api(&admin, "$JS.API.STREAM.CREATE.PERMS", config).await;
        assert!(answer.get("error").is_none(), "{answer}");
        admin
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn program() -> PathBuf {
    if let Some(path) = std::env::var_os("FERRY_TEST_NATS_SERVER") {
        return path.into();
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"))
}

async fn stored(admin: &async_nats::Client) -> u64 {
    let info = api(admin, "$JS.API.STREAM.INFO.PERMS", json!({})).await;
    info["state"]["messages"].as_u64().expect("state.messages")
}

#[tokio::test]
async fn a_subject_the_user_may_not_publish_to_is_named_not_waited_out() {
    let server = Server::start();
    let admin = server.stream().await;
    let sink = server.sink("narrow");
    let events = keyed(3, |seq| format!("k{seq}"));
    let refused = sink.publish(&route("no.orders"), &events).await;
    assert_eq!(refused.len(), 3);
    for outcome in &refused {
        // Transient: granting the permission lets the retries through.
        expect_err(
            outcome,
            ErrorKind::Transient,
            r#"Permissions Violation for Publish to "no.orders""#,
        );
        expect_err(outcome, ErrorKind::Transient, "publish permissions");
    }
    // Refusals still arriving for that batch are not taken for check's own.
    sink.check(&route("ok.orders")).await.expect("ok.orders is allowed");
    // The same connection still carries what the user may publish.
    let allowed = sink.publish(&route("ok.orders"), &events).await;
    assert!(allowed.iter().all(Result::is_ok), "{allowed:?}");
    assert_eq!(stored(&admin).await, 3, "only the allowed subject's events are stored");
    sink.close().await;
}

#[tokio::test]
async fn a_user_who_may_not_subscribe_hears_no_pubacks_and_is_told_why() {
    let server = Server::start();
    let admin = server.stream().await;
    let sink = server.sink("deaf");
    // `check` asks JetStream, whose answers come to an inbox it may not read.
    // The server refuses the inbox once per connection: a second check
    // (another route, the health probe) is told why too, not timed out.
    for _ in 0..2 {
        let err = sink.check(&route("ok.orders")).await.expect_err("no inbox");
        assert_eq!(err.kind, ErrorKind::Config, "{err}");
        assert!(err.message.contains("Permissions Violation for Subscription"), "{err}");
        assert!(err.message.contains("subscribe to _INBOX.>"), "{err}");
    }
    // The publish itself goes through; only its PubAck cannot come back, so
    // the event counts as failed (may or may not be stored) and is retried,
    // which the duplicate window absorbs.
    let events = keyed(2, |seq| format!("k{seq}"));
    let outcomes = sink.publish(&route("ok.orders"), &events).await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Transient, "subscribe to _INBOX.>");
    }
    // The refusal of the inbox can come back before the server has stored
    // the messages sent after it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stored(&admin).await < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stored(&admin).await, 2);
    sink.close().await;
}

#[tokio::test]
async fn a_user_without_the_jetstream_api_can_publish_and_check_says_it_cannot_look() {
    let server = Server::start();
    let admin = server.stream().await;
    let sink = server.sink("blind");
    // Publishing needs no API subject, so this must not stop a relay starting.
    let err = sink.check(&route("ok.orders")).await.expect_err("no API");
    assert_eq!(err.kind, ErrorKind::Transient, "{err}");
    assert!(err.message.contains("$JS.API"), "{err}");
    assert!(err.message.contains("cannot be checked"), "{err}");
    let events = keyed(2, |seq| format!("k{seq}"));
    let outcomes = sink.publish(&route("ok.orders"), &events).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(stored(&admin).await, 2);
    sink.close().await;
}

/// A login the server refuses (its user not there yet, as while an auth
/// callout or account resolver restarts, or in the middle of a password
/// rotation) is a configuration error to `check`, which runs before a relay
/// starts, but only transient to a publish: the events wait and go through
/// once the user is there. Each batch that met the refusal went dead.
#[tokio::test]
async fn a_refused_login_fails_a_check_but_only_delays_a_publish() {
    let server = Server::start();
    let admin = server.stream().await;
    let sink = server.sink("late");
    let err = sink.check(&route("ok.orders")).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    let sink = server.sink("late");
    let events = keyed(3, |seq| format!("k{seq}"));
    for outcome in sink.publish(&route("ok.orders"), &events).await {
        expect_err(&outcome, ErrorKind::Transient, "authorization");
    }
    server.add_user("late");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let outcomes = loop {
        let outcomes = sink.publish(&route("ok.orders"), &events).await;
        if outcomes.iter().all(Result::is_ok) || std::time::Instant::now() > deadline {
            break outcomes;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(stored(&admin).await, 3);
}
