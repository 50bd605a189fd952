//! Retention against a real PostgreSQL: the shared retention suite, then
//! scenarios that write deliveries and their ages directly in SQL (every
//! state at once, long runs of kept events, a delete failing mid-run) to
//! check what goes, what stays, and the archive written before anything is
//! deleted.

use std::collections::BTreeSet;

use chrono::Utc;
use ferry_core::Event;
use ferry_store::postgres::{PgStore, enqueue_batch};
use ferry_store::{
    DeleteFailed, ExpiredBatch, PurgeError, PurgeOptions, Retention, RetentionRules, purge, read_archive,
};
use ferry_testkit::pg::TestDb;
use ferry_testkit::pg_store::PgHarness;
use ferry_testkit::retention_suite::rules;
use serde_json::json;
use sqlx::PgPool;

mod suite {
    use ferry_testkit::pg_store::PgHarness;
    ferry_testkit::retention_conformance!(PgHarness::create());
}

struct Outbox {
    store: PgStore,
    pool: PgPool,
    _db: TestDb,
}

async fn outbox() -> Outbox {
    let h = PgHarness::create().await;
    Outbox {
        store: h.store,
        pool: h.pool,
        _db: h.db,
    }
}

impl Outbox {
    /// Commits `n` events and returns their seqs.
    async fn produce(&self, n: usize, key: &str) -> Vec<i64> {
        let events = (0..n)
            .map(|i| {
                Event::new("order.item.created", json!({ "n": i, "key": key }))
                    .key(key)
                    .header("tenant", "acme")
            })
            .collect();
        let mut tx = self.pool.begin().await.unwrap();
        let ids: Vec<uuid::Uuid> = enqueue_batch(&mut tx, events)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.id.0)
            .collect();
        tx.commit().await.unwrap();
        sqlx::query_scalar("SELECT seq FROM ferry.events WHERE id = ANY($1) ORDER BY seq")
            .bind(&ids)
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Routes `seqs` to `route` in `state`, settled `days_ago`, with `failures`
    /// failed attempts logged before (and one more attempt, the settling
    /// one, unless still pending).
    async fn settle(&self, seqs: &[i64], route: &str, state: &str, days_ago: i32, failures: i32) {
        sqlx::query("DELETE FROM ferry.unrouted WHERE seq = ANY($1)")
            .bind(seqs)
            .execute(&self.pool)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO ferry.deliveries (seq, route, partition, key, state, attempts, last_error, published_at, updated_at)
             SELECT e.seq, $2, e.partition, e.key, $3, CASE WHEN $3 = 'pending' THEN $5 ELSE $5 + 1 END,
                    CASE WHEN $3 = 'published' THEN NULL ELSE 'broker said no' END,
                    CASE WHEN $3 = 'published' THEN now() - make_interval(days => $4) END,
                    now() - make_interval(days => $4)
               FROM ferry.events e WHERE e.seq = ANY($1)",
        )
        .bind(seqs)
        .bind(route)
        .bind(state)
        .bind(days_ago)
        .bind(failures)
        .execute(&self.pool)
        .await
        .unwrap();
        // An event is created before it is delivered.
        sqlx::query(
            "UPDATE ferry.events SET created_at = least(created_at, now() - make_interval(days => $2 + 2))
              WHERE seq = ANY($1)",
        )
        .bind(seqs)
        .bind(days_ago)
        .execute(&self.pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO ferry.failures (seq, route, attempt, at, dead, error)
             SELECT e.seq, $2, a, now() - make_interval(days => $3 + 1), false, 'timeout ' || a
               FROM ferry.events e, generate_series(1, $4) a WHERE e.seq = ANY($1)",
        )
        .bind(seqs)
        .bind(route)
        .bind(days_ago)
        .bind(failures)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn seqs(&self) -> BTreeSet<i64> {
        let all: Vec<i64> = sqlx::query_scalar("SELECT seq FROM ferry.events")
            .fetch_all(&self.pool)
            .await
            .unwrap();
        all.into_iter().collect()
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM ferry.{table}")))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// Every kind of event, old and new; returns (what must go, what must stay).
async fn every_state(o: &Outbox) -> (BTreeSet<i64>, BTreeSet<i64>) {
    let mut gone = BTreeSet::new();
    let mut kept = BTreeSet::new();
    let old_published = o.produce(25, "a").await;
    o.settle(&old_published, "orders", "published", 8, 2).await;
    gone.extend(&old_published);
    let fresh_published = o.produce(5, "b").await;
    o.settle(&fresh_published, "orders", "published", 1, 0).await;
    kept.extend(&fresh_published);
    // Published on one route, long ago, but still pending on another.
    let half_done = o.produce(3, "c").await;
    o.settle(&half_done, "orders", "published", 20, 0).await;
    o.settle(&half_done, "audit", "pending", 20, 0).await;
    kept.extend(&half_done);
    // Published on both routes: goes whole.
    let both = o.produce(2, "d").await;
    o.settle(&both, "orders", "published", 9, 0).await;
    o.settle(&both, "audit", "published", 10, 1).await;
    gone.extend(&both);
    let recent_dead = o.produce(2, "e").await;
    o.settle(&recent_dead, "orders", "dead", 10, 3).await;
    kept.extend(&recent_dead);
    let old_dead = o.produce(2, "f").await;
    o.settle(&old_dead, "orders", "dead", 31, 3).await;
    gone.extend(&old_dead);
    let old_cancelled = o.produce(1, "g").await;
    o.settle(&old_cancelled, "orders", "cancelled", 40, 0).await;
    gone.extend(&old_cancelled);
    // Never routed: however old, it has not been delivered.
    let unrouted = o.produce(2, "h").await;
    sqlx::query("UPDATE ferry.events SET created_at = now() - interval '90 days' WHERE seq = ANY($1)")
        .bind(&unrouted)
        .execute(&o.pool)
        .await
        .unwrap();
    kept.extend(&unrouted);
    // Events were created now; only their deliveries are old. Make them as
    // old as their deliveries so the scan's early stop is exercised too.
    sqlx::query(
        "UPDATE ferry.events e SET created_at = d.t - interval '1 day'
           FROM (SELECT seq, min(updated_at) t FROM ferry.deliveries GROUP BY seq) d WHERE d.seq = e.seq",
    )
    .execute(&o.pool)
    .await
    .unwrap();
    (gone, kept)
}

#[tokio::test]
async fn settled_events_past_their_window_go_and_everything_else_stays() {
    let o = outbox().await;
    let (gone, kept) = every_state(&o).await;
    let report = purge(&o.store, &rules(7), &PurgeOptions::default(), Utc::now())
        .await
        .unwrap();
    assert_eq!(report.events, gone.len() as u64);
    assert_eq!(
        report.deliveries,
        gone.len() as u64 + 2,
        "the two-route events lose both deliveries"
    );
    assert!(report.batches >= 5, "batches of at most 7: {report:?}");
    assert_eq!(o.seqs().await, kept);
    // Deliveries and failure history went with their events.
    let orphans: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM ferry.deliveries d WHERE NOT EXISTS (SELECT 1 FROM ferry.events e WHERE e.seq = d.seq))
              + (SELECT count(*) FROM ferry.failures f WHERE NOT EXISTS (SELECT 1 FROM ferry.events e WHERE e.seq = f.seq))",
    )
    .fetch_one(&o.pool)
    .await
    .unwrap();
    assert_eq!(orphans, 0);
    assert_eq!(
        o.count("failures").await,
        2 * 3,
        "only the recent dead events' failures remain"
    );
    // A second run finds nothing more.
    let again = purge(&o.store, &rules(7), &PurgeOptions::default(), Utc::now())
        .await
        .unwrap();
    assert_eq!(again.events, 0);
}

