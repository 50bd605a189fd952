//! End to end: the `ferry` binary against real PostgreSQL and RabbitMQ,
//! counting every event through crashes, concurrent relays and cut
//! connections. One test binary for all of them.

mod fanout;
mod relay;
mod support;
