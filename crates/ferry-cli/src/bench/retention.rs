//! Retention: does the outbox stay the same size under a sustained load?
//!
//! A producer commits `retention_rate` events per second, one per
//! transaction, for `retention_seconds`; the relay publishes them to
//! RabbitMQ (a consumer takes them off the queue); every `RETENTION_EVERY`
//! the retention job deletes what was published more than
//! `retention_window` ago, in the batches `ferry run` uses, and then runs
//! `VACUUM` on the outbox tables, standing in for autovacuum (which a
//! production server runs on its own and this bench cannot count on).
//! Every `SAMPLE_EVERY` the size of each outbox table with its indexes is
//! read. Flat sizes once the window is full mean the space deleted rows
//! leave is reused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use chrono::Utc;
use ferry_core::Event;
use ferry_store::postgres::{PgStore, enqueue};
use ferry_store::{PurgeOptions, RetentionRules, purge};
use futures::StreamExt;
use sqlx::{Connection, PgConnection, Row};
use tokio::time::{Instant, MissedTickBehavior, interval};

use super::topology::{self, Topology};
use super::{Ctx, progress, relay, workload};

const SAMPLE_EVERY: Duration = Duration::from_secs(30);
const RETENTION_EVERY: Duration = Duration::from_secs(15);

/// The outbox's size at one moment.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub at: Duration,
    /// Rows in `ferry.events`.
    pub events: i64,
    /// Bytes, tables with their indexes and TOAST.
    pub events_bytes: i64,
    pub deliveries_bytes: i64,
    /// `unrouted` and `failures`.
    pub other_bytes: i64,
}

impl Sample {
    pub(crate) fn total(&self) -> i64 {
        self.events_bytes + self.deliveries_bytes + self.other_bytes
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RetentionResult {
    pub rate: u32,
    pub seconds: u64,
    pub window: Duration,
    pub sent: u64,
    pub deleted: u64,
    pub samples: Vec<Sample>,
}

impl RetentionResult {
    /// The last sample's total size over the first one taken after the
    /// window had filled: 1.0 is perfectly flat.
    pub(crate) fn growth(&self) -> Option<f64> {
        let full = self.samples.iter().find(|s| s.at >= self.window * 2)?;
        let last = self.samples.last()?;
        (full.total() > 0).then(|| last.total() as f64 / full.total() as f64)
    }

    /// The samples as a markdown table.
    pub(crate) fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = String::from(
            "| time | events kept | events table | deliveries table | unrouted + failures | total |\n\
             | --- | --- | --- | --- | --- | --- |\n",
        );
        for s in &self.samples {
            let _ = writeln!(
                out,
                "| {} s | {} | {} | {} | {} | {} |",
                s.at.as_secs(),
                super::report::thousands(s.events.max(0) as u64),
                mib(s.events_bytes),
                mib(s.deliveries_bytes),
                mib(s.other_bytes),
                mib(s.total())
            );
        }
        out
    }
}

fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub(crate) async fn run(ctx: &Ctx<'_>) -> anyhow::Result<RetentionResult> {
    topology::with_topology(ctx, "retention", async |t| measure(ctx, t).await).await
}

async fn measure(ctx: &Ctx<'_>, topology: &Topology) -> anyhow::Result<RetentionResult> {
    ctx.db.reset_outbox().await?;
    let received = Arc::new(AtomicU64::new(0));
    let mut consumer = topology.consume().await?;
    let counting = {
        let received = received.clone();
        tokio::spawn(async move {
            while let Some(Ok(_)) = consumer.next().await {
                received.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let relay = relay::start(ctx, topology.exchange(), "bench-retention", ctx.args.batch_size, false).await?;
    let result = drive(ctx, &relay).await;
    let stopped = relay.stop().await;
    counting.abort();
    let result = result?;
    stopped?;
    Ok(result)
}

async fn drive(ctx: &Ctx<'_>, relay: &relay::RunningRelay) -> anyhow::Result<RetentionResult> {
    let args = ctx.args;
    let rate = args.retention_rate;
    let total = u64::from(rate) * args.retention_seconds;
    let window = args.retention_window;
    let rules = RetentionRules {
        published: window,
        settled: None,
        batch_size: 1_000,
        pause: Duration::from_millis(50),
    };
    // Retention beside the producer, as `ferry run` runs it beside the relay.
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let retention = {
        let store = PgStore::new(ctx.db.pool().clone());
        let mut conn = PgConnection::connect_with(ctx.db.options()).await?;
        tokio::spawn(async move {
            let mut deleted = 0;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(RETENTION_EVERY) => {}
                    _ = stopped.wait_for(|s| *s) => return Ok::<u64, anyhow::Error>(deleted),
                }
                let report = purge(&store, &rules, &PurgeOptions::default(), Utc::now())
                    .await
                    .context("retention")?;
                deleted += report.events;
                vacuum(&mut conn).await?;
            }
        })
    };
    let mut conn = PgConnection::connect_with(ctx.db.options()).await?;
    let bar = progress::bar(total, "retention");
    let mut tick = interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut next_sample = started;
    let mut samples = Vec::new();
    for i in 1..=total {
        tick.tick().await;
        let key = workload::random_key(args.keys);
        let event = Event::new(workload::EVENT_TYPE, workload::payload(i, &key)).key(key);
        let mut tx = conn.begin().await?;
        enqueue(&mut tx, event).await.context("enqueue")?;
        tx.commit().await?;
        if Instant::now() >= next_sample {
            samples.push(sample(&mut conn, started.elapsed()).await?);
            next_sample += SAMPLE_EVERY;
        }
        if i.is_multiple_of(500) {
            bar.set_position(i);
            relay.ensure_running()?;
            anyhow::ensure!(!retention.is_finished(), "the retention job stopped early");
        }
    }
    samples.push(sample(&mut conn, started.elapsed()).await?);
    let _ = stop.send(true);
    let deleted = retention.await.context("the retention job panicked")??;
    let result = RetentionResult {
        rate,
        seconds: args.retention_seconds,
        window,
        sent: total,
        deleted,
        samples,
    };
    let growth = result.growth().map_or_else(
        || "the run was shorter than twice the window".into(),
        |g| format!("{g:.2}x"),
    );
    progress::done(
        &bar,
        format!("retention: {total} events, {deleted} deleted; size at the end over size once full: {growth}"),
    );
    Ok(result)
}

async fn vacuum(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::raw_sql("VACUUM ferry.events, ferry.deliveries, ferry.unrouted, ferry.failures")
        .execute(&mut *conn)
        .await
        .context("VACUUM")?;
    Ok(())
}

async fn sample(conn: &mut PgConnection, at: Duration) -> anyhow::Result<Sample> {
    let row = sqlx::query(
        "SELECT (SELECT count(*) FROM ferry.events),
                pg_total_relation_size('ferry.events'),
                pg_total_relation_size('ferry.deliveries'),
                pg_total_relation_size('ferry.unrouted') + pg_total_relation_size('ferry.failures')",
    )
    .fetch_one(&mut *conn)
    .await
    .context("reading table sizes")?;
    Ok(Sample {
        at,
        events: row.get(0),
        events_bytes: row.get(1),
        deliveries_bytes: row.get(2),
        other_bytes: row.get(3),
    })
}