#[tokio::test]
async fn a_dry_run_counts_and_deletes_nothing() {
    let o = outbox().await;
    let (gone, _) = every_state(&o).await;
    let before = o.seqs().await;
    let dir = tempfile::tempdir().unwrap();
    let options = PurgeOptions {
        dry_run: true,
        archive_dir: Some(dir.path().to_owned()),
        stop: None,
    };
    let report = purge(&o.store, &rules(4), &options, Utc::now()).await.unwrap();
    assert!(report.dry_run);
    assert_eq!(report.events, gone.len() as u64);
    assert_eq!(o.seqs().await, before);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a dry run archives nothing"
    );
}

#[tokio::test]
async fn the_archive_holds_exactly_what_was_deleted() {
    let o = outbox().await;
    let (gone, kept) = every_state(&o).await;
    // A payload that is not JSON is archived byte for byte.
    let mut tx = o.pool.begin().await.unwrap();
    let raw = Event::bytes("file.blob.stored", vec![0u8, 159, 146, 150], "application/octet-stream");
    enqueue_batch(&mut tx, vec![raw]).await.unwrap();
    tx.commit().await.unwrap();
    let blob: i64 = sqlx::query_scalar("SELECT max(seq) FROM ferry.events")
        .fetch_one(&o.pool)
        .await
        .unwrap();
    o.settle(&[blob], "files", "published", 8, 0).await;
    let mut gone = gone;
    gone.insert(blob);
    let expected = sqlx::query_as::<_, (i64, uuid::Uuid, Vec<u8>, serde_json::Value)>(
        "SELECT seq, id, payload, headers FROM ferry.events WHERE seq = ANY($1) ORDER BY seq",
    )
    .bind(gone.iter().copied().collect::<Vec<_>>())
    .fetch_all(&o.pool)
    .await
    .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let options = PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let report = purge(&o.store, &rules(6), &options, Utc::now()).await.unwrap();
    assert_eq!(report.archived, gone.len() as u64);
    assert_eq!(o.seqs().await, kept);
    let file = report.archive_file.expect("an archive file");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "one file per run");
    let archived = read_archive(&file).unwrap();
    assert_eq!(
        archived.iter().map(|e| e.seq).collect::<BTreeSet<_>>(),
        gone,
        "archived and deleted differ"
    );
    assert_eq!(archived.len(), gone.len(), "each event once");
    for ((seq, id, payload, headers), a) in expected.iter().zip(&archived) {
        assert_eq!((a.seq, a.id), (*seq, *id));
        assert_eq!(a.payload_bytes().as_deref(), Some(&payload[..]), "payload of {seq}");
        assert_eq!(&a.headers, headers);
        assert!(!a.deliveries.is_empty());
    }
    let two_routes = archived.iter().find(|e| e.key.as_deref() == Some("d")).unwrap();
    let routes: Vec<&str> = two_routes.deliveries.iter().map(|d| d.route.as_str()).collect();
    assert_eq!(routes, ["audit", "orders"]);
    assert_eq!(
        two_routes.deliveries[0].failures.len(),
        1,
        "failure history is archived"
    );
    let dead = archived.iter().find(|e| e.key.as_deref() == Some("f")).unwrap();
    assert_eq!(dead.deliveries[0].state, "dead");
    assert_eq!(dead.deliveries[0].last_error.as_deref(), Some("broker said no"));
}

