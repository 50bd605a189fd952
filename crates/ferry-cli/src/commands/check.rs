use std::process::ExitCode;

use serde::Serialize;

use crate::config::Config;
use crate::sinks;

#[derive(Debug, Serialize)]
struct Finding {
    what: String,
    ok: bool,
    detail: String,
}

/// Checks the database and schema, then every route's destination.
pub async fn run(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let mut findings = Vec::new();
    findings.push(check_database(cfg).await);
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
            super::redact(&route.destination)
        );
        findings.push(match sink.check(route).await {
            Ok(()) => Finding {
                what,
                ok: true,
                detail: "reachable".into(),
            },
            Err(e) => Finding {
                what,
                ok: false,
                detail: e.to_string(),
            },
        });
    }
    for sink in sinks.values() {
        sink.close().await;
    }
    let failed = findings.iter().filter(|f| !f.ok).count();
    if json {
        println!("{}", serde_json::to_string_pretty(&findings)?);
    } else {
        for f in &findings {
            println!("{} {}: {}", if f.ok { "ok  " } else { "FAIL" }, f.what, f.detail);
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

async fn check_database(cfg: &Config) -> Finding {
    let what = format!("database {}", super::redact(&cfg.database.url));
    let mut conn = match super::connect(cfg).await {
        Ok(c) => c,
        Err(e) => {
            return Finding {
                what,
                ok: false,
                detail: format!("{e:#}"),
            };
        }
    };
    let known = ferry_store::postgres::MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
    let found: Result<Option<i32>, _> = sqlx::query_scalar("SELECT max(version) FROM ferry.schema_migrations")
        .fetch_one(&mut conn)
        .await;
    match found {
        Ok(Some(v)) if v == known => Finding {
            what,
            ok: true,
            detail: format!("schema at version {v}"),
        },
        Ok(Some(v)) if v > known => Finding {
            what,
            ok: false,
            detail: format!("schema version {v} is newer than this ferry ({known})"),
        },
        Ok(v) => Finding {
            what,
            ok: false,
            detail: format!(
                "schema at version {}, want {known}; run `ferry migrate`",
                v.unwrap_or(0)
            ),
        },
        Err(_) => Finding {
            what,
            ok: false,
            detail: "no ferry schema; run `ferry migrate`".into(),
        },
    }
}
