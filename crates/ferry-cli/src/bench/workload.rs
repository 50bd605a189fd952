//! What the bench writes: one event type, keys drawn from a fixed set, and a
//! JSON body of about 500 bytes, the same in every scenario so that their
//! figures compare.

use bytes::Bytes;
#[cfg(feature = "bench-sinks")]
use chrono::Utc;
#[cfg(feature = "bench-sinks")]
use ferry_core::{EventId, Headers, StoredEvent};
use serde_json::{Value, json};

/// The type of every bench event; the relay's route matches `bench.**`.
pub(crate) const EVENT_TYPE: &str = "bench.order.created";
/// The glob the bench route uses.
pub(crate) const ROUTE_GLOB: &str = "bench.**";
/// The body size the bench aims for.
pub(crate) const PAYLOAD_BYTES: usize = 500;

/// The `i`-th of `keys` keys (keys are taken round-robin).
pub(crate) fn key(i: u64, keys: u64) -> String {
    format!("customer-{:06}", i % keys.max(1))
}

/// A key chosen at random among `keys`.
pub(crate) fn random_key(keys: u64) -> String {
    key(rand::random_range(0..keys.max(1)), keys)
}

/// A plausible order body, padded to about [`PAYLOAD_BYTES`] once serialised.
pub(crate) fn payload(seq: u64, key: &str) -> Value {
    let mut body = json!({
        "order_id": seq,
        "customer": key,
        "currency": "EUR",
        "total_cents": 12_345 + seq % 1000,
        "items": [
            {"sku": "SKU-000123", "quantity": 2, "unit_cents": 2_500},
            {"sku": "SKU-004567", "quantity": 1, "unit_cents": 7_345},
        ],
        "shipping": {"method": "standard", "country": "DE", "postcode": "10115"},
        "note": "",
    });
    let len = serde_json::to_vec(&body).map_or(0, |b| b.len());
    body["note"] = Value::String("x".repeat(PAYLOAD_BYTES.saturating_sub(len)));
    body
}

/// The bodies and keys of the bench's messages `0..events`, built before a
/// baseline's clock starts, as the relay's come ready-made from the
/// database. Each is one buffer rather than one allocation per message, so
/// that dropping them gives the memory back to the system: the drain
/// scenario reads this process's resident memory right after a baseline.
pub(crate) struct Messages {
    bodies: Bytes,
    body_ends: Vec<usize>,
    keys: String,
    key_ends: Vec<usize>,
}

impl Messages {
    pub(crate) fn build(events: u64, keys: u64) -> Self {
        let n = usize::try_from(events).unwrap_or(usize::MAX);
        let mut bodies = Vec::with_capacity(n.saturating_mul(PAYLOAD_BYTES + 32));
        let mut text = String::with_capacity(n.saturating_mul(16));
        let (mut body_ends, mut key_ends) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for seq in 0..events {
            let key = key(seq, keys);
            serde_json::to_writer(&mut bodies, &payload(seq, &key)).expect("a JSON value serialises");
            body_ends.push(bodies.len());
            text.push_str(&key);
            key_ends.push(text.len());
        }
        Self {
            bodies: Bytes::from(bodies),
            body_ends,
            keys: text,
            key_ends,
        }
    }

    /// The `seq`-th body, sharing the buffer.
    pub(crate) fn body(&self, seq: u64) -> Bytes {
        let (start, end) = span(&self.body_ends, seq);
        self.bodies.slice(start..end)
    }

    pub(crate) fn key(&self, seq: u64) -> &str {
        let (start, end) = span(&self.key_ends, seq);
        &self.keys[start..end]
    }

    /// The `seq`-th message as the relay holds it once fetched: a fresh id,
    /// its key and body (sharing the buffer), no headers.
    #[cfg(feature = "bench-sinks")]
    pub(crate) fn event(&self, seq: u64) -> StoredEvent {
        StoredEvent {
            id: EventId::new(),
            seq: i64::try_from(seq).unwrap_or(i64::MAX),
            event_type: EVENT_TYPE.to_owned(),
            key: Some(self.key(seq).to_owned()),
            payload: self.body(seq),
            content_type: "application/json".to_owned(),
            headers: Headers::default(),
            created_at: Utc::now(),
        }
    }
}

fn span(ends: &[usize], seq: u64) -> (usize, usize) {
    let i = usize::try_from(seq).expect("a message index fits in memory");
    (i.checked_sub(1).map_or(0, |p| ends[p]), ends[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One body serialised on its own.
    fn payload_bytes(seq: u64, key: &str) -> Vec<u8> {
        serde_json::to_vec(&payload(seq, key)).expect("a JSON value serialises")
    }

    #[test]
    fn bodies_are_about_500_bytes() {
        for seq in [0, 7, 99_999, u64::MAX] {
            let len = payload_bytes(seq, &key(seq, 1000)).len();
            assert!((PAYLOAD_BYTES..PAYLOAD_BYTES + 20).contains(&len), "{len}");
        }
    }

    #[test]
    fn messages_hold_each_body_and_key_as_built_one_by_one() {
        let messages = Messages::build(5, 3);
        for seq in 0..5 {
            let key = key(seq, 3);
            assert_eq!(messages.key(seq), key);
            assert_eq!(messages.body(seq), payload_bytes(seq, &key));
        }
    }

    #[test]
    fn keys_cycle_through_the_set() {
        assert_eq!(key(0, 3), key(3, 3));
        assert_ne!(key(0, 3), key(1, 3));
        assert_eq!(key(5, 1), key(0, 1));
        assert!(random_key(1) == key(0, 1));
    }
}
