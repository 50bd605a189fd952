//! The Kafka-protocol broker the end-to-end tests use: tansu on
//! 127.0.0.1:19092, or whatever `FERRY_TEST_KAFKA_URL` names.

use std::time::Duration;

/// The broker's address, once it answers a connection. Fails, never skips,
/// when it is not running: `scripts/test` starts it.
pub fn broker() -> String {
    let url = std::env::var("FERRY_TEST_KAFKA_URL").unwrap_or_else(|_| "127.0.0.1:19092".into());
    let addr = url.trim_start_matches("kafka://").to_owned();
    let reachable = std::net::ToSocketAddrs::to_socket_addrs(&addr.as_str())
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok());
    assert!(
        reachable,
        "no Kafka broker at {addr} (FERRY_TEST_KAFKA_URL); run scripts/test, which starts tansu there"
    );
    addr
}
