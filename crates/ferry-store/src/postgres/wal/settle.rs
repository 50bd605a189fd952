//! The writes of WAL streaming mode: what a streamed batch may publish
//! directly ([`WalSource::look`]), and the delivery rows that record what
//! happened to it ([`WalSource::settle`]).

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use ferry_core::StoreError;
use sqlx::{Connection, Row};

use super::gone::{lost, unconnected};
use super::{WalEvent, WalSource};
use crate::postgres::direct::{self, Conflicts, SettleMode};
use crate::postgres::store_error;

/// What the delivery table says about a streamed batch.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Look {
    /// Outbox rows of the batch not routed yet: the stream may deliver
    /// them. Any other row was routed before (a replay after a crash, or a
    /// relay's start-up sweep) and is skipped.
    pub unrouted: HashSet<i64>,
    /// Routes with pending deliveries in the table (failed and waiting, or
    /// parked): their new events queue behind those, in the table.
    pub busy_routes: HashSet<String>,
    /// (route, key) pairs held by a dead delivery: later events of the key
    /// wait behind it, in the table, as on the table path.
    pub dead_keys: HashSet<(String, String)>,
    /// Transactions of the batch that committed but are not visible yet:
    /// `unrouted` says nothing about their rows until they are.
    pub invisible: HashSet<u32>,
}

/// What happened to one event on one route.
pub use ferry_core::DirectOutcome as Outcome;

/// A streamed batch's outcomes, to be written before its position is
/// confirmed to the slot.
#[derive(Debug, Default)]
pub struct Settlement<'a> {
    /// (event, route, outcome); the route is [`NO_ROUTE`] for an event that
    /// matched none.
    pub outcomes: Vec<(&'a WalEvent, String, Outcome)>,
    /// The stream position through which this settlement completes the
    /// slot's transactions (the position the relay confirms after it).
    /// Recorded with the outcomes when they include tableless events, so
    /// that the next session starts after them even when a crash of the
    /// server took the slot's position back.
    pub through: u64,
    /// The slot record's generation when the stream opened
    /// ([`WalStream::generation`](super::WalStream::generation)). The
    /// position is recorded only while it is still that generation: a
    /// settle that outlived its slot (lost and replaced, or gone with a
    /// failover) must not set the new slot's start to a position of the
    /// old one, which on a promoted server can lie ahead of transactions
    /// the new slot has yet to stream.
    pub generation: i64,
    /// When the settlement ends inside a large transaction: its commit
    /// position ([`WalTxn::commit_lsn`](super::WalTxn::commit_lsn)) and how
    /// many of its events are settled ([`WalTxn::read`](super::WalTxn::read)).
    /// Recorded as `through` is, so that a replay of the transaction after
    /// a restart skips those events rather than publish its tableless ones
    /// again.
    pub part: Option<(u64, u64)>,
}

/// What a settlement wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Outbox rows taken out of `unrouted` by this settlement.
    pub routed: u64,
    /// Tableless events written to the outbox because a delivery failed.
    pub written: u64,
    /// Delivery rows created.
    pub deliveries: u64,
}

impl WalSource {
    /// Which of `seqs` are still unrouted, which of `routes` have pending
    /// deliveries, and which of `keys` are held by a dead delivery on one of
    /// `routes`, and which of `xids` are not visible yet. One round trip.
    /// A failure saying the server is going away or cannot be reached is
    /// told by [`unreachable`](super::unreachable).
    pub async fn look(
        &self,
        seqs: &[i64],
        routes: &[String],
        keys: &[String],
        xids: &[u32],
    ) -> Result<Look, StoreError> {
        let xids: Vec<i64> = xids.iter().map(|x| i64::from(*x)).collect();
        let mut conn = self.pool.acquire().await.map_err(unconnected)?;
        let rows = sqlx::query(include_str!("look.sql"))
            .bind(seqs)
            .bind(routes)
            .bind(keys)
            .bind(&xids)
            .fetch_all(&mut *conn)
            .await
            .map_err(lost)?;
        let mut look = Look::default();
        for row in rows {
            let kind: i32 = row.get(0);
            match kind {
                0 => {
                    look.unrouted.insert(row.get::<i64, _>(1));
                }
                1 => {
                    look.busy_routes.insert(row.get::<String, _>(2));
                }
                3 => {
                    look.invisible.insert(row.get::<i64, _>(1) as u32);
                }
                _ => {
                    look.dead_keys
                        .insert((row.get::<String, _>(2), row.get::<String, _>(3)));
                }
            }
        }
        Ok(look)
    }