#[tokio::test]
async fn an_unwritable_archive_stops_deletion_and_is_reported() {
    let o = outbox().await;
    let (gone, _) = every_state(&o).await;
    assert!(!gone.is_empty());
    let before = o.seqs().await;
    let dir = tempfile::tempdir().unwrap();
    // A file where the directory should be: nothing can be created in it,
    // whatever the user's privileges.
    let not_a_dir = dir.path().join("archive");
    std::fs::write(&not_a_dir, b"").unwrap();
    let options = PurgeOptions {
        archive_dir: Some(not_a_dir.clone()),
        ..PurgeOptions::default()
    };
    let err = purge(&o.store, &rules(5), &options, Utc::now()).await.unwrap_err();
    match &err {
        PurgeError::Archive { path, done, .. } => {
            assert!(path.starts_with(&not_a_dir), "{}", path.display());
            assert_eq!(done.events, 0);
        }
        other => panic!("expected an archive error, got {other}"),
    }
    assert!(err.to_string().contains("nothing more was deleted"), "{err}");
    assert_eq!(o.seqs().await, before, "nothing may be deleted without its archive");
}

#[tokio::test]
async fn a_stop_signal_ends_the_run_between_batches() {
    let o = outbox().await;
    let seqs = o.produce(30, "s").await;
    o.settle(&seqs, "orders", "published", 8, 0).await;
    let (tx, rx) = tokio::sync::watch::channel(false);
    let dir = tempfile::tempdir().unwrap();
    let options = PurgeOptions {
        stop: Some(rx),
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    // The stop comes while the first batch is deleted: that batch finishes,
    // and the run ends before the next.
    let stopping = StopOnDelete {
        store: o.store.clone(),
        stop: tx,
    };
    let report = purge(&stopping, &rules(10), &options, Utc::now()).await.unwrap();
    assert_eq!((report.events, report.batches, report.archived), (10, 1, 10));
    let left = o.seqs().await;
    assert_eq!(left.len(), 20);
    let file = report.archive_file.expect("an archive file");
    let archived: BTreeSet<i64> = read_archive(&file).unwrap().into_iter().map(|e| e.seq).collect();
    let deleted: BTreeSet<i64> = seqs.iter().copied().filter(|s| !left.contains(s)).collect();
    assert_eq!(archived, deleted, "the archive holds exactly what was deleted");
}

/// Delegates to the PostgreSQL store and sends the stop signal when a
/// batch is about to be deleted.
struct StopOnDelete {
    store: PgStore,
    stop: tokio::sync::watch::Sender<bool>,
}

struct StoppingBatch {
    inner: Box<dyn ExpiredBatch>,
    stop: tokio::sync::watch::Sender<bool>,
}

#[async_trait::async_trait]
impl Retention for StopOnDelete {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, ferry_core::StoreError> {
        self.store.retention_range().await
    }

    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: chrono::DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, ferry_core::StoreError> {
        Ok(Box::new(StoppingBatch {
            inner: self.store.take_expired(rules, after, upto, now).await?,
            stop: self.stop.clone(),
        }))
    }
}

#[async_trait::async_trait]
impl ExpiredBatch for StoppingBatch {
    fn events(&self) -> &[ferry_store::ArchivedEvent] {
        self.inner.events()
    }

    fn scanned_to(&self) -> i64 {
        self.inner.scanned_to()
    }

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), ferry_core::StoreError> {
        self.inner.read_whole(max_payload_bytes).await
    }

    async fn delete(self: Box<Self>) -> Result<ferry_store::Deleted, DeleteFailed> {
        self.stop.send_replace(true);
        self.inner.delete().await
    }
}

