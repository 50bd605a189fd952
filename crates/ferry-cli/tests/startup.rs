//! What the built `ferry` binary says before it does anything: a relay with
//! no route to deliver to and settings it would otherwise ignore are
//! refused, `check` tells what it could not verify, and a signal before the
//! relay runs stops it cleanly.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_testkit::pg::TestDb;
use ferry_testkit::process::dies_with_test;
use ferry_testkit::rabbit::{TestTopology, unique_name};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ferry");

/// `ferry` with no config file and only `env` for its settings, as a
/// container configured by environment runs it. Killed if it has not
/// exited within `within`.
fn ferry_env(env: &[(&str, &str)], args: &[&str], within: Duration) -> Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("FERRY_CONFIG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = dies_with_test(&mut command).spawn().expect("spawn ferry");
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}

/// `ferry run` with `config`, its output captured.
fn spawn_run(config: &std::path::Path) -> std::process::Child {
    let mut command = Command::new(BIN);
    command
        .args(["--config", config.to_str().unwrap(), "run"])
        .env_remove("FERRY_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    dies_with_test(&mut command).spawn().expect("spawn ferry")
}

fn sigterm(child: &std::process::Child) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Only `database.url` from the environment: a config with no route loads,
/// and the commands that need no route work with it, but a relay would
/// record every event dead `(no route)`, so `ferry run` refuses to start,
/// and `check` warns that it will.
#[tokio::test]
async fn run_refuses_a_config_without_routes_that_migrate_and_status_accept() {
    let db = TestDb::create().await;
    let env = [("FERRY_DATABASE__URL", db.url())];
    for verb in ["migrate", "status", "check"] {
        let out = ferry_env(&env, &[verb], Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(0), "{verb}: {}", text(&out.stderr));
        if verb == "check" {
            let stdout = text(&out.stdout);
            assert!(
                stdout.contains("\nwarn routes: `ferry run` refuses this config: none configured"),
                "{stdout}"
            );
        }
    }
    let out = ferry_env(&env, &["run"], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "ferry run without routes: {stderr}");
    assert!(stderr.starts_with("error: routes: none configured"), "{stderr}");
    assert!(
        stderr.contains("add a [[routes]] section") && stderr.contains("--config FILE or FERRY_CONFIG"),
        "{stderr}"
    );
    db.drop_db().await;
}

/// A role that may not read the Ferry schema is told so: the schema is
/// there, and `ferry migrate` is not the fix.
#[tokio::test]
async fn check_tells_a_schema_it_may_not_read_from_a_missing_one() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    ferry_store::postgres::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let role = &format!("{}_no_access", db.name());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let url = db.url().replacen("://root@", &format!("://{role}@"), 1);
    assert_ne!(url, db.url(), "the test database's URL names another user");
    let out = ferry_env(
        &[("FERRY_DATABASE__URL", url.as_str())],
        &["check"],
        Duration::from_secs(60),
    );
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("database "))
        .unwrap_or_else(|| panic!("no line for the database: {stdout}{}", text(&out.stderr)));
    assert!(line.starts_with("FAIL"), "{line}");
    assert!(line.contains("permission denied"), "{line}");
    assert!(!line.contains("no ferry schema"), "{line}");
    pool.close().await;
    db.drop_db().await;
    let admin = sqlx::PgPool::connect(&ferry_testkit::pg::admin_url()).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
        .execute(&admin)
        .await
        .unwrap();
}

/// `check` reads the database's clock and compares it with this host's:
/// the local server shares this host's clock, so the line passes.
#[tokio::test]
async fn check_compares_the_database_clock_with_this_host() {
    let db = TestDb::create().await;
    let out = ferry_env(
        &[("FERRY_DATABASE__URL", db.url())],
        &["check"],
        Duration::from_secs(60),
    );
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("clocks (this host, database)"))
        .unwrap_or_else(|| panic!("no line for the clocks: {stdout}{}", text(&out.stderr)));
    assert!(line.starts_with("ok "), "{line}");
    assert!(
        line.contains("the database's clock is ") && line.contains("half the round trip"),
        "{line}"
    );
    db.drop_db().await;
}

