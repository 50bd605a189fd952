//! What the built `ferry` binary says before it does anything: a relay with
//! no route to deliver to and settings it would otherwise ignore are
//! refused.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_testkit::pg::TestDb;
use ferry_testkit::process::dies_with_test;

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

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Only `database.url` from the environment: a config with no route loads,
/// and the commands that need no route work with it, but a relay would
/// record every event dead `(no route)`, so `ferry run` refuses to start.
#[tokio::test]
async fn run_refuses_a_config_without_routes_that_migrate_and_status_accept() {
    let db = TestDb::create().await;
    let env = [("FERRY_DATABASE__URL", db.url())];
    for verb in ["migrate", "status"] {
        let out = ferry_env(&env, &[verb], Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(0), "{verb}: {}", text(&out.stderr));
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