/// Delegates to the PostgreSQL store, but the `fail_at`-th delete fails
/// (after the archive was written): it deletes nothing, or, with
/// `commit_answer_lost`, it deletes and commits but reports the failure a
/// connection lost during the commit would.
struct FailingDelete {
    store: PgStore,
    deletes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    fail_at: usize,
    commit_answer_lost: bool,
}

struct FailingBatch {
    inner: Box<dyn ExpiredBatch>,
    fail: bool,
    commit_answer_lost: bool,
}

#[async_trait::async_trait]
impl Retention for FailingDelete {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, ferry_core::StoreError> {
        self.store.retention_range().await
    }

    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: chrono::DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, ferry_core::StoreError> {
        let inner = self.store.take_expired(rules, after, upto, now).await?;
        let fail = !inner.events().is_empty()
            && self.deletes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == self.fail_at;
        Ok(Box::new(FailingBatch {
            inner,
            fail,
            commit_answer_lost: self.commit_answer_lost,
        }))
    }
}

#[async_trait::async_trait]
impl ExpiredBatch for FailingBatch {
    fn events(&self) -> &[ferry_store::ArchivedEvent] {
        self.inner.events()
    }

    fn scanned_to(&self) -> i64 {
        self.inner.scanned_to()
    }

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), ferry_core::StoreError> {
        self.inner.read_whole(max_payload_bytes).await
    }

    async fn delete(self: Box<Self>) -> Result<ferry_store::Deleted, DeleteFailed> {
        if !self.fail {
            return self.inner.delete().await;
        }
        let reset = ferry_core::StoreError::transient("connection reset mid-delete");
        if self.commit_answer_lost {
            self.inner.delete().await.unwrap();
            return Err(DeleteFailed::at_commit(
                sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into()),
                |_| reset,
            ));
        }
        drop(self.inner);
        Err(DeleteFailed::before_commit(reset))
    }
}

