//! Table capture: triggers that turn a table's inserts, updates and deletes
//! into Ferry events, written in the transaction that made the change.
//!
//! For code paths that cannot call [`enqueue`](super::enqueue) (an ORM, raw
//! SQL, bulk jobs, migrations). [`add`] generates a trigger function for the
//! table from a [`CaptureSpec`] and installs it; the events it writes are
//! `<prefix>.created`, `.updated` and `.deleted`, keyed by the key column,
//! with the payload `{"data": {<tracked columns>}}` and, for updates,
//! `"previous": {<changed tracked columns, old values>}`. An update that
//! changes no tracked column writes nothing; a soft-delete column going from
//! NULL to a value is a `.deleted`. The `initiator` header comes from
//! `SET LOCAL ferry.initiator = '...'` (default `user`).
//!
//! The column list (and the columns' types, which each session plans its
//! reads of the row for) is fixed when the trigger is generated, so a row
//! costs no catalog query; after a schema change [`check`] reports the
//! drift and [`refresh`] regenerates (in SQL, `SELECT
//! ferry.capture_refresh('t')` does the same inside the migration that
//! altered the table).
//!
//! [`replace`] changes a capture's spec in one transaction, with no moment
//! between the old triggers and the new in which a change commits without
//! its event.
//!
//! A table renamed (or moved to another schema) keeps its trigger, whose
//! events name the old table until [`refresh`] follows the rename; [`check`]
//! reports it, and [`remove`] refuses to drop a trigger from any table but
//! the one it names.
//!
//! A partitioned table, or a partition, is captured for all three
//! operations and without a soft-delete column: PostgreSQL runs an UPDATE
//! that moves a row to another partition as a DELETE and an INSERT, which
//! then arrive as the row deleted and created, and any narrower spec would
//! turn such a move into a wrong event (or none).
//!
//! By default a trigger fails closed: when the event cannot be written, the
//! business statement fails too. [`OnError::Warn`] keeps the write and drops
//! the event instead: lossy, counted in [`Capture::dropped`]. The triggers
//! fire always, `session_replication_role = replica` included, and a
//! `TRUNCATE` of a table that captures deletes is refused (counted, in warn
//! mode). [`check`] reports a trigger that does not fire always, with the
//! statement that enables it.
//!
//! ```no_run
//! # async fn demo(conn: &mut sqlx::PgConnection) -> Result<(), ferry_store::postgres::capture::CaptureError> {
//! use ferry_store::postgres::capture::{self, CaptureSpec};
//! let spec = CaptureSpec::new("app.orders", "shop.order", "id").exclude(["card_token"]);
//! capture::add(conn, &spec).await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgDatabaseError;
use sqlx::{Connection, PgConnection, Row};

/// A table change a capture can turn into an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Operation {
    Insert,
    Update,
    Delete,
}

impl Operation {
    pub const ALL: [Operation; 3] = [Operation::Insert, Operation::Update, Operation::Delete];

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Insert => "insert",
            Operation::Update => "update",
            Operation::Delete => "delete",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Operation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Operation::ALL
            .into_iter()
            .find(|op| op.as_str() == s)
            .ok_or_else(|| format!("unknown operation {s:?}; use insert, update or delete"))
    }
}

/// What a trigger does when the event cannot be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The business statement fails with the event's error: nothing is lost.
    #[default]
    Fail,
    /// The business statement succeeds and the event is dropped, with a
    /// WARNING and a count in `ferry.capture_dropped`; a `TRUNCATE` counts
    /// each row it removes. Lossy.
    Warn,
}

impl OnError {
    pub fn as_str(self) -> &'static str {
        match self {
            OnError::Fail => "fail",
            OnError::Warn => "warn",
        }
    }
}

/// What to capture from one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSpec {
    /// The table in SQL syntax: `orders`, `app.orders`, `app."Order Items"`.
    pub table: String,
    /// Event types are `<type_prefix>.created`, `.updated`, `.deleted`.
    pub type_prefix: String,
    /// The column whose value, as text, is the event key (per-key order).
    pub key_column: String,
    /// Columns left out of payloads (secrets, large blobs); never the key.
    pub exclude: Vec<String>,
    /// A column whose change from NULL to a value is a `.deleted` event.
    /// Refused on a partitioned table, where a move between partitions
    /// would turn a soft-deleted row into a created one, and among
    /// `exclude`, where setting it back to NULL would send nothing.
    pub soft_delete: Option<String>,
    /// The operations that write events: all three on a partitioned table.
    pub on: Vec<Operation>,
    pub on_error: OnError,
}

