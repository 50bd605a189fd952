//! Progress on stderr: bars while a phase runs, one line when it ends. The
//! bars hide themselves when stderr is not a terminal; the lines do not.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting up to `len`.
pub(crate) fn bar(len: u64, label: &str) -> ProgressBar {
    let style = ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {per_sec} {msg}")
        .expect("a valid template")
        .progress_chars("=> ");
    let bar = ProgressBar::new(len).with_style(style).with_prefix(label.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A spinner for a phase measured in time rather than count.
pub(crate) fn spinner(label: &str) -> ProgressBar {
    let style = ProgressStyle::with_template("{prefix:>10} {spinner} {elapsed} {msg}").expect("a valid template");
    let bar = ProgressBar::new_spinner()
        .with_style(style)
        .with_prefix(label.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Ends `bar` and prints one summary line.
pub(crate) fn done(bar: &ProgressBar, line: impl AsRef<str>) {
    bar.finish_and_clear();
    eprintln!("{}", line.as_ref());
}
