//! librdkafka properties derived from [`KafkaOptions`], and the checks that
//! keep `extra` from switching off what the delivery guarantees rest on.

use ferry_core::SinkError;
use rdkafka::ClientConfig;

use super::KafkaOptions;

/// Room librdkafka's `message.max.bytes` leaves above the payload limit for
/// the key (at most 512 bytes), the headers and the record framing, so a
/// payload at `max_message_bytes` is never refused by the client.
pub(crate) const RECORD_HEADROOM: usize = 64 * 1024;
/// The producer's `linger.ms` unless `extra` sets one. The sink hands
/// librdkafka a whole batch at once and then waits for every delivery
/// report, so the batch is already gathered: librdkafka's default of 5 ms
/// only delays each batch's last requests. One millisecond still lets a
/// batch's records share requests (with no linger at all, librdkafka sends
/// more, smaller requests and the drain was slower).
pub const DEFAULT_LINGER_MS: &str = "1";
/// librdkafka's upper bound for `message.max.bytes`.
const LIBRDKAFKA_MAX_MESSAGE_BYTES: usize = 1_000_000_000;

/// Properties the sink sets itself. Each is either what the ordering and
/// delivery guarantees depend on, or has its own field in [`KafkaOptions`].
const RESERVED: [(&str, &str); 14] = [
    ("bootstrap.servers", "use bootstrap_servers"),
    ("metadata.broker.list", "use bootstrap_servers"),
    ("message.timeout.ms", "use publish_timeout"),
    ("delivery.timeout.ms", "use publish_timeout"),
    ("message.max.bytes", "use max_message_bytes"),
    ("enable.idempotence", "per-key order across retries depends on it"),
    ("acks", "only acks=all confirms what survives a broker loss"),
    (
        "request.required.acks",
        "only acks=all confirms what survives a broker loss",
    ),
    (
        "max.in.flight.requests.per.connection",
        "idempotence keeps order only up to 5",
    ),
    ("max.in.flight", "idempotence keeps order only up to 5"),
    (
        "allow.auto.create.topics",
        "Ferry never creates topics; create them yourself",
    ),
    ("transactional.id", "Ferry's producer is idempotent, not transactional"),
    (
        "enable.gapless.guarantee",
        "one route's refused batch would stop the producer every route of the sink shares",
    ),
    (
        "delivery.report.only.error",
        "an event is published only when its delivery report says so",
    ),
];

/// librdkafka's partitioners that put every record of one key on one
/// partition (a hash of the key; they differ only in the hash and in where
/// records without a key go). `random` spreads a key's records over all
/// partitions, and Kafka orders records only within a partition: per-key
/// order would be lost without any error.
const KEY_HASHING_PARTITIONERS: [&str; 6] = [
    "murmur2_random",
    "murmur2",
    "consistent_random",
    "consistent",
    "fnv1a_random",
    "fnv1a",
];

impl KafkaOptions {
    /// Checks every field, naming the one that is wrong.
    pub fn validate(&self) -> Result<(), SinkError> {
        let bad = |field: &str, why: String| Err(SinkError::config(format!("sinks.<kafka>.{field} {why}")));
        if self.bootstrap_servers.trim().is_empty() {
            return bad("bootstrap_servers", "is empty; give host:port[,host:port...]".into());
        }
        let ms = self.publish_timeout.as_millis();
        if ms == 0 || ms > i32::MAX as u128 {
            return bad(
                "publish_timeout",
                format!("is {:?}; use 1 ms to 24 days", self.publish_timeout),
            );
        }
        let most = LIBRDKAFKA_MAX_MESSAGE_BYTES - RECORD_HEADROOM;
        if self.max_message_bytes == 0 || self.max_message_bytes > most {
            return bad(
                "max_message_bytes",
                format!("is {}; use 1 to {most}", self.max_message_bytes),
            );
        }
        if self.source.is_empty() {
            return bad("source", "is empty; it is the CloudEvents source attribute".into());
        }
        for name in self.extra.keys() {
            if let Some((_, why)) = RESERVED.iter().find(|(r, _)| r == name) {
                return bad(&format!("extra.{name:?}"), format!("is set by Ferry itself: {why}"));
            }
        }
        if let Some(partitioner) = self.extra.get("partitioner")
            && !KEY_HASHING_PARTITIONERS.contains(&partitioner.as_str())
        {
            return bad(
                "extra.\"partitioner\"",
                format!(
                    "is {partitioner:?}, which does not keep a key on one partition, so per-key order \
                     would be lost; use one that hashes the key ({}), or remove it for Ferry's \
                     murmur2_random",
                    KEY_HASHING_PARTITIONERS.join(", ")
                ),
            );
        }
        Ok(())
    }

    /// Whether `extra` has the producer compress record batches
    /// (`compression.type`, or its alias `compression.codec`, other than
    /// `none`).
    pub(crate) fn compresses(&self) -> bool {
        ["compression.type", "compression.codec"]
            .iter()
            .filter_map(|name| self.extra.get(*name))
            .any(|codec| !codec.trim().eq_ignore_ascii_case("none"))
    }

    /// librdkafka's `message.max.bytes`: the payload limit plus headroom.
    pub(crate) fn max_record_bytes(&self) -> usize {
        self.max_message_bytes + RECORD_HEADROOM
    }

