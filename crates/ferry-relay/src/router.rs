use std::collections::HashSet;
use std::sync::Arc;

use ferry_core::{Clock, Route, RoutePlan, Store, UnroutedEvent};
use tokio::time::{Duration, Instant};
use tracing::{debug, warn};

use crate::engine::Shared;
use crate::metrics;

/// Which routes each event goes to. An event that matches none gets an empty
/// plan, which the store records as dead with reason `no route`.
pub fn plan_routes(routes: &[Route], events: Vec<UnroutedEvent>) -> Vec<RoutePlan> {
    events
        .into_iter()
        .map(|event| {
            let routes = routes
                .iter()
                .filter(|r| r.matcher.matches(&event.event_type))
                .map(|r| r.name.clone())
                .collect();
            RoutePlan { event, routes }
        })
        .collect()
}

/// Re-checks after this relay tells producers it sleeps: a producer that read
/// the flag just before it flipped commits without notifying, and one of
/// these polls finds its event.
const RECHECKS: [Duration; 3] = [
    Duration::from_millis(5),
    Duration::from_millis(50),
    Duration::from_millis(500),
];

pub(crate) async fn run<S: Store, C: Clock>(shared: Arc<Shared<S, C>>) {
    let mut sleeping = false;
    let mut rechecks: Vec<Duration> = Vec::new();
    let mut backoff = Duration::from_millis(50);
    loop {
        if shared.cancel.is_cancelled() {
            return;
        }
        let gate = shared.gate.read().await;
        let Some(owned) = shared.valid_ownership() else {
            drop(gate);
            shared.wait_for_lease().await;
            continue;
        };
        let fetched = shared.store.fetch_unrouted(&owned, shared.settings.batch_size).await;
        let events = match fetched {
            Ok(events) => events,
            Err(err) => {
                drop(gate);
                warn!(error = %err, "fetching unrouted events failed; retrying");
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "fetch_unrouted").increment(1);
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let full = events.len() >= shared.settings.batch_size;
        if !events.is_empty() {
            let plans = plan_routes(&shared.routes, events);
            let touched: HashSet<&str> = plans.iter().flat_map(|p| p.routes.iter().map(String::as_str)).collect();
            let unroutable = plans.iter().filter(|p| p.routes.is_empty()).count();
            let mut per_type: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
            for p in &plans {
                *per_type.entry(p.event.event_type.as_str()).or_default() += 1;
            }
            match shared.store.route(&owned, &plans, shared.clock.now()).await {
                Ok(n) => {
                    debug!(routed = n, "routed events");
                    ::metrics::counter!(metrics::ROUTED).increment(n);
                    // A store that routed fewer (a lost lease) leaves the rest
                    // to the relay that routes them next.
                    if n as usize == plans.len() {
                        for (event_type, count) in per_type {
                            ::metrics::counter!(metrics::ENQUEUED, "type" => event_type.to_owned()).increment(count);
                        }
                    }
                    if unroutable > 0 {
                        warn!(
                            events = unroutable,
                            "events matched no route and are dead with reason `no route`"
                        );
                        ::metrics::counter!(metrics::UNROUTABLE).increment(unroutable as u64);
                    }
                    for name in touched {
                        shared.wake_route(name);
                    }
                }
                Err(err) => {
                    drop(gate);
                    warn!(error = %err, "routing events failed; retrying");
                    ::metrics::counter!(metrics::STORE_ERRORS, "op" => "route").increment(1);
                    shared.sleep(backoff).await;
                    continue;
                }
            }
        }
        drop(gate);
        if full {
            // Busy: keep going without waiting, and spare producers the NOTIFY.
            if sleeping && shared.store.set_sleeping(&shared.settings.id, false).await.is_ok() {
                sleeping = false;
            }
            continue;
        }
        if !sleeping {
            match shared.store.set_sleeping(&shared.settings.id, true).await {
                Ok(()) => {
                    sleeping = true;
                    rechecks = RECHECKS.iter().rev().copied().collect();
                    continue;
                }
                Err(err) => warn!(error = %err, "could not ask producers for notifications; polling instead"),
            }
        }
        let wait = rechecks.pop().unwrap_or(shared.settings.poll_interval);
        let deadline = Instant::now() + wait;
        tokio::select! {
            _ = shared.router_wake.notified() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            _ = shared.cancel.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::Glob;

    fn route(name: &str, glob: &str) -> Route {
        Route {
            name: name.into(),
            matcher: Glob::new(glob).unwrap(),
            sink: "s".into(),
            destination: "d".into(),
            routing_key: None,
        }
    }

    fn ev(seq: i64, t: &str) -> UnroutedEvent {
        UnroutedEvent {
            seq,
            partition: 0,
            event_type: t.into(),
            key: None,
        }
    }

    #[test]
    fn events_fan_out_to_every_matching_route_and_unmatched_get_none() {
        let routes = [
            route("orders", "order.*"),
            route("audit", "**"),
            route("billing", "billing.**"),
        ];
        let plans = plan_routes(
            &routes,
            vec![
                ev(1, "order.created"),
                ev(2, "billing.invoice.paid"),
                ev(3, "user.created"),
            ],
        );
        assert_eq!(plans[0].routes, vec!["orders", "audit"]);
        assert_eq!(plans[1].routes, vec!["audit", "billing"]);
        assert_eq!(plans[2].routes, vec!["audit"]);
        let plans = plan_routes(&routes[..1], vec![ev(4, "user.created")]);
        assert!(plans[0].routes.is_empty());
    }
}
