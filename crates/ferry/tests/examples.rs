//! The examples, run as a user would: each against a real database, and
//! checked for what it promises.

use std::net::SocketAddr;

use ferry_testkit::pg::TestDb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../examples/axum_producer.rs"]
#[allow(dead_code)]
mod axum_producer;

#[path = "../examples/capture.rs"]
#[allow(dead_code)]
mod capture;

/// One HTTP/1.1 POST with a JSON body; returns the status and the body.
async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

#[tokio::test]
async fn the_axum_producer_commits_an_order_with_its_event_or_neither() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    axum_producer::prepare(&pool).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, axum_producer::app(pool.clone())).into_future());

    let (status, body) = post(
        addr,
        "/orders",
        r#"{"id": 42, "customer": "acme", "total_cents": 4200}"#,
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let created: serde_json::Value = serde_json::from_str(&body).unwrap();
    let (event_type, key): (String, Option<String>) =
        sqlx::query_as("SELECT type, key FROM ferry.events WHERE id = $1::uuid")
            .bind(created["event"].as_str().unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (event_type.as_str(), key.as_deref()),
        ("shop.order.created", Some("order-42"))
    );

    // A refused order and a repeated one leave neither a row nor an event.
    let (status, _) = post(addr, "/orders", r#"{"id": 43, "customer": "acme", "total_cents": 0}"#).await;
    assert_eq!(status, 422);
    let (status, _) = post(addr, "/orders", r#"{"id": 42, "customer": "other", "total_cents": 1}"#).await;
    assert_eq!(status, 409);
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((orders, events), (1, 1));
}

#[tokio::test]
async fn the_capture_example_turns_plain_sql_into_events() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let events = capture::run(&pool).await.unwrap();
    let types: Vec<&str> = events.iter().map(|(t, _, _)| t.as_str()).collect();
    // The password change touches only an excluded column: no event.
    assert_eq!(
        types,
        ["crm.customer.created", "crm.customer.updated", "crm.customer.deleted"],
        "{events:?}"
    );
    assert!(events.iter().all(|(_, key, _)| key == "7"));
    let (_, _, created) = &events[0];
    assert_eq!(created["data"]["email"], "ada@example.com");
    assert!(created["data"].get("password_hash").is_none(), "{created}");
    let (_, _, updated) = &events[1];
    assert_eq!(updated["previous"], serde_json::json!({ "email": "ada@example.com" }));
}
