//! Ferry's destinations, one module per kind behind one trait,
//! [`ferry_core::Sink`].
//!
//! - [`rabbitmq::RabbitMqSink`] (feature `rabbitmq`): publishes to exchanges
//!   with publisher confirms and `mandatory` set, so an unroutable message is
//!   a failure, never a success. Configured by [`rabbitmq::RabbitMqOptions`].
//! - [`stdout::StdoutSink`] (feature `stdout`): one JSON line per event, for
//!   development and piping into other tools.
//!
//! Every sink carries the event id as the message id and the CloudEvents 1.0
//! attributes in its binary content mode, reports one outcome per event in
//! input order, and classifies failures as transient, permanent or
//! configuration errors so the relay never parses error text.
//!
//! Adding a sink means one module, one feature, and one test that runs
//! `ferry_testkit::sink_suite::run` against the real destination.

// Shared by the connection-holding sinks; unused when only stdout is built.
#[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
mod backoff;
#[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
mod batch;

#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "stdout")]
pub mod stdout;
