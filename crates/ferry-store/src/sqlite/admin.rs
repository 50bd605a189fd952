//! [`Admin`] for SQLite.
//!
//! How requeue and cancel stay safe beside a running relay: they run in a
//! `BEGIN IMMEDIATE` transaction, which holds SQLite's one write lock, so no
//! relay can take a lease or record an outcome until it commits, and every
//! check reads what was committed before. (A requeue reads the later events
//! of its targets' keys before it takes the lock, which reading them would
//! hold too long, and under it only what changed since: see `OrderFacts`.)
//! As with PostgreSQL, requeue touches only dead, cancelled and published
//! deliveries, which no relay holds; cancel refuses a pending delivery a
//! relay could have claimed (due, not held back by its key, in a leased
//! partition).

use std::collections::BTreeMap;
use std::str::FromStr;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, NO_ROUTE, StoreError};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection, SqlitePool};

use super::SqliteStore;
use super::error::store_error;
use super::store::{from_micros, micros};
use crate::admin::{
    LastPublished, OrderFacts, REQUEUED_MEANWHILE, StoredStates, in_flight_after_sql, later_unrouted_sql, out_of_order,
};
use crate::{
    Action, ActionRecord, Admin, AdminState, Applied, Attempt, Change, Cursor, DeliverySummary, DeliveryView,
    EventView, Filter, ListPage, Page, Plan, Refusal, StatusReport, Target,
};

type Query<'q> = sqlx::query::Query<'q, Sqlite, SqliteArguments>;

/// The filter's conditions on `d` (deliveries) and `e` (events); lists are
/// JSON arrays, NULL when the filter does not narrow on them.
/// ?1 ids, ?2 states, ?3 route, ?4 event types, ?5 key, ?6 since, ?7 until, ?8 error text
/// (lowercased by [`lower`]). Needs [`with_lower`] on the connection.
const FILTER: &str = "
       (?1 IS NULL OR e.id IN (SELECT value FROM json_each(?1)))
   AND (?2 IS NULL OR (CASE WHEN d.state = 'pending' AND d.attempts > 0 THEN 'retrying' ELSE d.state END)
                      IN (SELECT value FROM json_each(?2)))
   AND (?3 IS NULL OR d.route = ?3)
   AND (?4 IS NULL OR e.type IN (SELECT value FROM json_each(?4)))
   AND (?5 IS NULL OR d.key = ?5)
   AND (?6 IS NULL OR e.created_at >= ?6)
   AND (?7 IS NULL OR e.created_at < ?7)
   AND (?8 IS NULL OR instr(ferry_lower(coalesce(d.last_error, '')), ?8) > 0)";

/// A pending delivery of `d` that a relay may hold right now: due (never
/// attempted, or with a margin for the relay's clock running ahead), not
/// held back by an earlier failed delivery of its key, and in a partition
/// under a live lease.
fn maybe_in_flight() -> String {
    let now = now_us!();
    format!(
        "d.state = 'pending'
     AND (d.attempts = 0 OR d.next_attempt_at <= {now} + 5000000)
     AND EXISTS (SELECT 1 FROM ferry_partitions p
                  WHERE p.partition = d.partition AND p.owner IS NOT NULL AND p.expires_at > {now})
     AND (d.key IS NULL OR NOT EXISTS (
          SELECT 1 FROM ferry_deliveries b
           WHERE b.route = d.route AND b.key = d.key AND b.seq < d.seq
             AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))))"
    )
}

const IN_FLIGHT_REASON: &str =
    "may be in flight: a relay can be publishing it now; wait for its outcome, or stop the relay and retry";

/// Why `d` cannot take `action`, or NULL. For requeue, `?9` says whether
/// published deliveries may go again.
fn refusal(action: &Action) -> String {
    match action {
        Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => "CASE
       WHEN d.state = 'pending' AND d.attempts > 0
         THEN 'retrying: still being worked on; cancel it first to requeue it'
       WHEN d.state = 'pending' THEN 'pending or in flight: not failed, nothing to requeue'
       WHEN d.state = 'published' AND NOT ?9
         THEN 'published already; pass --include-published to deliver it again'
     END"
        .to_owned(),
        Action::Cancel { .. } => format!(
            "CASE
           WHEN d.state = 'published' THEN 'published already'
           WHEN d.state = 'cancelled' THEN 'cancelled already'
           WHEN {} THEN '{IN_FLIGHT_REASON}'
         END",
            maybe_in_flight()
        ),
    }
}

