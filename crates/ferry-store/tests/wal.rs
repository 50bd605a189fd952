//! The WAL source's queries against a real PostgreSQL.

use ferry_core::{Event, EventId, StoredEvent};
use ferry_store::postgres::migrate;
use ferry_store::postgres::wal::{
    Finding, Outcome, Prepared, Settlement, SlotLoss, WalConfig, WalEvent, WalSource, diagnose, emit,
};
use ferry_testkit::pg::TestDb;
use ferry_testkit::pg_server::PgServer;
use serde_json::json;
use sqlx::{Connection, PgPool};

/// A slot named after the test database: slots are server-wide.
fn config_of(db: &TestDb) -> WalConfig {
    WalConfig {
        url: db.url().to_owned(),
        slot: db.name().to_owned(),
        publication: "ferry".into(),
    }
}

/// What `prepare` found: whether the slot waits for its sweep, and the
/// loss it reports.
fn seen(prepared: Prepared) -> (bool, Option<SlotLoss>) {
    (prepared.unswept, prepared.replaced)
}

fn source_of(db: &TestDb, pool: &PgPool) -> WalSource {
    WalSource::new(pool.clone(), config_of(db)).unwrap()
}

/// A source on a second slot of the test database, and that slot's name.
fn other_source(db: &TestDb, pool: &PgPool) -> (String, WalSource) {
    let name = format!("{}_b", db.name());
    let source = WalSource::new(
        pool.clone(),
        WalConfig {
            slot: name.clone(),
            ..config_of(db)
        },
    )
    .unwrap();
    (name, source)
}

async fn drop_slot(pool: &PgPool, slot: &str) {
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(slot)
        .execute(pool)
        .await
        .unwrap();
}

/// Emits one event in a transaction of its own; says whether it became an
/// outbox row instead of a tableless event.
async fn emit_one(pool: &PgPool) -> bool {
    let mut tx = pool.begin().await.unwrap();
    let id = emit(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry.events WHERE id = $1)")
        .bind(id.0)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// What `ferry check` says of the slot.
async fn slot_check(db: &TestDb, pool: &PgPool) -> Finding {
    diagnose(pool, &config_of(db), u64::MAX)
        .await
        .into_iter()
        .find(|f| f.what.starts_with("replication slot"))
        .expect("a finding on the slot")
}

async fn wal_status(pool: &PgPool, slot: &str) -> Option<String> {
    sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
        .bind(slot)
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
}

/// A slot PostgreSQL invalidated never streams again: a tableless event
/// written for it would be read by nobody, so until a relay has replaced
/// and swept it `ferry.emit` writes outbox rows instead, as it does before a
/// slot is ready and while one is about to be lost. `prepare` replaces a lost
/// slot and says so; a slot gone altogether, as after a failover, is
/// replaced and reported too.
#[tokio::test]
async fn a_lost_slot_is_replaced_and_meanwhile_emit_writes_outbox_rows() {
    let server = PgServer::start().await;
    let db = TestDb::create_on(&server.admin_url()).await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let slot = db.name();
    assert!(emit_one(&pool).await, "no slot: the event must become an outbox row");
    let fresh = (true, None);
    let prepared = source.prepare().await.unwrap();
    assert_eq!(seen(prepared), fresh);
    // Not swept yet: a tableless event could overtake an older row.
    assert!(emit_one(&pool).await, "before the sweep: the event must become a row");
    source.mark_swept(&prepared).await.unwrap();
    assert!(!emit_one(&pool).await, "a ready slot reads tableless events");

    server.invalidate_slot(slot).await;
    assert!(emit_one(&pool).await, "a lost slot: the event must become a row");
    let check = slot_check(&db, &pool).await;
    assert!(!check.ok && check.detail.starts_with("lost:"), "{check:?}");
    let replaced = source.prepare().await.unwrap();
    assert_eq!(seen(replaced), (true, Some(SlotLoss::Lost)));
    assert_eq!(wal_status(&pool, slot).await.as_deref(), Some("reserved"));
    assert!(emit_one(&pool).await, "the new slot is not swept yet");
    source.mark_swept(&replaced).await.unwrap();
    assert!(!emit_one(&pool).await, "the new slot reads tableless events");
    // max_slot_wal_keep_size caps slots now: how far from lost it is shows.
    let lag = source.status().await.unwrap();
    assert!(lag.safe_bytes.is_some(), "{lag:?}");
    let check = slot_check(&db, &pool).await;
    assert!(
        check.ok && check.detail.contains("PostgreSQL invalidates it after"),
        "{check:?}"
    );
    // Past the cap, the slot waits only for the next checkpoint to be lost.
    sqlx::query("CREATE TABLE wal_filler (at timestamptz)")
        .execute(&pool)
        .await
        .unwrap();
    for _ in 0..3 {
        sqlx::query("INSERT INTO wal_filler VALUES (now())")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("SELECT pg_switch_wal()").execute(&pool).await.unwrap();
    }
    assert_eq!(wal_status(&pool, slot).await.as_deref(), Some("unreserved"));
    assert!(
        emit_one(&pool).await,
        "a slot about to be lost: the event must become a row"
    );
    let check = slot_check(&db, &pool).await;
    assert!(
        !check.ok && check.detail.contains("the next checkpoint invalidates it"),
        "{check:?}"
    );
    assert_eq!(
        seen(source.prepare().await.unwrap()),
        (false, None),
        "a slot not lost is kept"
    );

    drop_slot(&pool, slot).await;
    let check = slot_check(&db, &pool).await;
    assert!(check.ok && check.detail.starts_with("gone though"), "{check:?}");
    assert_eq!(seen(source.prepare().await.unwrap()), (true, Some(SlotLoss::Vanished)));
    // A slot that never streamed is not reported when it goes.
    drop_slot(&pool, slot).await;
    assert_eq!(seen(source.prepare().await.unwrap()), fresh);
    pool.close().await;
    db.drop_db().await;
}

/// Making the new slot waits for every transaction already running, so a
/// `statement_timeout` or an old open transaction can fail the attempt that
/// dropped the lost slot, after it reset what said the slot had streamed (a
/// relay killed there leaves the same state). The next attempt must still
/// report the loss, from this relay or from another one started since.
#[tokio::test]
async fn a_loss_is_reported_by_whichever_relay_replaces_the_slot_after_an_attempt_that_failed() {
    let server = PgServer::start().await;
    let db = TestDb::create_on(&server.admin_url()).await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let impatient = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET statement_timeout = '1s'").execute(conn).await?;
                Ok(())
            })
        })
        .connect(db.url())
        .await
        .unwrap();
    let source = source_of(&db, &impatient);
    let prepared = source.prepare().await.unwrap();
    source.mark_swept(&prepared).await.unwrap();
    server.invalidate_slot(db.name()).await;

    // A transaction with an id, left open: the new slot waits for it.
    let mut old = sqlx::PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut old).await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut old)
        .await
        .unwrap();
    let failed = source.prepare().await.unwrap_err();
    assert!(failed.message.contains("before that"), "{failed:?}");
    sqlx::query("ROLLBACK").execute(&mut old).await.unwrap();

    // A relay started afresh, as after a crash of the one that failed.
    let restarted = source_of(&db, &pool);
    assert_eq!(seen(restarted.prepare().await.unwrap()), (true, Some(SlotLoss::Lost)));
    assert_eq!(seen(source.prepare().await.unwrap()), (true, None), "reported once");
    impatient.close().await;
    pool.close().await;
    db.drop_db().await;
}

/// The slot can hand a transaction over before other sessions see it
/// commit. `look` must tell such a transaction apart from one whose rows
/// were routed already, or the relay would skip its events for good.
#[tokio::test]
async fn look_reports_transactions_not_yet_visible() {
    look_tells_open_from_committed(TestDb::create().await).await;
}

