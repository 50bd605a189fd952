//! `ferry purge`, and the same retention run in the background of `ferry run`.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use ferry_relay::metrics as names;
use ferry_store::{PurgeError, PurgeOptions, PurgeReport, Retention, purge};
use tokio::sync::watch;
use tracing::{error, info};

use super::UsageError;
use crate::config::{Config, RetentionConfig};

/// Runs retention once, now, with the configured rules.
pub async fn run(cfg: &Config, dry_run: bool, json: bool) -> anyhow::Result<ExitCode> {
    // A dry run too: it answers what the real run would do, and that run
    // would stop at an archive it cannot write.
    if let Some(dir) = &cfg.retention.archive_dir {
        check_archive_dir(dir)?;
    }
    let store = super::store(cfg)?;
    let options = PurgeOptions {
        dry_run,
        archive_dir: cfg.retention.archive_dir.clone(),
        stop: None,
    };
    let result = purge(&store, &cfg.retention.rules(), &options, chrono::Utc::now()).await;
    let report = match &result {
        Ok(r) => r,
        Err(e) => e.done(),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        println!("{}", render(report));
    }
    result?;
    Ok(ExitCode::SUCCESS)
}

fn render(r: &PurgeReport) -> String {
    if r.dry_run {
        return format!(
            "would delete {} events in {} batches (dry run: nothing changed)",
            r.events, r.batches
        );
    }
    let mut out = format!(
        "deleted {} events and {} deliveries in {} batches",
        r.events, r.deliveries, r.batches
    );
    if let Some(file) = &r.archive_file {
        out.push_str(&format!("; archived {} events to {}", r.archived, file.display()));
    }
    out
}

/// Fails start-up, naming the field, when the archive directory cannot take
/// a file: better now than at the first batch, hours later.
pub(crate) fn check_archive_dir(dir: &Path) -> Result<(), UsageError> {
    let probe = dir.join(format!(".ferry-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| {
            UsageError(format!(
                "retention.archive_dir: cannot write to {} ({e}); create the directory and make it writable \
                 by this user, or remove archive_dir to delete without archiving",
                dir.display()
            ))
        })
}

/// Runs retention every `interval` until `stop` turns true; a run in
/// progress finishes its batch first. Failures are logged and counted, and
/// the next run tries again.
pub(crate) async fn background<R: Retention + ?Sized>(
    store: Arc<R>,
    cfg: RetentionConfig,
    mut stop: watch::Receiver<bool>,
) {
    let rules = cfg.rules();
    loop {
        let options = PurgeOptions {
            dry_run: false,
            archive_dir: cfg.archive_dir.clone(),
            stop: Some(stop.clone()),
        };
        let result = purge(store.as_ref(), &rules, &options, chrono::Utc::now()).await;
        record(&result);
        tokio::select! {
            _ = tokio::time::sleep(cfg.interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

fn record(result: &Result<PurgeReport, PurgeError>) {
    let done = match result {
        Ok(r) => r,
        Err(e) => e.done(),
    };
    ::metrics::counter!(names::RETENTION_DELETED).increment(done.events);
    ::metrics::counter!(names::RETENTION_ARCHIVED).increment(done.archived);
    match result {
        Ok(r) => {
            let now = chrono::Utc::now().timestamp_millis() as f64 / 1000.0;
            ::metrics::gauge!(names::RETENTION_LAST_SUCCESS).set(now);
            if r.events > 0 {
                info!(
                    events = r.events,
                    deliveries = r.deliveries,
                    archived = r.archived,
                    "retention deleted settled events"
                );
            }
        }
        Err(e) => {
            let kind = match e {
                PurgeError::Archive { .. } => "archive",
                _ => "store",
            };
            ::metrics::counter!(names::RETENTION_ERRORS, "kind" => kind).increment(1);
            error!(error = %e, deleted = done.events, "retention stopped");
        }
    }
}
