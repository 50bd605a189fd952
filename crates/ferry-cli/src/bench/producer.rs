//! Producer cost: how many one-event transactions `producer-clients`
//! connections commit per second, for a plain INSERT and for each way into
//! the outbox. In (b) to (d) no relay runs; a row in `ferry.relays` stands in
//! for one, busy (producers skip NOTIFY) or sleeping (every commit
//! notifies). In (e) a relay delivers the events as they commit, to a sink
//! that discards them: what producers get while Ferry runs beside them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_core::{Event, Sink};
use ferry_store::postgres::enqueue;
use sqlx::types::Json;
use sqlx::{Connection, PgConnection};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Ctx, progress, relay, workload};

/// The four producers compared, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    /// (a) INSERT of the same row into a plain table: the baseline.
    PlainInsert,
    /// (b) `SELECT ferry.enqueue(...)` with a busy relay registered.
    SqlBusy,
    /// (c) `BEGIN; ferry_store::postgres::enqueue; COMMIT` from Rust.
    RustApi,
    /// (d) `SELECT ferry.enqueue(...)` while the relay sleeps: NOTIFY on commit.
    SqlSleeping,
    /// (e) `SELECT ferry.enqueue(...)` while a relay delivers the events.
    SqlLive,
}

impl Variant {
    pub(crate) const ALL: [Variant; 5] = [
        Self::PlainInsert,
        Self::SqlBusy,
        Self::RustApi,
        Self::SqlSleeping,
        Self::SqlLive,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::PlainInsert => "(a) plain INSERT, autocommit",
            Self::SqlBusy => "(b) SELECT ferry.enqueue(...), autocommit, relay busy",
            Self::RustApi => "(c) Rust enqueue: BEGIN; enqueue; COMMIT, relay busy",
            Self::SqlSleeping => "(d) SELECT ferry.enqueue(...), autocommit, relay sleeping (NOTIFY)",
            Self::SqlLive => "(e) SELECT ferry.enqueue(...), autocommit, a relay delivering them",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::PlainInsert => "plain",
            Self::SqlBusy => "sql",
            Self::RustApi => "rust",
            Self::SqlSleeping => "notify",
            Self::SqlLive => "live",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProducerResult {
    pub variant: Variant,
    pub clients: u32,
    pub commits: u64,
    pub elapsed: Duration,
}

impl ProducerResult {
    pub(crate) fn rate(&self) -> f64 {
        super::broker::per_second(self.commits, self.elapsed)
    }
}

pub(crate) async fn run(ctx: &Ctx<'_>) -> anyhow::Result<Vec<ProducerResult>> {
    let pool = ctx.db.pool();
    sqlx::raw_sql(
        "CREATE TABLE bench_plain (
             id uuid PRIMARY KEY,
             type text NOT NULL,
             key text,
             payload jsonb NOT NULL,
             headers jsonb NOT NULL DEFAULT '{}',
             created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .context("creating the plain table")?;
    let mut results = Vec::new();
    for variant in Variant::ALL {
        // Each variant starts from empty tables, so none pays for another's rows.
        ctx.db.reset_outbox().await?;
        let relay_row = match variant {
            Variant::PlainInsert | Variant::SqlLive => None,
            Variant::SqlBusy | Variant::RustApi => Some(false),
            Variant::SqlSleeping => Some(true),
        };
        let setup = match relay_row {
            None => "TRUNCATE bench_plain",
            Some(false) => "TRUNCATE bench_plain; INSERT INTO ferry.relays (id, sleeping) VALUES ('bench', false)",
            Some(true) => "TRUNCATE bench_plain; INSERT INTO ferry.relays (id, sleeping) VALUES ('bench', true)",
        };
        sqlx::raw_sql(setup).execute(pool).await?;
        let result = if variant == Variant::SqlLive {
            measure_live(ctx).await?
        } else {
            measure(ctx, variant).await?
        };
        results.push(result);
    }
    sqlx::raw_sql("DROP TABLE bench_plain; DELETE FROM ferry.relays")
        .execute(pool)
        .await?;
    Ok(results)
}

async fn measure(ctx: &Ctx<'_>, variant: Variant) -> anyhow::Result<ProducerResult> {
    let clients = ctx.args.producer_clients;
    let mut conns = Vec::with_capacity(clients as usize);
    for _ in 0..clients {
        conns.push(PgConnection::connect_with(ctx.db.options()).await?);
    }
    let bar = progress::spinner(&format!("producer {}", variant.short()));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(ctx.args.producer_seconds);
    let mut tasks = JoinSet::new();
    for (client, conn) in conns.into_iter().enumerate() {
        tasks.spawn(client_loop(conn, variant, client as u64, ctx.args.keys, deadline));
    }
    let mut commits = 0;
    while let Some(joined) = tasks.join_next().await {
        commits += joined.context("a producer task panicked")??;
    }
    let result = ProducerResult {
        variant,
        clients,
        commits,
        elapsed: started.elapsed(),
    };
    progress::done(
        &bar,
        format!("producer {}: {:.0} commits/s", variant.label(), result.rate()),
    );
    Ok(result)
}

/// How long (e)'s relay may take to go idle before, and to deliver the
/// rest after, the producers' run.
const SETTLE_WITHIN: Duration = Duration::from_secs(60);

/// (e): a relay runs from before the first commit until every event is
/// delivered; the rate counts the commits alone.
async fn measure_live(ctx: &Ctx<'_>) -> anyhow::Result<ProducerResult> {
    let sink: Arc<dyn Sink> = Arc::new(relay::Discard);
    let targets = vec![("discard".to_owned(), sink, "nowhere".to_owned())];
    let relay = relay::start_routes(ctx, "bench-producer", ctx.args.batch_size, targets).await?;
    let measured = async {
        relay.wait_until_sleeping(ctx.db.pool(), SETTLE_WITHIN).await?;
        let result = measure(ctx, Variant::SqlLive).await?;
        // Delivered, all of them: the relay kept up, or catches up now.
        relay
            .wait_until_delivered(ctx.db.pool(), SETTLE_WITHIN)
            .await
            .context("producer (e)")?;
        anyhow::Ok(result)
    }
    .await;
    let report = relay.stop().await;
    let result = measured?;
    let report = report?;
    anyhow::ensure!(
        report.published == result.commits && report.dead == 0,
        "producer (e): {} events committed, the relay published {} and killed {}",
        result.commits,
        report.published,
        report.dead
    );
    Ok(result)
}

/// Commits one-event transactions until `deadline`; returns how many.
async fn client_loop(
    mut conn: PgConnection,
    variant: Variant,
    client: u64,
    keys: u64,
    deadline: Instant,
) -> anyhow::Result<u64> {
    // One body per client, the same for every variant.
    let payload = workload::payload(client, &workload::key(client, keys));
    let mut commits = 0;
    while Instant::now() < deadline {
        let key = workload::random_key(keys);
        match variant {
            Variant::PlainInsert => {
                sqlx::query("INSERT INTO bench_plain (id, type, key, payload, headers) VALUES ($1, $2, $3, $4, '{}')")
                    .bind(uuid::Uuid::now_v7())
                    .bind(workload::EVENT_TYPE)
                    .bind(key)
                    .bind(Json(&payload))
                    .execute(&mut conn)
                    .await?;
            }
            Variant::SqlBusy | Variant::SqlSleeping | Variant::SqlLive => {
                sqlx::query("SELECT ferry.enqueue($1, $2, $3)")
                    .bind(workload::EVENT_TYPE)
                    .bind(key)
                    .bind(Json(&payload))
                    .execute(&mut conn)
                    .await?;
            }
            Variant::RustApi => {
                let mut tx = conn.begin().await?;
                enqueue(&mut tx, Event::new(workload::EVENT_TYPE, payload.clone()).key(key)).await?;
                tx.commit().await?;
            }
        }
        commits += 1;
    }
    let _ = conn.close().await;
    Ok(commits)
}
