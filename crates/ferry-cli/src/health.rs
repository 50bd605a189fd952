//! `/metrics`, `/healthz` and `/readyz` on the metrics address, and the
//! prober that keeps them current.
//!
//! `/healthz` answers 200 while the process serves requests. `/readyz`
//! answers 200 only when the database answered the last probe, every route's
//! destination passed its last check, and the relay made progress recently
//! or has nothing to do; otherwise 503, with the reasons in the JSON body.
//! The prober also reads the outbox gauges (depth, oldest pending, blocked
//! keys, leases) from the store, so a scrape never queries the database.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use ferry_core::{Route, Sink};
use ferry_relay::{Progress, metrics as names};
use ferry_store::{GaugeReport, Gauges};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tokio::sync::watch;
use tracing::{debug, warn};

/// How often the database is probed and the gauges read.
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How often each destination is checked; checks can cost the broker a
/// round trip or two, so less often.
const CHECK_EVERY: Duration = Duration::from_secs(15);
/// One probe or check may take this long before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// The last outcome of one probe.
#[derive(Debug, Clone)]
struct Probe {
    at: Instant,
    error: Option<String>,
}

/// What `/readyz` reports, shared by the prober and the server.
pub struct Health {
    database: Mutex<Option<Probe>>,
    destinations: Mutex<BTreeMap<String, Probe>>,
    routes: Vec<String>,
    progress: Progress,
    /// The relay counts as stuck when it went this long without a claim or a
    /// publish while it had work.
    stalled_after: Duration,
}

#[derive(Debug, Serialize)]
struct Readiness {
    ready: bool,
    database: String,
    destinations: BTreeMap<String, String>,
    relay: String,
}

impl Health {
    pub fn new(routes: &[Route], progress: Progress, stalled_after: Duration) -> Arc<Self> {
        Arc::new(Self {
            database: Mutex::new(None),
            destinations: Mutex::new(BTreeMap::new()),
            routes: routes.iter().map(|r| r.name.clone()).collect(),
            progress,
            stalled_after,
        })
    }

    fn readiness(&self) -> Readiness {
        let fresh = |p: &Probe, every: Duration| p.at.elapsed() <= every * 3;
        let mut ready = true;
        let database = match &*self.database.lock().unwrap() {
            Some(p) if p.error.is_none() && fresh(p, PROBE_EVERY) => "ok".to_owned(),
            Some(Probe { error: Some(e), .. }) => {
                ready = false;
                e.clone()
            }
            _ => {
                ready = false;
                "not probed recently".to_owned()
            }
        };
        let probes = self.destinations.lock().unwrap();
        let mut destinations = BTreeMap::new();
        for route in &self.routes {
            let state = match probes.get(route) {
                Some(p) if p.error.is_none() && fresh(p, CHECK_EVERY) => "ok".to_owned(),
                Some(Probe { error: Some(e), .. }) => e.clone(),
                _ => "not checked recently".to_owned(),
            };
            ready &= state == "ok";
            destinations.insert(route.clone(), state);
        }
        let since = self.progress.since_last();
        let renewals_failing = self
            .progress
            .since_renewed()
            .filter(|since| *since > self.stalled_after);
        let relay = if let Some(failing) = renewals_failing {
            // Its workers wait for a lease, which reads as idle.
            ready = false;
            format!(
                "no lease renewal for {:.0}s (limit {}s): the relay holds no partitions it may work; the \
                 database refuses or cannot take its heartbeat (its log says why)",
                failing.as_secs_f64(),
                self.stalled_after.as_secs()
            )
        } else if let Some(failing) = self
            .progress
            .router_failing_for()
            .filter(|failing| *failing > self.stalled_after)
        {
            // The route workers have nothing to claim, which reads as idle.
            ready = false;
            format!(
                "the router has failed for {:.0}s (limit {}s): new events are not routed to their \
                 destinations (its log says why)",
                failing.as_secs_f64(),
                self.stalled_after.as_secs()
            )
        } else if self.progress.since_renewed().is_none() {
            // Before its first lease: starting, waiting for a database
            // that does not answer, or for the leases of a relay of its id.
            ready = false;
            "not started: no lease taken yet (its log says why)".to_owned()
        } else if self.progress.idle() {
            "idle: nothing to do".to_owned()
        } else if since <= self.stalled_after {
            format!("progress {:.1}s ago", since.as_secs_f64())
        } else {
            ready = false;
            format!(
                "no progress for {:.0}s with work to do (limit {}s)",
                since.as_secs_f64(),
                self.stalled_after.as_secs()
            )
        };
        ::metrics::gauge!(names::READY).set(if ready { 1.0 } else { 0.0 });
        Readiness {
            ready,
            database,
            destinations,
            relay,
        }
    }
}

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    metrics: PrometheusHandle,
}

