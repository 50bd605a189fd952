//! Metric names, in one place so dashboards and code agree.

pub const PUBLISHED: &str = "ferry_deliveries_published_total";
pub const FAILED: &str = "ferry_delivery_attempts_failed_total";
pub const DEAD: &str = "ferry_deliveries_dead_total";
pub const REFUSED: &str = "ferry_outcomes_refused_total";
pub const ROUTED: &str = "ferry_events_routed_total";
pub const UNROUTABLE: &str = "ferry_events_no_route_total";
pub const BATCH_SIZE: &str = "ferry_relay_batch_size";
pub const PUBLISH_SECONDS: &str = "ferry_publish_duration_seconds";
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "ferry_commit_to_publish_seconds";
pub const LEASED_PARTITIONS: &str = "ferry_leased_partitions";
pub const STORE_ERRORS: &str = "ferry_store_errors_total";
/// Events confirmed after an earlier event of their key was rejected in the
/// same pipelined batch: they reached the destination out of order.
pub const ORDER_BREAKS: &str = "ferry_order_breaks_total";
