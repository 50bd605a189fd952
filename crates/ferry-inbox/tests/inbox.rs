//! The inbox against a real PostgreSQL: duplicates, concurrent deliveries of
//! one event, retries, dead events and retention, counting every effect.

use ferry_testkit::metrics::Counts;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferry_core::{EventId, RetryPolicy};
use ferry_inbox::{HandlerError, Inbox, Outcome, ReceivedEvent};
use ferry_store::postgres::migrate;
use ferry_testkit::pg::TestDb;
use sqlx::{PgConnection, PgPool};

struct Env {
    pool: PgPool,
    _db: TestDb,
}

async fn env() -> Env {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id uuid NOT NULL, consumer text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Env { pool, _db: db }
}

/// How long a test waits for what must happen before failing.
const WITHIN: Duration = Duration::from_secs(60);

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

async fn effect(tx: &mut PgConnection, event: &ReceivedEvent, consumer: &str) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, consumer) VALUES ($1, $2)")
        .bind(event.id.0)
        .bind(consumer)
        .execute(tx)
        .await?;
    Ok(())
}

async fn effects(pool: &PgPool, id: EventId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
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

    // Another consumer of the same event has an inbox of its own.
    let other = Inbox::new(e.pool.clone(), "shipping").unwrap();
    let outcome = other
        .process(&ev, async |tx, ev| effect(tx, ev, "shipping").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 2);
}