/// A purge of 12 published events in batches of 5, into an archive, whose
/// second delete fails as `FailingDelete` does; what it left.
struct FailedRun {
    o: Outbox,
    seqs: Vec<i64>,
    dir: tempfile::TempDir,
    options: PurgeOptions,
    err: PurgeError,
    /// The seqs still in the outbox.
    left: BTreeSet<i64>,
}

impl FailedRun {
    async fn new(commit_answer_lost: bool) -> Self {
        let o = outbox().await;
        let seqs = o.produce(12, "x").await;
        o.settle(&seqs, "orders", "published", 8, 0).await;
        let dir = tempfile::tempdir().unwrap();
        let options = PurgeOptions {
            archive_dir: Some(dir.path().to_owned()),
            ..PurgeOptions::default()
        };
        let failing = FailingDelete {
            store: o.store.clone(),
            deletes: Default::default(),
            fail_at: 2,
            commit_answer_lost,
        };
        let err = purge(&failing, &rules(5), &options, Utc::now()).await.unwrap_err();
        let left = o.seqs().await;
        Self {
            o,
            seqs,
            dir,
            options,
            err,
            left,
        }
    }

    /// The seqs in the run's archive file, and those deleted.
    fn archived_and_deleted(&self) -> (BTreeSet<i64>, BTreeSet<i64>) {
        let file = std::fs::read_dir(self.dir.path())
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let archived = read_archive(&file).unwrap().into_iter().map(|e| e.seq).collect();
        let deleted = self.seqs.iter().copied().filter(|s| !self.left.contains(s)).collect();
        (archived, deleted)
    }
}

#[tokio::test]
async fn a_failed_delete_takes_its_batch_back_out_of_the_archive() {
    let run = FailedRun::new(false).await;
    let err = &run.err;
    assert!(matches!(err, PurgeError::Store { .. }), "{err}");
    assert_eq!((err.done().events, err.done().archived), (5, 5));
    assert_eq!(run.left.len(), 7, "only the first batch is gone");
    let (archived, deleted) = run.archived_and_deleted();
    assert_eq!(archived, deleted, "the archive holds exactly what was deleted");
    // The next run picks up where this one failed, in a new file.
    let o = &run.o;
    let report = purge(&o.store, &rules(5), &run.options, Utc::now()).await.unwrap();
    assert_eq!(report.events, 7);
    assert_eq!(o.seqs().await.len(), 0);
    let mut all = BTreeSet::new();
    for f in std::fs::read_dir(run.dir.path()).unwrap() {
        for e in read_archive(&f.unwrap().path()).unwrap() {
            assert!(all.insert(e.seq), "seq {} archived twice", e.seq);
        }
    }
    assert_eq!(all, run.seqs.iter().copied().collect());
}

/// A commit can reach the database and its answer be lost (the connection
/// resets): the batch may be deleted though the delete failed. The archive
/// is then its only copy and must keep it.
#[tokio::test]
async fn a_delete_whose_commit_answer_was_lost_stays_archived() {
    let run = FailedRun::new(true).await;
    let err = &run.err;
    assert!(matches!(err, PurgeError::Store { .. }), "{err}");
    assert_eq!(run.left.len(), 2, "both batches are gone");
    let (archived, deleted) = run.archived_and_deleted();
    assert_eq!(archived, deleted, "a deleted event is missing from the archive");
}

#[tokio::test]
async fn a_long_run_of_kept_events_does_not_stop_the_walk() {
    let o = outbox().await;
    // Far more kept events than one scanned stretch (ten batches) holds.
    let stuck = o.produce(120, "stuck").await;
    o.settle(&stuck, "orders", "pending", 20, 2).await;
    let done = o.produce(10, "done").await;
    o.settle(&done, "orders", "published", 8, 0).await;
    let report = purge(&o.store, &rules(3), &PurgeOptions::default(), Utc::now())
        .await
        .unwrap();
    assert_eq!(report.events, 10);
    assert_eq!(o.seqs().await, stuck.into_iter().collect());
}

