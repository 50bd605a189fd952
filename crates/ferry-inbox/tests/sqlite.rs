//! The SQLite inbox against a real database file per test, migrated by the
//! SQLite store: duplicates, concurrent deliveries of one event (from one
//! pool and from two, as two processes would), retries, dead events and
//! retention, counting every effect.

use ferry_testkit::metrics::Counts;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferry_core::{EventId, RetryPolicy};
use ferry_inbox::sqlite::Inbox;
use ferry_inbox::{HandlerError, Outcome, ReceivedEvent};
use ferry_store::sqlite::{connect_options, migrate};
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::{SqliteConnection, SqlitePool};
use tempfile::TempDir;

struct Env {
    pool: SqlitePool,
    path: String,
    _dir: TempDir,
}

async fn open(path: &str) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(connect_options(path).unwrap())
        .await
        .unwrap()
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db").to_str().unwrap().to_owned();
    let pool = open(&path).await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL, consumer TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Env { pool, path, _dir: dir }
}

fn policy(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(50),
        jitter: 0.0,
    }
}

fn event() -> ReceivedEvent {
    ReceivedEvent::new(EventId::new(), "order.item.created", &b"{\"n\":1}"[..])
}

async fn effect(tx: &mut SqliteConnection, event: &ReceivedEvent, consumer: &str) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, consumer) VALUES (?1, ?2)")
        .bind(event.id.to_string())
        .bind(consumer)
        .execute(tx)
        .await?;
    Ok(())
}