/// A database address that takes the connection and never answers (a
/// host dropping packets after the handshake, a proxy with nothing behind
/// it): `check` says so and ends, rather than wait until the OS gives up.
#[test]
fn check_ends_when_the_database_takes_the_connection_and_never_answers() {
    // Never accepted: the kernel completes the handshake, and the server's
    // side of the startup exchange never comes.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("postgres://ferry@{}/ferry", silent.local_addr().unwrap());
    let out = ferry_env(
        &[("FERRY_DATABASE__URL", url.as_str())],
        &["check"],
        Duration::from_secs(90),
    );
    assert!(
        out.status.code().is_some(),
        "check was still waiting after 90 s (killed): {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_ne!(out.status.code(), Some(0));
    drop(silent);
}

/// `FERRY_DATABASE_URL` (one underscore) is no setting: read as nothing, it
/// would leave the file's URL in force without a word. Every command
/// refuses it, naming the variable and the name meant.
#[test]
fn a_setting_with_a_single_underscore_is_refused_with_the_name_meant() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        "[database]\nurl = \"postgres://root@127.0.0.1:5432/ferry_from_the_file\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let env = [("FERRY_DATABASE_URL", "postgres://root@127.0.0.1:5432/postgres")];
    for verb in ["status", "run", "check"] {
        let out = ferry_env(&env, &["--config", config, verb], Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{verb}: {stderr}");
        assert!(
            stderr.starts_with("error: FERRY_DATABASE_URL: not a setting Ferry reads")
                && stderr.contains("write FERRY_DATABASE__URL"),
            "{verb}: {stderr}"
        );
    }
}

/// An SQLite database in a directory that does not exist cannot be opened:
/// `ferry run` and `ferry migrate` end with an error that says to check the
/// directory. `ferry run` used to take it for a database down at start and
/// retry every second for ever.
#[test]
fn an_sqlite_file_that_cannot_be_opened_ends_run_and_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("missing").join("ferry.db");
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\n\n[sinks.out]\nkind = \"stdout\"\n\n\
             [[routes]]\nmatch = \"order.*\"\nsink = \"out\"\ndestination = \"-\"\n",
            db.display()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    for verb in ["run", "migrate"] {
        let out = ferry_env(&[], &["--config", config, verb], Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert!(
            out.status.code().is_some_and(|c| c != 0),
            "{verb}: {:?} (killed: still running after 30 s): {stderr}",
            out.status
        );
        assert!(
            stderr.contains(&db.display().to_string()) && stderr.contains("directory exists and is writable"),
            "{verb}: {stderr}"
        );
        assert!(!stderr.contains("retrying"), "{verb}: {stderr}");
    }
    assert!(!db.parent().unwrap().exists());
}

/// One call to the local RabbitMQ's management API as `guest`; the status.
fn rabbit_api(method: &str, path: &str, body: &str) -> u16 {
    let mut stream = TcpStream::connect("127.0.0.1:15672").expect("the RabbitMQ management API");
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:15672\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A RabbitMQ user that may publish on `/` but has no tag, so the
/// management API refuses it; deleted on drop.
struct UntaggedUser(String);

impl UntaggedUser {
    fn create() -> UntaggedUser {
        let user = UntaggedUser(unique_name("untagged"));
        let name = &user.0;
        let created = rabbit_api("PUT", &format!("/api/users/{name}"), r#"{"password":"pw","tags":""}"#);
        assert!(matches!(created, 201 | 204), "creating user {name}: HTTP {created}");
        let granted = rabbit_api(
            "PUT",
            &format!("/api/permissions/%2F/{name}"),
            r#"{"configure":".*","write":".*","read":".*"}"#,
        );
        assert!(matches!(granted, 201 | 204), "granting {name}: HTTP {granted}");
        user
    }
}

impl Drop for UntaggedUser {
    fn drop(&mut self) {
        rabbit_api("DELETE", &format!("/api/users/{}", self.0), "");
    }
}

/// A RabbitMQ user that may publish but has no management tag, so the
/// management API refuses it. With no `management_url`, `check` asks the
/// API with the AMQP credentials and is refused: it cannot see the bindings
/// of an exchange that reaches no queue. It passes (the broker's returns
/// still catch every unroutable publish), but says so on the route's line.
#[tokio::test]
async fn check_says_when_it_could_not_see_a_rabbitmq_routes_bindings() {
    let untagged = UntaggedUser::create();
    let user = &untagged.0;
    let db = TestDb::create().await;
    let nobody = TestTopology::create_unbound("check-caveat").await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[sinks.rabbit]\nkind = \"rabbitmq\"\n\
             url = \"amqp://{user}:pw@127.0.0.1:5672/%2f\"\n\n[[routes]]\nname = \"orders\"\n\
             match = \"order.*\"\nsink = \"rabbit\"\ndestination = \"{}\"\n",
            db.url(),
            nobody.exchange()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let ferry = |args: &[&str]| {
        let mut all = vec!["--config", config];
        all.extend(args);
        ferry_env(&[], &all, Duration::from_secs(60))
    };
    let out = ferry(&["migrate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let out = ferry(&["check"]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let line = stdout
        .lines()
        .find(|l| l.contains("routes[0] (orders)"))
        .unwrap_or_else(|| panic!("no line for the route: {stdout}"));
    assert!(line.starts_with("warn "), "{line}");
    assert!(
        line.contains(
            "exchange exists; bindings not checked: could not ask the management API at http://127.0.0.1:15672/ \
             (HTTP 401 Unauthorized)"
        ) && line.contains("set the sink's management_url"),
        "{line}"
    );
    let out = ferry(&["check", "--json"]);
    let findings: Value = serde_json::from_slice(&out.stdout).unwrap();
    let route = findings
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["what"].as_str().unwrap().contains("(orders)"))
        .unwrap();
    assert_eq!(route["ok"], true);
    assert!(
        route["caveats"][0].as_str().unwrap().contains("bindings not checked"),
        "{route}"
    );
    nobody.delete().await;
    db.drop_db().await;
}

/// A SIGTERM while `ferry run` is still starting (here: checking a
/// destination whose broker accepts the connection and never answers)
/// stops the start and exits 0, as one after the start does; it used to
/// kill the process, which an orchestrator reads as a crash.
#[tokio::test]
async fn a_signal_during_the_start_exits_cleanly() {
    let db = TestDb::create().await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[sinks.rabbit]\nkind = \"rabbitmq\"\n\
             url = \"amqp://guest:guest@127.0.0.1:{port}/%2f\"\n\n\
             [[routes]]\nmatch = \"order.*\"\nsink = \"rabbit\"\ndestination = \"orders\"\n",
            db.url()
        ),
    )
    .unwrap();
    let mut child = spawn_run(&config);
    // The start is under way once the destination's check has connected.
    silent.set_nonblocking(true).unwrap();
    let connected_by = Instant::now() + Duration::from_secs(60);
    let _held = loop {
        match silent.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < connected_by => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the destination check never connected: {e}"),
        }
    };
    sigterm(&child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{:?}: {stderr}", out.status);
    db.drop_db().await;
}

/// A second SIGTERM or Ctrl-C while the relay stops, 2 s or more after the
/// first, ends it at once, as an operator's second Ctrl-C means: here the
/// stop would wait out a webhook request the receiver never answers. One
/// right after the first is the same stop signalled twice, and ignored. Nothing is lost: the delivery stays
/// pending, to be published again.
#[tokio::test]
async fn a_second_signal_while_stopping_exits_at_once() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    ferry_store::postgres::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    // Answers the start-up check's HEAD; holds every POST unanswered.
    let receiver = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = receiver.local_addr().unwrap().port();
    let posted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = posted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in receiver.incoming() {
            let Ok(mut stream) = stream else { break };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            if head.starts_with(b"HEAD") {
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            } else {
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
                held.push(stream);
            }
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[relay]\nshutdown_timeout = \"60s\"\n\n\
             [sinks.hook]\nkind = \"webhook\"\ntimeout = \"20s\"\n\n\
             [[routes]]\nname = \"orders\"\nmatch = \"order.*\"\nsink = \"hook\"\n\
             destination = \"http://127.0.0.1:{port}/hook\"\n",
            db.url()
        ),
    )
    .unwrap();
    let mut child = spawn_run(&config);
    let mut tx = pool.begin().await.unwrap();
    ferry_store::postgres::enqueue(
        &mut tx,
        ferry_core::Event::new("order.created", serde_json::json!({"n": 1})).key("k"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let posted_by = Instant::now() + Duration::from_secs(60);
    while !posted.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < posted_by, "the relay never posted the event");
        std::thread::sleep(Duration::from_millis(20));
    }
    sigterm(&child);
    // The same stop signalled twice at once (systemd's ExecStop kill, then
    // its own): not a second signal.
    std::thread::sleep(Duration::from_millis(100));
    sigterm(&child);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(child.try_wait().unwrap().is_none(), "the stop waits for the request");
    let second = Instant::now();
    sigterm(&child);
    let deadline = second + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(143),
        "128 + SIGTERM; {:?}: {stderr}",
        out.status
    );
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'pending'")
        .fetch_one(&pool)
        .await
        .unwrap();
    let unrouted: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pending + unrouted, 1, "the event waits to be published again");
    pool.close().await;
    db.drop_db().await;
}

