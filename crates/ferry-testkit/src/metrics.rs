//! A metrics recorder for tests: counts every counter increment by metric
//! name and one label's value, so a test can assert what was counted.
//!
//! ```
//! use ferry_testkit::metrics::Counts;
//! let counts = Counts::by_label("route");
//! metrics::with_local_recorder(&counts, || {
//!     metrics::counter!("ferry_things_total", "route" => "orders").increment(2);
//! });
//! assert_eq!(counts.get("ferry_things_total", "orders"), 2);
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Counter totals keyed by (metric name, value of the chosen label).
#[derive(Clone)]
pub struct Counts {
    label: &'static str,
    totals: Arc<Mutex<HashMap<(String, String), u64>>>,
}

impl Counts {
    /// Counts per value of `label` (an empty value when a counter lacks it).
    pub fn by_label(label: &'static str) -> Self {
        Self {
            label,
            totals: Arc::default(),
        }
    }

    /// The total of `name` for label value `value`.
    pub fn get(&self, name: &str, value: &str) -> u64 {
        let key = (name.to_owned(), value.to_owned());
        self.totals
            .lock()
            .expect("not poisoned")
            .get(&key)
            .copied()
            .unwrap_or(0)
    }
}

struct OneCounter {
    key: (String, String),
    totals: Arc<Mutex<HashMap<(String, String), u64>>>,
}

impl metrics::CounterFn for OneCounter {
    fn increment(&self, value: u64) {
        *self
            .totals
            .lock()
            .expect("not poisoned")
            .entry(self.key.clone())
            .or_default() += value;
    }
    fn absolute(&self, value: u64) {
        self.totals
            .lock()
            .expect("not poisoned")
            .insert(self.key.clone(), value);
    }
}

impl metrics::Recorder for Counts {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let value = key
            .labels()
            .find(|l| l.key() == self.label)
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        metrics::Counter::from_arc(Arc::new(OneCounter {
            key: (key.name().to_owned(), value),
            totals: self.totals.clone(),
        }))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}