async fn effects(pool: &SqlitePool, id: EventId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = ?1")
        .bind(id.to_string())
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn migrate_creates_the_inbox_table() {
    let e = env().await;
    let version: i64 = sqlx::query_scalar("SELECT max(version) FROM ferry_schema_migrations")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(version, i64::from(ferry_store::sqlite::MIGRATIONS.last().unwrap().0));
    // The key is what deduplicates: the table itself refuses a second row.
    let insert = "INSERT INTO ferry_inbox (consumer, event_id, state, processed_at) VALUES ('c', 'e', 'done', 0)";
    sqlx::query(insert).execute(&e.pool).await.unwrap();
    let err = sqlx::query(insert).execute(&e.pool).await.unwrap_err();
    assert!(
        err.as_database_error().is_some_and(|d| d.is_unique_violation()),
        "{err}"
    );
}

#[tokio::test]
async fn a_redelivery_is_skipped_and_counted_as_a_duplicate() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap();
    let ev = event();
    for expected in [Outcome::Processed, Outcome::Duplicate, Outcome::Duplicate] {
        let outcome = inbox
            .process(&ev, async |tx, ev| effect(tx, ev, "billing").await)
            .await
            .unwrap();
        assert_eq!(outcome, expected);
    }
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    let record = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((record.state.as_str(), record.attempts), ("done", 1));
    let age = chrono::Utc::now() - record.processed_at;
    assert!(age.num_seconds().abs() < 60, "processed_at is now: {age}");

    // Another consumer of the same event has an inbox of its own.
    let other = Inbox::new(e.pool.clone(), "shipping").unwrap();
    let outcome = other
        .process(&ev, async |tx, ev| effect(tx, ev, "shipping").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_of_one_event_take_effect_once() {
    let e = env().await;
    // Two pools on one file, as two consumer processes would have.
    let pools = [e.pool.clone(), open(&e.path).await];
    for _ in 0..5 {
        let ev = event();
        let runs = Arc::new(AtomicU32::new(0));
        let tasks: Vec<_> = (0..6)
            .map(|n| {
                let inbox = Inbox::new(pools[n % 2].clone(), "billing").unwrap();
                let (ev, runs) = (ev.clone(), runs.clone());
                tokio::spawn(async move {
                    inbox
                        .process(&ev, async |tx, ev| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            effect(tx, ev, "billing").await?;
                            // Hold the transaction open so the others
                            // arrive while it is in flight.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Ok(())
                        })
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        let processed = outcomes.iter().filter(|o| **o == Outcome::Processed).count();
        let duplicates = outcomes.iter().filter(|o| **o == Outcome::Duplicate).count();
        assert_eq!((processed, duplicates), (1, 5), "{outcomes:?}");
        // The waiters never ran the handler: they queued for the write lock,
        // then found the row done.
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(effects(&e.pool, ev.id).await, 1);
    }
}

#[tokio::test]
async fn a_failure_rolls_back_the_effect_and_counts_across_redeliveries() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(5));
    let ev = event();
    let mut outcomes = Vec::new();
    for attempt in 1..=3 {
        // A fresh inbox per delivery, as after a restart: the count lives in the file.
        let inbox = Inbox::new(open(&e.path).await, "billing")
            .unwrap()
            .with_retry(policy(5));
        let outcome = inbox
            .process(&ev, async |tx, ev| {
                effect(tx, ev, "billing").await?;
                if attempt < 3 {
                    return Err(HandlerError::transient(format!("flaky {attempt}")));
                }
                Ok(())
            })
            .await
            .unwrap();
        outcomes.push(outcome);
        if attempt < 3 {
            assert_eq!(
                effects(&e.pool, ev.id).await,
                0,
                "the failed attempt's write rolled back"
            );
            let r = inbox.record(ev.id).await.unwrap().unwrap();
            assert_eq!((r.state.as_str(), r.attempts), ("failing", attempt));
            assert_eq!(r.last_error.as_deref(), Some(format!("flaky {attempt}").as_str()));
        }
    }
    assert!(matches!(&outcomes[0], Outcome::Retry { attempts: 1, delay, .. } if *delay == Duration::from_millis(10)));
    assert!(matches!(&outcomes[1], Outcome::Retry { attempts: 2, delay, .. } if *delay == Duration::from_millis(20)));
    assert_eq!(outcomes[2], Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("done", 3));
}

#[tokio::test]
async fn after_the_last_attempt_the_event_is_dead_and_stays_dead() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    let runs = AtomicU32::new(0);
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        let runs = &runs;
        outcomes.push(
            inbox
                .process(&ev, async |tx, ev| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    effect(tx, ev, "billing").await?;
                    Err(HandlerError::transient("downstream refuses"))
                })
                .await
                .unwrap(),
        );
    }
    assert!(matches!(outcomes[0], Outcome::Retry { attempts: 1, .. }));
    assert!(matches!(outcomes[1], Outcome::Retry { attempts: 2, .. }));
    let reason = "max attempts (3) reached; last error: downstream refuses".to_owned();
    for o in &outcomes[2..] {
        assert_eq!(
            *o,
            Outcome::Dead {
                attempts: 3,
                reason: reason.clone()
            }
        );
    }
    // Deliveries after the death never reach the handler.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("dead", 3));
    assert_eq!(r.last_error, Some(reason));

    // An operator releases it; the replay is handled afresh.
    assert!(inbox.release(ev.id).await.unwrap());
    let outcome = inbox
        .process(&ev, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    assert!(!inbox.release(ev.id).await.unwrap(), "done rows are never released");
}

#[tokio::test]
async fn a_permanent_error_is_dead_at_once() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(10));
    let ev = event();
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::permanent("unknown order")))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Dead {
            attempts: 1,
            reason: "unknown order".into()
        }
    );
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

