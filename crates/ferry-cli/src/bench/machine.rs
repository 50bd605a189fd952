//! Facts about the machine and the run, printed above the figures, and the
//! process's own memory as Linux reports it.

use sqlx::PgPool;

/// What the figures were measured on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Machine {
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub memory_kib: Option<u64>,
    pub postgres: String,
    pub date: String,
    pub command: String,
    pub release_build: bool,
}

pub(crate) async fn gather(pool: &PgPool) -> Machine {
    let postgres = super::db::server_version(pool)
        .await
        .unwrap_or_else(|e| format!("unknown ({e})"));
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model: proc_field("/proc/cpuinfo", "model name"),
        memory_kib: proc_field("/proc/meminfo", "MemTotal").and_then(|v| kib(&v)),
        postgres,
        date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
        command: command_line(),
        release_build: !cfg!(debug_assertions),
    }
}

/// The command line as typed, quoted where a shell would need it.
fn command_line() -> String {
    let mut args = std::env::args();
    // The binary as `ferry`, not the absolute path cargo ran it from.
    let bin = args
        .next()
        .map_or_else(|| "ferry".to_owned(), |a| basename(&a).to_owned());
    std::iter::once(bin)
        // A URL's password never reaches the report.
        .chain(args.map(|a| crate::commands::shell_quote(&ferry_core::redact::url(&a))))
        .collect::<Vec<_>>()
        .join(" ")
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The value after `name:` on the first matching line of a /proc file.
fn proc_field(path: &str, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(k, _)| k.trim() == name)
        .map(|(_, v)| v.trim().to_owned())
}

/// "123456 kB" as 123456.
fn kib(value: &str) -> Option<u64> {
    value.split_whitespace().next()?.parse().ok()
}

/// This process's resident set now (`VmRSS`) and at its peak (`VmHWM`), KiB.
pub(crate) fn rss_kib() -> (Option<u64>, Option<u64>) {
    let now = proc_field("/proc/self/status", "VmRSS").and_then(|v| kib(&v));
    let peak = proc_field("/proc/self/status", "VmHWM").and_then(|v| kib(&v));
    (now, peak)
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0), so that the peak read
/// later belongs to what ran in between. Returns whether it worked.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::shell_quote;

    #[test]
    fn quoting_and_units() {
        assert_eq!(shell_quote("--only"), "--only");
        assert_eq!(shell_quote("drain,latency"), "drain,latency");
        assert_eq!(
            shell_quote("postgres://root@127.0.0.1:5432/postgres"),
            "postgres://root@127.0.0.1:5432/postgres"
        );
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(basename("/opt/ferry/target/release/ferry"), "ferry");
        assert_eq!(kib("24684512 kB"), Some(24_684_512));
        assert_eq!(kib("n/a"), None);
    }
}