    /// Up to `limit` events still unrouted, oldest first: at start, the ones
    /// committed before the slot existed or streamed but never settled. Each
    /// event is looked up by its seq, so that no plan merge-joins the few
    /// unrouted rows with the outbox's whole history (see claim.sql).
    pub async fn unrouted(&self, limit: i64) -> Result<Vec<WalEvent>, StoreError> {
        self.events_of(
            sqlx::query(
                "SELECT e.seq, e.id, e.type, e.key, e.partition, e.payload, e.content_type, e.headers, e.created_at \
                   FROM (SELECT u.seq FROM ferry.unrouted u ORDER BY u.seq LIMIT $1) u \
                  CROSS JOIN LATERAL (SELECT * FROM ferry.events e WHERE e.seq = u.seq LIMIT 1) e \
                  ORDER BY u.seq",
            )
            .bind(limit),
        )
        .await
    }

    /// Up to `limit` events an operator requeued after they were dead with
    /// no route, oldest first. A requeue puts such an event back into
    /// `unrouted` for a router, but the stream brought its row long ago and
    /// never brings it again: a relay in WAL mode takes these into the table
    /// path itself. Found through the requeue's `admin_log` entry, which
    /// nothing else leaves for an unrouted event.
    pub async fn requeued(&self, limit: i64) -> Result<Vec<WalEvent>, StoreError> {
        self.events_of(
            sqlx::query(
                "SELECT e.seq, e.id, e.type, e.key, e.partition, e.payload, e.content_type, e.headers, e.created_at \
                   FROM (SELECT u.seq FROM ferry.unrouted u \
                          WHERE u.seq IN (SELECT a.seq FROM ferry.admin_log a \
                                           WHERE a.action = 'requeue' AND a.route = $2) \
                          ORDER BY u.seq LIMIT $1) u \
                  CROSS JOIN LATERAL (SELECT * FROM ferry.events e WHERE e.seq = u.seq LIMIT 1) e \
                  ORDER BY u.seq",
            )
            .bind(limit)
            .bind(ferry_core::NO_ROUTE),
        )
        .await
    }

