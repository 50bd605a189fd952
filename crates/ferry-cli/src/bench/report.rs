//! The report: machine facts, then one table of scenario | figure | target |
//! met?, in markdown. Also the percentile summary and the number formats.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;

use super::broker::{self, BrokerResult};
use super::drain::DrainResult;
use super::idle::IdleResult;
use super::latency::LatencyResult;
use super::machine::Machine;
use super::producer::{ProducerResult, Variant};
use super::sinks::SinksResult;

/// Drain rate as a share of the broker's own rate.
pub(crate) const DRAIN_TARGET: f64 = 0.75;
pub(crate) const P50_TARGET_US: u64 = 3_000;
pub(crate) const P99_TARGET_US: u64 = 15_000;
/// WAL streaming mode's p99 target (issue: under 10 ms at 500 events/s).
const WAL_P99_TARGET_US: u64 = 10_000;
/// Transactions per second an idle relay may cost.
pub(crate) const IDLE_TARGET: f64 = 0.2;
/// `ferry.enqueue` with a busy relay, as a share of a plain INSERT.
pub(crate) const PRODUCER_TARGET: f64 = 0.90;
/// Hot-key drain as a share of the many-keys drain.
pub(crate) const HOTKEY_TARGET: f64 = 0.5;

/// A sink's drain as a share of its own baseline (or of the hand-over rate).
pub(crate) const SINK_DRAIN_TARGET: f64 = 0.75;
/// Fan-out time as a multiple of the slowest single-sink drain.
pub(crate) const FANOUT_TARGET: f64 = 1.0;

/// `--write` replaces what lies between these lines and keeps the rest.
pub(crate) const BEGIN_MARK: &str = "<!-- ferry bench: begin -->";
pub(crate) const END_MARK: &str = "<!-- ferry bench: end -->";

/// Latency percentiles, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl Percentiles {
    /// `None` for an empty histogram.
    pub(crate) fn of(h: &Histogram<u64>) -> Option<Self> {
        (!h.is_empty()).then(|| Self {
            count: h.len(),
            p50: h.value_at_quantile(0.50),
            p90: h.value_at_quantile(0.90),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
        })
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "p50 {}, p90 {}, p99 {}, max {}",
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.max)
        )
    }
}

/// Everything one run measured; scenarios not run stay empty.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub machine: Option<Machine>,
    /// The flags that shape the figures, already described.
    pub settings: String,
    pub broker: Option<BrokerResult>,
    pub drain: Option<DrainResult>,
    /// Per drain round: its rate as a share of that round's broker rate.
    pub drain_shares: Vec<f64>,
    /// The plain broker baseline with one property more (a timestamp).
    pub broker_stamped: Option<BrokerResult>,
    /// The broker baseline with the RabbitMQ sink's message properties.
    pub broker_ferry_format: Option<BrokerResult>,
    /// Per drain round: its rate as a share of that round's
    /// `broker_ferry_format` rate.
    pub format_shares: Vec<f64>,
    pub latency: Option<LatencyResult>,
    pub wal_latency: Option<LatencyResult>,
    pub wal_drain: Option<DrainResult>,
    pub idle: Option<IdleResult>,
    pub producer: Vec<ProducerResult>,
    pub hotkey: Option<DrainResult>,
    pub sinks: Option<SinksResult>,
    pub retention: Option<super::retention::RetentionResult>,
    pub wall: Option<Duration>,
    /// Why the run stopped before its last scenario: the report is partial.
    pub stopped: Option<String>,
}

/// Ends a baseline's parenthesis, naming the rounds it is the middle of.
fn close_rounds(figure: &mut String, rounds: usize) {
    if rounds > 1 {
        let _ = write!(figure, "; middle of {rounds} rounds");
    }
    figure.push(')');
}

struct Row {
    scenario: String,
    figure: String,
    target: &'static str,
    met: Option<bool>,
}

impl Report {
    /// Whether any scenario completed.
    pub(crate) fn has_results(&self) -> bool {
        self.broker.is_some()
            || self.drain.is_some()
            || self.latency.is_some()
            || self.wal_latency.is_some()
            || self.wal_drain.is_some()
            || self.idle.is_some()
            || !self.producer.is_empty()
            || self.hotkey.is_some()
            || self.sinks.is_some()
            || self.retention.is_some()
    }