/// Counts the store's calls of a run and fails one that walks on and on
/// (one call per empty stretch of seqs), rather than letting it run for
/// hours.
struct CountingCalls {
    store: PgStore,
    calls: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Retention for CountingCalls {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, ferry_core::StoreError> {
        self.store.retention_range().await
    }

    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: chrono::DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, ferry_core::StoreError> {
        let calls = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        assert!(calls <= 20, "a run over two events took {calls} batches, after {after}");
        self.store.take_expired(rules, after, upto, now).await
    }
}

/// In WAL mode only failed tableless events get rows, so seqs leave wide
/// gaps: a run jumps to the next stored event instead of stepping through
/// the empty stretches between.
#[tokio::test]
async fn a_run_jumps_over_gaps_in_the_seqs() {
    let o = outbox().await;
    let first = o.produce(1, "a").await;
    sqlx::query("SELECT setval(pg_get_serial_sequence('ferry.events', 'seq'), 500000000)")
        .execute(&o.pool)
        .await
        .unwrap();
    let second = o.produce(1, "b").await;
    assert!(second[0] > 500_000_000, "{second:?}");
    o.settle(&[first[0], second[0]], "orders", "published", 8, 0).await;
    let counting = CountingCalls {
        store: o.store.clone(),
        calls: Default::default(),
    };
    let report = purge(&counting, &rules(3), &PurgeOptions::default(), Utc::now())
        .await
        .unwrap();
    assert_eq!(report.events, 2);
    assert!(o.seqs().await.is_empty());
    let calls = counting.calls.load(std::sync::atomic::Ordering::SeqCst);
    assert!(calls <= 4, "{calls} store calls for two events");
}

/// Delegates to the PostgreSQL store; its first batch with events waits
/// before its delete (a slow archive disk, say) until told to go on.
struct SlowArchive {
    store: PgStore,
    paused: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    go: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

struct SlowBatch {
    inner: Box<dyn ExpiredBatch>,
    paused: Option<tokio::sync::oneshot::Sender<()>>,
    go: Option<tokio::sync::oneshot::Receiver<()>>,
}

#[async_trait::async_trait]
impl Retention for SlowArchive {
    async fn retention_range(&self) -> Result<Option<(i64, i64)>, ferry_core::StoreError> {
        self.store.retention_range().await
    }

    async fn take_expired(
        &self,
        rules: &RetentionRules,
        after: i64,
        upto: i64,
        now: chrono::DateTime<Utc>,
    ) -> Result<Box<dyn ExpiredBatch>, ferry_core::StoreError> {
        let inner = self.store.take_expired(rules, after, upto, now).await?;
        let (paused, go) = if inner.events().is_empty() {
            (None, None)
        } else {
            (self.paused.lock().unwrap().take(), self.go.lock().unwrap().take())
        };
        Ok(Box::new(SlowBatch { inner, paused, go }))
    }
}

#[async_trait::async_trait]
impl ExpiredBatch for SlowBatch {
    fn events(&self) -> &[ferry_store::ArchivedEvent] {
        self.inner.events()
    }

    fn scanned_to(&self) -> i64 {
        self.inner.scanned_to()
    }

    async fn read_whole(&mut self, max_payload_bytes: u64) -> Result<(), ferry_core::StoreError> {
        self.inner.read_whole(max_payload_bytes).await
    }

