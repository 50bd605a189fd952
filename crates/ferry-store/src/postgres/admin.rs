//! [`Admin`] for PostgreSQL.
//!
//! How requeue and cancel stay safe beside running relays: a relay only ever
//! writes deliveries that are `pending`, and its write is fenced by the
//! partition token and the attempt count it claimed with. Requeue touches
//! only dead, cancelled and published deliveries, which no relay holds, so
//! it cannot reset anything under one. Cancel may touch pending ones, so it
//! refuses any that a relay could have claimed (due, not held back by its
//! key, in a leased partition). Both first lock the partition rows so no
//! relay can take a lease or record an outcome there until they commit;
//! their checks then read what was committed before the lock: cancel's
//! check that a relay may hold a delivery, requeue's that a later event of
//! its key was published. A requeue reads most of that before it takes the
//! lock, which reading it all would hold for longer than a relay's lease
//! may wait, and under it only what can have changed since: see
//! `OrderFacts`.

use std::collections::{BTreeMap, HashSet};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, Glob, NO_ROUTE, StoreError};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::PgStore;
use super::error::store_error;
use crate::admin::{
    LastPublished, OrderFacts, REQUEUED_MEANWHILE, StoredStates, in_flight_after_sql, later_unrouted_sql, out_of_order,
};
use crate::{
    Action, ActionRecord, Admin, AdminState, Applied, Attempt, Change, Cursor, DeliverySummary, DeliveryView,
    EventView, Filter, ListPage, Page, Plan, Refusal, StatusReport, Target,
};

/// The filter's conditions on `d` (deliveries) and `e` (events).
/// $1 ids, $2 states, $3 route, $4 type regex, $5 key, $6 since, $7 until, $8 error text.
const FILTER: &str = "
       (cardinality($1::uuid[]) = 0 OR e.id = ANY($1::uuid[]))
   AND (cardinality($2::text[]) = 0
        OR (CASE WHEN d.state = 'pending' AND d.attempts > 0 THEN 'retrying' ELSE d.state END) = ANY($2::text[]))
   AND ($3::text IS NULL OR d.route = $3)
   AND ($4::text IS NULL OR ('.' || e.type) ~ $4)
   AND ($5::text IS NULL OR d.key = $5)
   AND ($6::timestamptz IS NULL OR e.created_at >= $6)
   AND ($7::timestamptz IS NULL OR e.created_at < $7)
   AND ($8::text IS NULL OR strpos(lower(coalesce(d.last_error, '')), lower($8)) > 0)";

/// A pending delivery of `d` that a relay may hold right now: due (never
/// attempted, or with a margin for the relay's clock running ahead), not
/// held back by an earlier failed delivery of its key, and in a partition
/// under a live lease. "Now" is the clock's, not the transaction's start
/// (`now()`): a cancel waits for its partition locks first, and what fell
/// due or lapsed meanwhile counts.
const MAYBE_IN_FLIGHT: &str = "
       d.state = 'pending'
   AND (d.attempts = 0 OR d.next_attempt_at <= clock_timestamp() + interval '5 seconds')
   AND EXISTS (SELECT 1 FROM ferry.partitions p
                WHERE p.partition = d.partition AND p.owner IS NOT NULL AND p.expires_at > clock_timestamp())
   AND (d.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM ferry.deliveries b
         WHERE b.route = d.route AND b.key = d.key AND b.seq < d.seq
           AND (b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0))))";

/// `d`'s state as [`AdminState`] names it.
const ADMIN_STATE: &str = "(CASE WHEN d.state = 'pending' AND d.attempts > 0 THEN 'retrying' ELSE d.state END)";

const IN_FLIGHT_REASON: &str =
    "may be in flight: a relay can be publishing it now; wait for its outcome, or stop the relays and retry";

/// Why `d` cannot be requeued, or NULL; `include_published` is the
/// parameter that says whether published deliveries may go again.
fn requeue_refusal(include_published: &str) -> String {
    format!(
        "CASE
       WHEN d.state = 'pending' AND d.attempts > 0
         THEN 'retrying: still being worked on; cancel it first to requeue it'
       WHEN d.state = 'pending' THEN 'pending or in flight: not failed, nothing to requeue'
       WHEN d.state = 'published' AND NOT {include_published}::bool
         THEN 'published already; pass --include-published to deliver it again'
     END"
    )
}

/// Why `d` cannot be cancelled, or NULL.
fn cancel_refusal() -> String {
    format!(
        "CASE
           WHEN d.state = 'published' THEN 'published already'
           WHEN d.state = 'cancelled' THEN 'cancelled already'
           WHEN {MAYBE_IN_FLIGHT} THEN '{IN_FLIGHT_REASON}'
         END"
    )
}