#[tokio::test]
async fn a_database_error_in_the_handler_rolls_back_everything() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    let outcome = inbox
        .process(&ev, async |tx, ev| {
            effect(tx, ev, "billing").await?;
            sqlx::query("INSERT INTO no_such_table VALUES (1)").execute(tx).await?;
            Ok(())
        })
        .await
        .unwrap();
    match outcome {
        Outcome::Retry { attempts: 1, error, .. } => assert!(error.contains("no_such_table"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "failing");
}

/// A panicking handler is a failed attempt like any other, as on PostgreSQL:
/// rolled back, counted, and dead after the last attempt; and the write
/// lock its transaction held is released.
#[tokio::test]
async fn a_panicking_handler_is_a_counted_failure() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let handler = async |tx: &mut SqliteConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        panic!("order {} has no customer", 42);
    };
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => {
            assert_eq!(error, "the handler panicked: order 42 has no customer")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 2, reason } => assert!(reason.ends_with("order 42 has no customer"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
    let ok = event();
    let outcome = inbox
        .process(&ok, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
}

/// A deferred foreign key the handler's writes break fails the `COMMIT` on
/// every redelivery: a failed attempt of the handler, counted until the
/// event is dead, not a database outage retried for ever.
#[tokio::test]
async fn a_commit_refused_for_a_deferred_constraint_is_a_counted_failure() {
    let e = env().await;
    for statement in [
        "CREATE TABLE parents (id INTEGER PRIMARY KEY)",
        "CREATE TABLE children (parent INTEGER REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(statement).execute(&e.pool).await.unwrap();
    }
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let handler = async |tx: &mut SqliteConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        sqlx::query("INSERT INTO children VALUES (42)")
            .execute(&mut *tx)
            .await?;
        Ok(())
    };
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => assert!(error.contains("could not commit"), "{error}"),
        other => panic!("{other:?}"),
    }
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 2, reason } => assert!(reason.contains("FOREIGN KEY"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// A handler hung outside the database is stopped at the inbox's handler
/// timeout: a counted failure, its writes rolled back, and the database's
/// write lock (`BEGIN IMMEDIATE`) free for other writers again.
#[tokio::test]
async fn a_hung_handler_is_stopped_at_its_timeout_and_frees_the_write_lock() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing")
        .unwrap()
        .with_retry(policy(5))
        .with_handler_timeout(Duration::from_millis(300));
    let ev = event();
    let hung = async |tx: &mut SqliteConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        std::future::pending::<()>().await;
        Ok(())
    };
    let outcome = tokio::time::timeout(Duration::from_secs(60), inbox.process(&ev, hung))
        .await
        .expect("the inbox waited for the hung handler")
        .unwrap();
    match outcome {
        Outcome::Retry { attempts: 1, error, .. } => {
            assert!(error.contains("handler_timeout (300ms)"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    // Another writer gets the lock; the next attempt succeeds.
    sqlx::query("INSERT INTO effects (event_id, consumer) VALUES ('other', 'billing')")
        .execute(&e.pool)
        .await
        .unwrap();
    let quick = async |tx: &mut SqliteConnection, ev: &ReceivedEvent| effect(tx, ev, "billing").await;
    assert_eq!(inbox.process(&ev, quick).await.unwrap(), Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
}

#[tokio::test]
async fn purge_removes_old_done_rows_in_batches_and_keeps_the_rest() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(1));
    let other = Inbox::new(e.pool.clone(), "shipping").unwrap();
    let mut old = Vec::new();
    for _ in 0..7 {
        let ev = event();
        inbox.process(&ev, async |_, _| Ok(())).await.unwrap();
        other.process(&ev, async |_, _| Ok(())).await.unwrap();
        old.push(ev.id);
    }
    let dead = event();
    let outcome = inbox
        .process(&dead, async |_, _| Err(HandlerError::transient("no")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Dead { .. }));
    // Two days ago, in microseconds.
    sqlx::query("UPDATE ferry_inbox SET processed_at = processed_at - 172800000000")
        .execute(&e.pool)
        .await
        .unwrap();
    let recent = event();
    inbox.process(&recent, async |_, _| Ok(())).await.unwrap();

    assert_eq!(inbox.purge(Duration::from_secs(86_400), 3).await.unwrap(), 7);
    assert_eq!(inbox.purge(Duration::from_secs(86_400), 3).await.unwrap(), 0);
    for id in &old {
        assert!(inbox.record(*id).await.unwrap().is_none());
        assert!(
            other.record(*id).await.unwrap().is_some(),
            "another consumer's rows stay"
        );
    }
    assert_eq!(inbox.record(dead.id).await.unwrap().unwrap().state, "dead");
    assert!(inbox.record(recent.id).await.unwrap().is_some());
    // A window longer than all time purges nothing and does not overflow.
    assert_eq!(other.purge(Duration::MAX, 3).await.unwrap(), 0);
}

#[tokio::test]
async fn a_blank_consumer_name_is_refused() {
    let pool = SqlitePoolOptions::new().connect_lazy("sqlite::memory:").unwrap();
    let err = Inbox::new(pool.clone(), " ").unwrap_err();
    assert!(err.to_string().contains("consumer name"), "{err}");
    // Refused as by the PostgreSQL inbox, which cannot store it.
    let err = Inbox::new(pool, "bill\0ing").unwrap_err();
    assert!(err.to_string().contains("without NUL bytes"), "{err}");
}

#[tokio::test]
async fn every_outcome_is_counted_per_consumer() {
    use ferry_inbox::metrics::{DEAD, DUPLICATES, PROCESSED, RETRIES};
    let counts = Counts::by_label("consumer");
    // The test's runtime has one thread, so a thread-local recorder sees all.
    let _recorder = metrics::set_default_local_recorder(&counts);
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ok = event();
    for _ in 0..2 {
        inbox.process(&ok, async |_, _| Ok(())).await.unwrap();
    }
    let bad = event();
    for _ in 0..4 {
        inbox
            .process(&bad, async |_, _| Err(HandlerError::transient("no")))
            .await
            .unwrap();
    }
    let get = |name: &str| counts.get(name, "billing");
    assert_eq!(get(PROCESSED), 1);
    assert_eq!(get(DUPLICATES), 1);
    assert_eq!(get(RETRIES), 2);
    // Dead at the third attempt, and again when redelivered after that.
    assert_eq!(get(DEAD), 2);
}

/// A handler that ends the inbox's transaction itself: its writes after
/// that commit one by one, outside it. As with PostgreSQL, a COMMIT is dead
/// at once (a retry would apply the writes before it again), and so is a
/// ROLLBACK the handler went on from to return `Ok` (a retry would apply
/// the writes after it again); neither is reported processed, nor left to
/// retry for ever as an outage.
#[tokio::test]
async fn a_handler_that_ends_the_transaction_itself_is_caught() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(5));

    let committed = event();
    let outcome = inbox
        .process(&committed, async |tx, ev| {
            effect(tx, ev, "billing").await?;
            sqlx::query("COMMIT").execute(&mut *tx).await?;
            effect(tx, ev, "billing").await
        })
        .await
        .unwrap();
    match &outcome {
        Outcome::Dead { attempts: 1, reason } => assert!(reason.contains("COMMIT inside the handler"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, committed.id).await, 2, "both writes committed");
    let r = inbox.record(committed.id).await.unwrap().unwrap();
    assert_eq!(r.state, "dead");
    // A redelivery does not apply it a third time.
    let again = inbox
        .process(&committed, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Duplicate | Outcome::Dead { .. }), "{again:?}");
    assert_eq!(effects(&e.pool, committed.id).await, 2);

    // A COMMIT, then a transaction of the handler's own, which fails: the
    // claim committed with the first write, and finding it in the open
    // transaction does not make that transaction the inbox's. It was
    // rolled back and reported a duplicate, acknowledged with half its
    // effects; returning Ok, it was reported processed.
    for result in [Err(HandlerError::transient("boom")), Ok(())] {
        let begun_again = event();
        let failed = result.is_err();
        let outcome = inbox
            .process(&begun_again, async |tx, ev| {
                effect(tx, ev, "billing").await?;
                sqlx::query("COMMIT").execute(&mut *tx).await?;
                sqlx::query("BEGIN").execute(&mut *tx).await?;
                effect(tx, ev, "billing").await?;
                result
            })
            .await
            .unwrap();
        match &outcome {
            Outcome::Dead { attempts: 1, reason } => {
                assert!(reason.contains("COMMIT inside the handler"), "{reason}");
                assert_eq!(reason.contains("then failed (boom)"), failed, "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            effects(&e.pool, begun_again.id).await,
            1,
            "the write in the handler's own transaction rolled back"
        );
        assert_eq!(inbox.record(begun_again.id).await.unwrap().unwrap().state, "dead");
    }

    let rolled_back = event();
    let outcome = inbox
        .process(&rolled_back, async |tx, ev| {
            effect(tx, ev, "billing").await?;
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            Ok(())
        })
        .await
        .unwrap();
    match &outcome {
        Outcome::Dead { attempts: 1, reason } => assert!(reason.contains("ROLLBACK inside the handler"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, rolled_back.id).await, 0);
    let r = inbox.record(rolled_back.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("dead", 1));
    // A ROLLBACK, then a write, which commits on its own: dead, not retried
    // (each retry wrote it again), the write once.
    let written_after = event();
    for _ in 0..5 {
        let outcome = inbox
            .process(&written_after, async |tx, ev| {
                sqlx::query("ROLLBACK").execute(&mut *tx).await?;
                effect(tx, ev, "billing").await
            })
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Dead { attempts: 1, .. }), "{outcome:?}");
    }
    assert_eq!(effects(&e.pool, written_after.id).await, 1);
    // A ROLLBACK the handler returns an error after (or SQLite's own
    // rollback after an error it returns) is a counted failure.
    let failed_after = event();
    let outcome = inbox
        .process(&failed_after, async |tx, _| {
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            Err(HandlerError::transient("boom"))
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 1, .. }), "{outcome:?}");
    // A ROLLBACK and a transaction of the handler's own after it: the claim
    // is not in that one, so committing it would record nothing.
    let begun_again = event();
    let outcome = inbox
        .process(&begun_again, async |tx, ev| {
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            sqlx::query("BEGIN").execute(&mut *tx).await?;
            effect(tx, ev, "billing").await
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Dead { attempts: 1, .. }), "{outcome:?}");
    assert_eq!(effects(&e.pool, begun_again.id).await, 0);
    // The pool is healthy afterwards: the next event goes through.
    let next = event();
    let outcome = inbox
        .process(&next, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, next.id).await, 1);
}