/// The same on a server past its first 2³² transactions, where the slot's
/// 32-bit xid must be placed in the right epoch. The newest transaction of
/// a quiet server is at or above its snapshots' `xmax`: placed an epoch too
/// early, it read as long committed, and its events were skipped.
#[tokio::test]
async fn look_reports_transactions_not_yet_visible_past_the_first_epoch() {
    let server = PgServer::start_in_epoch(1).await;
    look_tells_open_from_committed(TestDb::create_on(&server.admin_url()).await).await;
}

async fn look_tells_open_from_committed(db: TestDb) {
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let mut open = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let mut tx = open.begin().await.unwrap();
    let xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let xid = (xid & 0xffff_ffff) as u32;
    let look = source.look(&[], &[], &[], &[xid]).await.unwrap();
    assert!(look.invisible.contains(&xid), "an open transaction counts as visible");
    // Still open once later transactions have completed (its xid now below
    // the snapshots' xmax).
    for _ in 0..3 {
        sqlx::query("SELECT pg_current_xact_id()").execute(&pool).await.unwrap();
    }
    let look = source.look(&[], &[], &[], &[xid]).await.unwrap();
    assert!(
        look.invisible.contains(&xid),
        "an open transaction older than others counts as visible"
    );
    tx.commit().await.unwrap();
    let look = source.look(&[], &[], &[], &[xid]).await.unwrap();
    assert!(
        look.invisible.is_empty(),
        "a committed transaction is still invisible: {look:?}"
    );
    // One from long ago (a small xid of this epoch) is visible too.
    let look = source.look(&[], &[], &[], &[3]).await.unwrap();
    assert!(look.invisible.is_empty(), "{look:?}");
    drop(open);
    db.drop_db().await;
}

#[tokio::test]
async fn missed_tells_rows_of_transactions_ended_before_the_mark() {
    missed_tells_ended_from_open(TestDb::create().await).await;
}

/// The same past the server's first 2³² transactions: a row's 32-bit
/// `xmin` must be placed in the epoch of the mark's.
#[tokio::test]
async fn missed_tells_rows_of_transactions_ended_before_the_mark_past_the_first_epoch() {
    let server = PgServer::start_in_epoch(1).await;
    missed_tells_ended_from_open(TestDb::create_on(&server.admin_url()).await).await;
}

/// `missed` offers, once the stream is past a mark, the unrouted rows of
/// transactions that had ended when it was taken (subtransactions too), and
/// none of a transaction open then (though its row's seq is below the
/// mark's), nor of one begun after, nor one an operator requeued with no
/// route. The mark's `xmin` is the whole server's: another session's
/// transaction can hold it back, so what must be offered is waited for
/// with fresh marks, while what must not is checked at once.
async fn missed_tells_ended_from_open(db: TestDb) {
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let ids = |events: Vec<WalEvent>| events.into_iter().map(|e| e.event.id).collect::<Vec<EventId>>();
    let offered = async |want: &[EventId]| {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let mark = source.mark().await.unwrap();
            let got = ids(source.missed(&mark, 100).await.unwrap());
            if got == want {
                return;
            }
            assert!(
                got.iter().all(|id| want.contains(id)),
                "{got:?} offers more than {want:?}"
            );
            assert!(tokio::time::Instant::now() < deadline, "{got:?} is not {want:?}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    let before = enqueue_one(&pool).await;
    // Written in a subtransaction, committed before the mark.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut sub = tx.begin().await.unwrap();
    let in_sub = ferry_store::postgres::enqueue(&mut sub, Event::new("order.placed", json!({ "n": 2 })).key("k"))
        .await
        .unwrap()
        .id;
    sub.commit().await.unwrap();
    tx.commit().await.unwrap();
    let requeued = enqueue_one(&pool).await;
    sqlx::query(
        "INSERT INTO ferry.admin_log (seq, route, actor, action, from_state, attempts) \
         SELECT seq, $2, 'test', 'requeue', 'dead', 0 FROM ferry.events WHERE id = $1",
    )
    .bind(requeued.0)
    .bind(ferry_core::NO_ROUTE)
    .execute(&pool)
    .await
    .unwrap();
    offered(&[before, in_sub]).await;
    let mark = source.mark().await.unwrap();
    let now: i64 = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(mark.lsn() > 0 && mark.lsn() <= now as u64);
    let got = ids(source.missed(&mark, 1).await.unwrap());
    assert!(got.len() <= 1 && got.iter().all(|id| *id == before), "{got:?}");

    // Open across the next mark, its row in a subtransaction (whose id is
    // above the mark's xmin as its parent's is), then one committed while
    // it is open: both seqs are below the mark's.
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let mut open = conn.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *open)
        .await
        .unwrap();
    let mut sub = open.begin().await.unwrap();
    let across = ferry_store::postgres::enqueue(&mut sub, Event::new("order.placed", json!({ "n": 3 })).key("o"))
        .await
        .unwrap()
        .id;
    sub.commit().await.unwrap();
    let beside = enqueue_one(&pool).await;
    for _ in 0..3 {
        sqlx::query("SELECT pg_current_xact_id()").execute(&pool).await.unwrap();
    }
    let mark = source.mark().await.unwrap();
    let got = ids(source.missed(&mark, 100).await.unwrap());
    assert!(
        !got.contains(&across) && !got.contains(&beside) && !got.contains(&requeued),
        "{got:?}: across {across:?}, beside {beside:?}, requeued {requeued:?}"
    );
    open.commit().await.unwrap();
    drop(conn);
    let got = ids(source.missed(&mark, 100).await.unwrap());
    assert!(!got.contains(&across) && !got.contains(&beside), "{got:?}");
    // A later mark takes in what had ended by then.
    offered(&[before, in_sub, across, beside]).await;
    pool.close().await;
    db.drop_db().await;
}

/// The SQL door, `ferry.emit(type, key, payload)`: without a healthy slot it
/// writes `ferry.enqueue`'s row, checked by that; with one, a tableless
/// event, checked by `ferry._emit` itself. Either way a bad event is refused
/// with the fix, and a good one comes back with its id.
#[tokio::test]
async fn the_sql_emit_checks_the_event_with_or_without_a_slot() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    for slot_ready in [false, true] {
        if slot_ready {
            let prepared = source.prepare().await.unwrap();
            source.mark_swept(&prepared).await.unwrap();
        }
        for (sql, field) in [
            ("SELECT ferry.emit('Order Placed', 'k', '{}')", "type"),
            // What a destination would refuse for ever.
            ("SELECT ferry.emit('order.placed', E'k\\n', '{}')", "key"),
            (
                "SELECT ferry.emit('order.placed', 'k', '{}', '{\"a b\": \"x\"}')",
                "headers",
            ),
            (
                "SELECT ferry.emit('order.placed', 'k', '{}', '{\"a\": \"x\\ry\"}')",
                "headers",
            ),
        ] {
            let err = sqlx::query(sql).execute(&pool).await.expect_err(sql);
            let err = err.as_database_error().expect("refused by the database");
            assert_eq!(err.code().as_deref(), Some("22023"), "{err}");
            assert!(
                err.message().contains(&format!("invalid event {field}")),
                "{sql}: {err}"
            );
        }
        let id: uuid::Uuid = sqlx::query_scalar("SELECT ferry.emit('order.placed', 'k', '{\"n\": 1}')")
            .fetch_one(&pool)
            .await
            .unwrap();
        let row: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry.events WHERE id = $1)")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(
            row, !slot_ready,
            "a row only without a ready slot (slot ready: {slot_ready})"
        );
    }
    pool.close().await;
    db.drop_db().await;
}

