//! `ferry demo`, as a newcomer runs it: no config, no server. Its summary
//! must prove the guarantees, and the database it leaves must answer the
//! admin commands it prints.

use std::process::Command;

use crate::support::BIN;

#[test]
fn the_demo_proves_its_guarantees_and_leaves_an_inspectable_database() {
    let dir = tempfile::tempdir().unwrap();
    let demo_dir = dir.path().join("demo");
    let run = |orders: &str| {
        Command::new(BIN)
            .args(["demo", "--orders", orders, "--dir"])
            .arg(&demo_dir)
            .env_remove("FERRY_CONFIG")
            .output()
            .unwrap()
    };
    let out = run("60");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    let line = |label: &str| -> u64 {
        let l = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no line {label:?} in:\n{stdout}"));
        l.trim_start()[label.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(line("lost"), 0, "{stdout}");
    assert_eq!(line("dead"), 1, "{stdout}");
    assert!(line("transactions rolled back") >= 3, "{stdout}");
    assert!(line("delivered to the webhook") > 60, "{stdout}");
    assert!(stdout.contains("their events reached no one: 0 sent  [ok]"), "{stdout}");
    assert!(!stdout.contains("FAILED"), "{stdout}");
    // The refunds went to stdout as JSON lines, among the summary.
    let refunds = stdout.lines().filter(|l| l.contains("\"shop.order.refunded\"")).count();
    assert_eq!(refunds as u64, line("printed to stdout"), "{stdout}");

    // The config it wrote inspects what it left.
    let config = demo_dir.join("ferry.toml");
    let status = Command::new(BIN)
        .args(["status", "--json", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let webhook = report["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == "shop-webhook")
        .expect("the webhook route");
    assert_eq!(webhook["dead"], 1, "{report}");
    assert_eq!(webhook["pending"], 0, "{report}");

    // A second run replaces the first's database; a FERRY_CONFIG set for
    // the other verbs is not read, and the demo says so.
    let again = Command::new(BIN)
        .args(["demo", "--orders", "20", "--dir"])
        .arg(&demo_dir)
        .env("FERRY_CONFIG", dir.path().join("elsewhere.toml"))
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stdout));
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        stderr.contains("warning: FERRY_CONFIG is set") && stderr.contains("`ferry demo` reads no config file"),
        "{stderr}"
    );
}

#[test]
fn the_demo_refuses_a_config_flag_and_a_ferry_toml_it_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ferry.toml");
    let mine = "[database]\nurl = \"postgres://app@db/app\"\n";
    std::fs::write(&config, mine).unwrap();
    let demo = |global: &[&str]| {
        Command::new(BIN)
            .args(global)
            .args(["demo", "--dir"])
            .arg(dir.path())
            .env_remove("FERRY_CONFIG")
            .output()
            .unwrap()
    };

    let flagged = demo(&["--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&flagged.stderr);
    assert_eq!(flagged.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--config: `ferry demo` reads no config file"),
        "{stderr}"
    );

    let out = demo(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("is not a config an earlier `ferry demo` wrote"),
        "{stderr}"
    );
    assert!(stderr.contains("another --dir"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), mine);
    assert!(!dir.path().join("ferry.db").exists());
}
