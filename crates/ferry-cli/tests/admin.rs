//! The admin verbs (`list`, `show`, `requeue`, `cancel`, `tail`, and
//! `status` thresholds) run as the built `ferry` binary against a real
//! database with deliveries in every state: output parsed, exit codes
//! checked, and the guardrails held.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use chrono::Utc;
use ferry_core::{Event, EventId, Glob, Ownership, Recorded, RelayId, Route, Store, Transition};
use ferry_relay::plan_routes;
use ferry_store::postgres::{PgStore, enqueue_batch, migrate};
use ferry_testkit::pg::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;

const BIN: &str = env!("CARGO_BIN_EXE_ferry");
const ROUTE: &str = "orders";
/// More than the confirmation threshold of `requeue` and `cancel`.
const BULK: usize = 12;

/// `orders` deliveries by key: `kp` pending, `kr` retrying, `kd` dead then
/// a later one held back, `kpub` published, and `BULK` dead `order.bulk`
/// events. The fixture's own relay holds every partition's lease.
struct Fixture {
    store: PgStore,
    pool: PgPool,
    owned: Ownership,
    ids: HashMap<&'static str, EventId>,
    bulk: Vec<EventId>,
    dir: tempfile::TempDir,
    db: TestDb,
}

async fn fixture() -> Fixture {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let store = PgStore::new(pool.clone());
    let names = ["p1", "r1", "d1", "d2", "pub1"];
    let mut events = vec![
        Event::new("order.created", json!({"n": 1})).key("kp"),
        Event::new("order.item.added", json!({"n": 2})).key("kr"),
        Event::new("order.created", json!({"n": 3}))
            .key("kd")
            .header("tenant", "acme"),
        Event::new("order.paid", json!({"n": 4})).key("kd"),
        Event::new("order.shipped", json!({"n": 5})).key("kpub"),
    ];
    events.extend((0..BULK).map(|i| Event::new("order.bulk", json!({ "i": i })).key(format!("b{i}"))));
    let mut tx = pool.begin().await.unwrap();
    let all: Vec<EventId> = enqueue_batch(&mut tx, events)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    tx.commit().await.unwrap();
    let ids: HashMap<&'static str, EventId> = names.into_iter().zip(all.iter().copied()).collect();
    let bulk = all[names.len()..].to_vec();

    let relay = RelayId("fixture".into());
    let mut owned = store.tick(&relay, Duration::from_secs(300), &[]).await.unwrap();
    owned.relay = relay;
    let now = Utc::now();
    let route = Route {
        name: ROUTE.into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "out".into(),
        destination: "-".into(),
        routing_key: None,
    };
    let unrouted = store.fetch_unrouted(&owned, 100).await.unwrap();
    store
        .route(&owned, &plan_routes(&[route], unrouted), now)
        .await
        .unwrap();
    let claimed = store.claim(&owned, ROUTE, 100, now, &[]).await.unwrap();
    let seq = |id: EventId| claimed.iter().find(|c| c.event.id == id).unwrap().event.seq;
    let dead = |id: EventId, reason: &str| Recorded {
        seq: seq(id),
        expected_attempts: 0,
        transition: Transition::Dead {
            attempts: 1,
            reason: reason.into(),
        },
    };
    let mut outcomes = vec![
        Recorded {
            seq: seq(ids["r1"]),
            expected_attempts: 0,
            transition: Transition::Retry {
                attempts: 1,
                next_at: now + chrono::Duration::hours(1),
                error: "broker timeout".into(),
            },
        },
        dead(ids["d1"], "payload too large"),
        Recorded {
            seq: seq(ids["pub1"]),
            expected_attempts: 0,
            transition: Transition::Published { attempts: 1, at: now },
        },
    ];
    outcomes.extend(bulk.iter().map(|id| dead(*id, "unroutable")));
    store.record(&owned, ROUTE, &outcomes, now).await.unwrap();
    Fixture {
        store,
        pool,
        owned,
        ids,
        bulk,
        dir: tempfile::tempdir().unwrap(),
        db,
    }
}