impl CaptureSpec {
    /// Every operation, failing closed, no column excluded.
    pub fn new(table: impl Into<String>, type_prefix: impl Into<String>, key_column: impl Into<String>) -> Self {
        CaptureSpec {
            table: table.into(),
            type_prefix: type_prefix.into(),
            key_column: key_column.into(),
            exclude: Vec::new(),
            soft_delete: None,
            on: Operation::ALL.to_vec(),
            on_error: OnError::Fail,
        }
    }

    pub fn exclude<I: IntoIterator<Item = S>, S: Into<String>>(mut self, columns: I) -> Self {
        self.exclude.extend(columns.into_iter().map(Into::into));
        self
    }

    pub fn soft_delete(mut self, column: impl Into<String>) -> Self {
        self.soft_delete = Some(column.into());
        self
    }

    pub fn on(mut self, operations: impl IntoIterator<Item = Operation>) -> Self {
        self.on = operations.into_iter().collect();
        self
    }

    pub fn on_error(mut self, on_error: OnError) -> Self {
        self.on_error = on_error;
        self
    }
}

/// A captured table, as registered.
#[derive(Debug, Clone, Serialize)]
pub struct Capture {
    /// Schema-qualified and quoted where needed: what the other calls accept.
    pub table: String,
    pub type_prefix: String,
    pub key_column: String,
    pub exclude: Vec<String>,
    pub soft_delete: Option<String>,
    pub on: Vec<String>,
    pub on_error: String,
    /// The tracked columns the trigger was generated from, in table order.
    pub columns: Vec<String>,
    pub generated_at: DateTime<Utc>,
    /// Events a `warn` trigger dropped, with the last error and when.
    pub dropped: u64,
    pub last_dropped_error: Option<String>,
    pub last_dropped_at: Option<DateTime<Utc>>,
}

/// A captured table whose triggers would miss changes or no longer match
/// it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Drift {
    pub table: String,
    pub problem: String,
    /// The command (`ferry capture ...`) or SQL statement that fixes it.
    pub fix: String,
}

/// What [`replace`] did: the table, as [`list`] prints it, and the key
/// column it changed, if it did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replaced {
    pub table: String,
    pub key_change: Option<KeyChange>,
}

/// A replace that changed the key column. A row's events written before it
/// and still unpublished are under the old key, its later ones under the
/// new: the two keys keep no order between them, so the later ones may be
/// delivered first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyChange {
    /// The key column before the replace.
    pub from: String,
    /// The type prefix before the replace: its events are those counted.
    pub type_prefix: String,
    /// Events of `type_prefix` not yet published when the table was
    /// locked for the replace (unrouted, pending, retrying or dead): the
    /// ones whose order against the new key's events is not kept. Zero:
    /// the change kept every order.
    pub unpublished: u64,
}

/// Which captured tables [`refresh`] regenerates.
#[derive(Debug, Clone, Copy)]
pub enum Tables<'a> {
    One(&'a str),
    All,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// Bad input: `message` names the argument, `hint` says the fix.
    #[error("{message}; {hint}")]
    Invalid { message: String, hint: String },
    #[error("the database has no ferry capture schema; run `ferry migrate`")]
    NotMigrated,
    #[error("the table is locked by another transaction; try again when it has finished")]
    Busy,
    #[error(transparent)]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for CaptureError {
    fn from(err: sqlx::Error) -> Self {
        let Some(db) = err.as_database_error() else {
            return CaptureError::Database(err);
        };
        if let Some(message) = db.message().strip_prefix("ferry: ") {
            let hint = db
                .try_downcast_ref::<PgDatabaseError>()
                .and_then(PgDatabaseError::hint)
                .unwrap_or_default();
            return CaptureError::Invalid {
                message: message.to_owned(),
                hint: hint.to_owned(),
            };
        }
        match db.code().as_deref() {
            // undefined function or table: the capture migration is missing
            Some("42883" | "42P01") => CaptureError::NotMigrated,
            Some("55P03") => CaptureError::Busy,
            _ => CaptureError::Database(err),
        }
    }
}

/// How long DDL on a business table waits for its lock: waiting longer
/// would queue every writer of the table behind it.
const LOCK_TIMEOUT: &str = "5s";