/// Why requeueing `d` could let a later event of its key arrive first,
/// one that may be in flight now, or NULL; for a requeue. `later_unrouted`
/// as [`in_flight_after_sql`] takes it.
fn in_flight_after(action: &Action, later_unrouted: &str) -> String {
    if action.is_requeue() {
        in_flight_after_sql("ferry_", " INDEXED BY ferry_deliveries_held", later_unrouted)
    } else {
        "NULL".to_owned()
    }
}

/// [`LastPublished`] for `targets`, for a requeue.
async fn last_published<'e>(
    executor: impl sqlx::SqliteExecutor<'e>,
    action: &Action,
    targets: &[&Target],
) -> Result<LastPublished, StoreError> {
    let Some(wanted) = LastPublished::wanted(targets.iter().copied()).filter(|_| action.is_requeue()) else {
        return Ok(LastPublished::default());
    };
    let pairs: Vec<[&str; 2]> = wanted
        .routes
        .into_iter()
        .zip(wanted.keys)
        .map(|(r, k)| [r, k])
        .collect();
    // The targets themselves are left out: requeued together, in outbox
    // order, a key's published deliveries are replayed in that order.
    // Retention's order marks count as published deliveries: each stands
    // for later ones of its key that were published and then deleted.
    let itself: Vec<(i64, &str)> = targets.iter().map(|t| (t.seq, t.route.as_str())).collect();
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT l.route, l.key, max(l.seq)
           FROM ferry_deliveries l
          WHERE l.seq > ?1 AND l.state = 'published'
            AND ((l.route, l.key) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
                                        FROM json_each(?2))
                 OR l.key IN (SELECT value FROM json_each(?4)))
            AND (l.seq, l.route) NOT IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
                                           FROM json_each(?3))
          GROUP BY l.route, l.key
         UNION ALL
         SELECT m.route, m.key, m.seq
           FROM ferry_purged_order m
          WHERE m.seq > ?1
            AND ((m.route, m.key) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
                                        FROM json_each(?2))
                 OR m.key IN (SELECT value FROM json_each(?4)))",
    )
    .bind(wanted.after)
    .bind(serde_json::to_string(&pairs).expect("strings serialise"))
    .bind(serde_json::to_string(&itself).expect("numbers and strings serialise"))
    .bind(serde_json::to_string(&wanted.any_route).expect("strings serialise"))
    .fetch_all(executor)
    .await
    .map_err(store_error)?;
    Ok(LastPublished::new(rows).with_targets(targets.iter().copied()))
}

/// [`OrderFacts`] for a requeue of `targets`, read before the write lock.
async fn read_order_facts(pool: &SqlitePool, action: &Action, targets: &[Target]) -> Result<OrderFacts, StoreError> {
    let mut facts = OrderFacts::new(targets);
    let keys = json_strings(&facts.keys());
    let after = facts.after();
    // One snapshot for all of it.
    let mut tx = pool.begin().await.map_err(store_error)?;
    (facts.events_upto, facts.log_upto) = sqlx::query_as(
        "SELECT coalesce((SELECT max(seq) FROM ferry_events), 0),
                coalesce((SELECT max(id) FROM ferry_admin_log), 0)",
    )
    .fetch_one(&mut *tx)
    .await
    .map_err(store_error)?;
    facts.published = last_published(&mut *tx, action, &targets.iter().collect::<Vec<_>>()).await?;
    if keys.is_some() {
        // CROSS JOIN keeps SQLite reading the unrouted events and
        // looking each up, not every event after the earliest target.
        let unrouted: Vec<(String, i64)> = sqlx::query_as(
            "SELECT e.key, u.seq FROM ferry_unrouted u CROSS JOIN ferry_events e ON e.seq = u.seq
              WHERE u.seq > ?1 AND e.key IN (SELECT value FROM json_each(?2))",
        )
        .bind(after)
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        for (key, seq) in unrouted {
            facts.note_unrouted(key, seq);
        }
        let watched: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT l.seq, l.route, l.key FROM ferry_deliveries l INDEXED BY ferry_deliveries_held
              WHERE l.key IN (SELECT value FROM json_each(?2)) AND l.state IN ('pending', 'dead')
                AND l.seq > ?1",
        )
        .bind(after)
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        facts.watch(watched);
    }
    tx.rollback().await.map_err(store_error)?;
    Ok(facts)
}