impl Fixture {
    /// A config file with `extra` appended.
    fn config(&self, extra: &str) -> PathBuf {
        self.config_named(ROUTE, extra)
    }

    /// [`Fixture::config`] with the route named `route`.
    fn config_named(&self, route: &str, extra: &str) -> PathBuf {
        let text = format!(
            "[database]\nurl = \"{}\"\n\n[sinks.out]\nkind = \"stdout\"\n\n[[routes]]\nname = \"{route}\"\n\
             match = \"order.**\"\nsink = \"out\"\ndestination = \"-\"\n\n{extra}",
            self.db.url()
        );
        let path = self.dir.path().join(format!("ferry-{}.toml", rand::random::<u32>()));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Runs `ferry` with stdin closed, as a script would.
    fn ferry(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("--config")
            .arg(self.config(""))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run ferry")
    }

    fn id(&self, name: &str) -> String {
        self.ids[name].0.to_string()
    }

    /// The delivery state `ferry show --json` reports on the route.
    fn state(&self, name: &str) -> String {
        let shown = json_of(&self.ferry(&["show", &self.id(name), "--json"]), 0);
        shown["deliveries"][0]["state"].as_str().unwrap().to_owned()
    }

    async fn dead_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ferry.deliveries WHERE state = 'dead'")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// Asserts the exit code and parses stdout as JSON.
fn json_of(out: &Output, code: i32) -> Value {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn event_ids(v: &Value) -> Vec<String> {
    let mut ids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["event_id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn list_and_show_print_json_and_tables() {
    let f = fixture().await;
    let dead = json_of(&f.ferry(&["list", "--state", "dead", "--type", "order.*", "--json"]), 0);
    let dead_ids = event_ids(&dead["deliveries"]);
    assert_eq!(dead_ids.len(), 1 + BULK);
    assert!(dead_ids.contains(&f.id("d1")));
    let retrying = json_of(&f.ferry(&["list", "--state", "retrying", "--json"]), 0);
    assert_eq!(event_ids(&retrying["deliveries"]), [f.id("r1")]);
    assert_eq!(retrying["deliveries"][0]["last_error"], "broker timeout");
    let by_error = json_of(&f.ferry(&["list", "--error", "TOO LARGE", "--json"]), 0);
    assert_eq!(event_ids(&by_error["deliveries"]), [f.id("d1")]);

    // Paging: every delivery once, following `next`.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["list", "--limit", "7", "--json"];
        if let Some(a) = &after {
            args.extend(["--after", a.as_str()]);
        }
        let page = json_of(&f.ferry(&args), 0);
        seen.extend(event_ids(&page["deliveries"]));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen.len(), 5 + BULK);

    let table = f.ferry(&["list", "--key", "kd"]);
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.starts_with("EVENT") && text.contains(&f.id("d2")) && text.contains("payload too large"));

    let shown = json_of(&f.ferry(&["show", &f.id("d1"), "--json"]), 0);
    assert_eq!(shown["headers"]["tenant"], "acme");
    assert_eq!(shown["deliveries"][0]["failures"][0]["error"], "payload too large");
    let text = f.ferry(&["show", &f.id("d1")]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("tenant: acme"));

    let missing = f.ferry(&["show", &EventId::new().0.to_string()]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(stderr(&missing).contains("no event with id"), "{}", stderr(&missing));
    let bad = f.ferry(&["list", "--state", "stuck"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("pending, retrying, dead"), "{}", stderr(&bad));
}

#[tokio::test]
async fn requeue_refuses_pending_and_confirms_large_sets() {
    let f = fixture().await;
    // Pending (and so possibly in flight): refused, exit 1, nothing changed.
    let out = json_of(&f.ferry(&["requeue", &f.id("p1"), &f.id("r1"), "--json"]), 1);
    assert!(out["changed"].as_array().unwrap().is_empty());
    let reasons: Vec<&str> = out["refused"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons.len(), 2);
    assert!(reasons.iter().any(|r| r.contains("in flight")), "{reasons:?}");
    assert_eq!(f.state("p1"), "pending");
    assert_eq!(f.state("r1"), "retrying");
    // A dry run of it exits as the real run does.
    let dry = json_of(&f.ferry(&["requeue", &f.id("p1"), "--dry-run", "--json"]), 1);
    assert_eq!(dry["refused"].as_array().unwrap().len(), 1);

    // A window that ends before it starts: a usage error, not "nothing
    // matches".
    let empty_window = f.ferry(&["requeue", "--state", "dead", "--since", "1h", "--until", "2h"]);
    assert_eq!(empty_window.status.code(), Some(2));
    assert!(stderr(&empty_window).contains("--since"), "{}", stderr(&empty_window));

    // A dry run lists what would change and changes nothing.
    let before = f.dead_count().await;
    let dry = json_of(&f.ferry(&["requeue", "--state", "dead", "--dry-run", "--json"]), 0);
    assert_eq!(dry["would_change"].as_array().unwrap().len(), 1 + BULK);
    assert_eq!(f.dead_count().await, before);

    // Nothing selected, or a large set with no terminal and no --yes: usage errors.
    let unknown = EventId::new().0.to_string();
    let typo = f.ferry(&["requeue", &unknown]);
    assert_eq!(typo.status.code(), Some(1));
    assert!(stderr(&typo).contains(&unknown), "{}", stderr(&typo));
    let none = f.ferry(&["requeue"]);
    assert_eq!(none.status.code(), Some(2));
    assert!(stderr(&none).contains("nothing selected"), "{}", stderr(&none));
    // Empty text is in every error: it would select everything.
    let empty = f.ferry(&["requeue", "--error", "", "--yes"]);
    assert_eq!(empty.status.code(), Some(2));
    assert!(stderr(&empty).contains("--error"), "{}", stderr(&empty));
    let unconfirmed = f.ferry(&["requeue", "--type", "order.bulk"]);
    assert_eq!(unconfirmed.status.code(), Some(2));
    assert!(stderr(&unconfirmed).contains("--yes"), "{}", stderr(&unconfirmed));
    assert_eq!(f.dead_count().await, before);

    let done = json_of(&f.ferry(&["requeue", "--type", "order.bulk", "--yes", "--json"]), 0);
    let mut want: Vec<String> = f.bulk.iter().map(|id| id.0.to_string()).collect();
    want.sort();
    assert_eq!(event_ids(&done["changed"]), want);
    assert_eq!(f.dead_count().await, before - BULK as i64);
    let one = f.ferry(&["requeue", &f.id("d1")]);
    assert!(one.status.success(), "{}", stderr(&one));
    assert_eq!(f.state("d1"), "pending");
    let shown = json_of(&f.ferry(&["show", &f.id("d1"), "--json"]), 0);
    assert_eq!(shown["deliveries"][0]["actions"][0]["action"], "requeue");
    assert_eq!(shown["deliveries"][0]["attempts"], 0);
}

/// A key's published deliveries replayed together, more of them than a
/// batch holds: applied in batches of 500 cut across the key, the first
/// batch was refused for the later ones published after it (and the
/// consumer got the tail again but never the head), while the dry run said
/// nothing would be refused. All go, in one transaction, as the dry run says.
#[tokio::test]
async fn replaying_more_published_deliveries_of_a_key_than_a_batch_requeues_them_all() {
    const MANY: usize = 600;
    let f = fixture().await;
    let events = (0..MANY).map(|i| Event::new("order.updated", json!({ "i": i })).key("kbig"));
    let mut tx = f.pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events.collect()).await.unwrap();
    tx.commit().await.unwrap();
    let now = Utc::now();
    let route = Route {
        name: ROUTE.into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "out".into(),
        destination: "-".into(),
        routing_key: None,
    };
    let unrouted = f.store.fetch_unrouted(&f.owned, 2 * MANY).await.unwrap();
    f.store
        .route(&f.owned, &plan_routes(&[route], unrouted), now)
        .await
        .unwrap();
    let claimed = f.store.claim(&f.owned, ROUTE, 2 * MANY, now, &[]).await.unwrap();
    let published: Vec<Recorded> = claimed
        .iter()
        .filter(|c| c.event.key.as_deref() == Some("kbig"))
        .map(|c| Recorded {
            seq: c.event.seq,
            expected_attempts: 0,
            transition: Transition::Published { attempts: 1, at: now },
        })
        .collect();
    assert_eq!(published.len(), MANY);
    assert_eq!(
        f.store.record(&f.owned, ROUTE, &published, now).await.unwrap(),
        MANY as u64
    );

    let replay = ["requeue", "--include-published", "--key", "kbig", "--json"];
    let dry = json_of(&f.ferry(&[&replay[..], &["--dry-run"]].concat()), 0);
    assert_eq!(
        dry["would_change"].as_array().unwrap().len(),
        MANY,
        "{}",
        dry["refused"]
    );
    let done = json_of(&f.ferry(&[&replay[..], &["--yes"]].concat()), 0);
    assert!(done["refused"].as_array().unwrap().is_empty(), "{}", done["refused"]);
    assert_eq!(done["changed"].as_array().unwrap().len(), MANY);
    let again: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ferry.deliveries WHERE key = 'kbig' AND state = 'pending' AND attempts = 0",
    )
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(again, MANY as i64);
}

/// A cancel checks no order: one key's whole backlog cancelled in a single
/// transaction held its partition's rows for seconds, stalling the relays'
/// lease renewals and outcome writes. It goes in batches of 500 (each
/// its own transaction), cut across the key; a requeue of the same key
/// keeps it whole, in one.
#[tokio::test]
async fn cancelling_more_of_a_key_than_a_batch_goes_in_several_batches() {
    const MANY: usize = 1100;
    let f = fixture().await;
    let events = (0..MANY).map(|i| Event::new("order.updated", json!({ "i": i })).key("hot"));
    let mut tx = f.pool.begin().await.unwrap();
    enqueue_batch(&mut tx, events.collect()).await.unwrap();
    tx.commit().await.unwrap();
    let now = Utc::now();
    let route = Route {
        name: ROUTE.into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "out".into(),
        destination: "-".into(),
        routing_key: None,
    };
    let unrouted = f.store.fetch_unrouted(&f.owned, 2 * MANY).await.unwrap();
    f.store
        .route(&f.owned, &plan_routes(&[route], unrouted), now)
        .await
        .unwrap();
    let claimed = f.store.claim(&f.owned, ROUTE, 2 * MANY, now, &[]).await.unwrap();
    let dead: Vec<Recorded> = claimed
        .iter()
        .filter(|c| c.event.key.as_deref() == Some("hot"))
        .map(|c| Recorded {
            seq: c.event.seq,
            expected_attempts: 0,
            transition: Transition::Dead {
                attempts: 1,
                reason: "unroutable".into(),
            },
        })
        .collect();
    assert_eq!(dead.len(), MANY);
    assert_eq!(f.store.record(&f.owned, ROUTE, &dead, now).await.unwrap(), MANY as u64);
    // The transactions an action's admin log entries were written in.
    let transactions = |action: &'static str| {
        let pool = f.pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(DISTINCT l.xmin::text) FROM ferry.admin_log l
                   JOIN ferry.deliveries d USING (seq, route)
                  WHERE d.key = 'hot' AND l.action = $1",
            )
            .bind(action)
            .fetch_one(&pool)
            .await
            .unwrap();
            n
        }
    };

    let cancel = ["cancel", "--key", "hot", "--reason", "backlog", "--yes", "--json"];
    let done = json_of(&f.ferry(&cancel), 0);
    assert_eq!(done["changed"].as_array().unwrap().len(), MANY);
    assert_eq!(transactions("cancel").await, 3, "500 + 500 + 100");

    let requeue = ["requeue", "--key", "hot", "--state", "cancelled", "--yes", "--json"];
    let done = json_of(&f.ferry(&requeue), 0);
    assert_eq!(done["changed"].as_array().unwrap().len(), MANY);
    assert_eq!(transactions("requeue").await, 1, "a requeue keeps the key whole");
}