/// Starts capturing `spec.table` and returns its name as [`list`] prints it.
/// Installs the trigger, which takes a brief exclusive lock on the table.
pub async fn add(conn: &mut PgConnection, spec: &CaptureSpec) -> Result<String, CaptureError> {
    let mut tx = conn.begin().await?;
    limit_lock_wait(&mut tx).await?;
    let table = install(&mut tx, "SELECT ferry.capture_add($1, $2, $3, $4, $5, $6, $7)", spec).await?;
    tx.commit().await?;
    Ok(table)
}

/// Gives the table `spec.table`, captured already, the spec `spec` in one
/// transaction, under the table's exclusive lock from the old triggers'
/// removal to the new ones' commit: every change of the table commits with
/// the old spec's events or the new one's. ([`remove`] then [`add`] would
/// let a change commit between the two with no event.) The spec is checked
/// as [`add`] checks it, and a refused one leaves the capture as it was;
/// the table's dropped-event count is kept.
///
/// A new key column is taken even with events of the table still waiting,
/// and [`Replaced::key_change`] counts them: a row's events among them may
/// be delivered after its events under the new key. Drain first.
pub async fn replace(conn: &mut PgConnection, spec: &CaptureSpec) -> Result<Replaced, CaptureError> {
    let mut tx = conn.begin().await?;
    limit_lock_wait(&mut tx).await?;
    // The spec being replaced, in the replace's own transaction; none for a
    // table not captured, which the replace then refuses.
    let before: Option<(String, String)> = sqlx::query_as(
        "SELECT k.key_column, k.type_prefix
           FROM ferry.capture_resolve($1) r
           JOIN ferry.captures k ON k.table_schema = r.o_schema AND k.table_name = r.o_name",
    )
    .bind(&spec.table)
    .fetch_optional(&mut *tx)
    .await?;
    let table = install(
        &mut tx,
        "SELECT ferry.capture_replace($1, $2, $3, $4, $5, $6, $7)",
        spec,
    )
    .await?;
    let key_change = match before {
        Some((from, type_prefix)) if from != spec.key_column => {
            // After the replace took the table's lock: no event of the old
            // key commits from here on.
            let unpublished: i64 = sqlx::query_scalar("SELECT ferry.capture_unpublished($1)")
                .bind(&type_prefix)
                .fetch_one(&mut *tx)
                .await?;
            Some(KeyChange {
                from,
                type_prefix,
                unpublished: unpublished.max(0) as u64,
            })
        }
        _ => None,
    };
    tx.commit().await?;
    Ok(Replaced { table, key_change })
}

async fn install(conn: &mut PgConnection, sql: &'static str, spec: &CaptureSpec) -> Result<String, CaptureError> {
    let on: Vec<&str> = spec.on.iter().map(|op| op.as_str()).collect();
    let table: String = sqlx::query_scalar(sql)
        .bind(&spec.table)
        .bind(&spec.type_prefix)
        .bind(&spec.key_column)
        .bind(&spec.exclude)
        .bind(&spec.soft_delete)
        .bind(&on)
        .bind(spec.on_error.as_str())
        .fetch_one(conn)
        .await?;
    Ok(table)
}

/// Regenerates the triggers of `tables` from their tables' columns now;
/// returns the tables refreshed, by their names now.
///
/// A table renamed, or moved to another schema, since it was captured is
/// followed: found by its trigger, recorded under its new name, and its
/// events name it from then on. Refused where the regenerated function
/// would break another table that calls it: the capture's trigger left on
/// a table renamed away (a new table has the name), a rename onto a name
/// another capture still records, or a table of the name that is another
/// capture's, renamed since. Refreshing all, such a table, and one that is
/// gone (no table of its name, nor one with its trigger), is passed over:
/// [`check`] reports it, with its fix.
pub async fn refresh(conn: &mut PgConnection, tables: Tables<'_>) -> Result<Vec<String>, CaptureError> {
    let one = match tables {
        Tables::One(t) => Some(t),
        Tables::All => None,
    };
    let mut tx = conn.begin().await?;
    limit_lock_wait(&mut tx).await?;
    let done: Vec<String> = sqlx::query_scalar("SELECT ferry.capture_refresh($1)")
        .bind(one)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(done)
}