/// Under the write lock: reads again what may have changed since
/// [`read_order_facts`].
async fn catch_up(facts: &mut OrderFacts, tx: &mut SqliteConnection) -> Result<(), StoreError> {
    let Some(keys) = json_strings(&facts.keys()) else {
        return Ok(());
    };
    let touched: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT e.key FROM ferry_admin_log a JOIN ferry_events e ON e.seq = a.seq
          WHERE a.id > ?1 AND a.action = 'requeue' AND e.key IN (SELECT value FROM json_each(?2))",
    )
    .bind(facts.log_upto)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    facts.set_touched(touched);
    let newer: Vec<(String, i64)> = sqlx::query_as(
        "SELECT e.key, u.seq FROM ferry_unrouted u JOIN ferry_events e ON e.seq = u.seq
          WHERE u.seq > ?1 AND e.key IN (SELECT value FROM json_each(?2))",
    )
    .bind(facts.events_upto)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    for (key, seq) in newer {
        facts.note_unrouted(key, seq);
    }
    let mut published: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT d.route, d.key, d.seq FROM ferry_deliveries d
          WHERE d.seq > ?1 AND d.state = 'published' AND d.key IN (SELECT value FROM json_each(?2))",
    )
    .bind(facts.events_upto)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    let watched: Vec<(i64, &str)> = facts
        .watched()
        .iter()
        .map(|(seq, route)| (*seq, route.as_str()))
        .collect();
    published.extend(
        sqlx::query_as::<_, (String, String, i64)>(
            "SELECT d.route, d.key, d.seq
               FROM json_each(?1) w
               JOIN ferry_deliveries d
                 ON d.seq = json_extract(w.value, '$[0]') AND d.route = json_extract(w.value, '$[1]')
              WHERE d.state = 'published'",
        )
        .bind(serde_json::to_string(&watched).expect("numbers and strings serialise"))
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?,
    );
    published.extend(
        sqlx::query_as::<_, (String, String, i64)>(
            "SELECT d.route, d.key, d.seq FROM ferry_deliveries d
              WHERE d.seq IN (SELECT value FROM json_each(?1)) AND d.state = 'published'",
        )
        .bind(serde_json::to_string(&facts.unrouted_seqs()).expect("numbers serialise"))
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?,
    );
    // Retention's order marks of the keys: one written since the read
    // stands for a later event published and deleted meanwhile. Retention
    // writes its marks under the write lock this holds.
    published.extend(
        sqlx::query_as::<_, (String, String, i64)>(
            "SELECT m.route, m.key, m.seq FROM ferry_purged_order m
              WHERE m.key IN (SELECT value FROM json_each(?1))",
        )
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?,
    );
    facts.note_published(published);
    Ok(())
}

/// `text` lowercased as `ferry_lower` does it in SQL: each character by
/// Unicode's rules, so that `--error` matches in any case, as PostgreSQL's
/// `lower()` does; SQLite's own folds only ASCII.
fn lower(text: &str) -> String {
    text.chars().flat_map(char::to_lowercase).collect()
}

/// `ferry_lower(text)`: [`lower`] for SQL. NULL stays NULL.
///
/// # Safety
///
/// Called by SQLite only, with `argc` values in `argv`.
unsafe extern "C" fn ferry_lower(
    ctx: *mut libsqlite3_sys::sqlite3_context,
    argc: std::ffi::c_int,
    argv: *mut *mut libsqlite3_sys::sqlite3_value,
) {
    use libsqlite3_sys as ffi;
    // SAFETY: SQLite passes `argc` valid values (one, as registered), each
    // readable for the length of this call; the text is copied before the
    // result is set.
    unsafe {
        if argc != 1 {
            ffi::sqlite3_result_null(ctx);
            return;
        }
        let value = *argv;
        if ffi::sqlite3_value_type(value) == ffi::SQLITE_NULL {
            ffi::sqlite3_result_null(ctx);
            return;
        }
        let text = ffi::sqlite3_value_text(value);
        let len = ffi::sqlite3_value_bytes(value);
        if text.is_null() {
            ffi::sqlite3_result_null(ctx);
            return;
        }
        let bytes = std::slice::from_raw_parts(text, len.max(0) as usize);
        let folded = lower(&String::from_utf8_lossy(bytes));
        ffi::sqlite3_result_text(
            ctx,
            folded.as_ptr().cast(),
            folded.len() as std::ffi::c_int,
            ffi::SQLITE_TRANSIENT(),
        );
    }
}

