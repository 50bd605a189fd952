//! `ferry run` stopping with a blocking-pool thread that never ends.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_testkit::pg::TestDb;
use ferry_testkit::process::dies_with_test;

const BIN: &str = env!("CARGO_BIN_EXE_ferry");

/// Whether a thread of process `pid` waits to write into a full pipe.
fn writing_into_a_full_pipe(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        // `pipe_write`, `anon_pipe_write` or `pipe_wait_writable`, by kernel.
        std::fs::read_to_string(task.path().join("wchan"))
            .is_ok_and(|wchan| wchan.contains("pipe") && wchan.contains("writ"))
    })
}

/// A stdout sink whose reader never reads: the relay's write blocks on a
/// blocking-pool thread for ever. The relay stopped after SIGTERM, but the
/// runtime, dropped at the end of `main`, waited for that thread: the
/// process never exited, and an orchestrator had to kill it.
#[tokio::test]
async fn run_exits_after_sigterm_with_a_stdout_nobody_reads() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    ferry_store::postgres::migrate(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[relay]\nshutdown_timeout = \"2s\"\n\n\
             [sinks.out]\nkind = \"stdout\"\n\n\
             [[routes]]\nname = \"orders\"\nmatch = \"order.*\"\nsink = \"out\"\ndestination = \"-\"\n",
            db.url()
        ),
    )
    .unwrap();
    let stderr = dir.path().join("stderr.log");
    let mut command = Command::new(BIN);
    command
        .args(["--config", config.to_str().unwrap(), "run"])
        .env_remove("FERRY_CONFIG")
        .stdin(Stdio::null())
        // Held, never read.
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap());
    let mut child = dies_with_test(&mut command).spawn().expect("spawn ferry");
    // Far more than a pipe holds (64 KiB).
    let mut tx = pool.begin().await.unwrap();
    for n in 0..200 {
        let event = ferry_core::Event::new("order.created", serde_json::json!({ "n": n, "pad": "x".repeat(2_000) }));
        ferry_store::postgres::enqueue(&mut tx, event.key(format!("k{n}")))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let blocked_by = Instant::now() + Duration::from_secs(60);
    while !writing_into_a_full_pipe(child.id()) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "ferry run ended: {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        assert!(
            Instant::now() < blocked_by,
            "the relay never blocked writing to its stdout: {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // shutdown_timeout, the sinks' close, then the exit's own bound.
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let exited = child.try_wait().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&stderr).unwrap_or_default();
    let status = exited.unwrap_or_else(|| panic!("ferry run still running 30 s after SIGTERM: {log}"));
    assert_eq!(status.code(), Some(0), "{status:?}: {log}");
    pool.close().await;
    db.drop_db().await;
}
