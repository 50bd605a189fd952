//! The database itself killed mid-drain: a PostgreSQL server of the test's
//! own gets SIGKILL (postmaster and backends at once) while producers commit
//! and the relay delivers, and starts again through crash recovery. The
//! relay keeps running throughout and must deliver every committed event.
//!
//! What such a crash takes away: every transaction in progress (a settle,
//! a lease renewal, a producer's commit whose answer never came), and any
//! asynchronous commit whose WAL had not been written (the table path
//! settles with `synchronous_commit = off`), and in WAL mode the slot's
//! confirmed position, which PostgreSQL before 17 writes to disk only now
//! and then. Each of those must come back as an event delivered again,
//! never as an event lost, and nothing settled before the crash may come
//! again: not even tableless events, which no table marks as delivered.

use std::collections::HashSet;
use std::time::Duration;

use ferry_core::Event;
use ferry_store::postgres::{enqueue_batch, wal};
use ferry_testkit::pg::TestDb;
use ferry_testkit::pg_server::PgServer;
use ferry_testkit::rabbit::TestTopology;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::oneshot;

use crate::support::{Overrides, PATIENCE, Relay, Stack, Tally, order, produce, published, streaming};

const KEYS: usize = 50;
/// Committed in large transactions once the relay runs, so that it is
/// mid-drain at the crash: enough for the drain to outlast a poll of its
/// progress delayed by a loaded machine (a few thousand went between two).
const BACKLOG: usize = 16_000;
/// Then committed one event per key per transaction, through the crash.
const TRANSACTIONS: usize = 60;
/// Of which this many before it.
const TRANSACTIONS_BEFORE: usize = 5;
const EVENTS: usize = BACKLOG + TRANSACTIONS * KEYS;
/// Settled before the crash.
const SETTLED_BEFORE: usize = 1_000;
/// In WAL mode, tableless events (`ferry.emit`) delivered before the
/// backlog, one per key per transaction.
const TABLELESS: usize = 500;

#[tokio::test]
async fn a_database_killed_mid_drain_and_restarted_loses_nothing() {
    survives_a_database_crash("e2e-pg-crash", false).await;
}

#[tokio::test]
async fn in_wal_mode_a_database_killed_mid_stream_and_restarted_loses_nothing() {
    survives_a_database_crash("e2e-pg-crash-wal", true).await;
}

