use std::process::ExitCode;

use serde::Serialize;

use crate::config::Config;
use crate::sinks;

#[derive(Debug, Default, Serialize)]
struct Finding {
    what: String,
    ok: bool,
    detail: String,
    /// What a passing check could not verify (bindings the broker would
    /// not show): printed as `warn`, and no failure.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    caveats: Vec<String>,
}

/// Checks what `ferry run` refuses before it connects, the database and
/// schema, then every route's destination.
pub async fn run(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let mut findings = refused_at_start(cfg);
    findings.push(check_database(cfg).await);
    // Table capture exists on PostgreSQL only.
    if !crate::store::is_sqlite(&cfg.database.url) {
        findings.extend(check_captures(cfg).await);
        #[cfg(feature = "postgres")]
        if cfg.relay.mode == crate::config::RelayMode::Wal {
            findings.extend(check_wal(cfg).await);
        } else {
            findings.extend(check_no_slot_unread(cfg).await);
        }
    }
    // Loading a config without routes is fine (migrate, status, capture
    // need none), but a relay cannot run on it.
    if cfg.routes.is_empty() {
        let caveat = format!("`ferry run` refuses this config: {}", super::NO_ROUTES);
        findings.push(Finding {
            what: "routes".into(),
            ok: true,
            detail: caveat.clone(),
            caveats: vec![caveat],
        });
    }
    let sinks = sinks::build(cfg)?;
    for (i, route) in cfg.routes.iter().enumerate() {
        let sink = &sinks[&route.sink];
        // Route, sink name and kind, and the destination as configured (a
        // template is checked only as far as the sink can without an event).
        let what = format!(
            "routes[{i}] ({}) -> sinks.{} ({}) {}",
            route.name,
            route.sink,
            sink.kind(),
            ferry_core::redact::url(&route.destination)
        );
        findings.push(match sink.check_with_caveats(route).await {
            Ok(caveats) if caveats.is_empty() => Finding {
                what,
                ok: true,
                detail: "reachable".into(),
                ..Finding::default()
            },
            Ok(caveats) => Finding {
                what,
                ok: true,
                detail: caveats.join("; "),
                caveats,
            },
            Err(e) => Finding {
                what,
                ok: false,
                detail: e.to_string(),
                ..Finding::default()
            },
        });
    }
    for sink in sinks.values() {
        sink.close().await;
    }
    findings.extend(check_unserved(cfg).await);
    let failed = findings.iter().filter(|f| !f.ok).count();
    if json {
        println!("{}", serde_json::to_string_pretty(&findings)?);
    } else {
        for f in &findings {
            let mark = match (f.ok, f.caveats.is_empty()) {
                (false, _) => "FAIL",
                (true, true) => "ok  ",
                (true, false) => "warn",
            };
            println!("{mark} {}: {}", f.what, f.detail);
        }
        if failed > 0 {
            println!("{failed} problem(s)");
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A failed finding per thing `ferry run` would refuse at start without
/// connecting anywhere, from the code `run` itself uses.
fn refused_at_start(cfg: &Config) -> Vec<Finding> {
    super::run::refusals(cfg)
        .into_iter()
        .map(|problem| {
            // Each names its setting first: `retention.archive_dir: ...`.
            let (what, detail) = problem.split_once(": ").unwrap_or(("start-up", &problem));
            Finding {
                what: what.to_owned(),
                ok: false,
                detail: detail.to_owned(),
                ..Finding::default()
            }
        })
        .collect()
}

/// A finding per route name that holds undelivered deliveries but is not in
/// the config. A database that cannot be read is a finding of its own.
async fn check_unserved(cfg: &Config) -> Vec<Finding> {
    use ferry_store::Gauges;
    let Ok(store) = super::store(cfg) else {
        return Vec::new();
    };
    let Ok(gauges) = store.gauges().await else {
        return Vec::new();
    };
    super::unserved::from_gauges(cfg, &gauges)
        .into_iter()
        .map(|u| Finding {
            what: format!("route {:?}", u.route),
            ok: false,
            detail: u.detail(),
            ..Finding::default()
        })
        .collect()
}

async fn check_database(cfg: &Config) -> Finding {
    let what = format!("database {}", ferry_core::redact::url(&cfg.database.url));
    let found = match super::store(cfg) {
        Ok(store) => store.schema_version().await.map_err(|e| {
            format!(
                "cannot read the schema version from the database ({}): {e}",
                ferry_core::redact::url(&cfg.database.url)
            )
        }),
        Err(e) => Err(format!("{e:#}")),
    };
    let (ok, detail) = match found {
        Ok((Some(v), known)) if v == known => (true, format!("schema at version {v}")),
        Ok((Some(v), known)) if v > known => (false, format!("schema version {v} is newer than this ferry ({known})")),
        Ok((Some(v), known)) => (
            false,
            format!("schema at version {v}, want {known}; run `ferry migrate`"),
        ),
        Ok((None, _)) => (false, "no ferry schema; run `ferry migrate`".into()),
        Err(detail) => (false, detail),
    };
    Finding {
        what,
        ok,
        detail,
        ..Finding::default()
    }
}

#[cfg(feature = "postgres")]
/// WAL streaming: wal_level, the role's REPLICATION grant, the publication
/// and the slot with its lag, each problem with its fix.
async fn check_wal(cfg: &Config) -> Vec<Finding> {
    use ferry_store::postgres::wal::{WalConfig, diagnose};
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return Vec::new();
    };
    let config = WalConfig {
        url: cfg.database.url.clone(),
        slot: cfg.relay.wal_slot.clone(),
        publication: cfg.relay.wal_publication.clone(),
    };
    diagnose(pg.pool(), &config, cfg.relay.wal_lag_budget)
        .await
        .into_iter()
        .map(|f| Finding {
            what: f.what,
            ok: f.ok,
            detail: f.detail,
            ..Finding::default()
        })
        .collect()
}

#[cfg(feature = "postgres")]
/// Polling: a WAL slot that `ferry.emit` still writes tableless events for
/// would have them read by nobody. Silent when there is none.
async fn check_no_slot_unread(cfg: &Config) -> Vec<Finding> {
    let Ok(crate::store::AnyStore::Postgres(pg)) = super::store(cfg) else {
        return Vec::new();
    };
    match ferry_store::postgres::wal::emit_slots(pg.pool(), None).await {
        Ok(slots) => slots
            .first()
            .map(|slot| Finding {
                what: format!("WAL slot {slot}"),
                ok: false,
                detail: super::run::poll_beside_slot(slot),
                ..Finding::default()
            })
            .into_iter()
            .collect(),
        // No schema, no database: already findings of their own.
        Err(_) => Vec::new(),
    }
}

/// A finding per captured table: its trigger matches the table, or is out
/// of date with the fix. A database that cannot be reached is already a
/// finding of its own.
async fn check_captures(cfg: &Config) -> Vec<Finding> {
    let Ok(mut conn) = super::connect(cfg).await else {
        return Vec::new();
    };
    match super::capture::check_findings(&mut conn).await {
        Ok(found) => found
            .into_iter()
            .map(|(what, ok, detail)| Finding {
                what,
                ok,
                detail,
                ..Finding::default()
            })
            .collect(),
        Err(e) => vec![Finding {
            what: "captured tables".into(),
            ok: false,
            detail: format!("{e:#}"),
            ..Finding::default()
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config with an archive directory that does not exist, retention
    /// `enabled` or not, and, in a binary without `otel`, a `[tracing]`
    /// section.
    fn config(archive_dir: &std::path::Path, enabled: bool) -> Config {
        let tracing = if cfg!(feature = "otel") {
            ""
        } else {
            "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"
        };
        crate::config::from_toml_str(&format!(
            "[database]\nurl = \"postgres://h/db\"\n[retention]\nenabled = {enabled}\narchive_dir = \"{}\"\n{tracing}",
            archive_dir.display()
        ))
        .unwrap()
    }

    /// `ferry run` refuses these before it connects anywhere; `check`
    /// passed them.
    #[test]
    fn what_run_refuses_at_start_fails_check() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let findings = refused_at_start(&config(&missing, true));
        let archive = findings
            .iter()
            .find(|f| f.what == "retention.archive_dir")
            .unwrap_or_else(|| panic!("{findings:?}"));
        assert!(!archive.ok);
        assert!(
            archive
                .detail
                .starts_with(&format!("cannot write to {}", missing.display())),
            "{archive:?}"
        );
        let tracing = findings.iter().find(|f| f.what == "tracing.otlp_endpoint");
        if cfg!(feature = "otel") {
            assert!(tracing.is_none(), "{findings:?}");
        } else {
            let tracing = tracing.unwrap_or_else(|| panic!("{findings:?}"));
            assert!(!tracing.ok && tracing.detail.contains("built without the `otel` feature"));
        }
        // With retention off, a relay writes no archive.
        let off = refused_at_start(&config(&missing, false));
        assert!(off.iter().all(|f| f.what != "retention.archive_dir"), "{off:?}");
        std::fs::create_dir(&missing).unwrap();
        let made = refused_at_start(&config(&missing, true));
        assert!(made.iter().all(|f| f.what != "retention.archive_dir"), "{made:?}");
    }
}
