//! End to end: the `ferry` binary against real PostgreSQL and RabbitMQ,
//! counting every event through crashes (of the relay and of the database),
//! concurrent relays and cut connections, and with the `kafka` feature
//! against a Kafka-protocol broker. One test binary for all of them.

mod crash;
#[cfg(feature = "demo")]
mod demo;
mod fanout;
mod file;
#[cfg(feature = "kafka")]
mod kafka;
mod relay;
mod support;