/// Two relays start at once. One makes the slot, sweeps and marks it ready
/// while the other, which found no slot a moment before, is about to record
/// that it makes one. That record must not undo the first relay's `ready`:
/// tableless producing would stay off (`ferry.emit` writing outbox rows)
/// until the streaming relay restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_found_no_slot_does_not_undo_another_relays_sweep() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let slot = db.name().to_owned();
    // The first relay holds the table from before the second looks until it
    // has made the slot and swept. A table lock takes no transaction id, so
    // making the slot does not wait for it.
    let mut first = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ferry.wal_slots IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *first)
        .await
        .unwrap();
    let second = tokio::spawn({
        let source = source_of(&db, &pool);
        async move { source.prepare().await }
    });
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE relation = 'ferry.wal_slots'::regclass AND NOT granted)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second relay never reached its record of the slot"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The second relay has found no slot and waits to record one: the first
    // makes it, sweeps, and marks it ready.
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO ferry.wal_slots (slot, publication, ready, swept_generation) VALUES ($1, 'ferry', true, 0)",
    )
    .bind(&slot)
    .execute(&mut *first)
    .await
    .unwrap();
    first.commit().await.unwrap();
    let prepared = seen(second.await.unwrap().unwrap());
    assert_eq!(prepared, (false, None));
    let ready: bool = sqlx::query_scalar("SELECT ready FROM ferry.wal_slots WHERE slot = $1")
        .bind(&slot)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ready, "the second relay undid the first one's sweep");
    pool.close().await;
    db.drop_db().await;
}

/// A relay sweeping a new slot can lose it meanwhile to another relay that
/// replaces it. Its sweep covered only what was committed before the old
/// slot, so it must not mark the new one swept: if the relay that made the
/// new slot then crashed before its own sweep, the next one would skip the
/// sweep, and whatever was committed in between would stay unrouted for
/// good.
#[tokio::test]
async fn a_sweep_of_a_slot_since_replaced_does_not_mark_the_new_slot_swept() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let sweeping = source_of(&db, &pool);
    let swept = sweeping.prepare().await.unwrap();
    assert_eq!(seen(swept), (true, None));
    // While it sweeps, its slot goes and another relay makes a new one.
    drop_slot(&pool, db.name()).await;
    let replacing = source_of(&db, &pool);
    let made = replacing.prepare().await.unwrap();
    assert_eq!(seen(made), (true, None));
    let err = sweeping.mark_swept(&swept).await.unwrap_err();
    assert!(err.message.contains("replaced during the sweep"), "{err:?}");
    assert!(
        emit_one(&pool).await,
        "the new slot is not swept: events must become rows"
    );
    // The relay that made the new slot crashed before its sweep was done:
    // the next one must sweep.
    let next = source_of(&db, &pool);
    let prepared = next.prepare().await.unwrap();
    assert_eq!(seen(prepared), (true, None), "the new slot was taken as swept");
    next.mark_swept(&prepared).await.unwrap();
    assert!(!emit_one(&pool).await, "a swept slot reads tableless events");
    pool.close().await;
    db.drop_db().await;
}

/// Retires `slot`, with no relay streaming from it: `retire` marks it, then
/// waits for a relay to finish with it, which is not waited for here.
async fn retire_now(pool: &PgPool, slot: &str) {
    let retiring = {
        let (pool, slot) = (pool.clone(), slot.to_owned());
        tokio::spawn(async move { ferry_store::postgres::wal::retire(&pool, &slot, |_| {}).await })
    };
    while !emit_one(pool).await {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    retiring.abort();
}

/// `retire` takes the slot out of `ferry.emit`'s use, but its sweep stays
/// done: a relay returning to it must not sweep again (rows written since
/// would overtake tableless events the slot still holds).
#[tokio::test]
async fn a_retired_slot_stays_swept() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    retire_now(&pool, db.name()).await;
    let again = source.prepare().await.unwrap();
    assert_eq!(seen(again), (false, None), "a retired slot was taken as unswept");
    assert!(
        !source.mark_swept(&again).await.unwrap(),
        "a retired slot was marked ready"
    );
    // A new slot of the same name starts afresh.
    drop_slot(&pool, db.name()).await;
    let made = source.prepare().await.unwrap();
    assert_eq!(seen(made), (true, None), "a new slot was taken as swept");
    assert!(source.mark_swept(&made).await.unwrap());
    // A relay of the release before schema 19 resets the record for a new
    // slot as it knows it: not ready, the next generation. The new slot is
    // not swept, whoever reset the record.
    sqlx::query("UPDATE ferry.wal_slots SET ready = false, generation = generation + 1 WHERE slot = $1")
        .bind(db.name())
        .execute(&pool)
        .await
        .unwrap();
    let reset = source.prepare().await.unwrap();
    assert_eq!(
        seen(reset),
        (true, None),
        "a slot reset by an older relay was taken as swept"
    );
    pool.close().await;
    db.drop_db().await;
}

/// Before the first sweep of a slot the relay waits for the transactions
/// writing at that moment: one committed just before the slot's consistent
/// point may not be visible yet. Readers and writers of other databases
/// are not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_waits_for_the_writers_open_when_it_began() {
    let db = TestDb::create().await;
    let other = TestDb::create().await;
    let pool = db.pool().await;
    let other_pool = other.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    source.prepare().await.unwrap();
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM ferry.events")
        .execute(&mut *reader)
        .await
        .unwrap();
    let mut elsewhere = other_pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE t (n int)")
        .execute(&mut *elsewhere)
        .await
        .unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), source.await_writers(|_| {}))
        .await
        .expect("the wait waited for a reader or another database's writer")
        .unwrap();
    let mut writer = pool.begin().await.unwrap();
    let writer_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *writer)
        .await
        .unwrap();
    emit(&mut writer, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let waiting = {
        let source = source_of(&db, &pool);
        tokio::spawn(async move {
            source
                .await_writers(move |pids| {
                    let _ = seen_tx.send(pids.to_vec());
                })
                .await
        })
    };
    let pids = seen_rx.recv().await.expect("the wait reports whom it waits for");
    assert_eq!(pids, vec![writer_pid]);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the wait ended while the writer was open");
    // A writer begun after the wait began is not waited for.
    let mut later = pool.begin().await.unwrap();
    sqlx::query("CREATE TABLE later (n int)")
        .execute(&mut *later)
        .await
        .unwrap();
    writer.commit().await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("the wait outlived the writer")
        .unwrap()
        .unwrap();
    later.rollback().await.unwrap();
    reader.rollback().await.unwrap();
    elsewhere.rollback().await.unwrap();
    pool.close().await;
    other_pool.close().await;
    db.drop_db().await;
    other.drop_db().await;
}

/// A tableless event, as the stream hands one over.
fn tableless_event() -> WalEvent {
    WalEvent {
        event: StoredEvent {
            id: EventId::new(),
            seq: 0,
            event_type: "order.paid".into(),
            key: Some("k".into()),
            payload: b"{}".to_vec().into(),
            content_type: "application/json".into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
        },
        partition: None,
        undecodable: None,
    }
}

/// The settlement of a batch in which `event` failed: one that records a
/// position.
fn failed(event: &WalEvent, generation: i64, through: u64, part: Option<(u64, u64)>) -> Settlement<'_> {
    Settlement {
        outcomes: vec![(
            event,
            "all".to_owned(),
            Outcome::Retry {
                next_at: chrono::Utc::now(),
                error: "down".into(),
            },
        )],
        through,
        generation,
        part,
    }
}

