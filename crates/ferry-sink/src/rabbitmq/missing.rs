//! Exchanges found missing, remembered across batches so that events to
//! them are refused before sending: one such event would make the broker
//! close its channel and fail its neighbours' publishes with it.
//!
//! Remembered, not trusted: each batch asks the broker again (a passive
//! declare) before refusing an event, so an exchange declared meanwhile is
//! used at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long an exchange no event went to is remembered.
const REMEMBERED_FOR: Duration = Duration::from_secs(600);
/// At most this many are remembered; the oldest goes first.
const CAPACITY: usize = 256;

#[derive(Debug, Default)]
pub(crate) struct MissingExchanges {
    /// When each was last found missing.
    found: HashMap<String, Instant>,
}

impl MissingExchanges {
    pub(crate) fn remember(&mut self, exchange: &str, now: Instant) {
        if !self.found.contains_key(exchange) && self.found.len() >= CAPACITY {
            let oldest = self
                .found
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                self.found.remove(&oldest);
            }
        }
        self.found.insert(exchange.to_owned(), now);
    }

    pub(crate) fn forget(&mut self, exchange: &str) {
        self.found.remove(exchange);
    }

    /// Whether `exchange` was found missing within [`REMEMBERED_FOR`] of `now`.
    pub(crate) fn suspects(&self, exchange: &str, now: Instant) -> bool {
        self.found
            .get(exchange)
            .is_some_and(|at| now.saturating_duration_since(*at) < REMEMBERED_FOR)
    }

    /// Those of `named` found missing within [`REMEMBERED_FOR`] of `now`,
    /// the longest ago first: a check finding one missing again puts it
    /// last, so that checks capped per call take each in turn.
    pub(crate) fn suspects_among<'a>(&self, named: impl IntoIterator<Item = &'a str>, now: Instant) -> Vec<String> {
        let mut suspects: Vec<(Instant, &str)> = named
            .into_iter()
            .filter(|x| self.suspects(x, now))
            .map(|x| (self.found[x], x))
            .collect();
        suspects.sort_unstable();
        suspects.into_iter().map(|(_, x)| x.to_owned()).collect()
    }

    /// Drops what is older than [`REMEMBERED_FOR`].
    pub(crate) fn expire(&mut self, now: Instant) {
        self.found
            .retain(|_, at| now.saturating_duration_since(*at) < REMEMBERED_FOR);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.found.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_for_a_while_and_bounded() {
        let start = Instant::now();
        let mut missing = MissingExchanges::default();
        missing.remember("a", start);
        assert!(missing.suspects("a", start + Duration::from_secs(1)));
        assert!(!missing.suspects("b", start));
        assert!(!missing.suspects("a", start + REMEMBERED_FOR));
        missing.expire(start + REMEMBERED_FOR);
        assert!(missing.is_empty());

        for i in 0..CAPACITY + 10 {
            missing.remember(&format!("x{i}"), start + Duration::from_millis(i as u64));
        }
        assert_eq!(missing.found.len(), CAPACITY);
        assert!(!missing.suspects("x0", start), "the oldest went first");
        assert!(missing.suspects(&format!("x{}", CAPACITY + 9), start));
        missing.forget(&format!("x{}", CAPACITY + 9));
        assert_eq!(missing.found.len(), CAPACITY - 1);
    }

    #[test]
    fn suspects_come_longest_unchecked_first_and_take_turns() {
        let start = Instant::now();
        let mut missing = MissingExchanges::default();
        for (i, x) in ["a", "b", "c", "d"].into_iter().enumerate() {
            missing.remember(x, start + Duration::from_secs(i as u64));
        }
        let now = start + Duration::from_secs(10);
        let named = ["d", "b", "elsewhere", "a"];
        assert_eq!(missing.suspects_among(named, now), ["a", "b", "d"]);
        // a and b checked, found missing again: d's turn comes first.
        missing.remember("a", now);
        missing.remember("b", now + Duration::from_secs(1));
        assert_eq!(missing.suspects_among(named, now), ["d", "a", "b"]);
    }
}
