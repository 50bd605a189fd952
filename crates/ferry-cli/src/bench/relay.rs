//! The relay under test, run in this process against the bench database and
//! one scenario's exchange, with the production settings the brief asks for
//! (lease 30 s, fallback poll 60 s).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow};
use async_trait::async_trait;
use ferry_core::{Glob, PublishOutcome, Route, Sink, SinkError, StoredEvent, SystemClock};
use ferry_relay::{Relay, RelaySettings, RunReport};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_store::postgres::PgStore;
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use super::Ctx;
use super::workload::ROUTE_GLOB;

/// `ferry run`'s default pool size.
const POOL_CONNECTIONS: u32 = 10;
const SINK: &str = "rabbitmq";
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct RunningRelay {
    id: String,
    pool: PgPool,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<RunReport, ferry_relay::RelayError>>,
}

/// Starts a relay named `id` that routes `bench.**` to `exchange`; with
/// `wal`, in WAL streaming mode.
pub(crate) async fn start(
    ctx: &Ctx<'_>,
    exchange: &str,
    id: &str,
    batch_size: usize,
    wal: bool,
) -> anyhow::Result<RunningRelay> {
    let sink: Arc<dyn Sink> = Arc::new(RabbitMqSink::new(RabbitMqOptions {
        url: ctx.args.amqp_url.clone(),
        ..RabbitMqOptions::default()
    }));
    let targets = vec![(SINK.to_owned(), sink, exchange.to_owned())];
    if wal {
        start_wal(ctx, id, batch_size, targets).await
    } else {
        start_routes(ctx, id, batch_size, targets).await
    }
}

/// Like [`start_routes`], streaming from a slot named after the database.
async fn start_wal(
    ctx: &Ctx<'_>,
    id: &str,
    batch_size: usize,
    targets: Vec<(String, Arc<dyn Sink>, String)>,
) -> anyhow::Result<RunningRelay> {
    use ferry_store::postgres::wal::{WalConfig, WalSource};
    let db = ctx.db;
    build(ctx, id, batch_size, targets, |pool| {
        let source = WalSource::new(
            pool.clone(),
            WalConfig {
                url: db.url().to_owned(),
                slot: db.name().to_owned(),
                publication: "ferry".into(),
            },
        )
        .map_err(|e| anyhow!("{e}"))?;
        Ok(Some(ferry_relay::Wal {
            source,
            options: ferry_relay::WalOptions::default(),
        }))
    })
    .await
}

/// Starts a relay named `id` with one route per `(sink name, sink,
/// destination)`, each matching `bench.**`: several targets fan one event out.
pub(crate) async fn start_routes(
    ctx: &Ctx<'_>,
    id: &str,
    batch_size: usize,
    targets: Vec<(String, Arc<dyn Sink>, String)>,
) -> anyhow::Result<RunningRelay> {
    build(ctx, id, batch_size, targets, |_| Ok(None)).await
}

/// The bench's route of every bench event to the sink named `sink`.
pub(crate) fn route(sink: &str, destination: String) -> anyhow::Result<Route> {
    Ok(Route {
        name: format!("bench-{sink}"),
        matcher: Glob::new(ROUTE_GLOB).map_err(|e| anyhow!("route glob: {e}"))?,
        sink: sink.to_owned(),
        destination,
        routing_key: None,
    })
}