async fn survives_a_database_crash(prefix: &str, wal: bool) {
    let mut server = PgServer::start().await;
    let s = Stack::on(
        TestDb::create_on(&server.admin_url()).await,
        TestTopology::create(prefix).await,
    )
    .await;
    let cfg = s.config(&Overrides {
        wal,
        ..Overrides::default()
    });
    let mut relay = s.spawn(&cfg, "relay-a");
    let mut tally = Tally::default();
    // How many messages the tableless events came as.
    let tableless = if wal {
        streaming(&s).await;
        // Delivered and settled long before the crash. Nothing in the
        // table tells a replay that they were: only the position the relay
        // recorded does, which a crash of the server must not take back.
        emit_tableless(&s).await;
        tally.collect(&s.topo, TABLELESS, PATIENCE).await;
        assert_eq!(
            tally.unique(),
            TABLELESS,
            "tableless events lost; log:\n{}",
            relay.log()
        );
        TABLELESS
    } else {
        0
    };
    produce(&s.pool, BACKLOG, KEYS).await;
    let (paused, crashed) = (oneshot::channel(), oneshot::channel());
    let producer = tokio::spawn(produce_through_crashes(s.db.url().to_owned(), paused.0, crashed.1));
    paused.1.await.expect("the producer reaches its pause");
    // Crash once the relay has settled part of the backlog, at once: read a
    // moment before the crash, the count cannot lose a batch in between.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let backlog_left = loop {
        let left = backlog_left(&s).await;
        if left <= (BACKLOG - SETTLED_BEFORE) as i64 {
            break left;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no progress before the crash; relay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    server.crash();
    assert!(
        backlog_left >= 500,
        "the relay had all but drained the backlog before the crash ({backlog_left} left): \
         the crash interrupted nothing"
    );
    // The producer's next transaction meets the dead server.
    crashed.0.send(()).unwrap();
    // Long enough for the relay to meet the dead server on every
    // connection it holds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;
    let retried = producer.await.unwrap();
    assert!(retried > 0, "no transaction of the producer met the crash");

    let expected = EVENTS + if wal { TABLELESS } else { 0 };
    tally.collect(&s.topo, expected, PATIENCE).await;
    assert_eq!(
        tally.unique(),
        expected,
        "lost events ({retried} transactions retried); relay log:\n{}\nserver log:\n{}",
        relay.log(),
        server.log()
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&s.pool)
        .await
        .unwrap();
    assert_eq!(stored, EVENTS as i64, "each event committed once, by its dispatch key");
    assert_eq!(tally.assert_per_key_order(), if wal { 2 * KEYS } else { KEYS });
    // A copy sent again can arrive after the last first arrival: read what
    // is still queued before counting replays and duplicates.
    tally.collect(&s.topo, expected + 1, Duration::from_secs(1)).await;
    let early: HashSet<&str> = tally.messages[..tableless]
        .iter()
        .filter_map(|m| m.message_id.as_deref())
        .collect();
    let replayed = tally.messages[tableless..]
        .iter()
        .filter(|m| m.message_id.as_deref().is_some_and(|id| early.contains(id)))
        .count();
    assert_eq!(
        replayed,
        0,
        "tableless events settled before the crash were published again; relay log:\n{}",
        relay.log()
    );
    // Sent again can only be what was in doubt at the crash: the batch
    // whose settle the crash interrupted, the batch published while the
    // server was down (500 each), and settles whose asynchronous commit had
    // not reached the WAL file (a page of WAL or so: SIGKILL spares what
    // was written to the kernel).
    assert!(
        tally.duplicates() <= 2_000,
        "{} duplicates; relay log:\n{}",
        tally.duplicates(),
        relay.log()
    );
    assert!(
        relay.running(),
        "the relay exited when the database went away; log:\n{}",
        relay.log()
    );
    s.status_until(&cfg, &relay, PATIENCE, |st| {
        published(st, "orders") == (EVENTS as u64, 0, 0)
    })
    .await;
    terminate(relay);
}

/// Commits [`TRANSACTIONS`] transactions of one event per key after the
/// backlog, numbered per key as `support::produce_from` numbers them, each
/// event with a dispatch key. After [`TRANSACTIONS_BEFORE`] it says so on
/// `paused` and waits for `crashed`.
///
/// A transaction that fails, the database gone, is committed again until it
/// succeeds: a commit whose answer was lost may have happened, and its
/// dispatch keys make the second one a no-op, so every event is committed
/// exactly once. Returns how many transactions were tried again.
async fn produce_through_crashes(url: String, paused: oneshot::Sender<()>, crashed: oneshot::Receiver<()>) -> usize {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        // Short of the second the server stays down, so that a transaction
        // fails then instead of waiting for the restart.
        .acquire_timeout(Duration::from_millis(200))
        .connect(&url)
        .await
        .unwrap();
    let (mut paused, mut crashed) = (Some(paused), Some(crashed));
    let mut retried = 0;
    for t in 0..TRANSACTIONS {
        if t == TRANSACTIONS_BEFORE {
            paused.take().unwrap().send(()).unwrap();
            crashed.take().unwrap().await.unwrap();
        }
        let events: Vec<Event> = (0..KEYS)
            .map(|k| {
                let i = BACKLOG + t * KEYS + k;
                order(i / KEYS, &format!("k{}", i % KEYS)).dispatch_key(format!("crash-{i}"))
            })
            .collect();
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match commit(&pool, events.clone()).await {
                Ok(()) => break,
                Err(e) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "transaction {t} never committed: {e}"
                    );
                    retried += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    retried
}

/// Commits [`TABLELESS`] tableless events, keyed `t0`..., numbered per key.
async fn emit_tableless(s: &Stack) {
    for chunk in (0..TABLELESS).collect::<Vec<_>>().chunks(KEYS) {
        let mut tx = s.pool.begin().await.unwrap();
        for &i in chunk {
            wal::emit(&mut tx, order(i / KEYS, &format!("t{}", i % KEYS)))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

/// Events of the backlog not yet settled.
async fn backlog_left(s: &Stack) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ferry.unrouted WHERE seq <= $1")
        .bind(BACKLOG as i64)
        .fetch_one(&s.pool)
        .await
        .unwrap()
}

async fn commit(pool: &sqlx::PgPool, events: Vec<Event>) -> Result<(), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    enqueue_batch(&mut tx, events).await.map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())
}

fn terminate(relay: Relay) {
    let log = relay.log();
    assert!(relay.terminate().success(), "SIGTERM must exit 0; log:\n{log}");
}