#[tokio::test]
async fn concurrent_deliveries_of_one_event_take_effect_once() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap();
    for _ in 0..5 {
        let ev = event();
        let runs = Arc::new(AtomicU32::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (inbox, ev, runs) = (inbox.clone(), ev.clone(), runs.clone());
                tokio::spawn(async move {
                    inbox
                        .process(&ev, async |tx, ev| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            effect(tx, ev, "billing").await?;
                            // Hold the transaction open so the others
                            // arrive while it is in flight.
                            tokio::time::sleep(Duration::from_millis(100)).await;
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
        assert_eq!((processed, duplicates), (1, 3), "{outcomes:?}");
        // The waiters never ran the handler: they blocked on the row, then saw it done.
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
        // A fresh handler per delivery, as after a restart: the count lives in the table.
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
}

/// A handler that drops a failed statement's error and returns `Ok` leaves
/// the transaction aborted; PostgreSQL answers its `COMMIT` with a rollback
/// and no error. Reported as processed, the message would be acknowledged
/// with its effects and its inbox row gone: lost. It must be a failed
/// attempt, retried, whose redelivery takes effect once.
#[tokio::test]
async fn a_handler_that_swallows_a_failed_statement_is_retried_not_acknowledged() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    let outcome = inbox
        .process(&ev, async |tx, ev| {
            effect(tx, ev, "billing").await?;
            // The error is dropped; the transaction is aborted all the same.
            let _ = sqlx::query("INSERT INTO no_such_table VALUES (1)")
                .execute(&mut *tx)
                .await;
            Ok(())
        })
        .await
        .unwrap();
    match outcome {
        Outcome::Retry { attempts: 1, error, .. } => {
            assert!(error.contains("did not return the error"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "failing");

    let outcome = inbox
        .process(&ev, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
}

/// A handler that runs `ROLLBACK` itself takes the inbox row with it, and
/// what it writes afterwards commits statement by statement, outside the
/// inbox's transaction. Counted a transient failure, it was retried, and
/// each retry applied those writes again. Like a `COMMIT` inside the
/// handler, it is dead at once, the attempt counted, and never run again.
#[tokio::test]
async fn a_handler_that_rolls_back_itself_is_dead_not_retried() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    let runs = AtomicU32::new(0);
    let rollback_then_write = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        runs.fetch_add(1, Ordering::SeqCst);
        sqlx::query("ROLLBACK").execute(&mut *tx).await?;
        effect(tx, ev, "billing").await
    };
    for _ in 0..3 {
        match inbox.process(&ev, rollback_then_write).await.unwrap() {
            Outcome::Dead { attempts: 1, reason } => {
                assert!(reason.contains("ROLLBACK inside the handler"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(effects(&e.pool, ev.id).await, 1, "the write after the ROLLBACK, once");
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("dead", 1));

    // After a failure, and failing itself: dead all the same, both counted.
    let ev = event();
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::transient("not yet")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 1, .. }), "{outcome:?}");
    let outcome = inbox
        .process(&ev, async |tx, ev| {
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            effect(tx, ev, "billing").await?;
            Err(HandlerError::transient("boom"))
        })
        .await
        .unwrap();
    match outcome {
        Outcome::Dead { attempts: 2, reason } => assert!(reason.contains("and then failed (boom)"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// A handler that runs `COMMIT` itself commits the inbox row early, with the
/// writes it made before; what it does after is outside the inbox's
/// transaction. Failing afterwards, it was acknowledged as a duplicate (the
/// failure record found the row done): its failure hidden, its later writes
/// lost. It must be dead-lettered as the handler bug it is, the attempt
/// counted, and never run again (a retry would repeat the first writes).
#[tokio::test]
async fn a_handler_that_commits_itself_is_dead_not_acknowledged() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));

    // COMMIT, then a statement that fails: the failure is not hidden.
    let ev = event();
    let runs = AtomicU32::new(0);
    let commit_then_fail = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        runs.fetch_add(1, Ordering::SeqCst);
        effect(tx, ev, "billing").await?;
        sqlx::query("COMMIT").execute(&mut *tx).await?;
        sqlx::query("INSERT INTO no_such_table VALUES (1)")
            .execute(&mut *tx)
            .await?;
        Ok(())
    };
    let reason = match inbox.process(&ev, commit_then_fail).await.unwrap() {
        Outcome::Dead { attempts: 1, reason } => reason,
        other => panic!("{other:?}"),
    };
    assert!(reason.contains("COMMIT inside the handler"), "{reason}");
    assert!(
        reason.contains("and then failed") && reason.contains("no_such_table"),
        "{reason}"
    );
    assert_eq!(effects(&e.pool, ev.id).await, 1, "the write before the COMMIT stays");
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("dead", 1));
    assert_eq!(r.last_error.as_deref(), Some(reason.as_str()));
    // A redelivery is dead-lettered again, never run.
    match inbox.process(&ev, commit_then_fail).await.unwrap() {
        Outcome::Dead {
            attempts: 1,
            reason: again,
        } => assert_eq!(again, reason),
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // COMMIT and success: refused all the same, after an earlier failure.
    let ev = event();
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::transient("not yet")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 1, .. }), "{outcome:?}");
    let outcome = inbox
        .process(&ev, async |tx, ev| {
            sqlx::query("COMMIT").execute(&mut *tx).await?;
            effect(tx, ev, "billing").await
        })
        .await
        .unwrap();
    match outcome {
        Outcome::Dead { attempts: 2, reason } => {
            assert!(!reason.contains("then failed"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        effects(&e.pool, ev.id).await,
        1,
        "the write after the COMMIT committed on its own"
    );

    // COMMIT, then a transaction of the handler's own: the inbox ends it.
    let ev = event();
    let outcome = inbox
        .process(&ev, async |tx, ev| {
            sqlx::query("COMMIT").execute(&mut *tx).await?;
            sqlx::query("BEGIN").execute(&mut *tx).await?;
            effect(tx, ev, "billing").await
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Dead { attempts: 1, .. }), "{outcome:?}");
    assert_eq!(
        effects(&e.pool, ev.id).await,
        0,
        "the handler's second transaction rolled back"
    );
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");

    // COMMIT, then a transaction of its own that a failed statement
    // aborted: the claim committed all the same. It was taken for another
    // delivery's, a duplicate, and acknowledged with its failure unsaid.
    for swallowed in [true, false] {
        let ev = event();
        let outcome = inbox
            .process(&ev, async |tx, ev| {
                effect(tx, ev, "billing").await?;
                sqlx::query("COMMIT").execute(&mut *tx).await?;
                sqlx::query("BEGIN").execute(&mut *tx).await?;
                let failed = sqlx::query("INSERT INTO no_such_table VALUES (1)")
                    .execute(&mut *tx)
                    .await;
                if swallowed {
                    Ok(())
                } else {
                    failed.map(|_| ()).map_err(HandlerError::from)
                }
            })
            .await
            .unwrap();
        match outcome {
            Outcome::Dead { attempts: 1, reason } => {
                assert!(reason.contains("COMMIT inside the handler"), "{reason}")
            }
            other => panic!("swallowed {swallowed}: {other:?}"),
        }
        assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
    }
}

/// A deferred constraint the handler's writes break fails the `COMMIT`, the
/// same way on every redelivery: a failed attempt of the handler, counted
/// until the event is dead, not a database outage retried for ever.
#[tokio::test]
async fn a_commit_refused_for_a_deferred_constraint_is_a_counted_failure() {
    let e = env().await;
    for statement in [
        "CREATE TABLE parents (id int PRIMARY KEY)",
        "CREATE TABLE children (parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(statement).execute(&e.pool).await.unwrap();
    }
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let handler = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
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
        Outcome::Dead { attempts: 2, reason } => assert!(reason.contains("foreign key"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// The server ends the session while the handler's transaction is open (a
/// terminated backend here; `idle_in_transaction_session_timeout` under a
/// slow handler in production): an attempt that failed, counted, and dead
/// after the last one, not an outage put back for ever uncounted.
#[tokio::test]
async fn a_session_ended_mid_attempt_is_a_counted_failure() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let pool = e.pool.clone();
    let handler = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&pool)
            .await
            .expect("terminate the handler's session");
        Ok(())
    };
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => assert!(error.contains("connection failed"), "{error}"),
        other => panic!("{other:?}"),
    }
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 2, .. } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// `idle_in_transaction_session_timeout` itself: the server ends the
/// session with SQLSTATE 25P03, a class (25, invalid transaction state)
/// that otherwise means the server refused a statement. Taken for that, the
/// attempt failed on the dead connection before it was counted, and the
/// event came back for ever, never dead.
#[tokio::test]
async fn a_session_ended_for_idling_in_the_transaction_is_a_counted_failure() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let slow = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        sqlx::query("SET LOCAL idle_in_transaction_session_timeout = '100ms'")
            .execute(&mut *tx)
            .await?;
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok(())
    };
    match inbox.process(&ev, slow).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => assert!(error.contains("connection failed"), "{error}"),
        other => panic!("{other:?}"),
    }
    match inbox.process(&ev, slow).await.unwrap() {
        Outcome::Dead { attempts: 2, .. } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// A handler that stops waiting for a statement itself (its own timeout
/// around the future) and returns `Ok` leaves the statement running until
/// the server cancels it; the cancellation's error (SQLSTATE 57014) is the
/// answer the inbox's next statement reads. It was taken for a lost
/// database connection, and the attempt counted with that reason, which
/// hides the handler's bug from whoever reads it. It is the aborted
/// transaction it is: a counted failure that says so, retried, whose
/// redelivery takes effect once.
#[tokio::test]
async fn a_statement_the_handler_gave_up_on_is_an_aborted_attempt_not_a_lost_connection() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    let gave_up = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        sqlx::query("SET LOCAL statement_timeout = '200ms'")
            .execute(&mut *tx)
            .await?;
        let slow = sqlx::query("SELECT pg_sleep(5)").execute(&mut *tx);
        let _ = tokio::time::timeout(Duration::from_millis(20), slow).await;
        Ok(())
    };
    let outcome = tokio::time::timeout(WITHIN, inbox.process(&ev, gave_up))
        .await
        .expect("the inbox waited on its own transaction");
    match outcome.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => {
            assert!(error.contains("did not return the error"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "failing");
    let outcome = inbox
        .process(&ev, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
}

/// A handler that hangs, in a statement or outside the database, is stopped
/// at the inbox's handler timeout: a counted failure, its writes rolled
/// back, the statement it waited on cancelled, the event's row free for the
/// next attempt. Without the cancel the inbox waited for the statement.
#[tokio::test]
async fn a_handler_hung_in_a_statement_or_outside_is_stopped_at_its_timeout() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing")
        .unwrap()
        .with_retry(policy(5))
        .with_handler_timeout(Duration::from_millis(300));
    let ev = event();
    let in_a_statement = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        sqlx::query("SELECT pg_sleep(600)").execute(&mut *tx).await?;
        Ok(())
    };
    let outside = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        std::future::pending::<()>().await;
        Ok(())
    };
    for (attempt, outcome) in [
        (
            1,
            tokio::time::timeout(WITHIN, inbox.process(&ev, in_a_statement)).await,
        ),
        (2, tokio::time::timeout(WITHIN, inbox.process(&ev, outside)).await),
    ] {
        match outcome.expect("the inbox waited for the hung handler").unwrap() {
            Outcome::Retry { attempts, error, .. } => {
                assert_eq!(attempts, attempt);
                assert!(error.contains("handler_timeout (300ms)"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(effects(&e.pool, ev.id).await, 0);
    }
    let sleeping: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(600)' AND state = 'active'",
    )
    .fetch_one(&e.pool)
    .await
    .unwrap();
    assert_eq!(sleeping, 0, "the hung statement still runs");
    // Should the cancel not arrive, no statement outlives the limit either.
    let limit = std::sync::Mutex::new(String::new());
    let quick = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        *limit.lock().unwrap() = sqlx::query_scalar("SELECT current_setting('statement_timeout')")
            .fetch_one(&mut *tx)
            .await?;
        effect(tx, ev, "billing").await
    };
    assert_eq!(inbox.process(&ev, quick).await.unwrap(), Outcome::Processed);
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    assert_eq!(*limit.lock().unwrap(), "1300ms");
}

/// A member that claimed an event and stalled with its transaction open (a
/// handler hung without a handler timeout, a paused VM) holds the event's
/// row. Another member the broker hands the event to waited on that row
/// for as long as the stall lasted, serving nothing else; it gives up at
/// the inbox's lock timeout instead, with an outcome that is no attempt:
/// nothing ran, nothing counted, the message left for later. The handler
/// of an attempt that does claim the row runs under the session's
/// lock_timeout, not the inbox's.
#[tokio::test]
async fn a_delivery_that_meets_a_stalled_attempt_is_in_progress_not_stuck() {
    use ferry_inbox::metrics::{IN_PROGRESS, RETRIES};
    let counts = Counts::by_label("consumer");
    // The test's runtime has one thread, so a thread-local recorder sees all.
    let _recorder = metrics::set_default_local_recorder(&counts);
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing")
        .unwrap()
        .with_retry(policy(3))
        .with_lock_timeout(Duration::from_millis(200));
    // A new event (the stalled claim's row is an uncommitted insert) and a
    // failing one (an update of the committed row).
    let fresh = event();
    let failing = event();
    let flaky = inbox
        .process(&failing, async |_, _| Err(HandlerError::transient("flaky")))
        .await
        .unwrap();
    assert!(matches!(flaky, Outcome::Retry { attempts: 1, .. }), "{flaky:?}");
    let mut stalled = Vec::new();
    for ev in [&fresh, &failing] {
        let (claimed, has_claimed) = tokio::sync::oneshot::channel();
        let (holder, ev_) = (inbox.clone(), ev.clone());
        stalled.push(tokio::spawn(async move {
            holder
                .process(&ev_, async move |tx, ev| {
                    effect(tx, ev, "billing").await?;
                    let _ = claimed.send(());
                    std::future::pending::<()>().await;
                    Ok(())
                })
                .await
        }));
        has_claimed.await.expect("the stalled attempt claimed the event");
        let outcome = tokio::time::timeout(
            WITHIN,
            inbox.process(ev, async |tx, ev| effect(tx, ev, "billing").await),
        )
        .await
        .expect("the delivery waited on the stalled attempt's row")
        .unwrap();
        // Redelivered after the retry policy's longest backoff.
        assert_eq!(
            outcome,
            Outcome::InProgress {
                delay: Duration::from_millis(50)
            }
        );
    }
    assert_eq!(inbox.record(fresh.id).await.unwrap(), None);
    let r = inbox.record(failing.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("failing", 1), "not counted");
    assert_eq!(counts.get(IN_PROGRESS, "billing"), 2);
    assert_eq!(counts.get(RETRIES, "billing"), 1);

    // The stalled attempts end (their transactions roll back): the next
    // delivery runs, its handler under the session's lock_timeout.
    for task in stalled {
        task.abort();
    }
    let session: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    let patient = inbox.clone().with_lock_timeout(WITHIN);
    for ev in [&fresh, &failing] {
        let seen = std::sync::Mutex::new(String::new());
        let outcome = patient
            .process(ev, async |tx, ev| {
                *seen.lock().unwrap() = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                    .fetch_one(&mut *tx)
                    .await?;
                effect(tx, ev, "billing").await
            })
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::Processed);
        assert_eq!(*seen.lock().unwrap(), session, "the handler's lock_timeout");
        assert_eq!(effects(&e.pool, ev.id).await, 1);
    }
}

/// The same stall met when counting a failure: the attempt's handler
/// failed and rolled back, and another delivery claimed the row and stalled
/// before the failure was counted. The count waited on that row for as
/// long as the stall lasted; it gives up at the lock timeout, uncounted
/// (the stalled attempt's own outcome is the one that counts).
#[tokio::test]
async fn a_failure_whose_row_a_stalled_attempt_took_is_in_progress_not_stuck() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing")
        .unwrap()
        .with_retry(policy(3))
        .with_lock_timeout(Duration::from_millis(200));
    let patient = inbox.clone().with_lock_timeout(WITHIN);
    let ev = event();
    let (claimed, has_claimed) = tokio::sync::oneshot::channel();
    let (fail, to_fail) = tokio::sync::oneshot::channel::<()>();
    let failing = tokio::spawn({
        let (inbox, ev) = (inbox.clone(), ev.clone());
        async move {
            inbox
                .process(&ev, async move |_, _| {
                    let _ = claimed.send(());
                    let _ = to_fail.await;
                    Err(HandlerError::transient("flaky"))
                })
                .await
        }
    });
    has_claimed.await.unwrap();
    // A second delivery waits on the first's row, then claims it when the
    // first rolls back, and stalls.
    let (took, has_taken) = tokio::sync::oneshot::channel();
    let stalled = tokio::spawn({
        let ev = ev.clone();
        async move {
            patient
                .process(&ev, async move |_, _| {
                    let _ = took.send(());
                    std::future::pending::<()>().await;
                    Ok(())
                })
                .await
        }
    });
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&e.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second delivery never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    fail.send(()).unwrap();
    let outcome = tokio::time::timeout(WITHIN, failing)
        .await
        .expect("counting the failure waited on the stalled attempt's row")
        .unwrap()
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::InProgress {
            delay: Duration::from_millis(50)
        }
    );
    has_taken.await.expect("the second delivery claimed the event");
    assert_eq!(inbox.record(ev.id).await.unwrap(), None, "nothing counted");
    stalled.abort();
}

/// PostgreSQL cannot store a NUL byte in text (SQLSTATE 22021). A handler
/// error whose text has one must still be recorded and counted: otherwise
/// the attempt is lost to an error the inbox reports as an outage, and the
/// message is put back for ever without coming nearer to its dead letter.
#[tokio::test]
async fn a_handler_error_with_a_nul_byte_is_recorded_and_counted() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let fail = async |_: &mut PgConnection, _: &ReceivedEvent| Err(HandlerError::transient("bad\0byte"));
    match inbox.process(&ev, fail).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => assert_eq!(error, "bad\u{FFFD}byte"),
        other => panic!("{other:?}"),
    }
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!(r.last_error.as_deref(), Some("bad\u{FFFD}byte"));
    match inbox.process(&ev, fail).await.unwrap() {
        Outcome::Dead { attempts: 2, reason } => assert!(reason.ends_with("bad\u{FFFD}byte"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
}

/// A panicking handler is a failed attempt like any other: its writes roll
/// back, the attempt is counted, and after the last one the event is dead.
/// Uncaught, the panic took the consumer down before anything was counted,
/// and the broker handed the same message out first again on restart.
#[tokio::test]
async fn a_panicking_handler_is_a_counted_failure() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(2));
    let ev = event();
    let handler = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        effect(tx, ev, "billing").await?;
        panic!("order {} has no customer", 42);
    };
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Retry { attempts: 1, error, .. } => {
            assert_eq!(error, "the handler panicked: order 42 has no customer")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        effects(&e.pool, ev.id).await,
        0,
        "the panicking attempt's write rolled back"
    );
    let r = inbox.record(ev.id).await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.attempts), ("failing", 1));
    match inbox.process(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 2, reason } => assert_eq!(
            reason,
            "max attempts (2) reached; last error: the handler panicked: order 42 has no customer"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(effects(&e.pool, ev.id).await, 0);
    assert_eq!(inbox.record(ev.id).await.unwrap().unwrap().state, "dead");
    // The pool's connections are fit for use after the panic.
    let ok = event();
    let outcome = inbox
        .process(&ok, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
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
    sqlx::query("UPDATE ferry.inbox SET processed_at = now() - interval '2 days'")
        .execute(&e.pool)
        .await
        .unwrap();
    let recent = event();
    inbox.process(&recent, async |_, _| Ok(())).await.unwrap();

    assert_eq!(inbox.purge(Duration::from_secs(86_400), 3).await.unwrap(), 7);
    assert_eq!(inbox.purge(Duration::from_secs(86_400), 3).await.unwrap(), 0);
    // A window longer than all time purges nothing, and does not fail.
    assert_eq!(other.purge(Duration::MAX, 3).await.unwrap(), 0);
    for id in &old {
        assert!(inbox.record(*id).await.unwrap().is_none());
        assert!(
            other.record(*id).await.unwrap().is_some(),
            "another consumer's rows stay"
        );
    }
    assert_eq!(inbox.record(dead.id).await.unwrap().unwrap().state, "dead");
    assert!(inbox.record(recent.id).await.unwrap().is_some());
}

#[tokio::test]
async fn a_blank_consumer_name_is_refused() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://localhost/x")
        .unwrap();
    let err = Inbox::new(pool.clone(), " ").unwrap_err();
    assert!(err.to_string().contains("consumer name"), "{err}");
    // PostgreSQL cannot store a NUL in text: every claim would fail.
    let err = Inbox::new(pool, "bill\0ing").unwrap_err();
    assert!(err.to_string().contains("consumer name \"bill\\0ing\""), "{err}");
    assert!(err.to_string().contains("without NUL bytes"), "{err}");
}

