use std::ffi::OsStr;
use std::net::SocketAddr;

use anyhow::Context;
use metrics_exporter_prometheus::PrometheusHandle;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::{LOG_LEVELS, LogConfig, LogFormat, bare_target, check_log_filter};

/// The variable that, set and not blank, replaces `log.level`.
pub const RUST_LOG: &str = "RUST_LOG";

/// Logs go to stderr so that stdout stays clean for the stdout sink and
/// `--json` output. `RUST_LOG` overrides the configured level; one that
/// [`log_filter`] refuses is warned of on stderr and the configured level
/// used (`ferry run` refuses it before it gets here).
pub fn init_logs(cfg: &LogConfig) {
    init_logs_with(cfg, None);
}

/// [`init_logs`] beside a span exporter. The log level filters the log
/// lines only: the exporter gets every span at info and above, so that
/// `level = "warn"` does not also switch tracing off.
pub fn init_logs_with(cfg: &LogConfig, spans: Option<Box<dyn Layer<Registry> + Send + Sync>>) {
    let filter = log_filter(cfg, std::env::var_os(RUST_LOG).as_deref()).unwrap_or_else(|problem| {
        eprintln!("warning: {problem}; logging at log.level {:?} instead", cfg.level);
        EnvFilter::new(&cfg.level)
    });
    if let Some(warning) = rust_log_warning(std::env::var_os(RUST_LOG).as_deref()) {
        eprintln!("warning: {warning}");
    }
    let lines = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let lines = match cfg.format {
        LogFormat::Text => lines.with_filter(filter).boxed(),
        LogFormat::Json => lines.json().flatten_event(true).with_filter(filter).boxed(),
    };
    let spans = spans.map(|layer| layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    let _ = tracing_subscriber::registry().with(spans).with(lines).try_init();
}

/// The filter for log lines: `rust_log`, the value of `RUST_LOG` (passed in
/// so that tests need not set the process's), when it is set and not blank;
/// else `log.level`, checked when the config was read.
///
/// `RUST_LOG` gets the check `log.level` gets: a typo such as `verbose` would
/// be read by tracing as a target name and silence every line Ferry logs,
/// the warnings of dead deliveries included. A blank one is taken as unset,
/// as a shell's `RUST_LOG=` means, rather than as tracing's "errors only".
pub fn log_filter(cfg: &LogConfig, rust_log: Option<&OsStr>) -> Result<EnvFilter, String> {
    let unset = format!("unset {RUST_LOG} to log at log.level ({:?})", cfg.level);
    let level = match rust_log.map(OsStr::to_str) {
        None => cfg.level.as_str(),
        Some(None) => {
            return Err(format!(
                "{RUST_LOG}: not valid UTF-8; give a level such as \"info\", or {unset}"
            ));
        }
        Some(Some(value)) if value.trim().is_empty() => cfg.level.as_str(),
        Some(Some(value)) => {
            let value = value.trim();
            // A bare word naming a target (`ferry_relay`, or another
            // program's crate in a `RUST_LOG` the environment shares) is
            // tracing's own syntax, and was taken before: only one meant as
            // a level is refused.
            let checked = match bare_target(value) {
                Some(_) if !meant_as_level(value) => Ok(()),
                _ => check_log_filter(value),
            };
            checked.map_err(|problem| format!("{RUST_LOG}: {problem}; or {unset}"))?;
            value
        }
    };
    EnvFilter::try_new(level).map_err(|e| format!("{RUST_LOG} or log.level: {level:?} is not a valid filter ({e})"))
}

/// A warning for a `RUST_LOG` that [`log_filter`] takes but that hides
/// Ferry's own lines, the warnings of dead deliveries among them: a bare
/// target other than one of Ferry's (`RUST_LOG=lapin`).
pub fn rust_log_warning(rust_log: Option<&OsStr>) -> Option<String> {
    let value = rust_log?.to_str()?.trim();
    if value.is_empty() {
        return None;
    }
    let target = bare_target(value)?;
    if target == "ferry" || target.starts_with("ferry_") || meant_as_level(value) {
        return None;
    }
    Some(format!(
        "{RUST_LOG}={value:?} logs target {value:?} alone: Ferry's own lines, the warnings of dead deliveries \
         among them, are not logged; add a level for the rest, as in {RUST_LOG}=\"info,{value}=debug\""
    ))
}

/// Whether a bare word was meant as a level: another logger's level name
/// (`verbose`, `warning`) or a level misspelt by a letter (`debg`, `inf`).
fn meant_as_level(value: &str) -> bool {
    const ELSEWHERE: [&str; 10] = [
        "verbose",
        "warning",
        "fatal",
        "critical",
        "all",
        "none",
        "notice",
        "information",
        "err",
        "silent",
    ];
    let word = value.to_ascii_lowercase();
    ELSEWHERE.contains(&word.as_str()) || LOG_LEVELS.iter().any(|level| edit_distance(&word, level) <= 1)
}

/// Levenshtein distance, for words of a few letters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Installs the Prometheus recorder; [`crate::health::serve`] then serves
/// its text at `/metrics` beside the health probes. Durations get histogram
/// buckets (not summaries) so that dashboards can aggregate across relays.
pub fn install_metrics(addr: SocketAddr) -> anyhow::Result<PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: [f64; 14] = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    const BATCH: [f64; 10] = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ferry_relay::metrics::BATCH_SIZE.into()), &BATCH))
        .and_then(|b| b.install_recorder())
        .with_context(|| format!("metrics.listen: cannot set up metrics for {addr}"))?;
    ferry_relay::metrics::describe();
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(level: &str) -> LogConfig {
        LogConfig {
            format: LogFormat::Text,
            level: level.into(),
        }
    }

    fn filter(rust_log: Option<&str>) -> Result<String, String> {
        log_filter(&level("warn"), rust_log.map(OsStr::new)).map(|f| f.to_string())
    }

    /// `RUST_LOG=verbose` was read as a target name, which silenced every
    /// line Ferry logs; an invalid directive fell back to log.level
    /// without a word.
    #[test]
    fn rust_log_is_checked_as_log_level_is() {
        for bad in ["verbose", "ferry=loud", "[{"] {
            let e = filter(Some(bad)).unwrap_err();
            assert!(e.starts_with("RUST_LOG: "), "{bad}: {e}");
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
            assert!(
                e.contains("unset RUST_LOG to log at log.level (\"warn\")"),
                "{bad}: {e}"
            );
        }
        assert!(filter(Some("verbose")).unwrap_err().contains("unknown level"));
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let e = log_filter(&level("info"), Some(OsStr::from_bytes(b"\xff"))).unwrap_err();
            assert!(e.starts_with("RUST_LOG: not valid UTF-8"), "{e}");
        }
    }

    /// A bare target is tracing's own syntax: `RUST_LOG=ferry_relay`
    /// worked before it was checked, and a `RUST_LOG` shared with another
    /// program may name that program's crate. Only one that hides Ferry's
    /// lines is warned of.
    #[test]
    fn a_bare_target_is_taken_and_one_not_of_ferry_warned_of() {
        for target in ["ferry", "ferry_relay", "ferry_sink::kafka", "lapin", "my_app"] {
            assert_eq!(filter(Some(target)).unwrap(), format!("{target}=trace"), "{target}");
        }
        let warned = |v: &str| rust_log_warning(Some(OsStr::new(v)));
        for quiet in [
            "ferry",
            "ferry_relay",
            "ferry_sink::kafka",
            "info",
            "info,lapin=debug",
            "lapin=debug",
        ] {
            assert_eq!(warned(quiet), None, "{quiet}");
        }
        let warning = warned("lapin").unwrap();
        assert!(
            warning.contains("dead deliveries") && warning.contains("info,lapin"),
            "{warning}"
        );
        for level_meant in ["verbose", "WARNING", "debg", "inf", "eror", "trac"] {
            assert!(filter(Some(level_meant)).is_err(), "{level_meant}");
        }
    }

    #[test]
    fn rust_log_when_set_replaces_log_level() {
        assert_eq!(filter(None).unwrap(), "warn");
        assert_eq!(filter(Some("  ")).unwrap(), "warn");
        assert_eq!(filter(Some("debug")).unwrap(), "debug");
        assert_eq!(
            filter(Some("info,ferry_relay=debug")).unwrap(),
            "ferry_relay=debug,info"
        );
    }
}
