//! Test support for Ferry.
//!
//! - [`pg`]: a fresh PostgreSQL database per test, dropped afterwards.
//! - [`proxy`]: a TCP proxy that can delay, cut and refuse connections, for
//!   fault tests against real services.
//! - [`rabbit`]: uniquely named RabbitMQ exchanges and queues, and a counting
//!   consumer.
//! - [`clock`]: a manual clock; [`mock_sink`]: a scripted sink for engine tests.
//! - [`store_suite`] and [`sink_suite`]: the conformance suites every store
//!   and sink implementation runs against the real thing.

pub mod clock;
pub mod mock_sink;
pub mod pg;
pub mod proxy;
pub mod rabbit;
pub mod sink_suite;
pub mod store_suite;