    pub(super) async fn events_of(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<WalEvent>, StoreError> {
        let rows = query.fetch_all(&self.pool).await.map_err(store_error)?;
        rows.into_iter()
            .map(|r| {
                let headers: sqlx::types::Json<ferry_core::Headers> = r.try_get(7).map_err(store_error)?;
                Ok(WalEvent {
                    event: ferry_core::StoredEvent {
                        seq: r.try_get(0).map_err(store_error)?,
                        id: ferry_core::EventId(r.try_get(1).map_err(store_error)?),
                        event_type: r.try_get(2).map_err(store_error)?,
                        key: r.try_get(3).map_err(store_error)?,
                        payload: bytes::Bytes::from(r.try_get::<Vec<u8>, _>(5).map_err(store_error)?),
                        content_type: r.try_get(6).map_err(store_error)?,
                        headers: headers.0,
                        created_at: r.try_get(8).map_err(store_error)?,
                    },
                    partition: Some(r.try_get(4).map_err(store_error)?),
                    undecodable: None,
                })
            })
            .collect()
    }

    /// Writes the outcomes in one transaction, committed durably (the slot
    /// position is confirmed right after), with the position they settle
    /// through ([`Settlement::through`]): delivery rows for every outbox
    /// row still unrouted, and for tableless events that need the table (a
    /// delivery that did not publish), the event itself first. Partitions
    /// that received pending deliveries are notified, so the relays leasing
    /// them claim at once. A failure saying the server is going away or
    /// cannot be reached is told by [`unreachable`](super::unreachable).
    pub async fn settle(&self, s: &Settlement<'_>, now: DateTime<Utc>) -> Result<Settled, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(unconnected)?;
        let mut tx = conn.begin().await.map_err(lost)?;
        let mut settled = Settled::default();
        // Tableless events some route could not publish: written to the
        // outbox (and `unrouted`, which the statement below takes them out
        // of again) with the seq ferry._emit reserved, so their order
        // against the rest of the outbox is commit order whatever the order
        // of the outcomes. A replay finds the id taken and writes nothing
        // twice.
        let mut seq_of: HashMap<uuid::Uuid, i64> = HashMap::new();
        let mut tableless: Vec<&WalEvent> = Vec::new();
        for (e, _, outcome) in &s.outcomes {
            if e.tableless() && !matches!(outcome, Outcome::Published { .. }) && !seq_of.contains_key(&e.event.id.0) {
                seq_of.insert(e.event.id.0, 0);
                tableless.push(e);
            }
        }
        if !tableless.is_empty() {
            let rows = sqlx::query(include_str!("write_tableless.sql"))
                .bind(tableless.iter().map(|e| e.event.id.0).collect::<Vec<_>>())
                .bind(tableless.iter().map(|e| e.event.event_type.clone()).collect::<Vec<_>>())
                .bind(tableless.iter().map(|e| e.event.key.clone()).collect::<Vec<_>>())
                .bind(tableless.iter().map(|e| e.event.payload.to_vec()).collect::<Vec<_>>())
                .bind(
                    tableless
                        .iter()
                        .map(|e| e.event.content_type.clone())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    tableless
                        .iter()
                        .map(|e| serde_json::to_value(&e.event.headers).expect("string map serialises"))
                        .collect::<Vec<_>>(),
                )
                .bind(tableless.iter().map(|e| e.event.created_at).collect::<Vec<_>>())
                .bind(tableless.iter().map(|e| e.reserved_seq()).collect::<Vec<_>>())
                .fetch_all(&mut *tx)
                .await
                .map_err(lost)?;
            seq_of.clear();
            for row in rows {
                seq_of.insert(row.get(0), row.get(1));
            }
            settled.written = seq_of.len() as u64;
        }
        let mut claim: Vec<i64> = Vec::new();
        let mut claimed: HashSet<i64> = HashSet::new();
        let mut rows = Vec::with_capacity(s.outcomes.len());
        for (e, route, outcome) in &s.outcomes {
            let seq = if e.tableless() {
                match seq_of.get(&e.event.id.0) {
                    Some(seq) => *seq,
                    // Published, or written by an earlier run: nothing to add.
                    None => continue,
                }
            } else {
                e.event.seq
            };
            if claimed.insert(seq) {
                claim.push(seq);
            }
            rows.push((seq, route.as_str(), e.event.key.as_deref(), outcome));
        }
        if !claim.is_empty() {
            let mode = SettleMode {
                fence: None,
                notify: true,
                durable: true,
                // In a transaction, which a failed statement would abort.
                conflicts: Conflicts::Skip,
            };
            let rows = direct::Deliveries::new(rows.into_iter(), now);
            let written = direct::settle(&mut *tx, &claim, &rows, mode).await.map_err(lost)?;
            settled.routed = written.gone.saturating_sub(settled.written);
            settled.deliveries = written.made;
        }
        // A replay skips the outbox rows settled here (they are no longer
        // unrouted) but has nothing to tell tableless events by: for those,
        // the position is recorded. Batches of outbox rows only spare their
        // settle the statement.
        //
        // Both positions only move forward: a settle that comes late (from
        // a relay that lost the stream meanwhile) must not take them back.
        // There is one part record, so one that moves on to a later
        // transaction first moves the start past the transaction it named:
        // settles come in stream order, so that one is settled whole, and
        // if its last part held only outbox rows nothing else recorded it.
        // Without that, a replay after a server crash would stream it again
        // with no record of its settled part and publish its tableless
        // events twice.
        //
        // The position is confirmed to the server right after: it must be
        // on disk first even where commits default to asynchronous, or a
        // server crash takes it back with the slot's and the tableless
        // events of a batch that wrote no row (all published) go again.
        // A settle that wrote rows made its commit durable already.
        if (s.through > 0 || s.part.is_some()) && s.outcomes.iter().any(|(e, _, _)| e.tableless()) {
            let (part_lsn, part_events) = s.part.unzip();
            sqlx::query(
                "UPDATE ferry.wal_slots \
                    SET settled_lsn = greatest(settled_lsn, nullif($2, 0), \
                                               CASE WHEN part_lsn < coalesce($4, $2) THEN part_lsn + 1 END), \
                        part_lsn = CASE WHEN ($4, $5) > (coalesce(part_lsn, 0), coalesce(part_events, 0)) \
                                        THEN $4 ELSE part_lsn END, \
                        part_events = CASE WHEN ($4, $5) > (coalesce(part_lsn, 0), coalesce(part_events, 0)) \
                                           THEN $5 ELSE part_events END \
                   FROM (SELECT CASE WHEN current_setting('synchronous_commit') = 'off' \
                                     THEN set_config('synchronous_commit', 'local', true) END) durable \
                  WHERE slot = $1 AND generation = $3",
            )
            .bind(&self.config.slot)
            // The same 64 bits: WAL positions stay far below 2^63.
            .bind(s.through as i64)
            .bind(s.generation)
            .bind(part_lsn.map(|l| l as i64))
            .bind(part_events.map(|n| n as i64))
            .execute(&mut *tx)
            .await
            .map_err(lost)?;
        }
        tx.commit().await.map_err(lost)?;
        Ok(settled)
    }
}