/// A connection of `pool` with `ferry_lower` registered. Registered once
/// per connection: registering it again would expire the connection's
/// prepared statements.
async fn with_lower(pool: &SqlitePool) -> Result<PoolConnection<Sqlite>, StoreError> {
    let mut conn = pool.acquire().await.map_err(store_error)?;
    let known: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pragma_function_list WHERE name = 'ferry_lower')")
            .fetch_one(&mut *conn)
            .await
            .map_err(store_error)?;
    if !known {
        let mut handle = conn.lock_handle().await.map_err(store_error)?;
        // SAFETY: the handle is locked for the call, so no statement runs on
        // the connection meanwhile; the name is NUL-terminated, and the
        // function keeps no state.
        let rc = unsafe {
            libsqlite3_sys::sqlite3_create_function_v2(
                handle.as_raw_handle().as_ptr(),
                c"ferry_lower".as_ptr(),
                1,
                libsqlite3_sys::SQLITE_UTF8 | libsqlite3_sys::SQLITE_DETERMINISTIC,
                std::ptr::null_mut(),
                Some(ferry_lower),
                None,
                None,
                None,
            )
        };
        if rc != libsqlite3_sys::SQLITE_OK {
            return Err(StoreError::permanent(format!(
                "registering ferry_lower on a SQLite connection failed (code {rc})"
            )));
        }
    }
    Ok(conn)
}

/// The filter's values, ready to bind as ?1..?8.
struct FilterArgs {
    ids: Option<String>,
    states: Option<String>,
    route: Option<String>,
    types: Option<String>,
    key: Option<String>,
    since: Option<i64>,
    until: Option<i64>,
    error: Option<String>,
}

fn json_strings<T: ToString>(items: &[T]) -> Option<String> {
    (!items.is_empty()).then(|| {
        let list: Vec<String> = items.iter().map(T::to_string).collect();
        serde_json::to_string(&list).expect("strings serialise")
    })
}

impl FilterArgs {
    /// SQLite has no regular expressions: the type glob is matched here
    /// against the distinct event types, and the query takes the list.
    async fn new(pool: &SqlitePool, f: &Filter) -> Result<Self, StoreError> {
        let types = match &f.type_glob {
            None => None,
            Some(glob) => {
                let all: Vec<String> = sqlx::query_scalar("SELECT DISTINCT type FROM ferry_events")
                    .fetch_all(pool)
                    .await
                    .map_err(store_error)?;
                let matching: Vec<String> = all.into_iter().filter(|t| glob.matches(t)).collect();
                Some(serde_json::to_string(&matching).expect("strings serialise"))
            }
        };
        Ok(Self {
            ids: json_strings(&f.ids),
            states: json_strings(&f.states.iter().map(|s| s.as_str()).collect::<Vec<_>>()),
            route: f.route.clone(),
            types,
            key: f.key.clone(),
            since: f.since.map(micros),
            until: f.until.map(micros),
            error: f.error.as_deref().map(lower),
        })
    }

    fn bind<'q>(&self, query: Query<'q>) -> Query<'q> {
        query
            .bind(self.ids.clone())
            .bind(self.states.clone())
            .bind(self.route.clone())
            .bind(self.types.clone())
            .bind(self.key.clone())
            .bind(self.since)
            .bind(self.until)
            .bind(self.error.clone())
    }
}

fn attempts(row: &SqliteRow, index: &str) -> u32 {
    row.get::<i64, _>(index).max(0) as u32
}

fn state(row: &SqliteRow) -> Result<AdminState, StoreError> {
    AdminState::of(row.get::<&str, _>("state"), row.get::<i64, _>("attempts") as i32)
}

fn event_id(row: &SqliteRow) -> Result<EventId, StoreError> {
    let id: &str = row.get("id");
    EventId::from_str(id).map_err(|e| StoreError::permanent(format!("event id {id:?} is not a UUID: {e}")))
}

fn time(row: &SqliteRow, index: &str) -> DateTime<Utc> {
    from_micros(row.get(index))
}

fn maybe_time(row: &SqliteRow, index: &str) -> Option<DateTime<Utc>> {
    row.get::<Option<i64>, _>(index).map(from_micros)
}

fn target(row: &SqliteRow) -> Result<Target, StoreError> {
    Ok(Target {
        event_id: event_id(row)?,
        seq: row.get("seq"),
        route: row.get("route"),
        event_type: row.get("type"),
        key: row.get("key"),
        state: state(row)?,
    })
}