/// An event whose type has a NUL byte (built by a caller: the runners'
/// decoders refuse it) is deduplicated like any other. Its type is only
/// recorded for operators; storing it as is failed every claim with SQLSTATE
/// 22021, an error the caller could only retry for ever.
#[tokio::test]
async fn an_event_type_with_a_nul_byte_does_not_fail_the_claim() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = ReceivedEvent::new(EventId::new(), "order.item\0created", &b"{}"[..]);
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::transient("not yet")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 1, .. }), "{outcome:?}");
    for expected in [Outcome::Processed, Outcome::Duplicate] {
        let outcome = inbox
            .process(&ev, async |tx, ev| effect(tx, ev, "billing").await)
            .await
            .unwrap();
        assert_eq!(outcome, expected);
    }
    assert_eq!(effects(&e.pool, ev.id).await, 1);
    let stored: String = sqlx::query_scalar("SELECT event_type FROM ferry.inbox WHERE event_id = $1")
        .bind(ev.id.0)
        .fetch_one(&e.pool)
        .await
        .unwrap();
    assert_eq!(stored, "order.item\u{FFFD}created");
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

/// An attempt the process dies in: the handler entered, then the attempt's
/// future dropped where it stands, its transaction never ended by the
/// inbox (the connection rolls it back), as when the process is killed.
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
async fn marks(pool: &PgPool, id: EventId) -> (String, i32, i32) {
    sqlx::query_as("SELECT state, attempts, unfinished FROM ferry.inbox WHERE consumer = 'billing' AND event_id = $1")
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An attempt the process died in rolled back its claim and, with it, the
/// count: an event whose handler kills the process was tried for ever. A
/// delivery that may be a replay marks its attempt's start first; past
/// `max_attempts` started attempts the event is dead, the handler not run.
#[tokio::test]
async fn attempts_the_process_died_in_are_counted_and_the_event_dies_unrun() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(3));
    let ev = event();
    for n in 1..=3 {
        dies_in_handler(&inbox, &ev).await;
        assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 0, n));
    }
    let runs = AtomicU32::new(0);
    let handler = async |tx: &mut PgConnection, ev: &ReceivedEvent| {
        runs.fetch_add(1, Ordering::SeqCst);
        effect(tx, ev, "billing").await
    };
    let reason = match inbox.process_redelivered(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 3, reason } => reason,
        other => panic!("{other:?}"),
    };
    assert!(
        reason.starts_with("3 attempts did not finish: the process stopped while handling this event"),
        "{reason}"
    );
    assert_eq!(marks(&e.pool, ev.id).await, ("dead".into(), 3, 0));
    assert_eq!(
        inbox.record(ev.id).await.unwrap().unwrap().last_error,
        Some(reason.clone())
    );
    // Dead for every later delivery, marked or not; never run.
    for outcome in [
        inbox.process_redelivered(&ev, handler).await.unwrap(),
        inbox.process(&ev, handler).await.unwrap(),
    ] {
        assert_eq!(
            outcome,
            Outcome::Dead {
                attempts: 3,
                reason: reason.clone()
            }
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(effects(&e.pool, ev.id).await, 0);

    // Failed and unfinished attempts add up: one failure, two deaths.
    let ev = event();
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::transient("boom")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 1, .. }), "{outcome:?}");
    dies_in_handler(&inbox, &ev).await;
    dies_in_handler(&inbox, &ev).await;
    match inbox.process_redelivered(&ev, handler).await.unwrap() {
        Outcome::Dead { attempts: 3, reason } => {
            assert!(
                reason.starts_with("2 attempts did not finish, after 1 that failed"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A finished attempt, failed or done, clears the marks of those the
/// process died in before it, and counts them, once.
#[tokio::test]
async fn a_finished_attempt_counts_the_unfinished_ones_and_clears_them() {
    let e = env().await;
    let inbox = Inbox::new(e.pool.clone(), "billing").unwrap().with_retry(policy(5));
    let ev = event();
    dies_in_handler(&inbox, &ev).await;
    let outcome = inbox
        .process_redelivered(&ev, async |_, _| Err(HandlerError::transient("boom")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 2, .. }), "{outcome:?}");
    assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 2, 0));
    dies_in_handler(&inbox, &ev).await;
    assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 2, 1));
    let outcome = inbox
        .process_redelivered(&ev, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(marks(&e.pool, ev.id).await, ("done".into(), 4, 0));
    // A done event is a duplicate; the mark changes nothing.
    let outcome = inbox
        .process_redelivered(&ev, async |tx, ev| effect(tx, ev, "billing").await)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Duplicate);
    assert_eq!(marks(&e.pool, ev.id).await, ("done".into(), 4, 0));
    assert_eq!(effects(&e.pool, ev.id).await, 1);

    // An attempt not marked (a first delivery) counts the unfinished ones
    // before it too, and its own.
    let ev = event();
    dies_in_handler(&inbox, &ev).await;
    let outcome = inbox
        .process(&ev, async |_, _| Err(HandlerError::transient("boom")))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Retry { attempts: 2, .. }), "{outcome:?}");
    assert_eq!(marks(&e.pool, ev.id).await, ("failing".into(), 2, 0));
}