    async fn delete(mut self: Box<Self>) -> Result<ferry_store::Deleted, DeleteFailed> {
        if let (Some(paused), Some(go)) = (self.paused.take(), self.go.take()) {
            paused.send(()).unwrap();
            go.await.unwrap();
        }
        self.inner.delete().await
    }
}

/// Two relays run retention at once, and one's batch takes long to archive:
/// the other neither waits on it nor fails, every event goes, and the
/// archives hold each event exactly once between them.
#[tokio::test]
async fn concurrent_runs_do_not_fail_on_each_others_batches() {
    let o = outbox().await;
    let seqs = o.produce(12, "x").await;
    o.settle(&seqs, "orders", "published", 8, 0).await;
    let (paused_tx, paused_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel();
    let slow = SlowArchive {
        store: o.store.clone(),
        paused: std::sync::Mutex::new(Some(paused_tx)),
        go: std::sync::Mutex::new(Some(go_rx)),
    };
    let slow_dir = tempfile::tempdir().unwrap();
    let slow_options = PurgeOptions {
        archive_dir: Some(slow_dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let slow_run = tokio::spawn(async move { purge(&slow, &rules(5), &slow_options, Utc::now()).await });
    paused_rx.await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let options = PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let report = purge(&o.store, &rules(5), &options, Utc::now())
        .await
        .expect("a run beside another one's slow batch");
    go_tx.send(()).unwrap();
    let slow_report = slow_run.await.unwrap().expect("the slow run");
    assert_eq!(report.events + slow_report.events, 12, "{report:?} {slow_report:?}");
    assert!(o.seqs().await.is_empty());
    let mut all = BTreeSet::new();
    for d in [dir.path(), slow_dir.path()] {
        for f in std::fs::read_dir(d).unwrap() {
            for e in read_archive(&f.unwrap().path()).unwrap() {
                assert!(all.insert(e.seq), "seq {} archived twice", e.seq);
            }
        }
    }
    assert_eq!(all, seqs.into_iter().collect());
}

/// A batch is read without payloads unless it is archived, and then only
/// so many bytes of them; it holds no lock while archived, and an event
/// requeued meanwhile keeps its whole batch in the table.
#[tokio::test]
async fn a_batch_reads_payloads_only_to_archive_them_and_holds_no_lock_meanwhile() {
    let o = outbox().await;
    let seqs = o.produce(5, "p").await;
    o.settle(&seqs, "orders", "published", 8, 0).await;
    let size: i32 = sqlx::query_scalar("SELECT octet_length(payload) FROM ferry.events WHERE seq = $1")
        .bind(seqs[0])
        .fetch_one(&o.pool)
        .await
        .unwrap();
    let mut batch = o.store.take_expired(&rules(10), 0, i64::MAX, Utc::now()).await.unwrap();
    assert_eq!(batch.events().len(), 5);
    assert!(
        batch
            .events()
            .iter()
            .all(|e| e.payload.is_none() && e.payload_base64.is_none() && e.deliveries.is_empty()),
        "payloads read though nothing is archived"
    );
    // Two and a half payloads' worth: two events, the rest for the next batch.
    batch.read_whole(size as u64 * 5 / 2).await.unwrap();
    let read: Vec<i64> = batch.events().iter().map(|e| e.seq).collect();
    assert_eq!(read, seqs[..2]);
    assert_eq!(batch.scanned_to(), seqs[1]);
    assert!(
        batch
            .events()
            .iter()
            .all(|e| e.payload.is_some() && e.deliveries.len() == 1)
    );

    // While it is archived, an operator requeues one of its events, and
    // does not wait for retention.
    let mut tx = o.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '200ms'")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE ferry.deliveries SET state = 'pending', attempts = 0, updated_at = now() WHERE seq = $1")
        .bind(seqs[1])
        .execute(&mut *tx)
        .await
        .expect("the batch holds no lock");
    tx.commit().await.unwrap();
    let deleted = batch.delete().await.unwrap();
    assert!(deleted.changed && deleted.events == 0, "{deleted:?}");
    assert_eq!(o.seqs().await.len(), 5, "a changed batch stays whole");

    // A run archives what is still due, in batches within the byte budget.
    let dir = tempfile::tempdir().unwrap();
    let options = PurgeOptions {
        archive_dir: Some(dir.path().to_owned()),
        ..PurgeOptions::default()
    };
    let report = purge(&o.store, &rules(10), &options, Utc::now()).await.unwrap();
    assert_eq!((report.events, report.archived), (4, 4));
    assert_eq!(o.seqs().await, BTreeSet::from([seqs[1]]));
}