/// Binds `addr` and serves the three endpoints until `stop` turns true.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("metrics.listen: cannot listen on {addr}; free the port or choose another"))?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { health, metrics });
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
            warn!(error = %e, "the metrics endpoint stopped");
        }
    }))
}

async fn render_metrics(State(s): State<AppState>) -> impl IntoResponse {
    // `ferry_ready` is what `/readyz` would answer now, whether or not
    // anything asks `/readyz`.
    s.health.readiness();
    s.metrics.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(),
    )
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let r = s.health.readiness();
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(r))
}

/// Probes the database and reads the gauges every few seconds, and checks
/// every route's destination less often, until `stop` turns true. Three
/// loops, so that a slow gauge query on a large backlog never makes the
/// database look down, nor a slow broker delay the database probe.
pub async fn probe<S: Gauges + ?Sized>(
    store: Arc<S>,
    sinks: HashMap<String, Arc<dyn Sink>>,
    routes: Vec<Route>,
    health: Arc<Health>,
    stop: watch::Receiver<bool>,
) {
    tokio::join!(
        ping_loop(store.as_ref(), &health, stop.clone()),
        gauges_loop(store.as_ref(), &routes, stop.clone()),
        checks_loop(&sinks, &routes, &health, stop),
    );
}

async fn ping_loop<S: Gauges + ?Sized>(store: &S, health: &Health, mut stop: watch::Receiver<bool>) {
    loop {
        let error = match tokio::time::timeout(PROBE_TIMEOUT, store.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("database: {e}")),
            Err(_) => Some(format!("database: no answer within {}s", PROBE_TIMEOUT.as_secs())),
        };
        if let Some(e) = &error {
            debug!(error = %e, "database probe failed");
        }
        ::metrics::gauge!(names::DATABASE_UP).set(if error.is_none() { 1.0 } else { 0.0 });
        *health.database.lock().unwrap() = Some(Probe {
            at: Instant::now(),
            error,
        });
        if pause(PROBE_EVERY, &mut stop).await {
            return;
        }
    }
}

async fn gauges_loop<S: Gauges + ?Sized>(store: &S, routes: &[Route], mut stop: watch::Receiver<bool>) {
    let mut known = Known {
        routes: routes.iter().map(|r| r.name.clone()).collect(),
        tables: Vec::new(),
    };
    let mut failing = false;
    loop {
        match store.gauges().await {
            Ok(g) => {
                publish_gauges(&g, &mut known);
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                ::metrics::gauge!(names::GAUGES_READ).set(now.map_or(0.0, |d| d.as_secs_f64()));
                failing = false;
            }
            Err(e) => {
                // The gauges keep their last values: say so once, then
                // count (ferry_gauges_read_timestamp_seconds stops).
                if !std::mem::replace(&mut failing, true) {
                    warn!(error = %e, "reading the outbox gauges failed; they show their last values until a read succeeds");
                } else {
                    debug!(error = %e, "reading the outbox gauges failed");
                }
                ::metrics::counter!(names::STORE_ERRORS, "op" => "gauges").increment(1);
            }
        }
        if pause(PROBE_EVERY, &mut stop).await {
            return;
        }
    }
}

async fn checks_loop(
    sinks: &HashMap<String, Arc<dyn Sink>>,
    routes: &[Route],
    health: &Health,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        for route in routes {
            // The caveats were logged at start-up; a probe every 15 s only
            // asks whether the destination is there.
            let probe = sinks[&route.sink].check_with_caveats(route);
            let error = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                Ok(Ok(_caveats)) => None,
                Ok(Err(e)) => Some(format!("{}: {}", route.sink, e.message)),
                Err(_) => Some(format!("{}: no answer within {}s", route.sink, PROBE_TIMEOUT.as_secs())),
            };
            let up = if error.is_none() { 1.0 } else { 0.0 };
            ::metrics::gauge!(names::DESTINATION_UP, "route" => route.name.clone()).set(up);
            health.destinations.lock().unwrap().insert(
                route.name.clone(),
                Probe {
                    at: Instant::now(),
                    error,
                },
            );
        }
        if pause(CHECK_EVERY, &mut stop).await {
            return;
        }
    }
}