    pub(crate) fn render(&self) -> String {
        let mut out = String::from("## Results\n\n");
        if let Some(why) = &self.stopped {
            let _ = writeln!(
                out,
                "**Partial report**: the run stopped before its end ({}); only the scenarios that \
                 completed before that are below.\n",
                why.replace('\n', " ")
            );
        }
        if let Some(m) = &self.machine {
            let memory = m
                .memory_kib
                .map_or_else(String::new, |k| format!(", {} memory", gib(k)));
            let cpu = m.cpu_model.as_deref().map_or_else(String::new, |c| format!(" ({c})"));
            let build = if m.release_build {
                "release"
            } else {
                "**debug** (not representative)"
            };
            let _ = writeln!(out, "- date: {}", m.date);
            let _ = writeln!(out, "- command: `{}` ({build} build)", m.command);
            let _ = writeln!(out, "- machine: {} CPUs{cpu}{memory}", m.cpus);
            let _ = writeln!(out, "- PostgreSQL {}", m.postgres);
        }
        if !self.settings.is_empty() {
            let _ = writeln!(out, "- settings: {}", self.settings);
        }
        if let Some(wall) = self.wall {
            let _ = writeln!(out, "- wall time: {}", minutes(wall));
        }
        out.push_str("\n| scenario | figure | target | met? |\n| --- | --- | --- | --- |\n");
        for row in self.rows() {
            let met = match row.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "–",
            };
            let _ = writeln!(out, "| {} | {} | {} | {met} |", row.scenario, row.figure, row.target);
        }
        if let Some(r) = &self.retention {
            let _ = writeln!(
                out,
                "\n### Retention: outbox size under {} events/s for {} s, published window {} s\n",
                r.rate,
                r.seconds,
                r.window.as_secs()
            );
            let _ = writeln!(
                out,
                "{} events sent, {} deleted by retention; size at the end over size once the window was \
                 full: {}.\n",
                thousands(r.sent),
                thousands(r.deleted),
                r.growth().map_or_else(|| "–".into(), |g| format!("{g:.2}x"))
            );
            out.push_str(&r.table());
        }
        out
    }

    fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        let mut row = |scenario: &str, figure: String, target: &'static str, met: Option<bool>| {
            rows.push(Row {
                scenario: scenario.to_owned(),
                figure,
                target,
                met,
            })
        };
        let broker = self.broker.as_ref().map(BrokerResult::rate);
        if let Some(b) = &self.broker {
            let mut figure = format!(
                "{} confirmed publishes/s ({} in windows of {}",
                rate(b.rate()),
                thousands(b.events),
                thousands(b.window as u64)
            );
            close_rounds(&mut figure, self.drain_shares.len());
            row("broker", figure, "baseline", None);
        }
        if let (Some(s), Some(b)) = (&self.broker_stamped, broker) {
            let mut figure = format!(
                "{} confirmed publishes/s = {} of broker (the plain publishes with a timestamp property: \
                 {} bytes of encoded properties against {}",
                rate(s.rate()),
                pct(s.rate() / b),
                broker::PLAIN_PROPERTY_BYTES + broker::TIMESTAMP_BYTES,
                broker::PLAIN_PROPERTY_BYTES,
            );
            close_rounds(&mut figure, self.drain_shares.len());
            row("broker: one property more", figure, "–", None);
        }
        let formatted = self.broker_ferry_format.as_ref().map(BrokerResult::rate);
        if let Some(f) = formatted {
            let mut figure = format!("{} confirmed publishes/s", rate(f));
            if let Some(b) = broker {
                let _ = write!(figure, " = {} of broker", pct(f / b));
            }
            let _ = write!(
                figure,
                " (the same publishes with the properties and CloudEvents headers the RabbitMQ sink sends, \
                 spread by key over its {} channels",
                broker::Format::Ferry.channels()
            );
            close_rounds(&mut figure, self.format_shares.len());
            row("broker: Ferry's messages", figure, "–", None);
        }
        if let Some(d) = &self.drain {
            let share = broker.map(|b| d.rate() / b);
            let mut figure = match share {
                Some(s) => format!("{} events/s = {} of broker", rate(d.rate()), pct(s)),
                None => format!("{} events/s", rate(d.rate())),
            };
            if let Some((low, high)) = spread(&self.drain_shares) {
                let _ = write!(
                    figure,
                    " (middle of {} rounds; rounds {}–{})",
                    self.drain_shares.len(),
                    pct(low),
                    pct(high)
                );
            }
            if let Some(f) = formatted {
                let _ = write!(figure, "; {} of broker with Ferry's messages", pct(d.rate() / f));
                if let Some((low, high)) = spread(&self.format_shares) {
                    let _ = write!(figure, " (rounds {}–{})", pct(low), pct(high));
                }
            }
            row("drain", figure, "≥ 75% of broker", share.map(|s| s >= DRAIN_TARGET));
            let figure = format!(
                "{} events/s (enqueue_batch, 1,000 per transaction)",
                rate(d.prefill_rate())
            );
            row("drain: prefill", figure, "–", None);
            if let (Some(before), Some(peak)) = (d.rss_before_kib, d.peak_rss_kib) {
                let figure = format!("peak RSS {} (at relay start: {})", mib(peak), mib(before));
                row("drain: memory", figure, "bounded", None);
            }
            if let Some(t) = d.transactions_per_batch() {
                let figure = format!("{t:.1} transactions per batch of {}", d.batch_size);
                row("drain: database", figure, "–", None);
            }
        }
        if let Some(d) = &self.wal_drain {
            let share = broker.map(|b| d.rate() / b);
            let figure = match share {
                Some(s) => format!("{} events/s = {} of broker", rate(d.rate()), pct(s)),
                None => format!("{} events/s", rate(d.rate())),
            };
            row("wal drain", figure, "–", None);
            if let Some(t) = d.transactions_per_batch() {
                let figure = format!("{t:.1} transactions per batch of {}", d.batch_size);
                row("wal drain: database", figure, "–", None);
            }
        }
        // (result, label, p50 target, p99 target): the table mode, then WAL streaming.
        let latencies = [
            (
                &self.latency,
                "latency",
                Some(("< 3 ms", P50_TARGET_US)),
                ("< 15 ms", P99_TARGET_US),
            ),
            (&self.wal_latency, "wal latency", None, ("< 10 ms", WAL_P99_TARGET_US)),
        ];
        for (result, label, p50_target, (p99_text, p99_us)) in latencies {
            let Some(l) = result else { continue };
            if let Some(p) = l.latency {
                match p50_target {
                    Some((text, us)) => row(&format!("{label} p50"), ms(p.p50), text, Some(p.p50 < us)),
                    None => row(&format!("{label} p50"), ms(p.p50), "–", None),
                }
                row(&format!("{label} p90"), ms(p.p90), "–", None);
                row(&format!("{label} p99"), ms(p.p99), p99_text, Some(p.p99 < p99_us));
                row(&format!("{label} max"), ms(p.max), "–", None);
            }
            let figure = format!(
                "{} of {} at {}/s ({} missing)",
                thousands(l.sent - l.missing),
                thousands(l.sent),
                rate(l.achieved_rate()),
                l.missing
            );
            row(&format!("{label}: delivered"), figure, "all", Some(l.missing == 0));
        }
        if let Some(i) = &self.idle {
            let figure = format!(
                "{:.3} transactions/s ({} in {:.0} s)",
                i.per_second(),
                i.transactions,
                i.window.as_secs_f64()
            );
            row("idle", figure, "< 0.2/s", Some(i.per_second() < IDLE_TARGET));
        }
        let plain = self
            .producer
            .iter()
            .find(|p| p.variant == Variant::PlainInsert)
            .map(ProducerResult::rate);
        for p in &self.producer {
            let share = plain
                .filter(|_| p.variant != Variant::PlainInsert)
                .map(|b| p.rate() / b);
            let figure = match share {
                Some(s) => format!("{} commits/s = {} of (a)", rate(p.rate()), pct(s)),
                None => format!("{} commits/s", rate(p.rate())),
            };
            let (target, met) = match p.variant {
                Variant::PlainInsert => ("baseline", None),
                Variant::SqlBusy => ("≥ 90% of (a)", share.map(|s| s >= PRODUCER_TARGET)),
                _ => ("–", None),
            };
            row(&format!("producer {}", p.variant.label()), figure, target, met);
        }
        if let Some(h) = &self.hotkey {
            let share = self.drain.as_ref().map(|d| h.rate() / d.rate());
            let figure = match share {
                Some(s) => format!("{} events/s = {} of drain", rate(h.rate()), pct(s)),
                None => format!("{} events/s", rate(h.rate())),
            };
            row(
                "hot key (1 key)",
                figure,
                "≥ 50% of drain",
                share.map(|s| s >= HOTKEY_TARGET),
            );
        }
        if let Some(s) = &self.sinks {
            sink_rows(s, &mut row);
        }
        rows
    }
}