/// The slot record's `settled_lsn`, `part_lsn` and `part_events`.
async fn positions(pool: &PgPool, slot: &str) -> (Option<i64>, Option<i64>, Option<i64>) {
    sqlx::query_as("SELECT settled_lsn, part_lsn, part_events FROM ferry.wal_slots WHERE slot = $1")
        .bind(slot)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A settle still under way when its slot is replaced (lost, or gone with a
/// failover) must not record its position for the new slot: a position of
/// the old slot can lie ahead of what a promoted server's new slot has yet
/// to stream, and the next session would start past it.
#[tokio::test]
async fn a_settle_that_outlived_its_slot_records_no_position_for_the_new_one() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let old = source_of(&db, &pool);
    let before = old.prepare().await.unwrap().generation;
    drop_slot(&pool, db.name()).await;
    let now_made = source_of(&db, &pool).prepare().await.unwrap().generation;
    assert_ne!(before, now_made, "the replaced slot kept its generation");
    // A tableless event the old session could not publish: its settle
    // records a position.
    let event = tableless_event();
    let now = chrono::Utc::now();
    let settle = |generation: i64| failed(&event, generation, 1 << 40, Some((1 << 41, 7)));
    let written = old.settle(&settle(before), now).await.unwrap();
    assert_eq!(written.written, 1, "the failed event was not written to the outbox");
    assert_eq!(
        positions(&pool, db.name()).await,
        (None, None, None),
        "a settle of the old slot set the new one's start"
    );
    old.settle(&settle(now_made), now).await.unwrap();
    assert_eq!(
        positions(&pool, db.name()).await,
        (Some(1 << 40), Some(1 << 41), Some(7))
    );
    pool.close().await;
    db.drop_db().await;
}

/// The slot record holds one partly settled transaction. When a settle moves
/// it on to a later transaction, the start moves past the one it named
/// (settled whole by then, its last part perhaps holding outbox rows only,
/// which record nothing): a replay after a server crash would otherwise
/// stream that transaction again with nothing to skip its settled part by.
/// A settle that comes late takes neither position back.
#[tokio::test]
async fn the_recorded_positions_only_move_forward_and_past_a_transaction_left_behind() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let generation = source.prepare().await.unwrap().generation;
    let event = tableless_event();
    let now = chrono::Utc::now();
    let settle = async |through: u64, part: Option<(u64, u64)>| {
        source
            .settle(&failed(&event, generation, through, part), now)
            .await
            .unwrap();
        positions(&pool, db.name()).await
    };
    let (t1, t2) = (1u64 << 40, 1u64 << 41);
    // A first part of T1, then a second.
    assert_eq!(settle(0, Some((t1, 2000))).await, (None, Some(t1 as i64), Some(2000)));
    assert_eq!(settle(0, Some((t1, 4000))).await, (None, Some(t1 as i64), Some(4000)));
    // The first again, late: nothing moves back.
    assert_eq!(settle(0, Some((t1, 2000))).await, (None, Some(t1 as i64), Some(4000)));
    // T1's last part held rows only; a part of T2 moves the start past T1.
    assert_eq!(
        settle(0, Some((t2, 2000))).await,
        (Some(t1 as i64 + 1), Some(t2 as i64), Some(2000))
    );
    // T1's part, late: neither the start nor the record goes back to it.
    assert_eq!(
        settle(0, Some((t1, 4000))).await,
        (Some(t1 as i64 + 1), Some(t2 as i64), Some(2000))
    );
    // A batch that completes T2 and more: the start moves to its end.
    let end = t2 + 1000;
    assert_eq!(settle(end, None).await, (Some(end as i64), Some(t2 as i64), Some(2000)));
    // An earlier end, late: the start stays.
    assert_eq!(
        settle(t2 - 5, None).await,
        (Some(end as i64), Some(t2 as i64), Some(2000))
    );
    pool.close().await;
    db.drop_db().await;
}

/// Two relays configured with different slot names that start at once both
/// pass `prepare` (neither slot is ready yet); only the first to finish its
/// sweep may mark its slot ready, or every tableless event would be read by
/// both and delivered twice.
#[tokio::test]
async fn of_two_slots_prepared_at_once_only_the_first_is_marked_ready() {
    use ferry_store::postgres::wal::emit_slots;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let first = source_of(&db, &pool);
    let (other_name, other) = other_source(&db, &pool);
    let (a, b) = (first.prepare().await.unwrap(), other.prepare().await.unwrap());
    assert!(first.mark_swept(&a).await.unwrap());
    let err = other.mark_swept(&b).await.unwrap_err();
    assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
    assert!(err.message.contains("ferry wal retire --slot"), "{err}");
    assert_eq!(emit_slots(&pool, None).await.unwrap(), vec![db.name().to_owned()]);
    for slot in [db.name(), other_name.as_str()] {
        drop_slot(&pool, slot).await;
    }
    pool.close().await;
    db.drop_db().await;
}

/// `ferry.emit` writes tableless events for the ready slot; a relay
/// configured with another slot name would never read them, so it is
/// refused with the fix, until the first slot is retired (or gone).
#[tokio::test]
async fn a_relay_on_another_slot_is_refused_while_emit_writes_for_the_first() {
    use ferry_store::postgres::wal::emit_slots;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let first = source_of(&db, &pool);
    let prepared = first.prepare().await.unwrap();
    first.mark_swept(&prepared).await.unwrap();
    assert_eq!(emit_slots(&pool, None).await.unwrap(), vec![db.name().to_owned()]);
    assert!(emit_slots(&pool, Some(db.name())).await.unwrap().is_empty());

    let (other_name, other) = other_source(&db, &pool);
    let err = other.prepare().await.unwrap_err();
    assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
    for needle in [format!("wal_slot = \"{}\"", db.name()), "ferry wal retire".to_owned()] {
        assert!(err.message.contains(&needle), "missing {needle:?} in: {err}");
    }
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)")
        .bind(&other_name)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!exists, "the refused relay made its slot anyway");
    // `ferry check` on the other slot's config says so, with the same fix.
    let found = diagnose(&pool, other.config(), u64::MAX).await;
    let refused = found
        .iter()
        .find(|f| f.what == format!("WAL slot {}", db.name()))
        .unwrap_or_else(|| panic!("no finding on the ready slot: {found:?}"));
    assert!(
        !refused.ok && refused.detail.contains("ferry wal retire"),
        "{refused:?}"
    );
    assert!(
        diagnose(&pool, first.config(), u64::MAX)
            .await
            .iter()
            .all(|f| !f.what.starts_with("WAL slot")),
        "the ready slot's own config was refused"
    );

    // Marked not ready, as `retire` does first: ferry.emit writes rows, and
    // the other slot may start.
    sqlx::query("UPDATE ferry.wal_slots SET ready = false WHERE slot = $1")
        .bind(db.name())
        .execute(&pool)
        .await
        .unwrap();
    assert!(emit_slots(&pool, None).await.unwrap().is_empty());
    assert!(
        emit_one(&pool).await,
        "ferry.emit wrote a tableless event for a slot not ready"
    );
    drop_slot(&pool, db.name()).await;
    other.prepare().await.unwrap();
    drop_slot(&pool, &other_name).await;
    pool.close().await;
    db.drop_db().await;
}

