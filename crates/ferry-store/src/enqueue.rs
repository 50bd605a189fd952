use ferry_core::{EventId, ValidationError};

/// The result of an enqueue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The event's id; for a duplicate, the id of the event already stored.
    pub id: EventId,
    /// The dispatch key was seen before: nothing was written.
    pub duplicate: bool,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// Writing outside a transaction would break the outbox's one promise:
    /// the event commits with the business write or not at all.
    #[error(
        "ferry::enqueue must run inside the caller's transaction; \
         begin one (`let mut tx = pool.begin().await?`, on SQLite \
         `pool.begin_with(\"BEGIN IMMEDIATE\").await?`) and pass `&mut *tx`"
    )]
    NotInTransaction,
    /// SQLite ended the caller's transaction itself, undoing its writes (an
    /// `ON CONFLICT ROLLBACK` clause, `RAISE(ROLLBACK, ...)` in a trigger, a
    /// full disk). Written now, the event would commit on its own.
    #[error(
        "the caller's transaction was rolled back by SQLite (an ON CONFLICT ROLLBACK \
         clause, RAISE(ROLLBACK) in a trigger, or an I/O error) and its writes are gone; \
         nothing was written: roll back and run the whole transaction again"
    )]
    TransactionEnded,
    /// The ferry tables or functions are missing: `ferry migrate` has not
    /// run on this database.
    #[error("{0}: the ferry schema is missing or out of date; run `ferry migrate` on this database")]
    NotMigrated(#[source] sqlx::Error),
    #[error("the database refused the event: {0}")]
    Database(#[from] sqlx::Error),
}

/// An event whose id is stored already: the same `Event` enqueued again,
/// which only a dispatch key makes a reported no-op.
pub(crate) fn stored_already(id: &str) -> EnqueueError {
    EnqueueError::Invalid(ValidationError {
        field: "id",
        problem: format!("event {id} is stored already"),
        fix: "this Event was enqueued before (earlier in this transaction, or in one that committed), so it \
              is sent: drop the retry, or give events a dispatch key to make such a retry a reported no-op",
    })
}
