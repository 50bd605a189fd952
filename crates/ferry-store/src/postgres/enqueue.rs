use std::collections::HashSet;

use ferry_core::{Event, EventId};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

pub use crate::enqueue::{EnqueueError, Enqueued};

/// Writes `event` in the caller's transaction and returns its id. With a
/// dispatch key seen before, writes nothing and returns the first event's id.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use ferry_core::Event;
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42").execute(&mut *tx).await?;
/// let sent = ferry_store::postgres::enqueue(
///     &mut *tx,
///     Event::new("order.paid", serde_json::json!({"id": 42})).key("order-42"),
/// ).await?;
/// tx.commit().await?;
/// println!("event {}", sent.id);
/// # Ok(()) }
/// ```
pub async fn enqueue(conn: &mut PgConnection, event: Event) -> Result<Enqueued, EnqueueError> {
    let mut out = enqueue_batch(conn, vec![event]).await?;
    Ok(out.remove(0))
}

/// Writes many events in one round trip, in order, in the caller's transaction.
pub async fn enqueue_batch(conn: &mut PgConnection, events: Vec<Event>) -> Result<Vec<Enqueued>, EnqueueError> {
    if !conn.is_in_transaction() {
        return Err(EnqueueError::NotInTransaction);
    }
    if events.is_empty() {
        return Ok(Vec::new());
    }
    // The producer's span travels with the event (an explicit
    // `traceparent` header wins).
    #[cfg(feature = "otel")]
    let events: Vec<Event> = events.into_iter().map(Event::with_current_trace_context).collect();
    let n = events.len();
    let (mut ids, mut types, mut keys, mut payloads, mut cts, mut headers, mut dks) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for event in &events {
        event.validate()?;
        ids.push(event.id().0);
        types.push(event.event_type().to_owned());
        keys.push(event.get_key().map(str::to_owned));
        payloads.push(event.payload().to_bytes().to_vec());
        cts.push(event.payload().content_type().to_owned());
        headers.push(serde_json::to_value(event.headers()).expect("string map serialises"));
        dks.push(event.get_dispatch_key().map(str::to_owned));
    }
    // An event with a dispatch key may come back with its own id and still
    // be a repeat: the same `Event` retried after a commit whose outcome
    // the caller did not learn. From schema 29 on, `_enqueue_batch` names
    // the events it wrote nothing for (their positions, from 1) in
    // `ferry.enqueue_repeats`, read after it (the fenced subquery runs
    // first). That includes a first attempt that committed while the call
    // ran (its insert waited for it, or it committed after the statement
    // began), which no snapshot of the statement shows. On an older schema
    // the setting is NULL and only the ids stored before the call count:
    // the scalar subquery sees the statement's snapshot, which does not
    // include what `_enqueue_batch` writes.
    let keyed: Vec<Uuid> = events
        .iter()
        .filter(|e| e.get_dispatch_key().is_some())
        .map(|e| e.id().0)
        .collect();
    let query = if keyed.is_empty() {
        "SELECT ferry._enqueue_batch($1, $2, $3, $4, $5, $6, $7), NULL::text, '{}'::uuid[]"
    } else {
        "SELECT b.ids, current_setting('ferry.enqueue_repeats', true), \
                ARRAY(SELECT e.id FROM ferry.events e WHERE e.id = ANY($8)) \
           FROM (SELECT ferry._enqueue_batch($1, $2, $3, $4, $5, $6, $7) AS ids OFFSET 0) b"
    };
    let mut query = sqlx::query_as(query)
        .bind(&ids)
        .bind(&types)
        .bind(&keys)
        .bind(&payloads)
        .bind(&cts)
        .bind(&headers)
        .bind(&dks);
    if !keyed.is_empty() {
        query = query.bind(&keyed);
    }
    let (stored, repeats, before): (Vec<Uuid>, Option<String>, Vec<Uuid>) =
        query.fetch_one(&mut *conn).await.map_err(refused)?;
    let before: HashSet<Uuid> = before.into_iter().collect();
    let repeats: HashSet<usize> = repeats
        .iter()
        .flat_map(|r| r.split(','))
        .filter_map(|i| i.parse().ok())
        .collect();
    Ok(flag_repeats(&ids, &stored, &before, &repeats))
}

/// What the database refused, said in the caller's terms: the ferry schema
/// missing (as the relay's `store_error` reads it), or an event without a
/// dispatch key enqueued again.
fn refused(e: sqlx::Error) -> EnqueueError {
    if super::error::missing_schema(&e) {
        return EnqueueError::NotMigrated(e);
    }
    id_taken(e)
}

/// A unique violation of the events' id: an event without a dispatch key
/// enqueued again, named by its id (`Key (id)=(...) already exists.`).
fn id_taken(e: sqlx::Error) -> EnqueueError {
    let Some(db) = e.as_database_error() else {
        return e.into();
    };
    if db.constraint() != Some("events_id") {
        return e.into();
    }
    let detail = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .and_then(|pg| pg.detail())
        .unwrap_or_default();
    let id = detail
        .split_once("=(")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map_or("of this batch", |(id, _)| id);
    crate::enqueue::stored_already(id)
}

/// Each event's outcome: a repeat when `_enqueue_batch` says so (its
/// position, from 1, is in `repeats`), the stored event is another one, was
/// there `before` the call, or an earlier event of the batch wrote it.
fn flag_repeats(mine: &[Uuid], stored: &[Uuid], before: &HashSet<Uuid>, repeats: &HashSet<usize>) -> Vec<Enqueued> {
    let mut written = HashSet::new();
    mine.iter()
        .zip(stored)
        .enumerate()
        .map(|(i, (mine, got))| {
            let first_in_batch = written.insert(*got);
            Enqueued {
                id: EventId(*got),
                duplicate: repeats.contains(&(i + 1)) || mine != got || before.contains(got) || !first_in_batch,
            }
        })
        .collect()
}