/// [`in_flight_after_sql`] for PostgreSQL.
fn in_flight_after() -> String {
    in_flight_after_sql("ferry.", "", &later_unrouted_sql("ferry."))
}

/// [`in_flight_after_sql`] for a requeue's write, with the targets a later
/// event of their key waits unrouted after in `param` (seqs, from
/// [`OrderFacts`]): reading the unrouted events in the statement would
/// read every one after each target, under the partition locks.
fn in_flight_after_known(param: &str) -> String {
    in_flight_after_sql("ferry.", "", &format!("d.seq = ANY({param}::bigint[])"))
}

/// [`OrderFacts`] for a requeue of `targets`, read before the partition
/// locks.
async fn read_order_facts(pool: &PgPool, action: &Action, targets: &[Target]) -> Result<OrderFacts, StoreError> {
    let mut facts = OrderFacts::new(targets);
    let keys = facts.keys();
    let after = facts.after();
    // The keys' producers in flight commit before the seqs are read;
    // the lock is the one `ferry.enqueue` takes, in the same order.
    let mut tx = pool.begin().await.map_err(store_error)?;
    sqlx::query(
        "SELECT pg_advisory_xact_lock(1178948185, b.bucket)
           FROM (SELECT DISTINCT 1 + (hashtext(k.key) & 1023) AS bucket
                   FROM unnest($1::text[]) k(key)
                  ORDER BY 1) b",
    )
    .persistent(false)
    .bind(&keys)
    .execute(&mut *tx)
    .await
    .map_err(store_error)?;
    (facts.events_upto, facts.log_upto) = sqlx::query_as(
        "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('ferry.events', 'seq')::regclass), 0),
                coalesce((SELECT max(id) FROM ferry.admin_log), 0)",
    )
    .persistent(false)
    .fetch_one(&mut *tx)
    .await
    .map_err(store_error)?;
    tx.commit().await.map_err(store_error)?;
    // One snapshot for the rest.
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await
        .map_err(store_error)?;
    facts.published = last_published(&mut *tx, action, &targets.iter().collect::<Vec<_>>()).await?;
    if !keys.is_empty() {
        let unrouted: Vec<(String, i64)> = sqlx::query_as(
            "SELECT e.key, u.seq FROM ferry.unrouted u JOIN ferry.events e ON e.seq = u.seq
              WHERE u.seq > $1 AND e.key = ANY($2::text[])",
        )
        .persistent(false)
        .bind(after)
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        let watched: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT l.seq, l.route, l.key FROM ferry.deliveries l
              WHERE l.key = ANY($2::text[]) AND l.state IN ('pending', 'dead') AND l.seq > $1",
        )
        .persistent(false)
        .bind(after)
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        for (key, seq) in unrouted {
            facts.note_unrouted(key, seq);
        }
        facts.watch(watched);
    }
    tx.rollback().await.map_err(store_error)?;
    Ok(facts)
}

/// Under the partition locks: reads again what may have changed since
/// [`read_order_facts`].
async fn catch_up(facts: &mut OrderFacts, tx: &mut sqlx::PgConnection) -> Result<(), StoreError> {
    let keys = facts.keys();
    if keys.is_empty() {
        return Ok(());
    }
    let touched: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT e.key FROM ferry.admin_log a JOIN ferry.events e ON e.seq = a.seq
          WHERE a.id > $1 AND a.action = 'requeue' AND e.key = ANY($2::text[])",
    )
    .persistent(false)
    .bind(facts.log_upto)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    facts.set_touched(touched);
    let newer: Vec<(String, i64)> = sqlx::query_as(
        "SELECT e.key, u.seq FROM ferry.unrouted u JOIN ferry.events e ON e.seq = u.seq
          WHERE u.seq > $1 AND e.key = ANY($2::text[])",
    )
    .persistent(false)
    .bind(facts.events_upto)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    for (key, seq) in newer {
        facts.note_unrouted(key, seq);
    }
    let (watched_seqs, watched_routes): (Vec<i64>, Vec<&str>) = facts
        .watched()
        .iter()
        .map(|(seq, route)| (*seq, route.as_str()))
        .unzip();
    let routed = facts.unrouted_seqs();
    // With the order marks of the keys, in one statement: retention deletes
    // a published delivery and writes its mark in one transaction, and no
    // lock here keeps it from committing meanwhile (it locks the deleted
    // rows, this the targets' partitions), so one snapshot sees either.
    let published: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT d.route, d.key, d.seq FROM ferry.deliveries d
          WHERE d.seq > $1 AND d.state = 'published' AND d.key = ANY($2::text[])
         UNION ALL
         SELECT d.route, d.key, d.seq FROM ferry.deliveries d
           JOIN unnest($3::bigint[], $4::text[]) AS w(seq, route) ON d.seq = w.seq AND d.route = w.route
          WHERE d.state = 'published'
         UNION ALL
         SELECT d.route, d.key, d.seq FROM ferry.deliveries d
          WHERE d.seq = ANY($5::bigint[]) AND d.state = 'published' AND d.key IS NOT NULL
         UNION ALL
         SELECT m.route, m.key, m.seq FROM ferry.purged_order m WHERE m.key = ANY($2::text[])",
    )
    .persistent(false)
    .bind(facts.events_upto)
    .bind(&keys)
    .bind(&watched_seqs)
    .bind(&watched_routes)
    .bind(&routed)
    .fetch_all(&mut *tx)
    .await
    .map_err(store_error)?;
    facts.note_published(published);
    Ok(())
}

