//! The file sink through a relay killed while writing: every event is in
//! some file, no line is split or glued to another, and each key's lines
//! keep their order across the rotated files.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_core::Event;
use ferry_testkit::rabbit::TestTopology;
use serde_json::{Value, json};

use crate::support::{PATIENCE, Stack, assert_interrupted, produce_events, published};

const EVENTS: usize = 2_000;
const KEYS: usize = 20;

#[tokio::test]
async fn a_relay_killed_while_writing_files_loses_no_line_and_splits_none() {
    let s = Stack::new(TestTopology::create_unbound("e2e-file").await).await;
    let out = s.dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let live = out.join("events.jsonl");
    let cfg = s.dir.path().join("file.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[database]
url = "{db}"

[relay]
batch_size = 100
lease = "3s"
backoff_base = "50ms"
backoff_max = "1s"

[log]
level = "warn"

[sinks.archive]
kind = "file"
max_file_bytes = 2097152

[[routes]]
name = "archive"
match = "order.**"
sink = "archive"
destination = "{live}"
"#,
            db = s.db.url(),
            live = live.display()
        ),
    )
    .unwrap();
    // Lines of about 20 KB: a batch's writes take many system calls, and a
    // kill lands inside one.
    let events: Vec<Event> = (0..EVENTS)
        .map(|i| {
            let key = format!("k{}", i % KEYS);
            Event::new(
                "order.item.created",
                json!({ "key": key, "n": i / KEYS, "pad": "x".repeat(20_000) }),
            )
            .key(key)
        })
        .collect();
    produce_events(&s.pool, events).await;

    let first = s.spawn(&cfg, "relay-a");
    let left = s.unrouted_at_most(1_500, &first).await;
    first.kill();
    assert_interrupted(left, "kill");
    // What a kill in the middle of a line leaves, for certain: the start of
    // a line at the end of the live file, never reported written.
    let mut tail = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&live)
        .unwrap();
    std::io::Write::write_all(&mut tail, b"{\"id\":\"0190cut-in-the-midd").unwrap();
    drop(tail);

    let second = s.spawn(&cfg, "relay-b");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (done, _, dead) = published(&s.status(&cfg).await, "archive");
        assert_eq!(dead, 0, "log:\n{}", second.log());
        if done == EVENTS as u64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{done} of {EVENTS} written; log:\n{}",
            second.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(second.terminate().success());

    let files = in_write_order(&out, "events.jsonl");
    assert!(files.len() > 2, "the files were rotated: {files:?}");
    let mut seen: HashSet<(String, u64)> = HashSet::new();
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut lines = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(
            text.is_empty() || text.ends_with('\n'),
            "{file:?} ends in part of a line"
        );
        for line in text.lines() {
            lines += 1;
            let value: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{file:?}: a split or glued line ({e}): {}", &line[..line.len().min(80)]));
            let key = value["key"].as_str().unwrap().to_owned();
            let n = value["data"]["n"].as_u64().unwrap();
            if seen.insert((key.clone(), n)) {
                // A key's first appearances come in its order.
                let expected = next.entry(key.clone()).or_insert(0);
                assert_eq!(n, *expected, "key {key}: line {n} before {expected}");
                *expected += 1;
            }
        }
    }
    assert_eq!(seen.len(), EVENTS, "lost events");
    // A relay killed repeats at most what it had written but not recorded.
    assert!(lines - EVENTS <= 500, "{} duplicates", lines - EVENTS);
}

/// `name`'s rotated files by timestamp, then number, then the live file.
fn in_write_order(dir: &Path, name: &str) -> Vec<PathBuf> {
    let prefix = format!("{name}.");
    let mut rotated: Vec<(String, u64, PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|entry| {
            let path = entry.unwrap().path();
            let file = path.file_name()?.to_str()?.to_owned();
            let (stamp, n) = file.strip_prefix(&prefix)?.split_once('.')?;
            Some((stamp.to_owned(), n.parse().ok()?, path))
        })
        .collect();
    rotated.sort();
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, _, path)| path).collect();
    files.push(dir.join(name));
    files
}
