use ferry_core::{Event, EventId, Partition};
use sqlx::{Connection, SqliteConnection};

use super::PARTITIONS;
use crate::enqueue::{EnqueueError, Enqueued};

/// Writes `event` in the caller's transaction and returns its id. With a
/// dispatch key seen before, writes nothing and returns the first event's id.
///
/// SQLite runs one writer at a time: a transaction that reads before it
/// writes can be refused with `SQLITE_BUSY` when another commits in between.
/// Begin producer transactions with `BEGIN IMMEDIATE` to queue for the write
/// lock up front instead.
///
/// ```no_run
/// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use ferry_core::Event;
/// let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
/// sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42").execute(&mut *tx).await?;
/// let sent = ferry_store::sqlite::enqueue(
///     &mut *tx,
///     Event::new("order.paid", serde_json::json!({"id": 42})).key("order-42"),
/// ).await?;
/// tx.commit().await?;
/// println!("event {}", sent.id);
/// # Ok(()) }
/// ```
pub async fn enqueue(conn: &mut SqliteConnection, event: Event) -> Result<Enqueued, EnqueueError> {
    let mut out = enqueue_batch(conn, vec![event]).await?;
    Ok(out.remove(0))
}

/// Writes many events, in order, in the caller's transaction: all of them,
/// or none when the call fails. Every event is validated before the first
/// is written.
pub async fn enqueue_batch(conn: &mut SqliteConnection, events: Vec<Event>) -> Result<Vec<Enqueued>, EnqueueError> {
    if !conn.is_in_transaction() {
        return Err(EnqueueError::NotInTransaction);
    }
    if !in_transaction(conn).await? {
        return Err(EnqueueError::TransactionEnded);
    }
    // The producer's span travels with the event (an explicit
    // `traceparent` header wins).
    #[cfg(feature = "otel")]
    let events: Vec<Event> = events.into_iter().map(Event::with_current_trace_context).collect();
    for event in &events {
        event.validate()?;
    }
    if let [event] = events.as_slice() {
        // No savepoint. From migration 4 on, the event's insert writes its
        // unrouted row too (its trigger), so a failure there writes
        // nothing. `write_one` then runs a second statement, an insert into
        // ferry_unrouted for a schema not migrated yet, which that trigger
        // skips; should it fail all the same, the event stays written in
        // the caller's transaction although the call failed.
        return Ok(vec![write_one(conn, event).await?]);
    }
    // A failed statement undoes only itself in SQLite, and the transaction
    // goes on: without the savepoint a batch refused at its third event
    // would leave the first two in the caller's transaction, committed with
    // it although the call failed. All or nothing, as on PostgreSQL.
    sqlx::query("SAVEPOINT ferry_enqueue_batch").execute(&mut *conn).await?;
    let mut out = Vec::with_capacity(events.len());
    for event in &events {
        match write_one(conn, event).await {
            Ok(enqueued) => out.push(enqueued),
            Err(e) => {
                // Fails only when SQLite already rolled the whole
                // transaction back, which the caller's commit reports.
                if sqlx::query("ROLLBACK TO ferry_enqueue_batch")
                    .execute(&mut *conn)
                    .await
                    .is_ok()
                {
                    let _ = sqlx::query("RELEASE ferry_enqueue_batch").execute(&mut *conn).await;
                }
                return Err(e);
            }
        }
    }
    sqlx::query("RELEASE ferry_enqueue_batch").execute(&mut *conn).await?;
    Ok(out)
}

/// Whether SQLite has the connection inside a transaction. sqlx counts the
/// transactions it began, but SQLite ends one on its own (`ON CONFLICT
/// ROLLBACK`, `RAISE(ROLLBACK)`, some I/O errors), and each statement after
/// that commits alone: an event written then would go out without the
/// business write it was to commit with.
async fn in_transaction(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    // SAFETY: the handle is locked for the call, so no statement runs on the
    // connection meanwhile, and `sqlite3_get_autocommit` only reads a flag.
    let autocommit = unsafe { libsqlite3_sys::sqlite3_get_autocommit(handle.as_raw_handle().as_ptr()) };
    Ok(autocommit == 0)
}

/// Inserts first and looks for a duplicate only on conflict: the insert takes
/// the write lock before any read, and the one writer at a time is what
/// makes `seq` order commit order.
async fn write_one(conn: &mut SqliteConnection, event: &Event) -> Result<Enqueued, EnqueueError> {
    let id = event.id();
    let partition = partition_of(event.get_key(), id);
    let headers = serde_json::to_string(event.headers()).expect("a string map serialises");
    let stored: Option<i64> = sqlx::query_scalar(concat!(
        "INSERT INTO ferry_events
             (id, type, key, partition, payload, content_type, headers, dispatch_key, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ",
        now_us!(),
        ")
         ON CONFLICT (dispatch_key) DO NOTHING
         RETURNING seq"
    ))
    .bind(id.to_string())
    .bind(event.event_type())
    .bind(event.get_key())
    .bind(partition)
    .bind(event.payload().to_bytes().to_vec())
    .bind(event.payload().content_type())
    .bind(headers)
    .bind(event.get_dispatch_key())
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| match e.as_database_error() {
        // The same event without a dispatch key, enqueued again.
        Some(db) if db.is_unique_violation() && db.message().contains("ferry_events.id") => {
            crate::enqueue::stored_already(&id.to_string())
        }
        // No ferry tables yet (as the relay's `store_error` reads it).
        Some(_) if super::error::missing_schema(&e) => EnqueueError::NotMigrated(e),
        _ => e.into(),
    })?;
    if let Some(seq) = stored {
        // From migration 4 on, the insert's trigger wrote the unrouted row
        // in the same statement, so neither is ever left alone, and this
        // insert is skipped (a trigger ignores a row that exists). It stays
        // for a database not migrated yet: a producer can be upgraded
        // before `ferry migrate` runs.
        sqlx::query("INSERT INTO ferry_unrouted (seq, partition) VALUES (?1, ?2)")
            .bind(seq)
            .bind(partition)
            .execute(&mut *conn)
            .await?;
        return Ok(Enqueued { id, duplicate: false });
    }
    let existing: String = sqlx::query_scalar("SELECT id FROM ferry_events WHERE dispatch_key = ?1")
        .bind(event.get_dispatch_key())
        .fetch_one(&mut *conn)
        .await?;
    let existing = existing
        .parse()
        .map_err(|e: uuid::Error| EnqueueError::Database(sqlx::Error::Decode(e.into())))?;
    Ok(Enqueued {
        id: EventId(existing),
        duplicate: true,
    })
}

/// The partition of an event: by key, so a key's events share one; keyless
/// events spread by id. FNV-1a, fixed forever: events already stored keep
/// the partition they were given, and a key must not move while it has
/// events in flight.
pub fn partition_of(key: Option<&str>, id: EventId) -> Partition {
    let id = id.to_string();
    let bytes = key.unwrap_or(&id).as_bytes();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(PARTITIONS)) as Partition
}
