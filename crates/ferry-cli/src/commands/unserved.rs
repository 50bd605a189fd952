//! Deliveries left on a route name the config does not have.
//!
//! A route's name keys its delivery state, so renaming a route, or changing
//! the destination of one without a `name` (its default name is
//! `<sink>:<destination>`), leaves its pending and dead deliveries under a
//! name no relay running the new config claims: they would wait for ever,
//! unsaid. `check` fails on them, `run` logs them at start, `status` marks
//! their route, and `requeue` refuses to send them again, each with the
//! same two fixes.
//!
//! The counts come from the queries `status` and the gauges already make;
//! nothing here reads the outbox on its own.

use ferry_core::NO_ROUTE;
use ferry_store::{GaugeReport, StatusReport};

use crate::config::Config;

/// Undelivered work on a route name the config does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unserved {
    pub route: String,
    /// Pending, in flight or waiting for a retry.
    pub pending: u64,
    pub dead: u64,
}

/// Whether the config has a route named `route`. `(no route)` is no route
/// at all, but its deliveries go back to the router when requeued, so they
/// are never stranded: it counts as configured.
pub fn configured(cfg: &Config, route: &str) -> bool {
    route == NO_ROUTE || cfg.routes.iter().any(|r| r.name == route)
}

/// The unserved routes among the gauges' (cheap: they read only the work
/// left). A config without routes cannot tell which routes the relays
/// serve, and finds none.
pub fn from_gauges(cfg: &Config, gauges: &GaugeReport) -> Vec<Unserved> {
    collect(cfg, gauges.routes.iter().map(|g| (&g.route, g.pending, g.dead)))
}

/// [`from_gauges`] from a status report.
pub fn from_status(cfg: &Config, report: &StatusReport) -> Vec<Unserved> {
    collect(
        cfg,
        report.routes.iter().map(|s| (&s.route, s.pending + s.retrying, s.dead)),
    )
}

fn collect<'a>(cfg: &Config, routes: impl Iterator<Item = (&'a String, u64, u64)>) -> Vec<Unserved> {
    if cfg.routes.is_empty() {
        return Vec::new();
    }
    routes
        .filter(|&(route, pending, dead)| pending + dead > 0 && !configured(cfg, route))
        .map(|(route, pending, dead)| Unserved {
            route: route.clone(),
            pending,
            dead,
        })
        .collect()
}

impl Unserved {
    /// `route "x" is not in the config, ...` with both fixes.
    pub fn explain(&self) -> String {
        format!("route {:?} is {}", self.route, self.detail())
    }

    /// What is wrong and both fixes, after the route's name.
    pub fn detail(&self) -> String {
        format!(
            "not in the config, yet {} pending and {} dead deliveries wait on it: no relay running \
             this config delivers them. {}",
            self.pending,
            self.dead,
            fixes(&self.route)
        )
    }
}

/// How to deliver what waits on `route`, or let it go.
pub fn fixes(route: &str) -> String {
    format!(
        "If the route was renamed, or its destination changed while it had no `name` (the default \
         name is <sink>:<destination>), give it name = {route:?} to keep its identity; otherwise \
         cancel them: `ferry cancel --route {} --state pending --state retrying --state dead --reason \
         \"<why>\"` (it refuses pending deliveries a running relay may hold: run it with the relays \
         stopped)",
        super::shell_quote(route)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_route_name_is_one_shell_word() {
        assert_eq!(crate::commands::shell_quote("rabbit:orders.v2"), "rabbit:orders.v2");
        assert_eq!(crate::commands::shell_quote("my orders"), "'my orders'");
        assert_eq!(crate::commands::shell_quote("it's"), r"'it'\''s'");
        assert_eq!(crate::commands::shell_quote(""), "''");
    }
}