/// A delivery whose transaction is rolled back, and a second delivery of
/// the same event that claims it in the same instant (it waited on the
/// write lock) and commits: the first must not take the second's committed
/// claim for its own, and neither mark it dead nor, having begun a
/// transaction of its own, commit that as processed.
#[tokio::test]
async fn an_attempt_rolled_back_does_not_take_another_deliverys_claim_for_its_own() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(5));
    for begins_again in [false, true] {
        let ev = event();
        let other = e.pool.clone();
        let outcome = inbox
            .process(&ev, async |tx, ev| {
                let stamp: i64 = sqlx::query_scalar(
                    "SELECT processed_at FROM ferry_inbox WHERE consumer = 'billing' AND event_id = ?1",
                )
                .bind(ev.id.to_string())
                .fetch_one(&mut *tx)
                .await?;
                sqlx::query("ROLLBACK").execute(&mut *tx).await?;
                // The second delivery, claiming at the same millisecond and
                // committing its effect with its claim.
                let mut second = other.begin_with("BEGIN IMMEDIATE").await?;
                sqlx::query(
                    "INSERT INTO ferry_inbox (consumer, event_id, state, attempts, event_type, processed_at, claim) \
                     VALUES ('billing', ?1, 'done', 1, ?2, ?3, ?4)",
                )
                .bind(ev.id.to_string())
                .bind(&ev.event_type)
                .bind(stamp)
                .bind(rand::random::<i64>())
                .execute(&mut *second)
                .await?;
                effect(&mut second, ev, "billing").await?;
                second.commit().await?;
                if begins_again {
                    sqlx::query("BEGIN").execute(&mut *tx).await?;
                    effect(tx, ev, "billing").await?;
                    Ok(())
                } else {
                    Err(HandlerError::transient("boom"))
                }
            })
            .await
            .unwrap();
        assert!(
            !matches!(outcome, Outcome::Dead { .. } | Outcome::Processed),
            "begins again: {begins_again}: {outcome:?}"
        );
        let r = inbox.record(ev.id).await.unwrap().unwrap();
        assert_eq!(r.state, "done", "the second delivery's claim stands");
        assert_eq!(effects(&e.pool, ev.id).await, 1, "the effect applied once");
    }
}

