use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferry_core::{ErrorKind, SystemClock};
use ferry_relay::{Relay, RelaySettings};

use crate::config::RelayMode;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::{UsageError, purge};
use crate::config::Config;
use crate::{health, sinks, telemetry};

pub async fn run(cfg: Config) -> anyhow::Result<ExitCode> {
    if cfg.routes.is_empty() {
        return Err(UsageError(format!("routes: {}", super::NO_ROUTES)).into());
    }
    // Listening from the start: a signal while the destinations are checked
    // or the slot prepared (seconds against a slow broker) stops the start
    // and exits 0, as one later does, instead of killing the process.
    let mut signalled = Box::pin(shutdown_signal()?);
    tokio::select! {
        started = start(cfg) => started?.run(signalled).await,
        () = &mut signalled => {
            info!("stopping before the relay started: nothing was claimed");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `ferry run` refuses before it connects to anything, each with the
/// setting and the fix: what this binary cannot do (`[tracing]` without the
/// `otel` feature), an archive directory it cannot write, a `RUST_LOG` that
/// `log.level` would refuse. `ferry check` reports the same, from this
/// same code.
pub(crate) fn refusals(cfg: &Config) -> Vec<String> {
    let mut refused = Vec::new();
    if let Err(problem) = telemetry::log_filter(&cfg.log, std::env::var_os(telemetry::RUST_LOG).as_deref()) {
        refused.push(problem);
    }
    #[cfg(not(feature = "otel"))]
    if cfg.tracing.is_some() {
        refused.push(
            "tracing.otlp_endpoint: this ferry was built without the `otel` feature; rebuild with it or \
             remove the [tracing] section"
                .to_owned(),
        );
    }
    // Only a relay with retention on writes the archive.
    if cfg.retention.enabled
        && let Some(dir) = &cfg.retention.archive_dir
        && let Err(UsageError(problem)) = purge::check_archive_dir(dir)
    {
        refused.push(problem);
    }
    refused
}

/// How long after the first stop signal another one means "exit now".
const SECOND_SIGNAL_AFTER: Duration = Duration::from_secs(2);

/// A relay ready to run, with what runs beside it.
struct Started {
    relay: Relay<crate::store::AnyStore, SystemClock>,
    beside: Vec<tokio::task::JoinHandle<()>>,
    stop_tx: watch::Sender<bool>,
    stopped_tx: watch::Sender<bool>,
    #[cfg(feature = "otel")]
    exporting: Option<crate::tracing_otel::Exporting>,
}

/// Everything before the relay runs: telemetry, the store, the sinks and
/// their destinations' checks, WAL streaming's slot, the endpoints.
async fn start(cfg: Config) -> anyhow::Result<Started> {
    match refusals(&cfg).as_slice() {
        [] => {}
        [one] => return Err(UsageError(one.clone()).into()),
        many => {
            let list = many.join("\n  ");
            return Err(UsageError(format!("{} problems at start:\n  {list}", many.len())).into());
        }
    }
    #[cfg(feature = "otel")]
    let exporting = init_telemetry(&cfg)?;
    #[cfg(not(feature = "otel"))]
    init_telemetry(&cfg);
    let metrics = match cfg.metrics {
        Some(addr) => Some((addr, telemetry::install_metrics(addr)?)),
        None => None,
    };
    let store = super::relay_store(&cfg)?;
    let sinks = sinks::build(&cfg)?;
    // A route to nowhere is reported before any event is lost to it.
    let mut refused = Vec::new();
    for (i, route) in cfg.routes.iter().enumerate() {
        match sinks[&route.sink].check(route).await {
            Ok(()) => info!(route = %route.name, "destination checked"),
            Err(e) if e.kind == ErrorKind::Transient => {
                warn!(route = %route.name, error = %e, "destination unreachable at start; the relay retries")
            }
            Err(e) => refused.push(format!("routes[{i}] ({}): {}", route.name, e.message)),
        }
    }
    if !refused.is_empty() {
        return Err(UsageError(format!("routes reach no destination:\n  {}", refused.join("\n  "))).into());
    }
    // Beside the start, not before it: a database that is down would hold
    // the relay up, and the relay itself retries.
    tokio::spawn(report_unserved(store.clone(), cfg.clone()));
    // Leases and retry times are the relay's clock; `ferry cancel` judges
    // them by the database's.
    #[cfg(feature = "postgres")]
    tokio::spawn({
        let store = store.clone();
        async move { super::check::warn_on_clock_skew(&store).await }
    });
    let relay = Relay::new(
        store.clone(),
        SystemClock,
        relay_settings(&cfg),
        cfg.routes.clone(),
        sinks.clone(),
    )
    .map_err(|e| UsageError(e.to_string()))?;
    let relay = match cfg.relay.mode {
        RelayMode::Poll => {
            #[cfg(feature = "postgres")]
            refuse_unread_slot(&store).await?;
            relay
        }
        #[cfg(feature = "postgres")]
        RelayMode::Wal => relay.with_wal(wal(&cfg, &store).await?),
        // Refused with the fix when the config is read.
        #[cfg(not(feature = "postgres"))]
        RelayMode::Wal => unreachable!("relay.mode = \"wal\" is refused by a ferry built without it"),
    };
    // Beside the relay: retention, which stops on the signal (a batch in
    // flight finishes), and the health and metrics endpoint, which serves
    // until the relay has drained and stopped.
    let (stop_tx, stop_rx) = watch::channel(false);
    let (stopped_tx, stopped_rx) = watch::channel(false);
    let mut beside = Vec::new();
    if let Some((addr, handle)) = metrics {
        // A batch may take a publish timeout or two; a relay with work that
        // claimed and published nothing for this long is stuck.
        let stalled_after = (cfg.relay.lease * 2).max(Duration::from_secs(30));
        let health = health::Health::new(&cfg.routes, relay.progress(), stalled_after);
        beside.push(health::serve(addr, handle, health.clone(), stopped_rx.clone()).await?);
        beside.push(tokio::spawn(health::probe(
            Arc::new(store.clone()),
            sinks,
            cfg.routes.clone(),
            health,
            stopped_rx,
        )));
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    // After the endpoints are up, so that a liveness probe does not kill a
    // relay waiting here. SQLite runs one relay per file, under a lock the
    // relay takes, which a killed relay's process gave up already.
    if !crate::store::is_sqlite(&cfg.database.url) {
        wait_for_own_id(&store, &cfg.relay.id, cfg.relay.lease).await;
    }
    if cfg.retention.enabled {
        beside.push(tokio::spawn(purge::background(
            Arc::new(store),
            cfg.retention.clone(),
            stop_rx,
        )));
    }
    Ok(Started {
        relay,
        beside,
        stop_tx,
        stopped_tx,
        #[cfg(feature = "otel")]
        exporting,
    })
}

impl Started {
    /// Runs the relay until `signalled`, then stops what runs beside it.
    async fn run(self, signalled: impl Future<Output = ()> + Send) -> anyhow::Result<ExitCode> {
        let Started {
            relay,
            beside,
            stop_tx,
            stopped_tx,
            #[cfg(feature = "otel")]
            exporting,
        } = self;
        let shutdown = async {
            signalled.await;
            let _ = stop_tx.send(true);
        };
        let result = relay.run(shutdown).await;
        let _ = stop_tx.send(true);
        let _ = stopped_tx.send(true);
        // Together, under one deadline: each waited for in turn, a few slow
        // ones could outlast the grace period a supervisor gives the exit.
        let aborts: Vec<_> = beside.iter().map(|task| task.abort_handle()).collect();
        if tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(beside))
            .await
            .is_err()
        {
            warn!("background tasks did not stop within 10s; stopping them");
            aborts.iter().for_each(tokio::task::AbortHandle::abort);
        }
        #[cfg(feature = "otel")]
        if let Some(exporting) = exporting {
            exporting.shutdown().await;
        }
        let report = result.context("the relay stopped")?;
        info!(
            published = report.published,
            retried = report.retried,
            dead = report.dead,
            "bye"
        );
        Ok(ExitCode::SUCCESS)
    }
}

/// Waits while a relay of this id renewed its leases within the lease.
/// Leases are held by relay id, so two relays of one id would both take
/// them and publish the same events out of order. Such a heartbeat is
/// another relay running with this id (`relay.id` set in a file several
/// relays read), or this relay's previous run, ended without handing its
/// leases back (`kill -9`), whose heartbeat then ages past the lease, as
/// its leases expire. Until then this relay waits, saying why: a duplicate
/// stands by, and takes over when the other stops. A database that does
/// not answer is left to the relay, which retries.
async fn wait_for_own_id(store: &crate::store::AnyStore, id: &str, lease: Duration) {
    loop {
        match store.heartbeat_age(id).await {
            Ok(Some(age)) if age < lease => {
                error!(
                    relay = id,
                    last_seen_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                    "a relay with this relay.id renewed its leases {}ms ago: another relay runs with the same id \
                     (give each its own, or leave relay.id unset), or this relay's previous run was killed; \
                     waiting until its leases expire",
                    age.as_millis()
                );
                tokio::time::sleep((lease - age).max(Duration::from_millis(200))).await;
            }
            Ok(_) => return,
            Err(e) => {
                warn!(error = %e, "could not read whether another relay runs with this relay.id; starting");
                return;
            }
        }
    }
}

/// Logs the deliveries waiting on routes this config does not have. The
/// relay starts anyway: in a rolling deploy, relays still running the old
/// config serve the old names.
async fn report_unserved(store: crate::store::AnyStore, cfg: Config) {
    use ferry_store::Gauges;
    match store.gauges().await {
        Ok(gauges) => {
            for u in super::unserved::from_gauges(&cfg, &gauges) {
                error!(route = %u.route, pending = u.pending, dead = u.dead, "{}", u.explain());
            }
        }
        Err(e) => warn!(error = %e, "could not look for deliveries on routes not in the config"),
    }
}

/// Logs, and with `[tracing]` the span exporter, which `run` flushes when
/// the relay has stopped.
#[cfg(feature = "otel")]
fn init_telemetry(cfg: &Config) -> anyhow::Result<Option<crate::tracing_otel::Exporting>> {
    let Some(tracing) = &cfg.tracing else {
        telemetry::init_logs(&cfg.log);
        return Ok(None);
    };
    let (layer, exporting) = crate::tracing_otel::layer(tracing, cfg.relay.batch_size)?;
    telemetry::init_logs_with(&cfg.log, Some(layer));
    info!(url = %ferry_core::redact::url(&tracing.traces_url), ratio = tracing.sample_ratio, "exporting spans over OTLP/HTTP");
    Ok(Some(exporting))
}

/// Logs; a `[tracing]` section was refused with [`refusals`].
#[cfg(not(feature = "otel"))]
fn init_telemetry(cfg: &Config) {
    telemetry::init_logs(&cfg.log);
}

#[cfg(feature = "postgres")]
/// A relay polling while `ferry.emit` writes tableless events for a WAL
/// slot would never deliver them: refused with the fix. A database not
/// reachable yet is let through (the relay retries it), with a warning.
async fn refuse_unread_slot(store: &crate::store::AnyStore) -> anyhow::Result<()> {
    #[cfg_attr(not(feature = "sqlite"), allow(irrefutable_let_patterns))]
    let crate::store::AnyStore::Postgres(pg) = store else {
        return Ok(());
    };
    match ferry_store::postgres::wal::emit_slots(pg.pool(), None).await {
        Ok(slots) => match slots.first() {
            None => Ok(()),
            Some(slot) => Err(UsageError(poll_beside_slot(slot)).into()),
        },
        Err(e) => {
            warn!(error = %e, "could not check whether ferry.emit writes tableless events for a WAL slot");
            Ok(())
        }
    }
}

/// Why polling is refused while `ferry.emit` writes for `slot`, and the fix.
#[cfg(feature = "postgres")]
pub(crate) fn poll_beside_slot(slot: &str) -> String {
    format!(
        "relay.mode = \"poll\", but ferry.emit writes tableless events for WAL slot {slot}, which only a relay \
         in WAL mode reads: set relay.mode = \"wal\" (relay.wal_slot = \"{slot}\"), or, to leave WAL mode, \
         retire the slot first with `ferry wal retire --slot {slot}`"
    )
}

#[cfg(feature = "postgres")]
/// WAL streaming mode's source, prepared: a server that cannot stream (no
/// wal_level=logical, no REPLICATION grant, no slot left) is refused at
/// start with the fix, not retried forever.
async fn wal(cfg: &Config, store: &crate::store::AnyStore) -> anyhow::Result<ferry_relay::Wal> {
    use ferry_store::postgres::wal::{WalConfig, WalSource};
    // Refutable once another store is compiled in.
    #[cfg_attr(not(feature = "sqlite"), allow(irrefutable_let_patterns))]
    let crate::store::AnyStore::Postgres(pg) = store else {
        return Err(UsageError("relay.mode: \"wal\" needs a postgres:// database.url".into()).into());
    };
    let source = WalSource::new(
        pg.pool().clone(),
        WalConfig {
            url: cfg.database.url.clone(),
            slot: cfg.relay.wal_slot.clone(),
            publication: cfg.relay.wal_publication.clone(),
        },
    )
    .map_err(|e| UsageError(e.message))?
    .with_read_ahead(cfg.relay.wal_read_ahead);
    match source.prepare().await {
        Ok(prepared) => ferry_relay::wal::report_prepared(&prepared, &cfg.relay.wal_slot),
        Err(e) if e.kind == ErrorKind::Config => {
            return Err(UsageError(format!("relay.mode = \"wal\": {}", e.message)).into());
        }
        // Unreachable now: the relay retries, as it does for polling.
        Err(e) => warn!(error = %e, "could not prepare WAL streaming at start; the relay retries"),
    }
    info!(slot = %cfg.relay.wal_slot, publication = %cfg.relay.wal_publication, "WAL streaming mode");
    Ok(ferry_relay::Wal {
        source,
        options: ferry_relay::WalOptions {
            publish_timeout: cfg.relay.wal_publish_timeout,
            lag_budget: cfg.relay.wal_lag_budget,
            ..ferry_relay::WalOptions::default()
        },
    })
}

/// The relay's settings from the `[relay]` section.
pub(crate) fn relay_settings(cfg: &Config) -> RelaySettings {
    RelaySettings {
        id: ferry_core::RelayId(cfg.relay.id.clone()),
        batch_size: cfg.relay.batch_size,
        lease: cfg.relay.lease,
        retry: cfg.retry_policy(),
        poll_interval: cfg.relay.poll_interval,
        shutdown_timeout: cfg.relay.shutdown_timeout,
        direct_publish_timeout: cfg.relay.direct_publish_timeout,
    }
}

/// Listens for SIGTERM and SIGINT from now on; the future resolves on the
/// first of them. Another one while the relay stops, 2 s or more after the
/// first, ends the process at once (exit 128 + the signal: 130 for SIGINT,
/// 143 for SIGTERM), as an operator's second Ctrl-C means: like a `kill
/// -9`, it loses nothing, but leaves the leases to expire and what was in
/// flight to be published again. One sooner is the same stop signalled
/// twice (systemd's `ExecStop` kill followed by its own, a Ctrl-C that
/// reached a process runner too), and is ignored.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()> + Send> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            let first = tokio::time::Instant::now();
            tokio::spawn(async move {
                let code = loop {
                    let code = tokio::select! {
                        _ = term.recv() => 143,
                        _ = int.recv() => 130,
                    };
                    if first.elapsed() >= SECOND_SIGNAL_AFTER {
                        break code;
                    }
                    info!("a repeat of the stop signal: still stopping (another one from 2 s on exits at once)");
                };
                tracing::error!(
                    "a second signal: exiting now, without waiting for the stop; the leases expire \
                     after relay.lease and what was in flight is published again"
                );
                std::process::exit(code);
            });
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
