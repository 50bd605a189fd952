//! End to end: the `ferry` binary against real PostgreSQL and RabbitMQ,
//! counting every event through crashes, concurrent relays and cut
//! connections. One test binary for all of them.

#[cfg(feature = "demo")]
mod demo;
mod fanout;
mod relay;
mod support;