/// An attempt the process dies in, as in the PostgreSQL inbox's tests: the
/// handler entered, then the attempt's future dropped where it stands.
async fn dies_in_handler(inbox: &Inbox, ev: &ReceivedEvent) {
    let entered = tokio::sync::Notify::new();
    let attempt = inbox.process_redelivered(ev, async |_, _| {
        entered.notify_one();
        std::future::pending().await
    });
    tokio::select! {
        outcome = attempt => panic!("the attempt ended: {outcome:?}"),
        () = entered.notified() => {}
    }
}

/// The row's (state, attempts, unfinished).
async fn marks(pool: &SqlitePool, id: EventId) -> (String, i32, i32) {
    sqlx::query_as("SELECT state, attempts, unfinished FROM ferry_inbox WHERE consumer = 'billing' AND event_id = ?1")
        .bind(id.to_string())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// As with PostgreSQL: attempts the process died in are counted from their
/// marks; past `max_attempts` the event is dead unrun; a finished attempt,
/// failed or done, counts the marks and clears them.
#[tokio::test]
async fn attempts_the_process_died_in_are_counted_and_cleared_when_one_finishes() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    for n in 1..=3 {
        dies_in_handler(&inbox, &ev).await;
        assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 0, n));
    }
    let runs = AtomicU32::new(0);
    let handler = async |tx: &mut SqliteConnection, ev: &ReceivedEvent| {
        runs.fetch_add(1, Ordering::SeqCst);
        effect(tx, ev, "billing").await
    };
    match inbox.process_redelivered(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 3, reason } => assert!(
            reason.starts_with("3 attempts did not finish: the process stopped while handling this event"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(marks(&e.pool, ev.id).await, ("dead".into(), 3, 0));
    let again = inbox.process_redelivered(&ev, handler).await.unwrap();
    assert!(matches!(again, Outcome::Dead { attempts: 3, .. }), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let inbox = inbox.with_retry(policy(5));
    let ev = event();
    dies_in_handler(&inbox, &ev).await;
    let outcome = inbox
        .process_redelivered(&ev, async |_, _| Err(HandlerError::transient("boom")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 2, .. }), "{outcome:?}");
    assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 2, 0));
    dies_in_handler(&inbox, &ev).await;
    assert_eq!(
        inbox.process_redelivered(&ev, handler).await.unwrap(),
        Outcome::Processed
    );
    assert_eq!(marks(&e.pool, ev.id).await, ("done".into(), 4, 0));
    assert_eq!(
        inbox.process_redelivered(&ev, handler).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(marks(&e.pool, ev.id).await, ("done".into(), 4, 0));
    assert_eq!(effects(&e.pool, ev.id).await, 1);
}

/// A file `ferry migrate` had not brought to schema 6 (`unfinished`) failed
/// every delivery with an error like any other database error. The inbox's
/// check now says what is wrong and what to do.
#[tokio::test]
async fn an_inbox_table_it_cannot_use_is_a_schema_error_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db").to_str().unwrap().to_owned();
    let pool = open(&path).await;
    for (_, _, sql) in ferry_store::sqlite::MIGRATIONS.iter().filter(|m| m.0 <= 5) {
        sqlx::raw_sql(*sql).execute(&pool).await.unwrap();
    }
    let inbox = Inbox::new(pool, "billing").unwrap();
    match inbox.check().await {
        Err(ferry_inbox::InboxError::Schema(why)) => {
            assert!(why.contains("ferry migrate") && why.contains("schema 6"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    let e = env().await;
    Inbox::new(e.pool.clone(), "billing").unwrap().check().await.unwrap();
}
