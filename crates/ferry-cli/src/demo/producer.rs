//! The demo's producer: a shop that writes each order change and its event
//! in one SQLite transaction, as a real service would. Some transactions
//! roll back on purpose (their events must never be sent) and one order is
//! malformed (its event is refused by the receiver and ends dead).

use std::collections::HashSet;
use std::time::Duration;

use ferry_core::Event;
use ferry_store::sqlite::enqueue;
use serde_json::json;
use sqlx::SqlitePool;

/// Every how many orders a checkout fails after writing its event, so the
/// transaction rolls back with it.
const ROLLBACK_EVERY: u64 = 17;
/// The order whose event the receiver refuses for good.
pub const POISON_ORDER: u64 = 13;

/// What the producer committed and what it rolled back.
#[derive(Debug, Default)]
pub struct Produced {
    pub committed_transactions: u64,
    pub rolled_back_transactions: u64,
    /// Ids of committed events.
    pub committed: HashSet<String>,
    /// Ids of events written in transactions that rolled back.
    pub rolled_back: HashSet<String>,
    /// Committed events that match the stdout route.
    pub refunds: u64,
}

pub async fn create_schema(pool: &SqlitePool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS shop_orders (
             id INTEGER PRIMARY KEY,
             total_cents INTEGER NOT NULL,
             state TEXT NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// One business change and its event.
struct Change {
    order: u64,
    step: u64,
}

impl Change {
    fn event_type(&self) -> &'static str {
        match self.step {
            1 => "shop.order.created",
            2 => "shop.order.paid",
            _ => "shop.order.refunded",
        }
    }

    fn state(&self) -> &'static str {
        match self.step {
            1 => "created",
            2 => "paid",
            _ => "refunded",
        }
    }
}

/// Writes `orders` orders: each is created; every third is paid two rounds
/// later; every tenth of those is refunded two rounds after that. Calls
/// `tick` after each transaction, and pauses `pace` between rounds so the
/// relay delivers while the shop is still busy.
pub async fn run(
    pool: &SqlitePool,
    orders: u64,
    pace: Duration,
    mut tick: impl FnMut(&Produced),
) -> anyhow::Result<Produced> {
    let mut out = Produced::default();
    let mut rolled_back_orders = HashSet::new();
    for round in 1..=orders + 4 {
        let mut changes = Vec::new();
        if round <= orders {
            changes.push(Change { order: round, step: 1 });
        }
        if let Some(o) = round.checked_sub(2).filter(|o| *o >= 1 && *o <= orders && o % 3 == 0) {
            changes.push(Change { order: o, step: 2 });
        }
        if let Some(o) = round.checked_sub(4).filter(|o| *o >= 1 && *o <= orders && o % 30 == 0) {
            changes.push(Change { order: o, step: 3 });
        }
        for change in changes {
            if rolled_back_orders.contains(&change.order) || (change.order == POISON_ORDER && change.step > 1) {
                continue;
            }
            let roll_back = change.step == 1 && change.order % ROLLBACK_EVERY == 0;
            let id = write(pool, &change, roll_back).await?;
            if roll_back {
                out.rolled_back_transactions += 1;
                out.rolled_back.insert(id);
                rolled_back_orders.insert(change.order);
            } else {
                out.committed_transactions += 1;
                out.committed.insert(id);
                if change.step == 3 {
                    out.refunds += 1;
                }
            }
            tick(&out);
        }
        tokio::time::sleep(pace).await;
    }
    Ok(out)
}

/// One transaction: the order row and its event; rolled back when asked,
/// as a failed checkout would be. Returns the event's id.
async fn write(pool: &SqlitePool, change: &Change, roll_back: bool) -> anyhow::Result<String> {
    let total_cents = if change.order == POISON_ORDER {
        -500
    } else {
        (change.order as i64 % 9 + 1) * 1250
    };
    // IMMEDIATE: SQLite's write lock up front, so the shop and the relay
    // queue for it instead of one failing with SQLITE_BUSY.
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    if change.step == 1 {
        sqlx::query("INSERT INTO shop_orders (id, total_cents, state) VALUES (?, ?, ?)")
            .bind(change.order as i64)
            .bind(total_cents)
            .bind(change.state())
            .execute(&mut *tx)
            .await?;
    } else {
        sqlx::query("UPDATE shop_orders SET state = ? WHERE id = ?")
            .bind(change.state())
            .bind(change.order as i64)
            .execute(&mut *tx)
            .await?;
    }
    let event = Event::new(
        change.event_type(),
        json!({ "order_id": change.order, "total_cents": total_cents, "step": change.step }),
    )
    .key(format!("order-{}", change.order));
    let sent = enqueue(&mut tx, event).await?;
    if roll_back {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(sent.id.to_string())
}