/// A migrated database and a config with one stdout route, plus `extra`:
/// everything `check` verifies passes, but for what `extra` breaks.
async fn checked_config(dir: &std::path::Path, db: &TestDb, extra: &str) -> std::path::PathBuf {
    let pool = db.pool().await;
    ferry_store::postgres::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    pool.close().await;
    let config = dir.join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[sinks.out]\nkind = \"stdout\"\n\n\
             [[routes]]\nmatch = \"order.*\"\nsink = \"out\"\ndestination = \"-\"\n\n{extra}",
            db.url()
        ),
    )
    .unwrap();
    config
}

/// An archive directory that does not exist: `ferry run` refuses to start,
/// and `ferry check`, which passed it, fails on it with the same message.
#[tokio::test]
async fn check_fails_on_an_archive_dir_run_refuses() {
    let db = TestDb::create().await;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("archive");
    let config = checked_config(
        dir.path(),
        &db,
        &format!("[retention]\narchive_dir = \"{}\"\n", archive.display()),
    )
    .await;
    let config = config.to_str().unwrap();
    let message = format!("retention.archive_dir: cannot write to {}", archive.display());
    let out = ferry_env(&[], &["--config", config, "run"], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "run: {stderr}");
    assert!(stderr.starts_with(&format!("error: {message}")), "run: {stderr}");
    let out = ferry_env(&[], &["--config", config, "check"], Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "check: {stdout}{}", text(&out.stderr));
    assert!(stdout.contains(&format!("FAIL {message}")), "check: {stdout}");
    assert!(
        stdout.contains("create the directory and make it writable"),
        "check: {stdout}"
    );
    // Made, it passes.
    std::fs::create_dir(&archive).unwrap();
    let out = ferry_env(&[], &["--config", config, "check"], Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(0), "check: {}", text(&out.stdout));
    db.drop_db().await;
}

