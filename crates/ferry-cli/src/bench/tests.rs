use std::time::Duration;

use anyhow::anyhow;

use super::idle::IdleResult;
use super::report::Report;
use super::*;

fn idle_only() -> Report {
    Report {
        idle: Some(IdleResult {
            window: Duration::from_secs(30),
            transactions: 3,
        }),
        ..Report::default()
    }
}

#[test]
fn a_run_that_fails_still_writes_the_scenarios_it_completed_marked_partial() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("BENCHMARKS.md");
    std::fs::write(&path, "# Benchmarks\n").unwrap();
    let mut report = idle_only();
    let err = finish(
        &mut report,
        Err(anyhow!("creating Kafka topic: timed out")),
        Some(&path),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "creating Kafka topic: timed out");
    let written = std::fs::read_to_string(&path).unwrap();
    assert!(written.starts_with("# Benchmarks\n"), "{written}");
    assert!(
        written.contains("**Partial report**: the run stopped before its end (creating Kafka topic: timed out)"),
        "{written}"
    );
    assert!(written.contains("| idle | 0.100 transactions/s"), "{written}");
}

#[test]
fn a_run_that_completed_nothing_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("BENCHMARKS.md");
    let err = finish(&mut Report::default(), Err(anyhow!("interrupted")), Some(&path)).unwrap_err();
    assert_eq!(err.to_string(), "interrupted");
    assert!(!path.exists());
}

#[test]
fn a_complete_run_is_written_unmarked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("BENCHMARKS.md");
    finish(&mut idle_only(), Ok(()), Some(&path)).unwrap();
    let written = std::fs::read_to_string(&path).unwrap();
    assert!(written.contains("| idle |"), "{written}");
    assert!(!written.contains("Partial"), "{written}");
}