/// Stops capturing `table`: drops its trigger and forgets it (its dropped
/// count too). Returns its name as [`list`] printed it.
///
/// Refused while the capture's trigger fires on another table (the table
/// renamed since, or another table that took the trigger along): removing
/// it would stop that table's events too. The error names that table and
/// what to run ([`refresh`] follows a rename).
pub async fn remove(conn: &mut PgConnection, table: &str) -> Result<String, CaptureError> {
    let mut tx = conn.begin().await?;
    limit_lock_wait(&mut tx).await?;
    let table: String = sqlx::query_scalar("SELECT ferry.capture_remove($1)")
        .bind(table)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(table)
}

/// The captured tables, by name.
pub async fn list(conn: &mut PgConnection) -> Result<Vec<Capture>, CaptureError> {
    let rows = sqlx::query(
        "SELECT format('%I.%I', c.table_schema, c.table_name), c.type_prefix, c.key_column, c.exclude,
                c.soft_delete, c.operations, c.on_error, c.columns, c.generated_at,
                coalesce(d.count, 0), d.last_error, d.last_at
           FROM ferry.captures c
           LEFT JOIN ferry.capture_dropped d USING (table_schema, table_name)
          ORDER BY c.table_schema, c.table_name",
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Capture {
            table: r.get(0),
            type_prefix: r.get(1),
            key_column: r.get(2),
            exclude: r.get(3),
            soft_delete: r.get(4),
            on: r.get(5),
            on_error: r.get(6),
            columns: r.get(7),
            generated_at: r.get(8),
            dropped: r.get::<i64, _>(9).max(0) as u64,
            last_dropped_error: r.get(10),
            last_dropped_at: r.get(11),
        })
        .collect())
}

/// Captured tables whose triggers would miss changes (disabled, or not
/// firing always, on the table or a partition; a partition without its
/// `TRUNCATE` guard; a soft-delete column also excluded, whose undelete
/// sends nothing) or are out of date with the table (columns added or
/// gone, a tracked column whose type changed, the trigger missing, the
/// table renamed or gone, the trigger left on another table), each with its
/// fix, the worst first; a table can have several. Empty when every trigger
/// fires always and matches its table.
///
/// A tracked column's type changed since the trigger was generated (`ALTER
/// COLUMN ... TYPE`, or the type replaced by a new one of the same name)
/// breaks the trigger in each session that wrote the table before:
/// PL/pgSQL keeps the plans of its reads of the row for the old type's
/// OID, and every later write of that session fails (in warn mode, drops
/// its event) until [`refresh`] regenerates the function. The types are
/// compared by OID, whatever the `search_path`; a modifier changed alone
/// (`varchar(20)` to `varchar(40)`) keeps the OID, breaks no plan and is
/// not reported.
pub async fn check(conn: &mut PgConnection) -> Result<Vec<Drift>, CaptureError> {
    let rows: Vec<(String, String, String)> =
        sqlx::query_as("SELECT table_name, problem, fix FROM ferry.capture_check()")
            .fetch_all(&mut *conn)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(table, problem, fix)| Drift { table, problem, fix })
        .collect())
}

/// A captured table's key column of a string type (text, varchar, char,
/// citext, or a domain over one), whose values the producer may refuse as
/// event keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TextKey {
    /// The key column, quoted as SQL needs it.
    pub column: String,
    /// Its type, as PostgreSQL prints it (`character varying(600)`).
    pub column_type: String,
}

/// The key column of the captured `table` (named as [`list`] names it)
/// when it is of a string type, else `None`. Every key goes through the
/// producer's checks: one that is empty, over 512 bytes or holds a line
/// break (CR or LF) is refused, and a row with such a key cannot be
/// written while captured (fail mode) or loses its events (warn mode).
pub async fn text_key(conn: &mut PgConnection, table: &str) -> Result<Option<TextKey>, CaptureError> {
    let row: Option<(String, String)> = sqlx::query_as(
        "SELECT quote_ident(k.key_column), format_type(a.atttypid, a.atttypmod)
           FROM ferry.captures k
           JOIN pg_attribute a ON a.attrelid = to_regclass(format('%I.%I', k.table_schema, k.table_name))
                              AND a.attname = k.key_column AND a.attnum > 0 AND NOT a.attisdropped
           JOIN pg_type t ON t.oid = a.atttypid
           LEFT JOIN pg_type b ON b.oid = t.typbasetype
          WHERE format('%I.%I', k.table_schema, k.table_name) = $1
            AND coalesce(b.typcategory, t.typcategory) = 'S'",
    )
    .bind(table)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|(column, column_type)| TextKey { column, column_type }))
}

async fn limit_lock_wait(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(LOCK_TIMEOUT)
        .execute(conn)
        .await
        .map(drop)
}