/// The deliveries table as `d`, and the condition on their stored state,
/// for a filter's states. Where those are one partial index's deliveries
/// the index is named: on an ordered page SQLite preferred to read every
/// delivery of the history in (seq, route) order rather than the few in
/// the index and sort them.
fn deliveries_of(states: &[AdminState]) -> (String, String) {
    let stored = StoredStates::of(states);
    let table = match stored.partial_index() {
        Some(index) => format!("ferry_deliveries d INDEXED BY ferry_{index}"),
        None => "ferry_deliveries d".to_string(),
    };
    (table, stored.condition())
}

/// A page of the deliveries `filter` selects, in (seq, route) order.
fn list_sql(filter: &Filter) -> String {
    let (deliveries, stored) = deliveries_of(&filter.states);
    format!(
        "SELECT e.id, d.seq, e.type, e.key, d.route, d.state, d.attempts, e.created_at, d.updated_at,
                d.next_attempt_at, d.last_error, d.published_at
           FROM {deliveries} JOIN ferry_events e ON e.seq = d.seq
          WHERE {FILTER}{stored}
            AND (?9 IS NULL OR d.seq > ?9 OR (d.seq = ?9 AND d.route > ?10))
          ORDER BY d.seq, d.route
          LIMIT ?11"
    )
}

/// [`list_sql`] (or a statement with its parameters) with its parameters
/// bound; one row more than the page, to tell whether another follows.
fn list_query<'q>(sql: String, args: &FilterArgs, page: &Page) -> Query<'q> {
    args.bind(sqlx::query(AssertSqlSafe(sql)))
        .bind(page.after.as_ref().map(|c| c.seq))
        .bind(page.after.as_ref().map(|c| c.route.clone()))
        .bind(page.limit.max(1) as i64 + 1)
}

/// Every delivery `selection` selects, with why `action` may not touch it,
/// and for a requeue why it would break its key's order.
fn plan_sql(action: &Action, selection: &Filter) -> String {
    // Cancel takes later deliveries of a key first: while the earlier
    // failure still holds them back, no relay can be publishing them.
    let order = if action.is_requeue() { "ASC" } else { "DESC" };
    let (deliveries, stored) = deliveries_of(&selection.states);
    format!(
        "SELECT e.id, d.seq, e.type, e.key, d.route, d.state, d.attempts, {} AS refusal,
                {} AS in_flight
           FROM {deliveries} JOIN ferry_events e ON e.seq = d.seq
          WHERE {FILTER}{stored}
          ORDER BY d.seq {order}, d.route",
        refusal(action),
        in_flight_after(action, &later_unrouted_sql("ferry_"))
    )
}

/// [`plan_sql`] (or a statement with its parameters) with its parameters
/// bound.
fn plan_query<'q>(sql: String, args: &FilterArgs, action: &Action) -> Query<'q> {
    let query = args.bind(sqlx::query(AssertSqlSafe(sql)));
    if action.is_requeue() {
        query.bind(action.includes_published())
    } else {
        query
    }
}

#[async_trait]
impl Admin for SqliteStore {
    async fn status(&self) -> Result<StatusReport, StoreError> {
        SqliteStore::status(self).await
    }

    async fn list(&self, filter: &Filter, page: &Page) -> Result<ListPage, StoreError> {
        let limit = page.limit.max(1);
        let args = FilterArgs::new(self.pool(), filter).await?;
        let mut conn = with_lower(self.pool()).await?;
        let rows = list_query(list_sql(filter), &args, page)
            .fetch_all(&mut *conn)
            .await
            .map_err(store_error)?;
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in rows.iter().take(limit) {
            let state = state(row)?;
            let pending = matches!(state, AdminState::Pending | AdminState::Retrying);
            deliveries.push(DeliverySummary {
                event_id: event_id(row)?,
                seq: row.get("seq"),
                event_type: row.get("type"),
                key: row.get("key"),
                route: row.get("route"),
                state,
                attempts: attempts(row, "attempts"),
                created_at: time(row, "created_at"),
                updated_at: time(row, "updated_at"),
                next_attempt_at: pending.then(|| time(row, "next_attempt_at")),
                last_error: row.get("last_error"),
                published_at: maybe_time(row, "published_at"),
            });
        }
        let next = (rows.len() > limit).then(|| {
            let last = deliveries.last().expect("a full page has a last row");
            Cursor {
                seq: last.seq,
                route: last.route.clone(),
            }
        });
        Ok(ListPage { deliveries, next })
    }

    async fn show(&self, id: EventId) -> Result<Option<EventView>, StoreError> {
        show(self.pool(), id).await
    }