/// A type glob as a regex over `'.' || type`: each segment is `\.name`,
/// `*` is one segment, `**` any number of them.
fn glob_regex(glob: &Glob) -> String {
    let mut re = String::from("^");
    for seg in glob.as_str().split('.') {
        match seg {
            "**" => re.push_str("(\\.[^.]+)*"),
            "*" => re.push_str("\\.[^.]+"),
            // Glob allows only [a-z0-9_-] here: nothing to escape.
            name => {
                re.push_str("\\.");
                re.push_str(name);
            }
        }
    }
    re.push('$');
    re
}

fn bind_filter<'q>(query: PgQuery<'q>, f: &'q Filter) -> PgQuery<'q> {
    let ids: Vec<Uuid> = f.ids.iter().map(|id| id.0).collect();
    let states: Vec<&str> = f.states.iter().map(|s| s.as_str()).collect();
    query
        .bind(ids)
        .bind(states)
        .bind(f.route.as_deref())
        .bind(f.type_glob.as_ref().map(glob_regex))
        .bind(f.key.as_deref())
        .bind(f.since)
        .bind(f.until)
        .bind(f.error.as_deref())
}

fn attempts(row: &PgRow, index: &str) -> u32 {
    row.get::<i32, _>(index).max(0) as u32
}

fn state(row: &PgRow) -> Result<AdminState, StoreError> {
    AdminState::of(row.get::<&str, _>("state"), row.get("attempts"))
}

fn target(row: &PgRow) -> Result<Target, StoreError> {
    Ok(Target {
        event_id: EventId(row.get("id")),
        seq: row.get("seq"),
        route: row.get("route"),
        event_type: row.get("type"),
        key: row.get("key"),
        state: state(row)?,
    })
}

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A page of the deliveries `filter` selects, in (seq, route) order.
fn list_sql(filter: &Filter) -> String {
    let stored = StoredStates::of(&filter.states).condition();
    format!(
        "SELECT e.id, d.seq, e.type, e.key, d.route, d.state, d.attempts, e.created_at, d.updated_at,
                d.next_attempt_at, d.last_error, d.published_at
           FROM ferry.deliveries d JOIN ferry.events e ON e.seq = d.seq
          WHERE {FILTER}{stored}
            AND ($9::bigint IS NULL OR (d.seq, d.route) > ($9, $10::text))
          ORDER BY d.seq, d.route
          LIMIT $11"
    )
}

/// [`list_sql`] (or a statement with its parameters) with its parameters
/// bound; one row more than the page, to tell whether another follows.
fn list_query<'q>(sql: String, filter: &'q Filter, page: &'q Page) -> PgQuery<'q> {
    // Unprepared: planned for this filter's values, which decide the index.
    bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)).persistent(false), filter)
        .bind(page.after.as_ref().map(|c| c.seq))
        .bind(page.after.as_ref().map(|c| c.route.as_str()))
        .bind(page.limit.max(1) as i64 + 1)
}

/// Every delivery `selection` selects, with why `action` may not touch it,
/// and for a requeue why it would break its key's order.
fn plan_sql(action: &Action, selection: &Filter) -> String {
    let (refusal, in_flight, order) = match action {
        Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => (requeue_refusal("$9"), in_flight_after(), "ASC"),
        // Later deliveries of a key first: while the earlier failure
        // still holds them back, no relay can be publishing them.
        Action::Cancel { .. } => (cancel_refusal(), "NULL::text".to_owned(), "DESC"),
    };
    let stored = StoredStates::of(&selection.states).condition();
    format!(
        "SELECT e.id, d.seq, e.type, e.key, d.route, d.state, d.attempts, {refusal} AS refusal,
                {in_flight} AS in_flight
           FROM ferry.deliveries d JOIN ferry.events e ON e.seq = d.seq
          WHERE {FILTER}{stored}
          ORDER BY d.seq {order}, d.route"
    )
}