/// `RUST_LOG=verbose` reads as a target name and silenced every line Ferry
/// logs, dead deliveries' warnings included; `RUST_LOG` now gets the check
/// `log.level` gets, at the start of `run` and in `check`.
#[tokio::test]
async fn run_and_check_refuse_a_rust_log_that_log_level_would_refuse() {
    let db = TestDb::create().await;
    let dir = tempfile::tempdir().unwrap();
    let config = checked_config(dir.path(), &db, "").await;
    let config = config.to_str().unwrap();
    let env = [("RUST_LOG", "verbose")];
    let out = ferry_env(&env, &["--config", config, "run"], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "run: {stderr}");
    assert!(
        stderr.starts_with("error: RUST_LOG: unknown level \"verbose\"")
            && stderr.contains("unset RUST_LOG to log at log.level (\"info\")"),
        "run: {stderr}"
    );
    let out = ferry_env(&env, &["--config", config, "check"], Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "check: {stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("FAIL RUST_LOG: unknown level \"verbose\""),
        "check: {stdout}"
    );
    let out = ferry_env(
        &[("RUST_LOG", "debug")],
        &["--config", config, "check"],
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "check: {}", text(&out.stdout));
    db.drop_db().await;
}

/// A `[tracing]` section in a binary built without `otel`: `ferry run`
/// refuses it, and `check` fails on it.
#[cfg(not(feature = "otel"))]
#[tokio::test]
async fn check_fails_on_tracing_a_binary_without_otel_refuses() {
    let db = TestDb::create().await;
    let dir = tempfile::tempdir().unwrap();
    let config = checked_config(
        dir.path(),
        &db,
        "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n",
    )
    .await;
    let config = config.to_str().unwrap();
    let out = ferry_env(&[], &["--config", config, "run"], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "run: {stderr}");
    assert!(
        stderr.starts_with("error: tracing.otlp_endpoint: this ferry was built without the `otel` feature"),
        "run: {stderr}"
    );
    let out = ferry_env(&[], &["--config", config, "check"], Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "check: {stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("FAIL tracing.otlp_endpoint: this ferry was built without the `otel` feature"),
        "check: {stdout}"
    );
    db.drop_db().await;
}
