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
    // the caller did not learn. So for those ids, read which were stored
    // before the call: the scalar subquery sees the statement's snapshot,
    // which does not include what `_enqueue_batch` writes.
    let keyed: Vec<Uuid> = events
        .iter()
        .filter(|e| e.get_dispatch_key().is_some())
        .map(|e| e.id().0)
        .collect();
    let query = if keyed.is_empty() {
        "SELECT ferry._enqueue_batch($1, $2, $3, $4, $5, $6, $7), '{}'::uuid[]"
    } else {
        "SELECT ferry._enqueue_batch($1, $2, $3, $4, $5, $6, $7), \
                ARRAY(SELECT e.id FROM ferry.events e WHERE e.id = ANY($8))"
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
    let (stored, before): (Vec<Uuid>, Vec<Uuid>) = query.fetch_one(&mut *conn).await.map_err(id_taken)?;
    Ok(flag_repeats(&ids, &stored, &before))
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

/// Each event's outcome: a repeat when the stored event is another one,
/// was there `before` the call, or an earlier event of the batch wrote it.
fn flag_repeats(mine: &[Uuid], stored: &[Uuid], before: &[Uuid]) -> Vec<Enqueued> {
    let mut written = std::collections::HashSet::new();
    mine.iter()
        .zip(stored)
        .map(|(mine, got)| {
            let first_in_batch = written.insert(*got);
            Enqueued {
                id: EventId(*got),
                duplicate: mine != got || before.contains(got) || !first_in_batch,
            }
        })
        .collect()
}
