//! Metric names, in one place so dashboards and code agree.

pub const PUBLISHED: &str = "ferry_deliveries_published_total";
pub const FAILED: &str = "ferry_delivery_attempts_failed_total";
pub const DEAD: &str = "ferry_deliveries_dead_total";
pub const REFUSED: &str = "ferry_outcomes_refused_total";
pub const ROUTED: &str = "ferry_events_routed_total";
/// Per event type, counted as the relay routes them: producers commit in
/// their own processes, so this is where the count can be kept.
pub const ENQUEUED: &str = "ferry_events_enqueued_total";
pub const UNROUTABLE: &str = "ferry_events_no_route_total";
pub const BATCH_SIZE: &str = "ferry_relay_batch_size";
pub const PUBLISH_SECONDS: &str = "ferry_publish_duration_seconds";
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "ferry_commit_to_publish_seconds";
pub const LEASED_PARTITIONS: &str = "ferry_leased_partitions";
pub const STORE_ERRORS: &str = "ferry_store_errors_total";
/// Events confirmed after an earlier event of their key was rejected in the
/// same pipelined batch: they reached the destination out of order.
pub const ORDER_BREAKS: &str = "ferry_order_breaks_total";
/// Events of a claimed batch not sent, to keep their key's order: behind a
/// failure of their key, or left by the sink for a later batch (a webhook
/// batch out of time). They stay pending, with no attempt counted.
pub const HELD_BACK: &str = "ferry_deliveries_held_back_total";
/// The relay got a component back after it failed: `component="database"`
/// after failed claims, `component="destination"` (with `route`) at the first
/// confirm after publishes that all failed transiently.
pub const RECONNECTS: &str = "ferry_reconnects_total";

// Read from the store every few seconds by the process that serves metrics.
pub const PENDING: &str = "ferry_pending_deliveries";
pub const RETRYING: &str = "ferry_retrying_deliveries";
pub const DEAD_NOW: &str = "ferry_dead_deliveries";
pub const CANCELLED_NOW: &str = "ferry_cancelled_deliveries";
pub const OLDEST_PENDING_SECONDS: &str = "ferry_oldest_pending_age_seconds";
pub const UNROUTED: &str = "ferry_unrouted_events";
pub const OLDEST_UNROUTED_SECONDS: &str = "ferry_oldest_unrouted_age_seconds";
pub const BLOCKED_KEYS: &str = "ferry_blocked_keys";
pub const OLDEST_BLOCKED_SECONDS: &str = "ferry_oldest_blocked_key_age_seconds";
pub const OLDEST_LEASE_SECONDS: &str = "ferry_oldest_lease_age_seconds";
pub const EXPIRED_LEASES: &str = "ferry_expired_leases";
pub const CAPTURE_DROPPED: &str = "ferry_capture_dropped_events";
/// When the gauges above were last read (Unix time): while reads fail
/// (a statement timeout on a large backlog, say), they keep their last
/// values, and only this tells.
pub const GAUGES_READ: &str = "ferry_gauges_read_timestamp_seconds";

// WAL streaming mode.
/// 1 while this relay streams from the slot, 0 while it stands by or reconnects.
pub const WAL_STREAMING: &str = "ferry_wal_streaming";
/// WAL the slot holds back (written since its confirmed position), in bytes.
pub const WAL_LAG_BYTES: &str = "ferry_wal_lag_bytes";
/// WAL that can still be written before the server invalidates the slot,
/// in bytes; `+Inf` without a `max_slot_wal_keep_size`.
pub const WAL_SAFE_BYTES: &str = "ferry_wal_safe_bytes";
/// Age of the newest transaction settled from the stream, at settling.
pub const WAL_LAG_SECONDS: &str = "ferry_wal_lag_seconds";
/// Streamed events queued in the table behind earlier deliveries of their
/// route or key, instead of published directly.
pub const WAL_PARKED: &str = "ferry_wal_parked_total";
/// Slots that had streamed and were found lost or gone, and replaced:
/// tableless events they had not handed over are lost.
pub const WAL_SLOT_REPLACED: &str = "ferry_wal_slot_replaced_total";
/// Outbox rows the stream went past without handing them over, swept into
/// the table path.
pub const WAL_UNSTREAMED: &str = "ferry_wal_unstreamed_total";

// Health, as `/readyz` sees it.
pub const READY: &str = "ferry_ready";
pub const DESTINATION_UP: &str = "ferry_destination_up";
pub const DATABASE_UP: &str = "ferry_database_up";

// Retention.
pub const RETENTION_DELETED: &str = "ferry_retention_deleted_events_total";
pub const RETENTION_ARCHIVED: &str = "ferry_retention_archived_events_total";
pub const RETENTION_ERRORS: &str = "ferry_retention_errors_total";
pub const RETENTION_LAST_SUCCESS: &str = "ferry_retention_last_success_timestamp_seconds";

