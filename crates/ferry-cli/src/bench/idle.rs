//! Idle cost: the relay running with nothing to do, and the transactions it
//! costs the database per second, from `pg_stat_database` for the bench
//! database over a window.
//!
//! The counters are read from the admin database, so reading them adds
//! nothing to the bench database's count. PostgreSQL 15 has no
//! `pg_stat_force_next_flush()`, and a backend that commits less than a
//! second after its last flush keeps its counters for up to 10 s once idle;
//! hence a settle longer than that before the window (the relay's start-up
//! burst stays out of it) and a 1 s margin after it.

use std::time::Duration;

use tokio::time::{Instant, sleep};

use super::topology::{self, Topology};
use super::{Ctx, db, progress, relay};

/// Longer than PostgreSQL 15's idle stats flush delay (10 s).
const SETTLE: Duration = Duration::from_secs(11);
const MARGIN: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct IdleResult {
    pub window: Duration,
    pub transactions: i64,
}

impl IdleResult {
    pub(crate) fn per_second(&self) -> f64 {
        self.transactions as f64 / self.window.as_secs_f64().max(f64::EPSILON)
    }
}

pub(crate) async fn run(ctx: &Ctx<'_>) -> anyhow::Result<IdleResult> {
    topology::with_topology(ctx, "idle", async |t| measure(ctx, t).await).await
}

async fn measure(ctx: &Ctx<'_>, topology: &Topology) -> anyhow::Result<IdleResult> {
    let window = Duration::from_secs(ctx.args.idle_seconds);
    let mut admin = ctx.db.admin().await?;
    let relay = relay::start(ctx, topology.exchange(), "bench-idle", ctx.args.batch_size, false).await?;
    let bar = progress::spinner("idle");
    let measured = async {
        relay
            .wait_until_sleeping(ctx.db.pool(), Duration::from_secs(10))
            .await?;
        bar.set_message(format!("settling {SETTLE:?}"));
        sleep(SETTLE).await;
        relay.ensure_running()?;
        let before = db::transactions(&mut admin, ctx.db.name()).await?;
        let started = Instant::now();
        bar.set_message(format!("counting for {window:?}"));
        sleep(window).await;
        let window = started.elapsed();
        sleep(MARGIN).await;
        let after = db::transactions(&mut admin, ctx.db.name()).await?;
        relay.ensure_running()?;
        anyhow::Ok(IdleResult {
            window,
            transactions: after - before,
        })
    }
    .await;
    let stopped = relay.stop().await;
    let result = measured?;
    stopped?;
    progress::done(
        &bar,
        format!(
            "idle: {} transactions in {:.0} s: {:.3}/s",
            result.transactions,
            result.window.as_secs_f64(),
            result.per_second()
        ),
    );
    Ok(result)
}
