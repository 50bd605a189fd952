//! End to end: the `ferry` binary against real PostgreSQL and RabbitMQ,
//! counting every event through crashes (of the relay and of the database),
//! concurrent relays and cut connections. One test binary for all of them.

mod crash;
#[cfg(feature = "demo")]
mod demo;
mod fanout;
mod file;
mod relay;
mod support;
