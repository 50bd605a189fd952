//! The producer API every store passes: `enqueue` only inside the caller's
//! transaction, nothing left by a rollback, dispatch keys making repeats a
//! reported no-op, and per key, outbox order is commit order.
//!
//! A store's test file implements [`ProducerHarness`] on top of its
//! [`StoreHarness`] and expands [`producer_conformance!`].

use async_trait::async_trait;
use std::time::Duration;

use ferry_core::{Event, RelayId, Store};
use ferry_store::{EnqueueError, Enqueued};
use serde_json::json;
use sqlx::{Database, Pool, Transaction};

use crate::store_suite::StoreHarness;

/// The store's own single-event `enqueue`, on its pool's connections, and
/// raw counts of what it wrote.
#[async_trait]
pub trait ProducerHarness: StoreHarness {
    type Db: Database;
    fn pool(&self) -> &Pool<Self::Db>;
    /// Begins a producer's transaction the way the store's users should.
    async fn begin(pool: &Pool<Self::Db>) -> Transaction<'static, Self::Db>;
    /// The store's `enqueue`, on any connection the suite chooses.
    async fn enqueue_on(conn: &mut <Self::Db as Database>::Connection, event: Event) -> Result<Enqueued, EnqueueError>;
    /// The store's `enqueue_batch`.
    async fn enqueue_batch_on(
        conn: &mut <Self::Db as Database>::Connection,
        events: Vec<Event>,
    ) -> Result<Vec<Enqueued>, EnqueueError>;
    /// Rows in the events table and in the queue of unrouted events.
    async fn counts(&self) -> (i64, i64);
}

/// Enqueues each event with the single-event API in one transaction,
/// committed or rolled back.
async fn enqueue_each<H: ProducerHarness>(h: &H, events: Vec<Event>, commit: bool) -> Vec<Enqueued> {
    let mut tx = H::begin(h.pool()).await;
    let mut out = Vec::new();
    for event in events {
        out.push(H::enqueue_on(&mut tx, event).await.unwrap());
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    out
}

/// Outside a transaction the outbox write could not share the caller's
/// commit, so it is refused and writes nothing.
pub async fn enqueue_refuses_to_run_outside_a_transaction<H: ProducerHarness>(h: &H) {
    let mut conn = h.pool().acquire().await.unwrap();
    let err = H::enqueue_on(&mut conn, Event::new("order.created", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, EnqueueError::NotInTransaction), "{err}");
    assert_eq!(h.counts().await.0, 0);
}

/// A rolled-back transaction leaves no event and nothing to route.
pub async fn a_rolled_back_transaction_leaves_no_event<H: ProducerHarness>(h: &H) {
    enqueue_each(h, vec![Event::new("order.created", json!({"n": 0}))], false).await;
    assert_eq!(h.counts().await, (0, 0));
}

/// A repeated dispatch key, in the same transaction or a later one, is
/// reported as a duplicate with the stored event's id and writes nothing.
pub async fn dispatch_keys_make_repeats_a_reported_no_op<H: ProducerHarness>(h: &H) {
    let both = enqueue_each(
        h,
        vec![
            Event::new("order.created", json!({"n": 1})).dispatch_key("stripe:evt_1"),
            Event::new("order.created", json!({"n": 2})).dispatch_key("stripe:evt_1"),
        ],
        true,
    )
    .await;
    let (first, again) = (&both[0], &both[1]);
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(again.id, first.id);
    // In a later transaction too.
    let later = enqueue_each(
        h,
        vec![Event::new("order.created", json!({"n": 3})).dispatch_key("stripe:evt_1")],
        true,
    )
    .await;
    assert!(later[0].duplicate);
    assert_eq!(later[0].id, first.id);
    assert_eq!(h.counts().await, (1, 1));

    // The same event (same id) again, as a caller retries after a commit
    // whose outcome it did not learn: in the same transaction and later.
    let event = Event::new("order.created", json!({"n": 4})).dispatch_key("stripe:evt_2");
    let twice = enqueue_each(h, vec![event.clone(), event.clone()], true).await;
    assert_eq!(twice.iter().map(|e| e.duplicate).collect::<Vec<_>>(), [false, true]);
    let retried = enqueue_each(h, vec![event.clone()], true).await;
    assert!(retried[0].duplicate, "a retried event is a duplicate");
    assert_eq!((retried[0].id, twice[1].id), (event.id(), event.id()));
    assert_eq!(h.counts().await, (2, 2));
}

/// The same event without a dispatch key enqueued a second time, as a
/// caller retrying after a commit whose outcome it did not learn: refused
/// with an error naming `id` and saying it is stored, not a bare unique
/// violation, and nothing is written twice.
pub async fn an_event_enqueued_again_without_a_dispatch_key_is_refused_by_id<H: ProducerHarness>(h: &H) {
    let event = Event::new("order.created", json!({"n": 5})).key("k");
    enqueue_each(h, vec![event.clone()], true).await;
    let mut tx = H::begin(h.pool()).await;
    match H::enqueue_on(&mut tx, event.clone()).await {
        Err(EnqueueError::Invalid(v)) => {
            assert_eq!(v.field, "id", "{v}");
            assert!(v.to_string().contains(&event.id().to_string()), "{v}");
            assert!(v.to_string().contains("dispatch key"), "{v}");
        }
        other => panic!("expected the id to be refused as stored, got {other:?}"),
    }
    tx.rollback().await.unwrap();
    assert_eq!(h.counts().await, (1, 1));
}

/// A batch refused part-way writes none of its events: the caller, told
/// the call failed, may still commit its own writes, and must not commit
/// the events before the one refused with them.
pub async fn a_batch_that_fails_writes_none_of_its_events<H: ProducerHarness>(h: &H) {
    let stored = Event::new("order.created", json!({"n": 6})).key("k");
    enqueue_each(h, vec![stored.clone()], true).await;
    let mut tx = H::begin(h.pool()).await;
    let batch = vec![
        Event::new("order.created", json!({"n": 7})).key("k"),
        Event::new("order.created", json!({"n": 8})).key("other"),
        stored,
    ];
    let err = H::enqueue_batch_on(&mut tx, batch).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Invalid(ref v) if v.field == "id"), "{err}");
    // PostgreSQL aborts the whole transaction, SQLite only the batch: the
    // commit goes through or reports the abort, and in neither case does
    // an event of the failed batch come with it.
    let _ = tx.commit().await;
    assert_eq!(h.counts().await, (1, 1));
    // A batch that succeeds after a failed one in the same transaction
    // still commits.
    let stored = Event::new("order.created", json!({"n": 9})).key("k");
    enqueue_each(h, vec![stored.clone()], true).await;
    let mut tx = H::begin(h.pool()).await;
    let failed = H::enqueue_batch_on(&mut tx, vec![Event::new("order.created", json!({"n": 10})), stored]).await;
    assert!(failed.is_err());
    if H::enqueue_batch_on(&mut tx, vec![Event::new("order.created", json!({"n": 11}))])
        .await
        .is_ok()
    {
        tx.commit().await.unwrap();
        assert_eq!(h.counts().await, (3, 3), "only the batch that succeeded is written");
    }
}