/// A transaction of many events, or of large ones, comes off the stream in
/// parts, so the relay holds at most a part of it in memory: every event in
/// its order, each part within the bounds, only the last one confirmable.
#[tokio::test]
async fn a_large_transaction_is_handed_over_in_bounded_parts() {
    use ferry_store::postgres::enqueue_batch;
    use ferry_store::postgres::wal::{PART_BYTES, PART_EVENTS, WalItem, WalTxn};
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let mut stream = source.open(&prepared).await.unwrap();

    // Many small events, rows and tableless ones interleaved.
    let many = 2 * PART_EVENTS + PART_EVENTS / 2;
    let mut tx = pool.begin().await.unwrap();
    let mut want = Vec::new();
    for chunk in 0..many / 500 {
        let rows: Vec<Event> = (0..250)
            .map(|i| Event::new("order.placed", json!({ "chunk": chunk, "i": i })).key("k"))
            .collect();
        want.extend(enqueue_batch(&mut tx, rows).await.unwrap().into_iter().map(|s| s.id));
        for i in 0..250 {
            let ev = Event::new("order.paid", json!({ "chunk": chunk, "i": i })).key("k");
            want.push(emit(&mut tx, ev).await.unwrap());
        }
    }
    tx.commit().await.unwrap();
    // Few large ones: the bytes bound applies first.
    let big = 1000 * 1024;
    let large = PART_BYTES / big * 2 + 3;
    let mut tx = pool.begin().await.unwrap();
    let mut want_large = Vec::new();
    for i in 0..large {
        let ev = Event::bytes("file.stored", vec![i as u8; big], "application/octet-stream").key("f");
        want_large.push(emit(&mut tx, ev).await.unwrap());
    }
    tx.commit().await.unwrap();

    async fn transaction(stream: &mut ferry_store::postgres::wal::WalStream) -> Vec<WalTxn> {
        let mut parts: Vec<WalTxn> = Vec::new();
        loop {
            let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
                .await
                .expect("the stream stalled")
                .unwrap();
            match item {
                WalItem::Txn(t) if t.events.is_empty() && t.end_lsn > 0 && parts.is_empty() => {}
                WalItem::Txn(t) => {
                    let last = t.end_lsn > 0;
                    parts.push(t);
                    if last {
                        return parts;
                    }
                }
                WalItem::Idle { .. } => {}
            }
        }
    }
    for (want, parts) in [
        (want, transaction(&mut stream).await),
        (want_large, transaction(&mut stream).await),
    ] {
        let got: Vec<_> = parts.iter().flat_map(|p| p.events.iter().map(|e| e.event.id)).collect();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the events came out of their order");
        assert!(parts.len() > 2, "{} parts", parts.len());
        for p in &parts {
            let bytes: usize = p.events.iter().map(|e| e.event.payload.len()).sum();
            assert!(p.events.len() <= PART_EVENTS, "a part of {} events", p.events.len());
            assert!(bytes < PART_BYTES + big, "a part of {bytes} bytes");
            assert_eq!(p.xid, parts[0].xid);
            assert_eq!(p.commit_time, parts[0].commit_time);
        }
        let last = parts.last().unwrap().end_lsn;
        assert!(parts[..parts.len() - 1].iter().all(|p| p.end_lsn == 0) && last > 0);
    }
    stream.close().await;
    pool.close().await;
    db.drop_db().await;
}

/// A stream reads change data ahead of the relay only as far as its byte
/// budget: counted in messages, a backlog of large events would be read
/// into memory whole while the relay was busy or away. Past the budget the
/// server waits, and the rest is read as the relay catches up, in order.
#[tokio::test]
async fn a_stream_reads_ahead_of_the_relay_only_as_far_as_its_byte_budget() {
    use ferry_store::postgres::wal::WalItem;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool).with_read_ahead(4 << 20);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let wal_now = async || -> i64 {
        sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let start = wal_now().await;
    let big = 1000 * 1024;
    let mut want = Vec::new();
    for i in 0..96u32 {
        let mut tx = pool.begin().await.unwrap();
        let ev = Event::bytes("file.stored", vec![i as u8; big], "application/octet-stream").key("f");
        want.push(emit(&mut tx, ev).await.unwrap());
        tx.commit().await.unwrap();
    }
    let end = wal_now().await;

    let mut stream = source.open(&prepared).await.unwrap();
    // Nothing is read from the stream: how far the server got sending is
    // how far the stream read ahead, give or take the sockets' buffers.
    let sent = async || -> Option<i64> {
        sqlx::query_scalar(
            "SELECT (r.sent_lsn - '0/0')::bigint FROM pg_stat_replication r
               JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1",
        )
        .bind(db.name())
        .fetch_optional(&pool)
        .await
        .unwrap()
        .flatten()
    };
    let (mut last, mut still) = (None, 0);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while still < 10 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let now = sent().await;
        still = if now.is_some() && now == last { still + 1 } else { 0 };
        last = now;
    }
    let ahead = last.expect("the stream's walsender") - start;
    let backlog = end - start;
    assert!(
        ahead < backlog / 2,
        "the stream read {} MiB of a {} MiB backlog ahead of the relay",
        ahead >> 20,
        backlog >> 20
    );

    let mut got = Vec::new();
    while got.len() < want.len() {
        let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
            .await
            .expect("the stream stalled")
            .unwrap();
        if let WalItem::Txn(t) = item {
            for e in &t.events {
                assert_eq!(e.event.payload.len(), big);
            }
            got.extend(t.events.iter().map(|e| e.event.id));
        }
    }
    assert!(got == want, "the events came out of their order");
    stream.close().await;
    pool.close().await;
    db.drop_db().await;
}

/// A settle whose tableless events were all published writes no row, only
/// the position the relay confirms right after: that commit must reach the
/// disk even where commits default to asynchronous, or a server crash takes
/// the position back and the events are published again.
#[tokio::test]
async fn a_settle_that_records_only_a_position_commits_durably() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let generation = source_of(&db, &pool).prepare().await.unwrap().generation;
    // The generated name of the test's own database.
    let setup = format!(
        "ALTER DATABASE \"{}\" SET synchronous_commit = off;
         CREATE TABLE seen (setting text);
         CREATE FUNCTION note() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO seen VALUES (current_setting('synchronous_commit')); RETURN NEW; END $$;
         CREATE TRIGGER note AFTER UPDATE ON ferry.wal_slots FOR EACH ROW EXECUTE FUNCTION note();",
        db.name()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(setup)).execute(&pool).await.unwrap();
    pool.close().await;
    let pool = db.pool().await;
    let event = tableless_event();
    let settlement = Settlement {
        outcomes: vec![(&event, "all".to_owned(), Outcome::Published { at: chrono::Utc::now() })],
        through: 1 << 40,
        generation,
        part: None,
    };
    let written = source_of(&db, &pool)
        .settle(&settlement, chrono::Utc::now())
        .await
        .unwrap();
    assert_eq!(written.written, 0, "a published tableless event is not written");
    assert_eq!(positions(&pool, db.name()).await.0, Some(1 << 40));
    let seen: Vec<String> = sqlx::query_scalar("SELECT setting FROM seen")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(seen, ["local"], "the position's commit was asynchronous");
    pool.close().await;
    db.drop_db().await;
}

