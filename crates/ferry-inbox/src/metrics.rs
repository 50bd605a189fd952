//! The inbox's counters, labelled by consumer, through the `metrics` crate:
//! install any recorder (Prometheus, say) to read them.

// Recorded by the inboxes and the runners, which need a database feature.
#![cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]

/// Events whose handler committed.
pub const PROCESSED: &str = "ferry_inbox_processed_total";
/// Redeliveries of events already processed, acknowledged without running.
pub const DUPLICATES: &str = "ferry_inbox_duplicates_total";
/// Failed attempts that will be tried again.
pub const RETRIES: &str = "ferry_inbox_retries_total";
/// Events given up on and dead-lettered (each dead-lettering counts).
pub const DEAD: &str = "ferry_inbox_dead_total";
/// Deliveries put back untouched because another attempt at the event held
/// its inbox row past the inbox's lock timeout (a delivery still running
/// elsewhere, or a consumer stalled with its transaction open). Not
/// attempts: a steady rise means a consumer hangs inside a handler.
pub const IN_PROGRESS: &str = "ferry_inbox_in_progress_total";
/// Messages that were not Ferry events at all, dead-lettered unhandled.
pub const MALFORMED: &str = "ferry_inbox_malformed_total";
/// Messages the broker removed before they were handled: their events are
/// lost to the consumer. Labelled by `reason`: `trimmed` (Redis MAXLEN or
/// XTRIM removed stream entries before the group read or acknowledged
/// them), `offset_reset` (a Kafka group's committed offset fell out of the
/// log, and librdkafka moved it past records the group had not read).
pub const LOST: &str = "ferry_inbox_lost_total";

pub(crate) fn processed(consumer: &str) {
    metrics::counter!(PROCESSED, "consumer" => consumer.to_owned()).increment(1);
}

pub(crate) fn duplicate(consumer: &str) {
    metrics::counter!(DUPLICATES, "consumer" => consumer.to_owned()).increment(1);
}

pub(crate) fn retry(consumer: &str) {
    metrics::counter!(RETRIES, "consumer" => consumer.to_owned()).increment(1);
}

#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn in_progress(consumer: &str) {
    metrics::counter!(IN_PROGRESS, "consumer" => consumer.to_owned()).increment(1);
}

pub(crate) fn dead(consumer: &str) {
    metrics::counter!(DEAD, "consumer" => consumer.to_owned()).increment(1);
}

#[cfg_attr(
    not(any(feature = "rabbitmq", feature = "redis", feature = "nats", feature = "kafka")),
    allow(dead_code)
)]
pub(crate) fn malformed(consumer: &str) {
    metrics::counter!(MALFORMED, "consumer" => consumer.to_owned()).increment(1);
}

#[cfg_attr(not(any(feature = "redis", feature = "kafka")), allow(dead_code))]
pub(crate) fn lost(consumer: &str, reason: &'static str, n: u64) {
    metrics::counter!(LOST, "consumer" => consumer.to_owned(), "reason" => reason).increment(n);
}