    async fn plan(&self, action: &Action, selection: &Filter) -> Result<Plan, StoreError> {
        let args = FilterArgs::new(self.pool(), selection).await?;
        let mut conn = with_lower(self.pool()).await?;
        let rows = plan_query(plan_sql(action, selection), &args, action)
            .fetch_all(&mut *conn)
            .await
            .map_err(store_error)?;
        let mut planned = Vec::with_capacity(rows.len());
        for row in &rows {
            let refusal: Option<String> = row.get("refusal");
            let in_flight: Option<String> = row.get("in_flight");
            planned.push((target(row)?, refusal, in_flight));
        }
        let eligible: Vec<&Target> = planned.iter().filter(|p| p.1.is_none()).map(|p| &p.0).collect();
        let published = last_published(&mut *conn, action, &eligible).await?;
        let mut plan = Plan::default();
        for (target, refusal, in_flight) in planned {
            let out_of_order = out_of_order(&target, &published, in_flight);
            crate::admin::sort_target(&mut plan, action, target, refusal, out_of_order);
        }
        Ok(plan)
    }

    async fn apply(&self, action: &Action, actor: &str, targets: &[Target]) -> Result<Applied, StoreError> {
        if targets.is_empty() {
            return Ok(Applied::default());
        }
        // Each target is checked as the targets before it in this
        // transaction left the outbox: a dead head and its dead follower
        // requeued together still pass, since what comes after them is
        // held back by the follower, dead when its own check runs.
        let check = format!(
            "SELECT d.state, d.attempts, d.partition, {} AS refusal, {} AS in_flight
               FROM ferry_deliveries d WHERE d.seq = ?1 AND d.route = ?2",
            refusal(action).replace("?9", "?3"),
            in_flight_after(action, "?4")
        );
        // What reads beyond the targets' own rows is read before the write
        // lock is taken, and only what may have changed since is read under
        // it (see OrderFacts).
        let mut order = if action.is_requeue() {
            Some(read_order_facts(self.pool(), action, targets).await?)
        } else {
            None
        };
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await.map_err(store_error)?;
        if let Some(order) = &mut order {
            catch_up(order, &mut tx).await?;
        }
        let mut applied = Applied::default();
        for t in targets {
            let mut query = sqlx::query(AssertSqlSafe(check.as_str())).bind(t.seq).bind(&t.route);
            if let Some(order) = &order {
                query = query.bind(action.includes_published()).bind(order.later_unrouted(t));
            }
            let row = query.fetch_optional(&mut *tx).await.map_err(store_error)?;
            let Some(row) = row else {
                applied.refused.push(Refusal {
                    target: t.clone(),
                    reason: "gone: deleted since it was selected".to_owned(),
                });
                continue;
            };
            let from = state(&row)?;
            // Moved on since the plan (by a relay or another operator):
            // acting now would overwrite that.
            let refusal = match &order {
                _ if from != t.state => Some(crate::admin::changed_since(t.state, from)),
                Some(order) if order.touched(t) => Some(REQUEUED_MEANWHILE.to_owned()),
                _ => {
                    let out_of_order = order
                        .as_ref()
                        .and_then(|o| out_of_order(t, &o.published, row.get("in_flight")))
                        .filter(|_| !action.allows_out_of_order());
                    row.get::<Option<String>, _>("refusal").or(out_of_order)
                }
            };
            if let Some(reason) = refusal {
                applied.refused.push(Refusal {
                    target: Target {
                        state: from,
                        ..t.clone()
                    },
                    reason,
                });
                continue;
            }
            let (from_state, from_attempts): (String, i64) = (row.get("state"), row.get("attempts"));
            match action {
                Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } if t.route == NO_ROUTE => {
                    // Back to the router, so a route added since can take it.
                    sqlx::query("DELETE FROM ferry_deliveries WHERE seq = ?1 AND route = ?2")
                        .bind(t.seq)
                        .bind(&t.route)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                    sqlx::query(
                        "INSERT INTO ferry_unrouted (seq, partition) VALUES (?1, ?2) ON CONFLICT (seq) DO NOTHING",
                    )
                    .bind(t.seq)
                    .bind(row.get::<i64, _>("partition"))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                    if let Some(order) = &mut order {
                        order.unrouted_again(t);
                    }
                }
                Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => {
                    sqlx::query(concat!(
                        "UPDATE ferry_deliveries
                            SET state = 'pending', attempts = 0, next_attempt_at = ",
                        now_us!(),
                        ", last_error = NULL, published_at = NULL, updated_at = ",
                        now_us!(),
                        " WHERE seq = ?1 AND route = ?2"
                    ))
                    .bind(t.seq)
                    .bind(&t.route)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                }
                Action::Cancel { .. } => {
                    sqlx::query(concat!(
                        "UPDATE ferry_deliveries SET state = 'cancelled', updated_at = ",
                        now_us!(),
                        " WHERE seq = ?1 AND route = ?2"
                    ))
                    .bind(t.seq)
                    .bind(&t.route)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                    // A lapsed lease let the cancel through, but its holder
                    // may still be publishing and come back with an outcome
                    // that its owner and token would let overwrite what the
                    // operator does next. Revoke it: the partition is taken
                    // anew, under a new token.
                    sqlx::query(concat!(
                        "UPDATE ferry_partitions SET owner = NULL, expires_at = NULL, token = token + 1
                          WHERE partition = ?1 AND owner IS NOT NULL AND expires_at <= ",
                        now_us!()
                    ))
                    .bind(row.get::<i64, _>("partition"))
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                }
            }
            let reason = match action {
                Action::Cancel { reason } => Some(reason.clone()),
                Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => None,
            };
            sqlx::query(concat!(
                "INSERT INTO ferry_admin_log (seq, route, at, actor, action, from_state, attempts, reason)
                 VALUES (?1, ?2, ",
                now_us!(),
                ", ?3, ?4, ?5, ?6, ?7)"
            ))
            .bind(t.seq)
            .bind(&t.route)
            .bind(actor)
            .bind(action.verb())
            .bind(from_state)
            .bind(from_attempts)
            .bind(reason)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
            applied.changed.push(Target {
                state: from,
                ..t.clone()
            });
        }
        tx.commit().await.map_err(store_error)?;
        Ok(applied)
    }

