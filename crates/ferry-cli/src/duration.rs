//! Human-written durations for the config file: `"250ms"`, `"30s"`, `"5m"`,
//! `"1h"`, `"1h30m"`.

use std::time::Duration;

/// How a duration must be written; appended to every parse error.
const DURATION_HINT: &str = "write it like \"30s\", \"500ms\" or \"2m\"";

/// The longest duration accepted: 100 years. Longer ones (up to 490,000
/// years parse) overflowed the clock arithmetic they feed: a retry's due
/// time, a lease's expiry, a retention cutoff, `--since`.
pub const MAX_DURATION: Duration = Duration::from_secs(876_000 * 3600);

/// Parses one or more `<whole number><unit>` parts, units largest first
/// (`h`, `m`, `s`, `ms`), each unit at most once. A bare number is rejected on
/// purpose: `lease = 30` could mean seconds or milliseconds, and guessing
/// wrong by a factor of 1000 is the kind of mistake a config must not hide.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("{text:?} is not a duration; {DURATION_HINT}");
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total = Duration::ZERO;
    // Index into UNITS of the last unit seen; enforces largest-first order,
    // which also rejects a repeated unit such as "1m1m".
    let mut last_unit: Option<usize> = None;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(invalid());
        }
        let amount: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let letters = rest.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(rest.len());
        let unit = &rest[..letters];
        rest = &rest[letters..];
        let Some(index) = UNITS.iter().position(|(name, _)| *name == unit) else {
            return Err(invalid());
        };
        if last_unit.is_some_and(|last| index <= last) {
            return Err(invalid());
        }
        last_unit = Some(index);
        let part = UNITS[index]
            .1
            .checked_mul(u32::try_from(amount).map_err(|_| invalid())?)
            .ok_or_else(invalid)?;
        total = total.checked_add(part).ok_or_else(invalid)?;
    }
    if total > MAX_DURATION {
        return Err(format!(
            "{text:?} is too long; a duration is at most 876000h (100 years)"
        ));
    }
    Ok(total)
}

/// Writes a duration the way the parser reads it, for messages: `1h30m`,
/// `500ms`, `0s`.
pub fn format_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".to_owned();
    }
    let mut millis = d.as_millis();
    let mut out = String::new();
    for (name, unit) in UNITS {
        let unit = unit.as_millis();
        if millis >= unit {
            out.push_str(&format!("{}{name}", millis / unit));
            millis %= unit;
        }
    }
    if out.is_empty() {
        // Below a millisecond: only reachable from code, never from a config.
        out = format!("{d:?}");
    }
    out
}

const UNITS: [(&str, Duration); 4] = [
    ("h", Duration::from_secs(3600)),
    ("m", Duration::from_secs(60)),
    ("s", Duration::from_secs(1)),
    ("ms", Duration::from_millis(1)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_forms() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("250ms"), Duration::from_millis(250));
        assert_eq!(ok("30s"), Duration::from_secs(30));
        assert_eq!(ok("5m"), Duration::from_secs(300));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1h30m"), Duration::from_secs(5400));
        assert_eq!(ok("1m30s500ms"), Duration::from_millis(90_500));
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok(" 10s "), Duration::from_secs(10));
    }

    #[test]
    fn rejects_everything_else_with_the_hint() {
        for bad in [
            "",
            "30",
            "s",
            "30 s",
            "1.5s",
            "-1s",
            "30sec",
            "1m1m",
            "30s1m",
            "10x",
            "99999999999h",
        ] {
            let err = parse_duration(bad).unwrap_err();
            assert!(
                err.contains("is not a duration") && err.contains("\"30s\""),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn a_hundred_years_is_the_longest() {
        assert_eq!(parse_duration("876000h").unwrap(), MAX_DURATION);
        for long in ["876000h1ms", "3000000000h"] {
            let err = parse_duration(long).unwrap_err();
            assert!(err.contains("at most 876000h (100 years)"), "{long}: {err}");
        }
    }

    #[test]
    fn formats_as_it_parses() {
        for text in ["0s", "250ms", "30s", "5m", "1h30m", "1m30s500ms"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
    }
}