fn sink_rows(s: &SinksResult, row: &mut impl FnMut(&str, String, &'static str, Option<bool>)) {
    let n = s.events;
    let rounds = if s.rounds > 1 {
        format!(", median of {} rounds", s.rounds)
    } else {
        String::new()
    };
    let handover = s.handover.map(|d| per_second(n, d));
    if let Some(h) = handover {
        let figure = format!("{} events/s (relay into a sink that only counts{rounds})", rate(h));
        row("sinks: hand-over", figure, "–", None);
    }
    for k in &s.sinks {
        let base = k.baseline_rate(n);
        let shape = match k.in_flight {
            Some(c) => format!("{c} requests in flight"),
            None => format!("windows of {}", thousands(s.window as u64)),
        };
        let figure = format!(
            "{} confirmed publishes/s ({} in {shape}{rounds})",
            rate(base),
            thousands(n)
        );
        row(&format!("sinks: {} baseline", k.kind), figure, "baseline", None);
        let drained = k.drain_rate(n);
        let alone = k.alone_rate(n);
        let figure = format!(
            "{} events/s = {} of baseline; the drain reaches {} of it (the sink publishing batches of {} \
             one after another, without the database)",
            rate(alone),
            pct(alone / base),
            pct(drained / alone),
            thousands(s.window as u64)
        );
        row(&format!("sinks: {} alone", k.kind), figure, "–", None);
        let share = drained / base;
        let mut figure = format!("{} events/s = {} of baseline", rate(drained), pct(share));
        if let Some((low, high)) = spread(&k.shares) {
            let _ = write!(figure, " (rounds {}–{})", pct(low), pct(high));
        }
        if let Some(h) = handover {
            let _ = write!(figure, ", {} of hand-over", pct(drained / h));
        }
        let met = share >= SINK_DRAIN_TARGET || handover.is_some_and(|h| drained / h >= SINK_DRAIN_TARGET);
        row(
            &format!("sinks: {} drain", k.kind),
            figure,
            "≥ 75% of baseline or the database's hand-over rate",
            Some(met),
        );
    }
    if let Some(fanout) = s.fanout {
        let slowest = s.slowest_fanout_single();
        let ratio = slowest.map(|k| fanout.as_secs_f64() / k.drain.as_secs_f64().max(f64::EPSILON));
        let mut figure = format!("{} events/s to each", rate(per_second(n, fanout)));
        if let (Some(k), Some(r)) = (slowest, ratio) {
            let _ = write!(
                figure,
                "; {r:.2}× the time of the slowest single drain ({}, {} events/s)",
                k.kind,
                rate(k.drain_rate(n))
            );
            if let Some((low, high)) = spread(&s.fanout_ratios) {
                let _ = write!(figure, " (rounds {low:.2}–{high:.2}×)");
            }
        }
        row(
            "sinks: fan-out (3 destinations)",
            figure,
            "≤ 1× the slowest single drain",
            ratio.map(|r| r <= FANOUT_TARGET),
        );
    }
    for (kind, l) in &s.latencies {
        let mut figure = l
            .latency
            .as_ref()
            .map_or_else(|| "no event confirmed".to_owned(), Percentiles::describe);
        let _ = write!(
            figure,
            " (commit to the destination's confirmation; {} of {} at {}/s, {} missing)",
            thousands(l.sent - l.missing),
            thousands(l.sent),
            rate(l.achieved_rate()),
            l.missing
        );
        row(
            &format!("sinks: {kind} latency"),
            figure,
            "all delivered",
            Some(l.missing == 0),
        );
    }
}

/// The lowest and highest of per-round figures; `None` for fewer than two.
fn spread(values: &[f64]) -> Option<(f64, f64)> {
    (values.len() > 1).then(|| {
        values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
    })
}

fn per_second(n: u64, d: Duration) -> f64 {
    super::broker::per_second(n, d)
}

/// Writes `section` into `path` between [`BEGIN_MARK`] and [`END_MARK`],
/// keeping the rest of the file; appends it when the marks are missing.
pub(crate) fn write_into(path: &Path, section: &str) -> anyhow::Result<()> {
    let existing = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    std::fs::write(path, splice(&existing, section)).with_context(|| format!("writing {}", path.display()))
}

fn splice(existing: &str, section: &str) -> String {
    let block = format!("{BEGIN_MARK}\n{}\n{END_MARK}", section.trim_end());
    if let (Some(begin), Some(end)) = (existing.find(BEGIN_MARK), existing.find(END_MARK))
        && begin < end
    {
        return format!("{}{block}{}", &existing[..begin], &existing[end + END_MARK.len()..]);
    }
    if existing.trim().is_empty() {
        format!("{block}\n")
    } else {
        format!("{}\n\n{block}\n", existing.trim_end())
    }
}

pub(crate) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn rate(per_second: f64) -> String {
    thousands(per_second.round().max(0.0) as u64)
}

fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

fn ms(micros: u64) -> String {
    format!("{:.2} ms", micros as f64 / 1000.0)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn gib(kib: u64) -> String {
    format!("{:.1} GiB", kib as f64 / (1024.0 * 1024.0))
}

fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    format!("{} min {:02} s", s / 60, s % 60)
}

#[cfg(test)]
mod tests;