/// A second producer of a key waits for the first one's commit (the key's
/// lock, or a single writer), so it draws a later seq: per key, outbox
/// order is commit order.
pub async fn per_key_seq_order_is_commit_order<H: ProducerHarness + 'static>(h: &H) {
    let mut t1 = H::begin(h.pool()).await;
    H::enqueue_on(&mut t1, Event::new("order.created", json!({"n": 1})).key("k"))
        .await
        .unwrap();
    let pool = h.pool().clone();
    let second = tokio::spawn(async move {
        let mut t2 = H::begin(&pool).await;
        H::enqueue_on(&mut t2, Event::new("order.paid", json!({"n": 2})).key("k"))
            .await
            .unwrap();
        t2.commit().await.unwrap();
    });
    // t2 waits for t1; let it queue up, then commit t1.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "the second producer of the key must wait for the first"
    );
    t1.commit().await.unwrap();
    second.await.unwrap();
    let relay = RelayId("r".into());
    let mut owned = h.store().tick(&relay, Duration::from_secs(30), &[]).await.unwrap();
    owned.relay = relay;
    let mut events = h.store().fetch_unrouted(&owned, 10).await.unwrap();
    events.sort_by_key(|e| e.seq);
    let types: Vec<&str> = events
        .iter()
        .filter(|e| e.key.as_deref() == Some("k"))
        .map(|e| e.event_type.as_str())
        .collect();
    assert_eq!(types, vec!["order.created", "order.paid"]);
}

/// Expands to one `#[tokio::test]` per producer scenario; `$make` is an
/// async expression giving a fresh [`ProducerHarness`].
#[macro_export]
macro_rules! producer_conformance {
    ($make:expr) => {
        $crate::producer_conformance!(@tests $make;
            enqueue_refuses_to_run_outside_a_transaction,
            a_rolled_back_transaction_leaves_no_event,
            dispatch_keys_make_repeats_a_reported_no_op,
            an_event_enqueued_again_without_a_dispatch_key_is_refused_by_id,
            a_batch_that_fails_writes_none_of_its_events,
            per_key_seq_order_is_commit_order
        );
    };
    (@tests $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let h = $make.await;
                $crate::producer_suite::$name(&h).await;
            }
        )*
    };
}