/// [`LastPublished`] for `targets`, for a requeue.
async fn last_published<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    action: &Action,
    targets: &[&Target],
) -> Result<LastPublished, StoreError> {
    let Some(wanted) = LastPublished::wanted(targets.iter().copied()).filter(|_| action.is_requeue()) else {
        return Ok(LastPublished::default());
    };
    // Unprepared: planned for this `after`, which decides between reading
    // the deliveries after it by their seq and reading them all.
    // The targets themselves are left out: requeued together, in outbox
    // order, a key's published deliveries are replayed in that order.
    // Retention's order marks count as published deliveries: each stands
    // for later ones of its key that were published and then deleted.
    let (seqs, target_routes): (Vec<i64>, Vec<&str>) = targets.iter().map(|t| (t.seq, t.route.as_str())).unzip();
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT l.route, l.key, max(l.seq)
           FROM ferry.deliveries l
          WHERE l.seq > $3 AND l.state = 'published'
            AND ((l.route, l.key) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                 OR l.key = ANY($6::text[]))
            AND (l.seq, l.route) NOT IN (SELECT * FROM unnest($4::bigint[], $5::text[]))
          GROUP BY l.route, l.key
         UNION ALL
         SELECT m.route, m.key, m.seq
           FROM ferry.purged_order m
          WHERE m.seq > $3
            AND ((m.route, m.key) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                 OR m.key = ANY($6::text[]))",
    )
    .persistent(false)
    .bind(wanted.routes)
    .bind(wanted.keys)
    .bind(wanted.after)
    .bind(&seqs)
    .bind(&target_routes)
    .bind(wanted.any_route)
    .fetch_all(executor)
    .await
    .map_err(store_error)?;
    Ok(LastPublished::new(rows).with_targets(targets.iter().copied()))
}

/// [`plan_sql`] (or a statement with its parameters) with its parameters
/// bound.
fn plan_query<'q>(sql: String, action: &Action, selection: &'q Filter) -> PgQuery<'q> {
    let query = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)).persistent(false), selection);
    if action.is_requeue() {
        query.bind(action.includes_published())
    } else {
        query
    }
}

#[async_trait]
impl Admin for PgStore {
    async fn status(&self) -> Result<StatusReport, StoreError> {
        PgStore::status(self).await
    }