/// Waits `period`; `true` when told to stop instead.
async fn pause(period: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(period) => false,
        _ = stop.wait_for(|s| *s) => true,
    }
}

/// The labels the gauges were set for so far.
struct Known {
    routes: Vec<String>,
    tables: Vec<String>,
}

/// Sets every gauge; a route that had work and has none now, or a table
/// whose capture (and its count of drops) was removed, goes back to zero
/// rather than keep its last value.
fn publish_gauges(g: &GaugeReport, known: &mut Known) {
    ::metrics::gauge!(names::UNROUTED).set(g.unrouted as f64);
    ::metrics::gauge!(names::OLDEST_UNROUTED_SECONDS).set(g.oldest_unrouted_seconds.unwrap_or(0.0));
    ::metrics::gauge!(names::EXPIRED_LEASES).set(g.expired_leases as f64);
    ::metrics::gauge!(names::OLDEST_LEASE_SECONDS).set(g.oldest_lease_seconds.unwrap_or(0.0));
    for (table, _) in &g.capture_dropped {
        if !known.tables.contains(table) {
            known.tables.push(table.clone());
        }
    }
    for table in &known.tables {
        let dropped = g
            .capture_dropped
            .iter()
            .find(|(t, _)| t == table)
            .map_or(0, |(_, n)| *n);
        ::metrics::gauge!(names::CAPTURE_DROPPED, "table" => table.clone()).set(dropped as f64);
    }
    for r in &g.routes {
        if !known.routes.contains(&r.route) {
            known.routes.push(r.route.clone());
        }
    }
    for route in known.routes.iter() {
        let r = g.routes.iter().find(|r| &r.route == route).cloned().unwrap_or_default();
        ::metrics::gauge!(names::PENDING, "route" => route.clone()).set(r.pending as f64);
        ::metrics::gauge!(names::RETRYING, "route" => route.clone()).set(r.retrying as f64);
        ::metrics::gauge!(names::DEAD_NOW, "route" => route.clone()).set(r.dead as f64);
        ::metrics::gauge!(names::CANCELLED_NOW, "route" => route.clone()).set(r.cancelled as f64);
        ::metrics::gauge!(names::OLDEST_PENDING_SECONDS, "route" => route.clone())
            .set(r.oldest_pending_seconds.unwrap_or(0.0));
        ::metrics::gauge!(names::BLOCKED_KEYS, "route" => route.clone()).set(r.blocked_keys as f64);
        ::metrics::gauge!(names::OLDEST_BLOCKED_SECONDS, "route" => route.clone())
            .set(r.oldest_blocked_seconds.unwrap_or(0.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::Glob;

    fn route(name: &str) -> Route {
        Route {
            name: name.into(),
            matcher: Glob::new("**").unwrap(),
            sink: "out".into(),
            destination: "d".into(),
            routing_key: None,
        }
    }

    fn probed(error: Option<&str>) -> Probe {
        Probe {
            at: Instant::now(),
            error: error.map(str::to_owned),
        }
    }

    #[test]
    fn ready_needs_the_database_every_destination_and_progress() {
        let progress = Progress::default();
        progress.renewed();
        let health = Health::new(&[route("a"), route("b")], progress, Duration::from_secs(60));
        let r = health.readiness();
        assert!(!r.ready, "nothing probed yet");
        assert_eq!(r.database, "not probed recently");
        *health.database.lock().unwrap() = Some(probed(None));
        health.destinations.lock().unwrap().insert("a".into(), probed(None));
        let r = health.readiness();
        assert!(!r.ready);
        assert_eq!(r.destinations["b"], "not checked recently");
        health
            .destinations
            .lock()
            .unwrap()
            .insert("b".into(), probed(Some("rabbitmq: no exchange")));
        assert_eq!(health.readiness().destinations["b"], "rabbitmq: no exchange");
        health.destinations.lock().unwrap().insert("b".into(), probed(None));
        assert!(health.readiness().ready);
        *health.database.lock().unwrap() = Some(probed(Some("database: refused")));
        let r = health.readiness();
        assert!(!r.ready);
        assert_eq!(r.database, "database: refused");
    }

    /// A relay whose lease renewals fail waits for a lease, which reads as
    /// idle: ready, while it works nothing.
    #[test]
    fn a_relay_whose_lease_renewals_fail_is_not_ready() {
        let progress = Progress::default();
        let health = Health::new(&[], progress.clone(), Duration::from_millis(20));
        *health.database.lock().unwrap() = Some(probed(None));
        progress.renewed();
        assert!(!health.readiness().relay.starts_with("no lease renewal"));
        std::thread::sleep(Duration::from_millis(40));
        *health.database.lock().unwrap() = Some(probed(None));
        let r = health.readiness();
        assert!(!r.ready);
        assert!(r.relay.starts_with("no lease renewal for"), "{}", r.relay);
        progress.renewed();
        assert!(!health.readiness().relay.starts_with("no lease renewal"));
    }

    /// A router that keeps failing leaves new events unrouted while the
    /// route workers, with nothing to claim, look idle: not ready once it
    /// has failed for longer than the limit, ready again after a step
    /// succeeds.
    #[test]
    fn a_relay_whose_router_keeps_failing_is_not_ready() {
        let progress = Progress::default();
        let health = Health::new(&[], progress.clone(), Duration::from_millis(20));
        *health.database.lock().unwrap() = Some(probed(None));
        progress.renewed();
        progress.router_step(false);
        assert!(health.readiness().ready, "one failure is retried");
        std::thread::sleep(Duration::from_millis(40));
        progress.router_step(false);
        progress.renewed();
        let r = health.readiness();
        assert!(!r.ready);
        assert!(r.relay.starts_with("the router has failed for"), "{}", r.relay);
        progress.router_step(true);
        assert!(!health.readiness().relay.starts_with("the router"));
    }

    /// Waiting before its first lease (the leases of a killed run of its
    /// id, a database that does not answer), a relay works nothing.
    #[test]
    fn a_relay_that_has_taken_no_lease_yet_is_not_ready() {
        let progress = Progress::default();
        let health = Health::new(&[], progress.clone(), Duration::from_secs(60));
        *health.database.lock().unwrap() = Some(probed(None));
        let r = health.readiness();
        assert!(!r.ready);
        assert!(r.relay.starts_with("not started"), "{}", r.relay);
        progress.renewed();
        assert!(health.readiness().ready);
    }

    #[test]
    fn a_relay_without_progress_and_with_work_is_not_ready() {
        let progress = Progress::default();
        let health = Health::new(&[], progress.clone(), Duration::from_millis(50));
        *health.database.lock().unwrap() = Some(probed(None));
        std::thread::sleep(Duration::from_millis(100));
        // Its leases renewed just now; no progress since it started.
        progress.renewed();
        let r = health.readiness();
        assert!(!r.ready);
        assert!(r.relay.starts_with("no progress for"), "{}", r.relay);
    }

    /// A route or a captured table that no longer reports goes back to
    /// zero instead of showing its last value for ever.
    #[test]
    fn gauges_of_what_no_longer_reports_go_back_to_zero() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let mut known = Known {
            routes: vec!["a".into()],
            tables: Vec::new(),
        };
        let busy = GaugeReport {
            routes: vec![ferry_store::RouteGauges {
                route: "b".into(),
                dead: 3,
                ..Default::default()
            }],
            capture_dropped: vec![("public.orders".into(), 7)],
            ..Default::default()
        };
        metrics::with_local_recorder(&recorder, || publish_gauges(&busy, &mut known));
        let text = handle.render();
        assert!(text.contains("ferry_dead_deliveries{route=\"b\"} 3"), "{text}");
        assert!(
            text.contains("ferry_capture_dropped_events{table=\"public.orders\"} 7"),
            "{text}"
        );
        metrics::with_local_recorder(&recorder, || publish_gauges(&GaugeReport::default(), &mut known));
        let text = handle.render();
        assert!(text.contains("ferry_dead_deliveries{route=\"b\"} 0"), "{text}");
        assert!(text.contains("ferry_dead_deliveries{route=\"a\"} 0"), "{text}");
        assert!(
            text.contains("ferry_capture_dropped_events{table=\"public.orders\"} 0"),
            "{text}"
        );
    }
}
