//! Test support for Ferry.
//!
//! - [`pg`]: a fresh PostgreSQL database per test, dropped afterwards;
//!   [`pg_store`]: the PostgreSQL store on one, for the suites below;
//!   [`pg_server`]: a server of a test's own, to crash and restart.
//! - [`proxy`]: a TCP proxy that can delay, cut and refuse connections, for
//!   fault tests against real services.
//! - [`rabbit`]: uniquely named RabbitMQ exchanges and queues, and a counting
//!   consumer.
//! - [`clock`]: a manual clock; [`mock_sink`]: a scripted sink for engine tests;
//!   [`hooked`]: a store whose calls can be failed or delayed.
//! - [`store_suite`] and [`sink_suite`]: the conformance suites every store
//!   and sink implementation runs against the real thing; [`admin_suite`]
//!   and [`retention_suite`], the operator's commands, retention and gauges
//!   every store offers on top; [`producer_suite`], its `enqueue`.
//! - [`process`]: child processes that end with their test;
//!   [`redis_server`]: a redis-server of a test's own.

pub mod admin_suite;
pub mod clock;
pub mod hooked;
pub mod kafka;
pub mod metrics;
pub mod mock_sink;
pub mod pg;
pub mod pg_server;
pub mod pg_store;
pub mod process;
pub mod producer_suite;
pub mod proxy;
pub mod rabbit;
pub mod redis_server;
pub mod retention_suite;
pub mod sink_suite;
pub mod store_suite;