/// A database the migrations brought to `version` only, as one an
/// application is deployed against before `ferry migrate` runs.
async fn migrated_to(version: i32) -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    sqlx::query("CREATE SCHEMA ferry").execute(&pool).await.unwrap();
    for (_, _, sql) in ferry_store::postgres::MIGRATIONS.iter().filter(|m| m.0 <= version) {
        sqlx::raw_sql(*sql).execute(&pool).await.unwrap();
    }
    (db, pool)
}

/// Before schema 25 (`ferry.inbox.unfinished`), without `ferry.inbox`, or
/// as a role without the grants, every statement of the inbox failed, and
/// the error read as a database outage: the runners put every delivery back
/// for ever. The inbox now says what is wrong and what to do, both when
/// asked at start and at a delivery.
#[tokio::test]
async fn an_inbox_table_it_cannot_use_is_a_schema_error_naming_the_fix() {
    use ferry_inbox::InboxError;
    let (_db, pool) = migrated_to(24).await;
    let inbox = Inbox::new(pool.clone(), "billing").unwrap();
    let schema = |e: InboxError| match e {
        InboxError::Schema(why) => why,
        other => panic!("{other:?}"),
    };
    let why = schema(inbox.check().await.unwrap_err());
    assert!(why.contains("ferry migrate") && why.contains("schema 25"), "{why}");
    let why = schema(inbox.process(&event(), async |_, _| Ok(())).await.unwrap_err());
    assert!(why.contains("ferry migrate"), "{why}");
    let why = schema(
        inbox
            .process_redelivered(&event(), async |_, _| Ok(()))
            .await
            .unwrap_err(),
    );
    assert!(why.contains("ferry migrate"), "{why}");

    let (_db, pool) = migrated_to(1).await;
    let why = schema(Inbox::new(pool, "billing").unwrap().check().await.unwrap_err());
    assert!(why.contains("does not exist") && why.contains("ferry migrate"), "{why}");

    // A role that may read the table but not write it, one that may not
    // use the schema at all, and a consumer's least-privilege role, which
    // may not delete: the runners never do.
    let e = env().await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&e.pool)
        .await
        .unwrap();
    let (reader, stranger, consumer) = (
        format!("{name}_reader"),
        format!("{name}_stranger"),
        format!("{name}_consumer"),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS {reader}; CREATE ROLE {reader} LOGIN; \
         DROP ROLE IF EXISTS {stranger}; CREATE ROLE {stranger} LOGIN; \
         DROP ROLE IF EXISTS {consumer}; CREATE ROLE {consumer} LOGIN; \
         GRANT USAGE ON SCHEMA ferry TO {reader}, {consumer}; GRANT SELECT ON ferry.inbox TO {reader}; \
         GRANT SELECT, INSERT, UPDATE ON ferry.inbox TO {consumer}"
    )))
    .execute(&e.pool)
    .await
    .unwrap();
    let options = e.pool.connect_options();
    for (role, says) in [(&reader, "it lacks INSERT, UPDATE)"), (&stranger, "permission denied")] {
        let pool = PgPool::connect_with((*options).clone().username(role)).await.unwrap();
        let inbox = Inbox::new(pool.clone(), "billing").unwrap();
        let why = schema(inbox.check().await.unwrap_err());
        assert!(why.contains("GRANT SELECT, INSERT, UPDATE ON ferry.inbox"), "{why}");
        assert!(why.contains(says), "{why}");
        pool.close().await;
    }
    let pool = PgPool::connect_with((*options).clone().username(&consumer))
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone(), "billing").unwrap();
    inbox.check().await.unwrap();
    inbox.process(&event(), async |_, _| Ok(())).await.unwrap();
    pool.close().await;
    Inbox::new(e.pool.clone(), "billing").unwrap().check().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP OWNED BY {reader}; DROP ROLE {reader}; DROP ROLE {stranger}; \
         DROP OWNED BY {consumer}; DROP ROLE {consumer}"
    )))
    .execute(&e.pool)
    .await
    .unwrap();
}