/// A dead head cancelled to unblock its key, whose key then went on
/// without it: requeued, it would reach the consumer after the later
/// event. `requeue` refuses it, saying why and how to send it anyway;
/// `--out-of-order` says so in the dry run, asks for confirmation however
/// few it touches, and with it sends the head.
#[tokio::test]
async fn requeue_refuses_to_break_a_keys_order_unless_told_out_of_order() {
    let f = fixture().await;
    let cancelled = f.ferry(&["cancel", &f.id("d1"), "--reason", "unblock kd"]);
    assert!(cancelled.status.success(), "{}", stderr(&cancelled));
    let now = Utc::now();
    let claimed = f.store.claim(&f.owned, ROUTE, 100, now, &[]).await.unwrap();
    let d2 = claimed
        .iter()
        .find(|c| c.event.id == f.ids["d2"])
        .expect("d2 no longer held back")
        .event
        .seq;
    let published = Recorded {
        seq: d2,
        expected_attempts: 0,
        transition: Transition::Published { attempts: 1, at: now },
    };
    assert_eq!(f.store.record(&f.owned, ROUTE, &[published], now).await.unwrap(), 1);

    let refused = json_of(&f.ferry(&["requeue", &f.id("d1"), "--json"]), 1);
    assert!(refused["changed"].as_array().unwrap().is_empty(), "{refused}");
    let reason = refused["refused"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("out of order") && reason.contains("--out-of-order"),
        "{reason}"
    );
    assert_eq!(f.state("d1"), "cancelled");

    let dry = f.ferry(&["requeue", &f.id("d1"), "--out-of-order", "--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = String::from_utf8_lossy(&dry.stdout);
    assert!(
        text.starts_with("would requeue 1 deliveries, 1 of them out of order")
            && text.contains("sent anyway (--out-of-order): out of order: a later event of its key was published"),
        "{text}"
    );
    let dry = json_of(
        &f.ferry(&["requeue", &f.id("d1"), "--out-of-order", "--dry-run", "--json"]),
        0,
    );
    assert_eq!(dry["action"]["out_of_order"], true, "{dry}");
    assert_eq!(event_ids(&dry["out_of_order"]), [f.id("d1")]);

    let unconfirmed = f.ferry(&["requeue", &f.id("d1"), "--out-of-order"]);
    assert_eq!(unconfirmed.status.code(), Some(2), "{}", stderr(&unconfirmed));
    let why = stderr(&unconfirmed);
    assert!(why.contains("1 of them out of order") && why.contains("--yes"), "{why}");
    assert_eq!(f.state("d1"), "cancelled");
    let done = f.ferry(&["requeue", &f.id("d1"), "--out-of-order", "--yes"]);
    assert!(done.status.success(), "{}", stderr(&done));
    let text = String::from_utf8_lossy(&done.stdout);
    assert!(
        text.starts_with("requeued 1 deliveries, 1 of them out of order"),
        "{text}"
    );
    assert_eq!(f.state("d1"), "pending");
}

#[tokio::test]
async fn cancel_records_the_reason_and_refuses_what_may_be_in_flight() {
    let f = fixture().await;
    let no_reason = f.ferry(&["cancel", &f.id("d1")]);
    assert_eq!(no_reason.status.code(), Some(2));
    assert!(stderr(&no_reason).contains("--reason"));

    let out = json_of(
        &f.ferry(&[
            "cancel",
            &f.id("d1"),
            "--reason",
            "bad payload, fixed by hand",
            "--json",
        ]),
        0,
    );
    assert_eq!(event_ids(&out["changed"]), [f.id("d1")]);
    let shown = json_of(&f.ferry(&["show", &f.id("d1"), "--json"]), 0);
    let action = &shown["deliveries"][0]["actions"][0];
    assert_eq!(action["action"], "cancel");
    assert_eq!(action["reason"], "bad payload, fixed by hand");
    assert_eq!(action["from_state"], "dead");

    // d2 is no longer held back by d1, so a relay may take it: refused.
    let out = json_of(&f.ferry(&["cancel", &f.id("d2"), "--reason", "x", "--json"]), 1);
    assert!(out["refused"][0]["reason"].as_str().unwrap().contains("in flight"));
    assert_eq!(f.state("d2"), "pending");
    // The claim path agrees: d2 is claimable now.
    let claimed = f.store.claim(&f.owned, ROUTE, 100, Utc::now(), &[]).await.unwrap();
    assert!(claimed.iter().any(|c| c.event.id == f.ids["d2"]));

    // A retrying delivery waiting for its next attempt can be cancelled.
    let out = json_of(
        &f.ferry(&["cancel", "--state", "retrying", "--reason", "obsolete", "--json"]),
        0,
    );
    assert_eq!(event_ids(&out["changed"]), [f.id("r1")]);
}

#[tokio::test]
async fn status_exits_3_when_a_threshold_is_breached() {
    let f = fixture().await;
    let run = |extra: &str| {
        Command::new(BIN)
            .arg("--config")
            .arg(f.config(extra))
            .args(["status", "--json"])
            .output()
            .unwrap()
    };
    let quiet = json_of(&run("[alerts]\nmax_dead = 100\nmax_pending_age = \"1h\"\n"), 0);
    assert!(quiet["breaches"].as_array().unwrap().is_empty());
    let loud = json_of(&run("[alerts]\nmax_dead = 0\nmax_blocked_keys = 0\n"), 3);
    let breached: Vec<&str> = loud["breaches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["threshold"].as_str().unwrap())
        .collect();
    assert_eq!(breached, ["alerts.max_dead", "alerts.max_blocked_keys"]);
    assert_eq!(loud["breaches"][0]["value"], json!((1 + BULK) as f64));
    let text = Command::new(BIN)
        .arg("--config")
        .arg(f.config("[alerts]\nmax_dead = 0\n"))
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(text.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&text.stdout).contains("ALERT route orders has 13 dead deliveries"));
}

/// A dead reason is a broker's or endpoint's error text: the table prints
/// it escaped, on its one line, and `--json` as it is.
#[tokio::test]
async fn status_prints_a_dead_reason_escaped_and_json_keeps_it_whole() {
    let f = fixture().await;
    let forged = "x\u{1b}[2J\nforged";
    sqlx::query(
        "UPDATE ferry.deliveries SET last_error = $1
          WHERE seq = (SELECT seq FROM ferry.events WHERE id = $2)",
    )
    .bind(forged)
    .bind(f.ids["d1"].0)
    .execute(&f.pool)
    .await
    .unwrap();
    let out = f.ferry(&["status"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert!(!text.lines().any(|l| l.starts_with("forged")), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("orders") && l.contains("x\\u{1b}[2J\\nforged"))
        .unwrap_or_else(|| panic!("no escaped reason: {text}"));
    assert!(line.trim_start().starts_with("1 "), "{line}");

    let json = json_of(&f.ferry(&["status", "--json"]), 0);
    let reasons: Vec<&str> = json["dead_reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert!(reasons.contains(&forged), "{reasons:?}");
}

#[tokio::test]
async fn tail_follows_outcomes_until_interrupted() {
    let f = fixture().await;
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(f.config(""))
        .args(["tail", "--json", "--since", "1h", "--interval", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(serde_json::from_str(&line).expect("a JSON line"));
        }
    });
    let next_line = || rx.recv_timeout(Duration::from_secs(20)).expect("a tail line");

    // The fixture's outcomes: one published, one retrying, the dead ones.
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    for _ in 0..(3 + BULK) {
        *outcomes
            .entry(next_line()["outcome"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(outcomes["published"], 1);
    assert_eq!(outcomes["retrying"], 1);
    assert_eq!(outcomes["dead"], 1 + BULK);

    // A new publish shows up live, with its commit-to-publish latency.
    let claimed = f.store.claim(&f.owned, ROUTE, 100, Utc::now(), &[]).await.unwrap();
    let p1 = claimed.iter().find(|c| c.event.id == f.ids["p1"]).unwrap();
    let recorded = f
        .store
        .record(
            &f.owned,
            ROUTE,
            &[Recorded {
                seq: p1.event.seq,
                expected_attempts: 0,
                transition: Transition::Published {
                    attempts: 1,
                    at: Utc::now(),
                },
            }],
            Utc::now(),
        )
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    let line = next_line();
    assert_eq!(line["event_id"], f.id("p1"));
    assert_eq!(
        (line["route"].as_str(), line["outcome"].as_str()),
        (Some(ROUTE), Some("published"))
    );
    assert!(line["latency_seconds"].as_f64().unwrap() >= 0.0);

    // SAFETY: kill(2) on our own child's pid with a valid signal.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "tail did not stop cleanly on Ctrl-C");
}

/// A relay that could not reach the database retries writing its outcomes
/// with the time it published them: such an outcome commits stamped well
/// before the changes `tail` has printed. It is printed late, not never.
#[tokio::test]
async fn tail_prints_an_outcome_that_committed_long_after_its_stamp() {
    let f = fixture().await;
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(f.config(""))
        .args(["tail", "--json", "--since", "1h", "--interval", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(serde_json::from_str(&line).expect("a JSON line"));
        }
    });
    let next_line = || rx.recv_timeout(Duration::from_secs(20)).expect("a tail line");
    // The newest change printed: where the tail's polls start from.
    let newest = (0..(3 + BULK))
        .map(|_| {
            next_line()["at"]
                .as_str()
                .unwrap()
                .parse::<chrono::DateTime<Utc>>()
                .unwrap()
        })
        .max()
        .unwrap();

    let claimed = f.store.claim(&f.owned, ROUTE, 100, Utc::now(), &[]).await.unwrap();
    let p1 = claimed.iter().find(|c| c.event.id == f.ids["p1"]).unwrap();
    let published = Recorded {
        seq: p1.event.seq,
        expected_attempts: 0,
        transition: Transition::Published {
            attempts: 1,
            at: Utc::now(),
        },
    };
    let stamped = newest - chrono::Duration::seconds(10);
    assert_eq!(f.store.record(&f.owned, ROUTE, &[published], stamped).await.unwrap(), 1);
    let line = next_line();
    assert_eq!(line["event_id"], f.id("p1"));
    assert_eq!(line["outcome"], "published");

    // SAFETY: kill(2) on our own child's pid with a valid signal.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// Without `--since` the tail starts now: outcomes from before it started,
/// even ones within the look-back its polls use for late commits, are not
/// printed.
#[tokio::test]
async fn tail_without_since_prints_nothing_from_before_it_started() {
    let f = fixture().await;
    sqlx::query("UPDATE ferry.deliveries SET updated_at = now() - interval '30 seconds'")
        .execute(&f.pool)
        .await
        .unwrap();
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(f.config(""))
        .args(["tail", "--json", "--interval", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(serde_json::from_str(&line).expect("a JSON line"));
        }
    });
    // Stamped ahead, so it is after the tail's start however late that
    // comes: the tail's first line, unless it printed the old ones.
    let claimed = f.store.claim(&f.owned, ROUTE, 100, Utc::now(), &[]).await.unwrap();
    let p1 = claimed.iter().find(|c| c.event.id == f.ids["p1"]).unwrap();
    let published = Recorded {
        seq: p1.event.seq,
        expected_attempts: 0,
        transition: Transition::Published {
            attempts: 1,
            at: Utc::now(),
        },
    };
    let ahead = Utc::now() + chrono::Duration::seconds(60);
    assert_eq!(f.store.record(&f.owned, ROUTE, &[published], ahead).await.unwrap(), 1);
    let line = rx.recv_timeout(Duration::from_secs(20)).expect("a tail line");
    assert_eq!(line["event_id"], f.id("p1"), "{line}");

    // SAFETY: kill(2) on our own child's pid with a valid signal.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// `ferry tail | head -1`: once the reader is gone, the tail ends cleanly
/// at its next line, rather than panic on the closed pipe (exit 101).
#[tokio::test]
async fn tail_into_a_reader_that_quits_ends_cleanly() {
    let f = fixture().await;
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(f.config(""))
        .args(["tail", "--since", "1h", "--interval", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(!first.is_empty(), "a first line");
    drop(stdout);
    // What the fixture had may all be in the pipe already: a new outcome's
    // line meets the closed pipe.
    let claimed = f.store.claim(&f.owned, ROUTE, 100, Utc::now(), &[]).await.unwrap();
    let p1 = claimed.iter().find(|c| c.event.id == f.ids["p1"]).unwrap();
    let published = Recorded {
        seq: p1.event.seq,
        expected_attempts: 0,
        transition: Transition::Published {
            attempts: 1,
            at: Utc::now(),
        },
    };
    assert_eq!(
        f.store.record(&f.owned, ROUTE, &[published], Utc::now()).await.unwrap(),
        1
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "tail kept running with no reader");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
}

/// The route renamed in the config: its deliveries stay under the old name,
/// which no relay running the new config claims. `check` fails naming the
/// route, its counts and the fixes; `status` marks it; `requeue` refuses to
/// send anything again on it; `run` logs it and keeps running.
#[tokio::test]
async fn a_renamed_route_leaves_its_deliveries_named_by_every_command() {
    let f = fixture().await;
    let renamed = f.config_named("orders-v2", "");
    let ferry = |args: &[&str]| {
        Command::new(BIN)
            .arg("--config")
            .arg(&renamed)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    // p1, d2 (held back) and r1 (retrying) wait; d1 and the bulk are dead.
    let waiting = "not in the config, yet 3 pending and 13 dead deliveries wait on it";

    let check = ferry(&["check"]);
    let stdout = String::from_utf8_lossy(&check.stdout).into_owned();
    assert_eq!(check.status.code(), Some(1), "{stdout}{}", stderr(&check));
    let line = stdout
        .lines()
        .find(|l| l.starts_with("FAIL route \"orders\": "))
        .unwrap_or_else(|| panic!("no line on the old route: {stdout}"));
    assert!(line.contains(waiting), "{line}");
    assert!(
        line.contains("give it name = \"orders\"")
            && line.contains("`ferry cancel --route orders --state pending --state retrying --state dead --reason"),
        "{line}"
    );
    let kept = f.ferry(&["check"]);
    assert_eq!(kept.status.code(), Some(0), "{}", String::from_utf8_lossy(&kept.stdout));

    let status = json_of(&ferry(&["status", "--json"]), 0);
    let configured: Vec<(&str, &Value)> = status["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["route"].as_str().unwrap(), &r["configured"]))
        .collect();
    assert_eq!(configured, [("orders", &json!(false)), ("orders-v2", &json!(true))]);
    let text = ferry(&["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("\norders (not configured) "), "{text}");
    assert!(
        text.contains(&format!("not in the config:\n  route \"orders\" is {waiting}")),
        "{text}"
    );

    let before = f.dead_count().await;
    let by_route = ferry(&["requeue", "--route", "orders", "--state", "dead", "--yes"]);
    assert_eq!(by_route.status.code(), Some(2), "{}", stderr(&by_route));
    assert!(
        stderr(&by_route).starts_with(&format!("error: nothing requeued: route \"orders\" is {waiting}")),
        "{}",
        stderr(&by_route)
    );
    let by_state = json_of(&ferry(&["requeue", "--state", "dead", "--yes", "--json"]), 1);
    assert!(by_state["changed"].as_array().unwrap().is_empty());
    let refused = by_state["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 1 + BULK);
    assert!(
        refused[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("route \"orders\" is not in the config"),
        "{refused:?}"
    );
    assert_eq!(f.dead_count().await, before, "nothing was requeued");

    let log = f.dir.path().join("relay.log");
    let mut relay = ferry_testkit::process::dies_with_test(
        Command::new(BIN)
            .arg("--config")
            .arg(&renamed)
            .arg("run")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap()),
    )
    .spawn()
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let logged = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("route \"orders\" is not in the config") || std::time::Instant::now() > deadline {
            break text;
        }
        if let Some(exit) = relay.try_wait().unwrap() {
            panic!("ferry run exited ({exit}): {text}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let line = logged
        .lines()
        .find(|l| l.contains("route \"orders\" is not in the config"))
        .unwrap_or_else(|| panic!("no error on the old route: {logged}"));
    assert!(line.contains("ERROR") && line.contains(waiting), "{line}");
    assert!(relay.try_wait().unwrap().is_none(), "the relay keeps running: {logged}");
    // SAFETY: kill(2) on our own child's pid with a valid signal.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    assert_eq!(relay.wait().unwrap().code(), Some(0));
}