/// Registers a help text for every metric, shown as `# HELP` by the
/// Prometheus exporter. Call once, after installing the recorder.
pub fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        PUBLISHED,
        "Deliveries the destination confirmed, per route and event type."
    );
    describe_counter!(
        FAILED,
        "Failed publish attempts (retried or dead), per route and event type."
    );
    describe_counter!(DEAD, "Deliveries that went dead, per route and event type.");
    describe_gauge!(WAL_STREAMING, "1 while this relay streams from the WAL slot.");
    describe_gauge!(
        WAL_LAG_BYTES,
        Unit::Bytes,
        "WAL the slot holds back, written since its confirmed position."
    );
    describe_gauge!(
        WAL_SAFE_BYTES,
        Unit::Bytes,
        "WAL that can still be written before PostgreSQL invalidates the slot (max_slot_wal_keep_size; +Inf without one)."
    );
    describe_gauge!(
        WAL_LAG_SECONDS,
        Unit::Seconds,
        "Age of the newest streamed transaction when it was settled."
    );
    describe_counter!(
        WAL_SLOT_REPLACED,
        "Replication slots that had streamed, found invalidated (reason=lost) or gone (reason=vanished) \
         and made anew; tableless events they had not handed over are lost."
    );
    describe_counter!(
        WAL_UNSTREAMED,
        "Outbox rows the WAL stream went past without handing them over (a publication without ferry.events \
         for a while), swept into the table path; they may arrive after later events of their keys."
    );
    describe_counter!(
        WAL_PARKED,
        "Streamed events queued in the table behind earlier deliveries, per route."
    );
    describe_counter!(REFUSED, "Outcomes the store refused because the lease had moved on.");
    describe_counter!(ROUTED, "Events routed into deliveries.");
    describe_counter!(
        ENQUEUED,
        "Events producers committed, per type, counted as the relay routes them."
    );
    describe_counter!(
        UNROUTABLE,
        "Events that matched no route (dead with reason `no route`)."
    );
    describe_histogram!(BATCH_SIZE, "Deliveries per published batch.");
    describe_histogram!(
        PUBLISH_SECONDS,
        Unit::Seconds,
        "Time to publish a batch and get it confirmed."
    );
    describe_histogram!(
        COMMIT_TO_PUBLISH_SECONDS,
        Unit::Seconds,
        "From the event's commit to its confirmed first-attempt publish."
    );
    describe_gauge!(LEASED_PARTITIONS, "Partitions this relay leases.");
    describe_counter!(STORE_ERRORS, "Failed store operations, per operation.");
    describe_counter!(
        ORDER_BREAKS,
        "Events confirmed after an earlier event of their key was rejected."
    );
    describe_counter!(
        HELD_BACK,
        "Events not sent in their batch, to keep their key's order; they stay pending, no attempt counted."
    );
    describe_counter!(
        "ferry_unroutable_returns_total",
        "Messages RabbitMQ returned as unroutable (no queue bound), per exchange; each is a failed publish."
    );
    describe_counter!(
        "ferry_sink_connections_total",
        "Connections (Kafka: producers) a sink opened, per kind; each after the first is a reconnect."
    );
    describe_counter!(
        RECONNECTS,
        "Times the relay got the database or a route's destination back after it failed."
    );
    describe_gauge!(PENDING, "Pending deliveries per route (retrying ones included).");
    describe_gauge!(RETRYING, "Pending deliveries that failed at least once, per route.");
    describe_gauge!(DEAD_NOW, "Dead deliveries per route, waiting for an operator.");
    describe_gauge!(CANCELLED_NOW, "Cancelled deliveries per route.");
    describe_gauge!(
        OLDEST_PENDING_SECONDS,
        Unit::Seconds,
        "Age of the oldest pending delivery's event."
    );
    describe_gauge!(UNROUTED, "Committed events not routed yet.");
    describe_gauge!(
        OLDEST_UNROUTED_SECONDS,
        Unit::Seconds,
        "Age of the oldest unrouted event."
    );
    describe_gauge!(BLOCKED_KEYS, "Keys held back by a failed or dead delivery, per route.");
    describe_gauge!(
        OLDEST_BLOCKED_SECONDS,
        Unit::Seconds,
        "Since the oldest blocked key's failure."
    );
    describe_gauge!(
        OLDEST_LEASE_SECONDS,
        Unit::Seconds,
        "Since the least recently renewed lease was renewed."
    );
    describe_gauge!(EXPIRED_LEASES, "Partitions whose lease ran out without a takeover.");
    describe_gauge!(
        CAPTURE_DROPPED,
        "Events a table trigger in warn mode failed to write, per table: lost by choice; alert on any."
    );
    describe_gauge!(
        GAUGES_READ,
        Unit::Seconds,
        "When the outbox gauges were last read (Unix time); they keep their last values while reads fail."
    );
    describe_gauge!(READY, "1 when /readyz answers 200.");
    describe_gauge!(DESTINATION_UP, "1 when the route's destination passed its last check.");
    describe_gauge!(DATABASE_UP, "1 when the database answered the last probe.");
    describe_counter!(RETENTION_DELETED, "Events deleted by retention.");
    describe_counter!(RETENTION_ARCHIVED, "Events written to the retention archive.");
    describe_counter!(
        RETENTION_ERRORS,
        "Retention runs that stopped on an error, per kind (archive, store)."
    );
    describe_gauge!(
        RETENTION_LAST_SUCCESS,
        Unit::Seconds,
        "When retention last completed a run (Unix time)."
    );
}