    async fn changes_since(
        &self,
        since: DateTime<Utc>,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<Change>, StoreError> {
        // New and requeued deliveries (pending, no attempt yet) are not
        // outcomes; everything else is.
        let rows = sqlx::query(
            "SELECT e.id, d.seq, d.route, e.type, e.key, d.state, d.attempts, e.created_at, d.updated_at,
                    d.published_at, d.last_error
               FROM ferry_deliveries d JOIN ferry_events e ON e.seq = d.seq
              WHERE (d.updated_at > ?1 OR (d.updated_at = ?1 AND (d.seq, d.route) > (?3, ?4)))
                AND NOT (d.state = 'pending' AND d.attempts = 0)
              ORDER BY d.updated_at, d.seq, d.route
              LIMIT ?2",
        )
        .bind(micros(since))
        .bind(limit as i64)
        .bind(after.map(|a| a.0))
        .bind(after.map(|a| a.1))
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        rows.iter()
            .map(|row| {
                Ok(Change {
                    event_id: event_id(row)?,
                    seq: row.get("seq"),
                    route: row.get("route"),
                    event_type: row.get("type"),
                    key: row.get("key"),
                    state: state(row)?,
                    attempts: attempts(row, "attempts"),
                    created_at: time(row, "created_at"),
                    updated_at: time(row, "updated_at"),
                    published_at: maybe_time(row, "published_at"),
                    last_error: row.get("last_error"),
                })
            })
            .collect()
    }
}

async fn show(pool: &SqlitePool, id: EventId) -> Result<Option<EventView>, StoreError> {
    let Some(row) = sqlx::query(
        "SELECT e.seq, e.type, e.key, e.content_type, e.headers, e.payload, e.dispatch_key, e.created_at,
                EXISTS (SELECT 1 FROM ferry_unrouted u WHERE u.seq = e.seq) AS unrouted
           FROM ferry_events e WHERE e.id = ?1",
    )
    .bind(id.to_string())
    .fetch_optional(pool)
    .await
    .map_err(store_error)?
    else {
        return Ok(None);
    };
    let seq: i64 = row.get("seq");
    let headers: BTreeMap<String, String> = serde_json::from_str(row.get("headers"))
        .map_err(|e| StoreError::permanent(format!("event headers are not a string map: {e}")))?;
    let payload: Vec<u8> = row.get("payload");
    let mut view = EventView {
        id,
        seq,
        event_type: row.get("type"),
        key: row.get("key"),
        content_type: row.get("content_type"),
        headers,
        payload_bytes: payload.len(),
        payload: String::from_utf8(payload).ok(),
        dispatch_key: row.get("dispatch_key"),
        created_at: time(&row, "created_at"),
        unrouted: row.get("unrouted"),
        deliveries: Vec::new(),
    };
    let deliveries = sqlx::query(
        "SELECT route, state, attempts, next_attempt_at, last_error, published_at, updated_at
           FROM ferry_deliveries WHERE seq = ?1 ORDER BY route",
    )
    .bind(seq)
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    let failures = sqlx::query("SELECT route, attempt, at, dead, error FROM ferry_failures WHERE seq = ?1 ORDER BY id")
        .bind(seq)
        .fetch_all(pool)
        .await
        .map_err(store_error)?;
    let actions = sqlx::query(
        "SELECT route, at, actor, action, from_state, attempts, reason FROM ferry_admin_log
          WHERE seq = ?1 ORDER BY id",
    )
    .bind(seq)
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    for d in &deliveries {
        let route: String = d.get("route");
        let state = state(d)?;
        let pending = matches!(state, AdminState::Pending | AdminState::Retrying);
        view.deliveries.push(DeliveryView {
            failures: failures
                .iter()
                .filter(|f| f.get::<&str, _>("route") == route)
                .map(|f| Attempt {
                    attempt: attempts(f, "attempt"),
                    at: time(f, "at"),
                    dead: f.get("dead"),
                    error: f.get("error"),
                })
                .collect(),
            actions: actions
                .iter()
                .filter(|a| a.get::<&str, _>("route") == route)
                .map(|a| {
                    Ok(ActionRecord {
                        at: time(a, "at"),
                        actor: a.get("actor"),
                        action: a.get("action"),
                        from_state: AdminState::of(a.get("from_state"), a.get::<i64, _>("attempts") as i32)?,
                        reason: a.get("reason"),
                    })
                })
                .collect::<Result<_, StoreError>>()?,
            route,
            state,
            attempts: attempts(d, "attempts"),
            next_attempt_at: pending.then(|| time(d, "next_attempt_at")),
            last_error: d.get("last_error"),
            published_at: maybe_time(d, "published_at"),
            updated_at: time(d, "updated_at"),
        });
    }
    Ok(Some(view))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As on PostgreSQL: listing, requeueing or cancelling failed
    /// deliveries reads them through their partial index, not every
    /// delivery of the outbox's history. SQLite takes a partial index only
    /// when the query states its predicate word for word.
    #[tokio::test]
    async fn a_state_filter_reads_its_partial_index_not_the_history() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("plans.db").to_str().unwrap())
            .await
            .unwrap();
        super::super::migrate(&mut store.pool().acquire().await.unwrap())
            .await
            .unwrap();
        sqlx::raw_sql(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
             INSERT INTO ferry_events (id, type, key, partition, payload, created_at)
             SELECT 'id-' || i, 'order.item.created', 'k-' || (i % 100), i % 32, x'7b7d', i FROM n;
             INSERT INTO ferry_deliveries (seq, route, partition, key, state, attempts, next_attempt_at, updated_at)
             SELECT seq, 'orders', partition, key,
                    CASE WHEN seq % 1000 = 7 THEN 'dead' WHEN seq % 1000 = 9 THEN 'cancelled'
                         WHEN seq % 1000 IN (3, 5) THEN 'pending' ELSE 'published' END,
                    CASE WHEN seq % 1000 = 5 THEN 0 ELSE 2 END, 0, seq
               FROM ferry_events;
             ANALYZE;",
        )
        .execute(store.pool())
        .await
        .unwrap();
        let (filters, actions) = crate::admin::partial_index_cases("orders");
        for (filter, index) in filters {
            let index = format!("ferry_{index}");
            let args = FilterArgs::new(store.pool(), &filter).await.unwrap();
            let page = Page { after: None, limit: 50 };
            let mut statements = vec![(
                "list",
                list_query(format!("EXPLAIN QUERY PLAN {}", list_sql(&filter)), &args, &page),
            )];
            for action in &actions {
                let sql = format!("EXPLAIN QUERY PLAN {}", plan_sql(action, &filter));
                statements.push((action.verb(), plan_query(sql, &args, action)));
            }
            for (name, query) in statements {
                let mut conn = with_lower(store.pool()).await.unwrap();
                let steps: Vec<String> = query
                    .fetch_all(&mut *conn)
                    .await
                    .unwrap()
                    .iter()
                    .map(|row| row.get::<String, _>("detail"))
                    .collect();
                let reads: Vec<&String> = steps
                    .iter()
                    .filter(|s| s.starts_with("SCAN d") || s.starts_with("SEARCH d"))
                    .collect();
                assert!(
                    !reads.is_empty() && reads.iter().all(|s| s.contains(&format!("USING INDEX {index}"))),
                    "{name} {filter:?}: {steps:#?}"
                );
            }
        }
    }
}