    async fn list(&self, filter: &Filter, page: &Page) -> Result<ListPage, StoreError> {
        let limit = page.limit.max(1);
        let rows = list_query(list_sql(filter), filter, page)
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in rows.iter().take(limit) {
            let state = state(row)?;
            let pending = matches!(state, AdminState::Pending | AdminState::Retrying);
            deliveries.push(DeliverySummary {
                event_id: EventId(row.get("id")),
                seq: row.get("seq"),
                event_type: row.get("type"),
                key: row.get("key"),
                route: row.get("route"),
                state,
                attempts: attempts(row, "attempts"),
                created_at: row.get("created_at"),
                updated_at: row.get("updated_at"),
                next_attempt_at: pending.then(|| row.get("next_attempt_at")),
                last_error: row.get("last_error"),
                published_at: row.get("published_at"),
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
        let rows = plan_query(plan_sql(action, selection), action, selection)
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        let mut planned = Vec::with_capacity(rows.len());
        for row in &rows {
            let refusal: Option<String> = row.get("refusal");
            let in_flight: Option<String> = row.get("in_flight");
            planned.push((target(row)?, refusal, in_flight));
        }
        let eligible: Vec<&Target> = planned.iter().filter(|p| p.1.is_none()).map(|p| &p.0).collect();
        let published = last_published(self.pool(), action, &eligible).await?;
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
        let seqs: Vec<i64> = targets.iter().map(|t| t.seq).collect();
        let routes: Vec<&str> = targets.iter().map(|t| t.route.as_str()).collect();
        let planned: Vec<&str> = targets.iter().map(|t| t.state.as_str()).collect();
        // Read before the locks, so relays' lease renewals do not wait for
        // it (see OrderFacts).
        let mut order = if action.is_requeue() {
            Some(read_order_facts(self.pool(), action, targets).await?)
        } else {
            None
        };
        let mut tx = self.pool().begin().await.map_err(store_error)?;
        // Relays record outcomes (and settle what they publish straight
        // from the outbox) under a share lock on their partition rows, and
        // all of a key's events share one partition. Taken in partition
        // order, as relay_tick does, so two operators cannot deadlock on
        // each other. Every statement after this one sees each outcome in
        // these partitions committed before the lock was granted, and none
        // after: a cancel's check and its change see one state, and so do
        // a requeue's catching up on what its keys published and its
        // change, which otherwise could miss a later event published
        // between the two. Held briefly: what runs under it reads by index.
        sqlx::query(
            "SELECT 1 FROM ferry.partitions p
              WHERE p.partition IN (SELECT d.partition FROM ferry.deliveries d
                                      JOIN unnest($1::bigint[], $2::text[]) AS t(seq, route)
                                        ON d.seq = t.seq AND d.route = t.route)
              ORDER BY p.partition FOR NO KEY UPDATE",
        )
        .persistent(false)
        .bind(&seqs)
        .bind(&routes)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        if let Some(order) = &mut order {
            catch_up(order, &mut tx).await?;
        }
        let none = LastPublished::default();
        let published = order.as_ref().map_or(&none, |o| &o.published);
        let touched = |t: &Target| order.as_ref().is_some_and(|o| o.touched(t));
        // The targets a later event of their key waits unrouted after.
        let later_unrouted = |ts: &[&Target]| -> Vec<i64> {
            ts.iter()
                .filter(|t| order.as_ref().is_some_and(|o| o.later_unrouted(t)))
                .map(|t| t.seq)
                .collect()
        };
        // A key another requeue touched meanwhile is left alone, as one a
        // later event of was published after.
        let (late_seqs, late_routes): (Vec<i64>, Vec<&str>) = targets
            .iter()
            .filter(|t| published.after(t) || touched(t))
            .map(|t| (t.seq, t.route.as_str()))
            .unzip();
        let changed: Vec<(i64, String, String, i32)> = match action {
            Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => {
                sqlx::query_as(sqlx::AssertSqlSafe(requeue_sql()))
                    .persistent(false)
                    .bind(&seqs)
                    .bind(&routes)
                    .bind(action.includes_published())
                    .bind(actor)
                    .bind(NO_ROUTE)
                    .bind(&planned)
                    .bind(action.allows_out_of_order())
                    .bind(&late_seqs)
                    .bind(&late_routes)
                    .bind(later_unrouted(&targets.iter().collect::<Vec<_>>()))
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(store_error)?
            }
            Action::Cancel { reason } => {
                let cancelled: Vec<(i64, String, String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(cancel_sql()))
                    .persistent(false)
                    .bind(&seqs)
                    .bind(&routes)
                    .bind(actor)
                    .bind(reason)
                    .bind(&planned)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(store_error)?;
                // A lapsed lease let the cancel through, but its holder may
                // still be publishing and come back with an outcome, which
                // its owner and token would let overwrite whatever the
                // operator does next (a requeue). Revoke it: any relay
                // takes the partition anew, under a new token.
                let (seqs, routes): (Vec<i64>, Vec<&str>) =
                    cancelled.iter().map(|(seq, route, ..)| (*seq, route.as_str())).unzip();
                sqlx::query(
                    "UPDATE ferry.partitions p SET owner = NULL, expires_at = NULL, token = p.token + 1
                      WHERE p.owner IS NOT NULL AND p.expires_at <= clock_timestamp()
                        AND p.partition IN (SELECT d.partition FROM ferry.deliveries d
                                              JOIN unnest($1::bigint[], $2::text[]) AS t(seq, route)
                                                ON d.seq = t.seq AND d.route = t.route)",
                )
                .persistent(false)
                .bind(&seqs)
                .bind(&routes)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?;
                cancelled
            }
        };
        // Wakes sleeping relays at commit: requeued deliveries are due, and
        // a cancelled one no longer holds its key's later events back (and
        // events going back to the router are unrouted again).
        sqlx::query(
            "SELECT pg_notify('ferry', 'due:' || p)
               FROM (SELECT u.partition AS p FROM ferry.unrouted u WHERE u.seq = ANY($1)
                     UNION
                     SELECT d.partition FROM ferry.deliveries d WHERE d.seq = ANY($1)) x",
        )
        .persistent(false)
        .bind(&seqs)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        let mut applied = Applied::default();
        let mut done = HashSet::new();
        for (seq, route, from_state, attempts) in changed {
            done.insert((seq, route.clone()));
            if let Some(t) = targets.iter().find(|t| t.seq == seq && t.route == route) {
                applied.changed.push(Target {
                    state: AdminState::of(&from_state, attempts)?,
                    ..t.clone()
                });
            }
        }
        let missed: Vec<&Target> = targets
            .iter()
            .filter(|t| !done.contains(&(t.seq, t.route.clone())))
            .collect();
        if !missed.is_empty() {
            // Say why, from the state as it is now, inside this transaction.
            let (refusal, in_flight) = match action {
                Action::Requeue { .. } | Action::RequeueOutOfOrder { .. } => {
                    (requeue_refusal("$3"), in_flight_after_known("$4"))
                }
                Action::Cancel { .. } => (cancel_refusal(), "NULL::text".to_owned()),
            };
            let sql = format!(
                "SELECT d.seq, d.route, d.state, d.attempts, {refusal} AS refusal, {in_flight} AS in_flight
                   FROM ferry.deliveries d
                   JOIN unnest($1::bigint[], $2::text[]) AS t(seq, route) ON d.seq = t.seq AND d.route = t.route"
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
                .persistent(false)
                .bind(missed.iter().map(|t| t.seq).collect::<Vec<_>>())
                .bind(missed.iter().map(|t| t.route.as_str()).collect::<Vec<_>>());
            if action.is_requeue() {
                query = query.bind(action.includes_published()).bind(later_unrouted(&missed));
            }
            let rows = query.fetch_all(&mut *tx).await.map_err(store_error)?;
            for t in missed {
                let row = rows
                    .iter()
                    .find(|r| r.get::<i64, _>("seq") == t.seq && r.get::<&str, _>("route") == t.route);
                let (state, reason) = match row {
                    None => (t.state, "gone: deleted since it was selected".to_owned()),
                    Some(r) => {
                        let now = state(r)?;
                        let reason = if now != t.state {
                            crate::admin::changed_since(t.state, now)
                        } else if touched(t) {
                            REQUEUED_MEANWHILE.to_owned()
                        } else {
                            let out_of_order = out_of_order(t, published, r.get("in_flight"))
                                .filter(|_| !action.allows_out_of_order());
                            r.get::<Option<String>, _>("refusal")
                                .or(out_of_order)
                                .unwrap_or_else(|| "changed while this ran; run the command again".into())
                        };
                        (now, reason)
                    }
                };
                applied.refused.push(Refusal {
                    target: Target { state, ..t.clone() },
                    reason,
                });
            }
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
               FROM ferry.deliveries d JOIN ferry.events e ON e.seq = d.seq
              WHERE (d.updated_at > $1 OR (d.updated_at = $1 AND (d.seq, d.route) > ($3, $4)))
                AND NOT (d.state = 'pending' AND d.attempts = 0)
              ORDER BY d.updated_at, d.seq, d.route
              LIMIT $2",
        )
        .bind(since)
        .bind(limit as i64)
        .bind(after.map(|a| a.0))
        .bind(after.map(|a| a.1))
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        rows.iter()
            .map(|row| {
                Ok(Change {
                    event_id: EventId(row.get("id")),
                    seq: row.get("seq"),
                    route: row.get("route"),
                    event_type: row.get("type"),
                    key: row.get("key"),
                    state: state(row)?,
                    attempts: attempts(row, "attempts"),
                    created_at: row.get("created_at"),
                    updated_at: row.get("updated_at"),
                    published_at: row.get("published_at"),
                    last_error: row.get("last_error"),
                })
            })
            .collect()
    }
}

/// Requeues in one statement: deliveries of a route go back to pending with
/// a fresh attempt count; `(no route)` deliveries go back to the router, so
/// a route added since can take them. Both are logged.
/// A delivery changed since it was planned is left alone, and so is one
/// that would break its key's order unless $7 allows it: one a later event
/// of its key may be in flight after (on any route, for `(no route)`),
/// judged by the state before the statement (a dead head requeued with the
/// dead deliveries of its key after it still held them back then), or one
/// in $8 and $9, after which a later event of its key was published.
/// $1 seqs, $2 routes, $3 include published, $4 actor, $5 the no-route name,
/// $6 the states when planned, $7 out of order allowed, $8 and $9 the seqs
/// and routes of those a later event of their key was published after,
/// $10 the seqs of those a later event of their key waits unrouted after.
fn requeue_sql() -> String {
    format!(
        "
WITH t AS (
    SELECT d.seq, d.route, d.state, d.attempts, x.planned, {} AS in_flight
      FROM ferry.deliveries d
      JOIN unnest($1::bigint[], $2::text[], $6::text[]) AS x(seq, route, planned)
        ON d.seq = x.seq AND d.route = x.route
), again AS (
    UPDATE ferry.deliveries d
       SET state = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL,
           published_at = NULL, updated_at = now()
      FROM t
     WHERE d.seq = t.seq AND d.route = t.route AND d.route <> $5
       AND (d.state IN ('dead', 'cancelled') OR (d.state = 'published' AND $3::bool))
       AND d.state = t.planned
       AND ($7::bool OR (t.in_flight IS NULL
                         AND NOT EXISTS (SELECT 1 FROM unnest($8::bigint[], $9::text[]) AS p(seq, route)
                                          WHERE p.seq = t.seq AND p.route = t.route)))
    RETURNING d.seq, d.route, t.state, t.attempts
), rerouted AS (
    DELETE FROM ferry.deliveries d
     USING t
     WHERE d.seq = t.seq AND d.route = t.route AND d.route = $5 AND d.state IN ('dead', 'cancelled')
       AND d.state = t.planned
       AND ($7::bool OR (t.in_flight IS NULL
                         AND NOT EXISTS (SELECT 1 FROM unnest($8::bigint[], $9::text[]) AS p(seq, route)
                                          WHERE p.seq = t.seq AND p.route = t.route)))
    RETURNING d.seq, d.route, d.partition, d.state, d.attempts
), unrouted AS (
    INSERT INTO ferry.unrouted (seq, partition)
    SELECT DISTINCT r.seq, r.partition FROM rerouted r
    ON CONFLICT (seq) DO NOTHING
), logged AS (
    INSERT INTO ferry.admin_log (seq, route, actor, action, from_state, attempts)
    SELECT c.seq, c.route, $4, 'requeue', c.state, c.attempts
      FROM (SELECT seq, route, state, attempts FROM again
            UNION ALL SELECT seq, route, state, attempts FROM rerouted) c
)
SELECT seq, route, state, attempts FROM again
UNION ALL SELECT seq, route, state, attempts FROM rerouted",
        in_flight_after_known("$10")
    )
}

/// Cancels in one statement what is still eligible and unchanged since it
/// was planned, and logs it.
/// $1 seqs, $2 routes, $3 actor, $4 reason, $5 the states when planned.
fn cancel_sql() -> String {
    format!(
        "WITH t AS (
             SELECT o.seq, o.route, o.state, o.attempts, x.planned
               FROM ferry.deliveries o
               JOIN unnest($1::bigint[], $2::text[], $5::text[]) AS x(seq, route, planned)
                 ON o.seq = x.seq AND o.route = x.route
         ), gone AS (
             UPDATE ferry.deliveries d
                SET state = 'cancelled', updated_at = now()
               FROM t
              WHERE d.seq = t.seq AND d.route = t.route
                AND d.state IN ('pending', 'dead')
                AND {ADMIN_STATE} = t.planned
                AND NOT ({MAYBE_IN_FLIGHT})
             RETURNING d.seq, d.route, t.state, t.attempts
         ), logged AS (
             INSERT INTO ferry.admin_log (seq, route, actor, action, from_state, attempts, reason)
             SELECT seq, route, $3, 'cancel', state, attempts, $4 FROM gone
         )
         SELECT seq, route, state, attempts FROM gone"
    )
}

async fn show(pool: &PgPool, id: EventId) -> Result<Option<EventView>, StoreError> {
    let Some(row) = sqlx::query(
        "SELECT e.seq, e.type, e.key, e.content_type, e.headers, e.payload, e.dispatch_key, e.created_at,
                EXISTS (SELECT 1 FROM ferry.unrouted u WHERE u.seq = e.seq) AS unrouted
           FROM ferry.events e WHERE e.id = $1",
    )
    .bind(id.0)
    .fetch_optional(pool)
    .await
    .map_err(store_error)?
    else {
        return Ok(None);
    };
    let seq: i64 = row.get("seq");
    let headers: BTreeMap<String, String> = serde_json::from_value(row.get("headers"))
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
        created_at: row.get("created_at"),
        unrouted: row.get("unrouted"),
        deliveries: Vec::new(),
    };
    let deliveries = sqlx::query(
        "SELECT route, state, attempts, next_attempt_at, last_error, published_at, updated_at
           FROM ferry.deliveries WHERE seq = $1 ORDER BY route",
    )
    .bind(seq)
    .fetch_all(pool)
    .await
    .map_err(store_error)?;
    let failures = sqlx::query("SELECT route, attempt, at, dead, error FROM ferry.failures WHERE seq = $1 ORDER BY id")
        .bind(seq)
        .fetch_all(pool)
        .await
        .map_err(store_error)?;
    let actions = sqlx::query(
        "SELECT route, at, actor, action, from_state, attempts, reason FROM ferry.admin_log
          WHERE seq = $1 ORDER BY id",
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
                    at: f.get("at"),
                    dead: f.get("dead"),
                    error: f.get("error"),
                })
                .collect(),
            actions: actions
                .iter()
                .filter(|a| a.get::<&str, _>("route") == route)
                .map(|a| {
                    Ok(ActionRecord {
                        at: a.get("at"),
                        actor: a.get("actor"),
                        action: a.get("action"),
                        from_state: AdminState::of(a.get("from_state"), a.get("attempts"))?,
                        reason: a.get("reason"),
                    })
                })
                .collect::<Result<_, StoreError>>()?,
            route,
            state,
            attempts: attempts(d, "attempts"),
            next_attempt_at: pending.then(|| d.get("next_attempt_at")),
            last_error: d.get("last_error"),
            published_at: d.get("published_at"),
            updated_at: d.get("updated_at"),
        });
    }
    Ok(Some(view))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_become_anchored_segment_regexes() {
        let re = |g: &str| glob_regex(&Glob::new(g).unwrap());
        assert_eq!(re("order.*"), "^\\.order\\.[^.]+$");
        assert_eq!(re("order.**"), "^\\.order(\\.[^.]+)*$");
        assert_eq!(re("**.created"), "^(\\.[^.]+)*\\.created$");
    }

    /// Every node of a JSON plan outside its subplans.
    fn main_nodes<'a>(node: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        if matches!(node["Parent Relationship"].as_str(), Some("SubPlan" | "InitPlan")) {
            return;
        }
        out.push(node);
        for child in node["Plans"].as_array().into_iter().flatten() {
            main_nodes(child, out);
        }
    }

    /// An operator listing, requeueing or cancelling failed deliveries during
    /// an incident reads those deliveries through their partial index, not
    /// every delivery of the outbox's history (which took a quarter to half a
    /// second per page over two million).
    #[tokio::test]
    async fn a_state_filter_reads_its_partial_index_not_the_history() {
        let db = ferry_testkit::pg::TestDb::create().await;
        let pool = db.pool().await;
        crate::postgres::migrate(&mut pool.acquire().await.unwrap())
            .await
            .unwrap();
        sqlx::raw_sql(
            "INSERT INTO ferry.events (id, type, key, partition, payload)
             SELECT gen_random_uuid(), 'order.item.created', 'k-' || (i % 100), i % 32, '{}'
               FROM generate_series(1, 20000) i;
             INSERT INTO ferry.deliveries (seq, route, partition, key, state, attempts, last_error)
             SELECT seq, 'orders', partition, key,
                    CASE WHEN seq % 1000 = 7 THEN 'dead' WHEN seq % 1000 = 9 THEN 'cancelled'
                         WHEN seq % 1000 IN (3, 5) THEN 'pending' ELSE 'published' END,
                    CASE WHEN seq % 1000 = 5 THEN 0 ELSE 2 END,
                    CASE WHEN seq % 1000 IN (3, 7) THEN 'broker said no' END
               FROM ferry.events;
             ANALYZE ferry.events, ferry.deliveries",
        )
        .execute(&pool)
        .await
        .unwrap();
        let (filters, actions) = crate::admin::partial_index_cases("orders");
        for (filter, index) in filters {
            let page = Page { after: None, limit: 50 };
            let mut statements = vec![(
                "list",
                list_query(format!("EXPLAIN (FORMAT JSON) {}", list_sql(&filter)), &filter, &page),
            )];
            for action in &actions {
                let sql = format!("EXPLAIN (FORMAT JSON) {}", plan_sql(action, &filter));
                statements.push((action.verb(), plan_query(sql, action, &filter)));
            }
            for (name, query) in statements {
                let plan: serde_json::Value = query.fetch_one(&pool).await.unwrap().get(0);
                let mut nodes = Vec::new();
                main_nodes(&plan[0]["Plan"], &mut nodes);
                let wrong: Vec<_> = nodes
                    .iter()
                    .filter(|n| {
                        (n["Relation Name"] == "deliveries" && n["Node Type"] == "Seq Scan")
                            || n["Index Name"]
                                .as_str()
                                .is_some_and(|i| i.starts_with("deliveries") && i != index)
                    })
                    .collect();
                assert!(wrong.is_empty(), "{name} {filter:?}: {wrong:#?} in {plan:#}");
                assert!(
                    nodes.iter().any(|n| n["Index Name"] == index),
                    "{name} {filter:?}: {index} unused in {plan:#}"
                );
            }
        }
        pool.close().await;
        db.drop_db().await;
    }
}