/// A publication that does not carry the outbox's inserts stops the stream
/// and marks the slot for a sweep once it is mended; a retired slot, which
/// the relays leave for polling, keeps its sweep.
#[tokio::test]
async fn a_wrong_publication_marks_the_slot_for_a_sweep_unless_it_is_retired() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    source.check_publication().await.expect("the relay's own publication");
    let publication = config_of(&db).publication;
    let alter = |what: &str| format!("ALTER PUBLICATION {publication} {what}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(alter("SET (publish = 'update')")))
        .execute(&pool)
        .await
        .unwrap();
    let err = source.prepare().await.unwrap_err();
    assert!(err.message.contains("does not publish inserts"), "{err}");
    assert!(err.message.contains(&alter("SET (publish = 'insert')")), "{err}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(alter("SET (publish = 'insert')")))
        .execute(&pool)
        .await
        .unwrap();
    let mended = source.prepare().await.unwrap();
    assert_eq!(seen(mended), (true, None), "rows committed meanwhile are not swept");
    assert!(source.mark_swept(&mended).await.unwrap());

    // Retired, it stays swept.
    retire_now(&pool, db.name()).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(alter("DROP TABLE ferry.events")))
        .execute(&pool)
        .await
        .unwrap();
    let err = source.check_publication().await.unwrap_err();
    assert!(err.message.contains("does not include ferry.events"), "{err}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(alter("ADD TABLE ferry.events")))
        .execute(&pool)
        .await
        .unwrap();
    let again = source.prepare().await.unwrap();
    assert_eq!(seen(again), (false, None), "a retired slot was taken as unswept");
    pool.close().await;
    db.drop_db().await;
}

/// Makes `slot` by hand, as an administrator would.
async fn make_slot(pool: &PgPool, slot: &str) {
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(slot)
        .execute(pool)
        .await
        .unwrap();
}

/// A slot dropped and made anew under the same name by hand (as an
/// administrator makes the first one, OPERATIONS.md) is a new slot: it
/// streams only what commits after it was made. Its record still says the
/// old one was swept, and `prepare` must tell the two apart: a row committed
/// in between would otherwise stay unrouted for good, and the old slot's
/// loss go unreported. A retirement does not carry over to the new slot
/// either: it "starts afresh".
#[tokio::test]
async fn a_slot_made_anew_by_hand_is_taken_for_a_new_slot() {
    use ferry_store::postgres::enqueue;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    assert_eq!(seen(source.prepare().await.unwrap()), (false, None), "its own slot");

    drop_slot(&pool, db.name()).await;
    let mut tx = pool.begin().await.unwrap();
    let row = enqueue(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    make_slot(&pool, db.name()).await;
    let made = source.prepare().await.unwrap();
    assert_eq!(
        seen(made),
        (true, Some(SlotLoss::Vanished)),
        "the slot made by hand was taken for the one swept"
    );
    assert!(made.generation > prepared.generation);
    let unrouted: Vec<EventId> = source.unrouted(10).await.unwrap().iter().map(|e| e.event.id).collect();
    assert_eq!(
        unrouted,
        vec![row],
        "the row the new slot will not stream is not left to the sweep"
    );
    assert!(
        emit_one(&pool).await,
        "the new slot is not swept: events must become rows"
    );
    assert_eq!(
        seen(source.prepare().await.unwrap()),
        (true, None),
        "the loss is reported once, and the new slot is the record's now"
    );
    assert!(source.mark_swept(&made).await.unwrap());
    assert!(!emit_one(&pool).await, "a swept slot reads tableless events");

    // Retired, dropped, made anew by hand: the new slot is not retired.
    retire_now(&pool, db.name()).await;
    drop_slot(&pool, db.name()).await;
    make_slot(&pool, db.name()).await;
    let afresh = source.prepare().await.unwrap();
    // Retired, it was not ready: ferry.emit wrote no tableless event for it.
    assert_eq!(seen(afresh), (true, None));
    assert!(!afresh.retired, "the new slot inherited the old one's retirement");
    assert!(
        source.mark_swept(&afresh).await.unwrap(),
        "the new slot was kept retired"
    );
    assert!(!emit_one(&pool).await, "the new slot reads tableless events");
    pool.close().await;
    db.drop_db().await;
}

/// The other side of telling a slot made anew by its position: the slot a
/// relay streamed from, confirmed as far as the relay got, is never taken
/// for a new one, after a stream, a restart of the relay or a crash of the
/// server (which may take its position back, never forward).
#[tokio::test]
async fn a_slot_streamed_and_confirmed_is_not_taken_for_a_new_one() {
    use ferry_store::postgres::wal::WalItem;
    let mut server = PgServer::start().await;
    let db = TestDb::create_on(&server.admin_url()).await;
    let mut pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let mut source = source_of(&db, &pool);
    let mut prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    for round in 0..3 {
        let mut stream = source.open(&prepared).await.unwrap();
        for _ in 0..3 {
            assert!(!emit_one(&pool).await);
        }
        // Everything the stream hands over is settled at once.
        let (mut events, mut last) = (0, 0);
        while events < 3 {
            let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
                .await
                .expect("the stream stalled")
                .unwrap();
            match item {
                WalItem::Txn(t) => {
                    events += t.events.len();
                    last = last.max(t.end_lsn);
                }
                WalItem::Idle { lsn } => last = last.max(lsn),
            }
        }
        stream.confirm(last);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let confirmed: i64 = sqlx::query_scalar(
                "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(db.name())
            .fetch_one(&pool)
            .await
            .unwrap();
            if confirmed as u64 >= last {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the slot was never confirmed");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        stream.close().await;
        if round == 1 {
            pool.close().await;
            server.crash();
            server.restart().await;
            pool = db.pool().await;
            source = source_of(&db, &pool);
        }
        let again = source.prepare().await.unwrap();
        assert_eq!(
            seen(again),
            (false, None),
            "round {round}: the relay's own slot was taken for a new one"
        );
        assert_eq!(again.generation, prepared.generation);
        prepared = again;
    }
    pool.close().await;
    db.drop_db().await;
}

/// A relay judges the slot when it prepares, and opens the stream later.
/// If another relay has replaced the slot in between (found it gone and
/// made a new one), the stream must not open on the new slot, whose sweep
/// the first relay never did (nor saw to be done): the new slot would be
/// streamed without rows committed before it ever being swept.
#[tokio::test]
async fn a_stream_opens_only_on_the_slot_its_relay_prepared() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let a = source_of(&db, &pool);
    let b = source_of(&db, &pool);
    let for_a = a.prepare().await.unwrap();
    a.mark_swept(&for_a).await.unwrap();
    drop_slot(&pool, db.name()).await;
    let for_b = b.prepare().await.unwrap();
    assert_ne!(for_a.generation, for_b.generation);
    let Err(err) = a.open(&for_a).await else {
        panic!("a stream opened on a slot made since its relay prepared");
    };
    assert_eq!(err.kind, ferry_core::ErrorKind::Transient, "{err}");
    assert!(err.message.contains("replaced"), "{err}");
    b.open(&for_b)
        .await
        .expect("the relay that made the slot streams")
        .close()
        .await;
    pool.close().await;
    db.drop_db().await;
}

/// A `ferry` message that `ferry.emit` did not write (anything may call
/// `pg_logical_emit_message('ferry', ...)`) does not stop the stream: it
/// comes out as an event of its own that says why, with the message's bytes
/// and its position, and the events after it come as usual. One of a newer
/// version stops the stream with the fix: a newer relay reads it.
#[tokio::test]
async fn a_foreign_ferry_message_does_not_stop_the_stream() {
    use ferry_store::postgres::wal::{UNDECODABLE_TYPE, WalItem, WalTxn};
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let mut stream = source.open(&prepared).await.unwrap();
    let foreign = br#"{"hello": "world"}"#.to_vec();
    let mut tx = pool.begin().await.unwrap();
    let at: String = sqlx::query_scalar("SELECT pg_logical_emit_message(true, 'ferry', $1)::text")
        .bind(&foreign)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let good = emit(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    async fn transaction(stream: &mut ferry_store::postgres::wal::WalStream) -> Result<WalTxn, ferry_core::StoreError> {
        loop {
            let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
                .await
                .expect("the stream stalled")?;
            if let WalItem::Txn(t) = item
                && !t.events.is_empty()
            {
                return Ok(t);
            }
        }
    }
    let txn = transaction(&mut stream)
        .await
        .expect("the foreign message stopped the stream");
    assert_eq!(txn.events.len(), 2);
    let (odd, next) = (&txn.events[0], &txn.events[1]);
    assert_eq!(next.event.id, good);
    assert!(next.undecodable.is_none());
    assert_eq!(odd.event.event_type, UNDECODABLE_TYPE);
    assert_eq!(&odd.event.payload[..], &foreign[..]);
    assert_eq!(odd.event.key, None);
    assert!(odd.tableless());
    assert_eq!(odd.event.headers.get("ferry-wal-lsn"), Some(&at));
    let why = odd.undecodable.as_deref().expect("the reason");
    assert!(why.contains(&format!("WAL position {at}")), "{why}");
    let first_id = odd.event.id;
    stream.close().await;
    // Read again (nothing was confirmed): the same event, the same id. The
    // walsender may take a moment to let the slot go.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut stream = loop {
        match source.open(&prepared).await {
            Ok(stream) => break stream,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "{e}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let again = transaction(&mut stream).await.unwrap();
    assert_eq!(
        again.events[0].event.id, first_id,
        "a replay gave the message another id"
    );

    // A newer version of Ferry's own message: the stream stops, saying so.
    sqlx::query("SELECT pg_logical_emit_message(true, 'ferry', $1)")
        .bind(br#"{"v": 2, "id": "0190b6a0-0000-7000-8000-000000000001", "type": "order.placed"}"#.to_vec())
        .execute(&pool)
        .await
        .unwrap();
    let err = transaction(&mut stream).await.expect_err("a newer message was read");
    assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
    assert!(
        err.message.contains("version 2") && err.message.contains("upgrade"),
        "{err}"
    );
    stream.close().await;
    pool.close().await;
    db.drop_db().await;
}

/// What `ferry check` says of the publication.
async fn publication_check(db: &TestDb, pool: &PgPool) -> Finding {
    diagnose(pool, &config_of(db), u64::MAX)
        .await
        .into_iter()
        .find(|f| f.what.starts_with("publication"))
        .expect("a finding on the publication")
}

/// Commits one outbox row; its id.
async fn enqueue_one(pool: &PgPool) -> EventId {
    let mut tx = pool.begin().await.unwrap();
    let id = ferry_store::postgres::enqueue(&mut tx, Event::new("order.placed", json!({ "n": 1 })).key("k"))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    id
}

/// A publication dropped while its slot exists is a problem `ferry check`
/// names. PostgreSQL before 18 decodes each change against the
/// publications of its time, so a change committed before it exists again
/// stops the slot for good: the stream says why and where, and the next
/// `prepare` replaces the slot (reporting it), with `ferry.emit` writing
/// outbox rows until the new slot is swept, and the row the old slot
/// stopped at waiting for that sweep.
#[tokio::test]
async fn a_slot_stopped_by_a_dropped_publication_is_reported_and_replaced() {
    use ferry_store::postgres::wal::WalItem;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    assert!(publication_check(&db, &pool).await.ok);
    let mut stream = source.open(&prepared).await.unwrap();
    let old_slot: i64 = sqlx::query_scalar(
        "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(db.name())
    .fetch_one(&pool)
    .await
    .unwrap();

    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&pool).await.unwrap();
    let check = publication_check(&db, &pool).await;
    assert!(!check.ok, "{check:?}");
    assert!(
        check.detail.contains("does not exist, though replication slot")
            && check.detail.contains("CREATE PUBLICATION ferry FOR TABLE ferry.events"),
        "{check:?}"
    );
    let unpublished = enqueue_one(&pool).await;
    sqlx::raw_sql("CREATE PUBLICATION ferry FOR TABLE ferry.events WITH (publish = 'insert')")
        .execute(&pool)
        .await
        .unwrap();
    assert!(publication_check(&db, &pool).await.ok);
    let err = loop {
        match tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
            .await
            .expect("the stream neither failed nor moved")
        {
            Ok(WalItem::Txn(t)) => assert!(t.events.is_empty(), "an event streamed past the drop"),
            Ok(WalItem::Idle { .. }) => {}
            Err(e) => break e,
        }
    };
    assert!(
        err.message
            .contains("cannot stream past a change committed after WAL position")
            && err.message.contains("publication ferry did not exist")
            && err.message.contains("replaces the slot"),
        "{err}"
    );
    stream.close().await;

    // The walsender may take a moment to let the slot go.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let replaced = loop {
        // Refused while the walsender still holds the slot.
        if let Ok(again) = source.prepare().await
            && again.replaced.is_some()
        {
            break again;
        }
        assert!(tokio::time::Instant::now() < deadline, "the slot was not replaced");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(seen(replaced), (true, Some(SlotLoss::Unpublished)));
    let new_slot: i64 = sqlx::query_scalar(
        "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(db.name())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(new_slot > old_slot, "the slot that stopped is still there");
    assert!(
        emit_one(&pool).await,
        "a tableless event was written before the new slot was swept"
    );
    let waiting: Vec<EventId> = source.unrouted(100).await.unwrap().iter().map(|e| e.event.id).collect();
    assert!(
        waiting.contains(&unpublished),
        "the row the slot stopped at is not swept"
    );
    assert!(source.mark_swept(&replaced).await.unwrap());
    let mut stream = source.open(&replaced).await.unwrap();
    let after = enqueue_one(&pool).await;
    // The row emit wrote comes first.
    loop {
        let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
            .await
            .expect("the new slot does not stream")
            .unwrap();
        if let WalItem::Txn(t) = item
            && t.events.iter().any(|e| e.event.id == after)
        {
            break;
        }
    }
    stream.close().await;
    // Once is enough: the new slot is not replaced again.
    assert_eq!(seen(source.prepare().await.unwrap()), (false, None));
    pool.close().await;
    db.drop_db().await;
}

/// The slot's confirmed position, if it exists.
async fn slot_position(db: &TestDb, pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar(
        "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(db.name())
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// Streams from `prepared` until the event `id` arrives.
async fn streams(source: &WalSource, prepared: &Prepared, id: EventId) {
    use ferry_store::postgres::wal::WalItem;
    let mut stream = source.open(prepared).await.unwrap();
    loop {
        let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
            .await
            .expect("the slot does not stream")
            .unwrap();
        if let WalItem::Txn(t) = item
            && t.events.iter().any(|e| e.event.id == id)
        {
            break;
        }
    }
    stream.close().await;
}

/// A publication dropped while the slot streams stops the stream at the
/// next check and marks the slot not ready: `ferry.emit` writes outbox
/// rows. Before PostgreSQL 18 the check's own write is a change the slot
/// can never stream past, so the next `prepare` replaces the slot rather
/// than sweep it and mark it ready: a tableless event written then would
/// be lost with it. Tableless events go into the new slot, and stream.
#[tokio::test]
async fn a_publication_dropped_under_the_slot_stops_the_stream_and_the_slot_is_replaced() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let old_slot = slot_position(&db, &pool).await.unwrap();
    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&pool).await.unwrap();
    let err = source.check_publication().await.unwrap_err();
    assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
    assert!(err.message.contains("does not exist, though replication slot"), "{err}");
    assert!(
        emit_one(&pool).await,
        "emit wrote a tableless event beside a slot without its publication"
    );
    // The relay makes it again, and replaces the slot before any is ready.
    let again = source.prepare().await.unwrap();
    assert_eq!(seen(again), (true, Some(SlotLoss::Unpublished)));
    assert!(
        slot_position(&db, &pool).await.unwrap() > old_slot,
        "the slot that cannot stream on is kept"
    );
    assert!(publication_check(&db, &pool).await.ok);
    assert!(source.mark_swept(&again).await.unwrap());
    let mut tx = pool.begin().await.unwrap();
    let tableless = emit(&mut tx, Event::new("order.placed", json!({ "n": 2 })).key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    streams(&source, &again, tableless).await;
    assert_eq!(seen(source.prepare().await.unwrap()), (false, None));
    pool.close().await;
    db.drop_db().await;
}

/// A relay that finds the publication missing beside the slot as it starts
/// makes it again, and sweeps what is unrouted: from PostgreSQL 18 on, the
/// slot survives but never streams what committed meanwhile; before 18, it
/// is replaced (the only branch this server can show).
#[tokio::test]
async fn a_publication_made_again_beside_the_slot_leads_to_a_sweep() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&pool).await.unwrap();
    let unpublished = enqueue_one(&pool).await;
    let fresh = source_of(&db, &pool);
    let again = fresh.prepare().await.unwrap();
    assert!(
        again.unswept,
        "rows committed while the publication was missing are not swept"
    );
    let waiting: Vec<EventId> = fresh.unrouted(100).await.unwrap().iter().map(|e| e.event.id).collect();
    assert!(waiting.contains(&unpublished), "{waiting:?}");
    assert!(fresh.mark_swept(&again).await.unwrap());
    let after = enqueue_one(&pool).await;
    streams(&fresh, &again, after).await;
    pool.close().await;
    db.drop_db().await;
}

/// A `prepare` that fails after dropping a slot that could not stream on
/// (here: its role may not create the publication) still has the loss
/// told, by the next `prepare` that succeeds.
#[tokio::test]
async fn an_unpublished_slot_dropped_by_a_failing_prepare_is_still_reported() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    // Replication, and the outbox's tables, but not their ownership.
    let role = format!("{}_relay", db.name());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN REPLICATION; \
         GRANT USAGE ON SCHEMA ferry TO {role}; \
         GRANT ALL ON ALL TABLES IN SCHEMA ferry TO {role}; \
         GRANT ALL ON ALL SEQUENCES IN SCHEMA ferry TO {role}; \
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA ferry TO {role}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let small = PgPool::connect_with(options.clone().username(&role)).await.unwrap();
    let relay = WalSource::new(small.clone(), config_of(&db)).unwrap();
    sqlx::raw_sql("DROP PUBLICATION ferry").execute(&pool).await.unwrap();
    assert!(relay.check_publication().await.is_err());
    let err = relay.prepare().await.unwrap_err();
    assert!(err.message.contains("create the publication"), "{err}");
    assert_eq!(slot_position(&db, &pool).await, None, "the slot was not dropped");
    sqlx::raw_sql("CREATE PUBLICATION ferry FOR TABLE ferry.events WITH (publish = 'insert')")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        seen(relay.prepare().await.unwrap()),
        (true, Some(SlotLoss::Unpublished))
    );
    assert_eq!(seen(relay.prepare().await.unwrap()), (true, None), "told twice");
    small.close().await;
    pool.close().await;
    db.drop_db().await;
    let mut admin = sqlx::PgConnection::connect_with(&options.database("postgres"))
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// A row filter or a column list on the publication (PostgreSQL 15 and
/// later) keeps rows, or their columns, from the stream: refused like a
/// publication without the table, naming the statement that mends it, and
/// the rows committed meanwhile are swept once it is mended.
#[tokio::test]
async fn a_publication_with_a_row_filter_or_a_column_list_is_refused_with_the_fix() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let fix = "ALTER PUBLICATION ferry SET TABLE ferry.events";
    for (narrowing, says) in [
        ("SET TABLE ferry.events WHERE (key IS NULL)", "row filter"),
        (
            "SET TABLE ferry.events (seq, id, type, key, partition, payload, content_type, headers, created_at)",
            "column list",
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("ALTER PUBLICATION ferry {narrowing}")))
            .execute(&pool)
            .await
            .unwrap();
        let err = source.check_publication().await.unwrap_err();
        assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
        assert!(err.message.contains(says) && err.message.contains(fix), "{err}");
        let check = publication_check(&db, &pool).await;
        assert!(
            !check.ok && check.detail.contains(says) && check.detail.contains(fix),
            "{check:?}"
        );
        let err = source.prepare().await.unwrap_err();
        assert!(err.message.contains(says), "{err}");
        sqlx::raw_sql(fix).execute(&pool).await.unwrap();
        assert!(publication_check(&db, &pool).await.ok);
        let mended = source.prepare().await.unwrap();
        assert_eq!(seen(mended), (true, None), "rows committed meanwhile are not swept");
        assert!(source.mark_swept(&mended).await.unwrap());
    }
    pool.close().await;
    db.drop_db().await;
}

/// `retire` waits for the transactions open when it marked the slot, and
/// says whom it waits for: a session left idle in a transaction holds it
/// until it ends.
#[tokio::test]
async fn retire_names_the_sessions_it_waits_for() {
    use ferry_store::postgres::wal::Retiring;
    use std::sync::{Arc, Mutex};
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let mut idle = sqlx::PgConnection::connect(db.url()).await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut idle).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut idle)
        .await
        .unwrap();
    let heard: Arc<Mutex<Vec<Retiring>>> = Arc::default();
    let retiring = {
        let (pool, slot, heard) = (pool.clone(), db.name().to_owned(), heard.clone());
        tokio::spawn(async move {
            ferry_store::postgres::wal::retire(&pool, &slot, |step| heard.lock().unwrap().push(step)).await
        })
    };
    let named = |heard: &[Retiring]| {
        heard
            .iter()
            .any(|step| matches!(step, Retiring::Waiting { pids, .. } if pids.contains(&pid)))
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while !named(&heard.lock().unwrap()) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", heard.lock().unwrap());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    sqlx::raw_sql("COMMIT").execute(&mut idle).await.unwrap();
    // Then it waits for a relay to drain the slot, which none does here.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while !heard.lock().unwrap().contains(&Retiring::NoRelay) {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", heard.lock().unwrap());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    retiring.abort();
    idle.close().await.unwrap();
    pool.close().await;
    db.drop_db().await;
}

/// The walsender streaming from the test database's slot, if any.
async fn walsender(db: &TestDb, pool: &PgPool) -> Option<i32> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(db.name())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A relay that gives up on an unreachable database abandons its stream:
/// the replication connection closes at once, without the watermark write
/// a clean end tries (which would wait on the database), so the walsender
/// no longer holds a stopping server. The next session of the same source
/// waits for that walsender to let the slot go, rather than take the slot
/// for another relay's.
#[tokio::test]
async fn an_abandoned_stream_lets_the_slot_go_at_once() {
    use ferry_store::postgres::wal::WalItem;
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = source_of(&db, &pool);
    let prepared = source.prepare().await.unwrap();
    assert!(source.mark_swept(&prepared).await.unwrap());
    let mut stream = source.open(&prepared).await.unwrap();
    let first = walsender(&db, &pool).await.expect("the stream's walsender");
    assert!(!emit_one(&pool).await);
    let last = loop {
        let item = tokio::time::timeout(std::time::Duration::from_secs(30), stream.next())
            .await
            .expect("the stream stalled")
            .unwrap();
        if let WalItem::Txn(t) = item {
            break t.end_lsn;
        }
    };
    // The slot's record held: the watermark write the settle calls for
    // waits on it.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM ferry.wal_slots WHERE slot = $1 FOR UPDATE")
        .bind(db.name())
        .execute(&mut *holder)
        .await
        .unwrap();
    stream.confirm(last);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    stream.abandon().await;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while walsender(&db, &pool).await == Some(first) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the abandoned stream's walsender still holds the slot"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    holder.rollback().await.unwrap();
    // The next session finds its own last walsender still on the slot
    // (the server has not ended it yet): it waits for it to go.
    let stream = source.open(&prepared).await.unwrap();
    let (next, ()) = tokio::join!(source.open(&prepared), async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        stream.abandon().await;
    });
    next.unwrap().close().await;
    pool.close().await;
    db.drop_db().await;
}