/// Checks every route's destination, as `ferry run` does before it starts
/// the relay (a check also readies the sink: Kafka's producer gets its
/// producer id), then starts the relay. The relay stops by itself when its
/// [`RunningRelay`] is dropped (Ctrl-C drops the scenario), and the bench
/// waits for that before it deletes what the relay publishes to.
async fn build(
    ctx: &Ctx<'_>,
    id: &str,
    batch_size: usize,
    targets: Vec<(String, Arc<dyn Sink>, String)>,
    wal: impl FnOnce(&PgPool) -> anyhow::Result<Option<ferry_relay::Wal>>,
) -> anyhow::Result<RunningRelay> {
    let db = ctx.db;
    let pool = PgStore::relay_pool_options()
        .max_connections(POOL_CONNECTIONS)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(db.options().clone().application_name("ferry-bench-relay"));
    let mut routes = Vec::with_capacity(targets.len());
    let mut sinks = HashMap::new();
    for (name, sink, destination) in targets {
        routes.push(route(&name, destination)?);
        sinks.insert(name, sink);
    }
    for route in &routes {
        sinks[&route.sink]
            .check(route)
            .await
            .map_err(|e| anyhow!("checking the destination of route {}: {e}", route.name))?;
    }
    let settings = RelaySettings {
        batch_size,
        lease: Duration::from_secs(30),
        poll_interval: Duration::from_secs(60),
        ..RelaySettings::new(id)
    };
    let relay = Relay::new(PgStore::new(pool.clone()), SystemClock, settings, routes, sinks)?;
    let relay = match wal(&pool)? {
        Some(wal) => relay.with_wal(wal),
        None => relay,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    // A dropped sender stops the relay as a sent one does.
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    ctx.left.track(task.abort_handle());
    Ok(RunningRelay {
        id: id.to_owned(),
        pool,
        stop,
        task,
    })
}

impl RunningRelay {
    /// Fails if the relay has already stopped on its own (an error).
    pub(crate) fn ensure_running(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.task.is_finished(), "relay {} stopped unexpectedly", self.id);
        Ok(())
    }

    /// Waits until the relay has caught up and told producers it sleeps:
    /// from then on a commit wakes it through NOTIFY.
    pub(crate) async fn wait_until_sleeping(&self, pool: &PgPool, within: Duration) -> anyhow::Result<()> {
        self.wait_until(within, "go idle", async || {
            let sleeping: Option<bool> = sqlx::query_scalar("SELECT sleeping FROM ferry.relays WHERE id = $1")
                .bind(&self.id)
                .fetch_optional(pool)
                .await?;
            Ok(sleeping == Some(true))
        })
        .await
    }

    /// Waits until the relay streams from its WAL slot, past the start-up
    /// sweep.
    pub(crate) async fn wait_until_streaming(&self, pool: &PgPool, slot: &str, within: Duration) -> anyhow::Result<()> {
        self.wait_until(within, &format!("stream from slot {slot}"), async || {
            Ok(ferry_store::postgres::wal::streaming(pool, slot).await?)
        })
        .await
    }

    /// Waits until no committed event is left unrouted: every one was
    /// published (or parked) and settled.
    pub(crate) async fn wait_until_delivered(&self, pool: &PgPool, within: Duration) -> anyhow::Result<()> {
        self.wait_until(within, "deliver every event", async || {
            let left: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry.unrouted)")
                .fetch_one(pool)
                .await?;
            Ok(!left)
        })
        .await
    }

    /// Polls `done` every 20 ms until it holds, failing if the relay stops
    /// or `within` passes first.
    async fn wait_until(
        &self,
        within: Duration,
        what: &str,
        mut done: impl AsyncFnMut() -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            self.ensure_running()?;
            if done().await? {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "relay {} did not {what} within {within:?}",
                self.id
            );
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the relay, returns what it did, and closes its connections so
    /// that their statistics reach `pg_stat_database`.
    pub(crate) async fn stop(self) -> anyhow::Result<RunReport> {
        let _ = self.stop.send(());
        let report = tokio::time::timeout(STOP_TIMEOUT, self.task)
            .await
            .with_context(|| format!("relay {} did not stop within {STOP_TIMEOUT:?}", self.id))?
            .context("the relay task panicked")?
            .context("the relay failed")?;
        self.pool.close().await;
        Ok(report)
    }
}

/// A sink that accepts everything: what the relay and the database hand
/// over when the destination costs nothing (the sinks scenario counts what
/// it confirms).
pub(crate) struct Discard;

#[async_trait]
impl Sink for Discard {
    fn kind(&self) -> &'static str {
        "discard"
    }

    async fn publish(&self, _route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
        events.iter().map(|_| Ok(())).collect()
    }

    async fn check(&self, _route: &Route) -> Result<(), SinkError> {
        Ok(())
    }
}