    /// Properties shared by the producer and the admin client: the cluster,
    /// security settings and anything else in `extra`.
    pub(crate) fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.bootstrap_servers);
        config.set("client.id", "ferry");
        for (name, value) in &self.extra {
            config.set(name, value);
        }
        config
    }

    /// The producer's properties: idempotent, `acks=all`, Java-compatible
    /// key partitioning, no topic auto-creation, a 1 ms linger.
    /// With `batch_cap`, `batch.size` is at most that: a topic's
    /// `max.message.bytes`, which a record batch must not exceed.
    pub(crate) fn producer_config(&self, batch_cap: Option<usize>) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.bootstrap_servers);
        config.set("client.id", "ferry");
        // Same partition per key as the Java client's default partitioner,
        // so Ferry and other producers of a topic agree on where a key lives.
        config.set("partitioner", "murmur2_random");
        config.set("linger.ms", DEFAULT_LINGER_MS);
        for (name, value) in &self.extra {
            config.set(name, value);
        }
        config.set("enable.idempotence", "true");
        config.set("acks", "all");
        config.set("max.in.flight.requests.per.connection", "5");
        config.set("allow.auto.create.topics", "false");
        config.set("message.timeout.ms", self.publish_timeout.as_millis().to_string());
        config.set("message.max.bytes", self.max_record_bytes().to_string());
        if let Some(cap) = batch_cap {
            let configured = self
                .extra
                .get("batch.size")
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(DEFAULT_BATCH_SIZE);
            config.set("batch.size", configured.min(cap).max(1).to_string());
        }
        config
    }
}

/// librdkafka's default `batch.size`.
const DEFAULT_BATCH_SIZE: usize = 1_000_000;

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::ErrorKind;
    use std::time::Duration;

    fn with_extra(name: &str, value: &str) -> KafkaOptions {
        let mut o = KafkaOptions::default();
        o.extra.insert(name.into(), value.into());
        o
    }

    #[test]
    fn batches_stay_under_the_smallest_known_topic_limit() {
        let o = KafkaOptions::default();
        assert_eq!(o.producer_config(None).get("batch.size"), None);
        assert_eq!(o.producer_config(Some(100_000)).get("batch.size"), Some("100000"));
        assert_eq!(o.producer_config(Some(5_000_000)).get("batch.size"), Some("1000000"));
        let small = with_extra("batch.size", "16384");
        assert_eq!(small.producer_config(Some(100_000)).get("batch.size"), Some("16384"));
    }

    #[test]
    fn defaults_are_valid_and_idempotent() {
        let o = KafkaOptions::default();
        assert_eq!(o.validate(), Ok(()));
        let c = o.producer_config(None);
        assert_eq!(c.get("enable.idempotence"), Some("true"));
        assert_eq!(c.get("acks"), Some("all"));
        assert_eq!(c.get("max.in.flight.requests.per.connection"), Some("5"));
        assert_eq!(c.get("allow.auto.create.topics"), Some("false"));
        assert_eq!(c.get("message.timeout.ms"), Some("10000"));
        assert_eq!(c.get("message.max.bytes"), Some("1065536"));
        assert_eq!(c.get("partitioner"), Some("murmur2_random"));
        assert_eq!(c.get("linger.ms"), Some("1"));
        assert_eq!(c.get("bootstrap.servers"), Some("127.0.0.1:9092"));
    }

    #[test]
    fn extra_properties_pass_through_and_may_replace_soft_defaults() {
        let mut o = with_extra("linger.ms", "20");
        o.extra.insert("partitioner".into(), "consistent_random".into());
        o.extra.insert("security.protocol".into(), "sasl_plaintext".into());
        assert_eq!(o.validate(), Ok(()));
        let c = o.producer_config(None);
        assert_eq!(c.get("linger.ms"), Some("20"));
        assert_eq!(c.get("partitioner"), Some("consistent_random"));
        let admin = o.client_config();
        assert_eq!(admin.get("security.protocol"), Some("sasl_plaintext"));
        assert_eq!(admin.get("enable.idempotence"), None);
    }

    #[test]
    fn extra_cannot_weaken_the_guarantees() {
        for (name, _) in RESERVED {
            let err = with_extra(name, "x").validate().unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config, "{name}");
            assert!(err.message.contains(&format!("extra.{name:?}")), "{}", err.message);
        }
    }

    #[test]
    fn only_partitioners_that_hash_the_key_are_accepted() {
        for partitioner in KEY_HASHING_PARTITIONERS {
            let o = with_extra("partitioner", partitioner);
            assert_eq!(o.validate(), Ok(()), "{partitioner}");
            assert_eq!(o.producer_config(None).get("partitioner"), Some(partitioner));
        }
        // `random` ignores the key; the rest are not librdkafka partitioners.
        for partitioner in ["random", "", "Murmur2", "murmur3"] {
            let err = with_extra("partitioner", partitioner).validate().unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config, "{partitioner:?}");
            assert!(err.message.contains("extra.\"partitioner\""), "{}", err.message);
            assert!(err.message.contains("murmur2_random"), "{}", err.message);
            assert!(err.message.contains("per-key order"), "{}", err.message);
        }
    }

    #[test]
    fn invalid_fields_are_named() {
        let cases: [(KafkaOptions, &str); 5] = [
            (
                KafkaOptions {
                    bootstrap_servers: " ".into(),
                    ..KafkaOptions::default()
                },
                "bootstrap_servers",
            ),
            (
                KafkaOptions {
                    publish_timeout: Duration::ZERO,
                    ..KafkaOptions::default()
                },
                "publish_timeout",
            ),
            (
                KafkaOptions {
                    max_message_bytes: 0,
                    ..KafkaOptions::default()
                },
                "max_message_bytes",
            ),
            (
                KafkaOptions {
                    max_message_bytes: 999_999_999,
                    ..KafkaOptions::default()
                },
                "max_message_bytes",
            ),
            (
                KafkaOptions {
                    source: String::new(),
                    ..KafkaOptions::default()
                },
                "source",
            ),
        ];
        for (options, field) in cases {
            let err = options.validate().unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config);
            assert!(err.message.contains(field), "{field}: {}", err.message);
        }
    }
}
