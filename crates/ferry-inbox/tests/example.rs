//! The RabbitMQ consumer example, run as a user would: events published the
//! way Ferry publishes them, one of them twice, credit each customer once.

mod support;

use ferry_core::{Glob, Route, Sink};
use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
use ferry_testkit::metrics::Counts;
use ferry_testkit::rabbit::{amqp_url, unique_name};
use ferry_testkit::sink_suite::event;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;
use support::{Db, wait};

#[path = "../examples/rabbitmq_consumer.rs"]
#[allow(dead_code)]
mod example;

#[tokio::test]
async fn the_consumer_example_credits_each_payment_once() {
    // The consumer runs in its own task: count its metrics process-wide (the
    // only test of this binary) to see the duplicate skipped.
    let counts = Counts::by_label("consumer");
    metrics::set_global_recorder(counts.clone()).expect("no other recorder in this test binary");
    let db = Db::new().await;
    let amqp = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = amqp.create_channel().await.unwrap();
    let (exchange, queue) = (unique_name("example"), unique_name("billing"));
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn({
        let (pool, exchange, queue) = (db.pool.clone(), exchange.clone(), queue.clone());
        async move {
            example::consume(pool, &amqp_url(), (&exchange, &queue), async {
                let _ = stopped.await;
            })
            .await
            .map_err(|e| e.to_string())
        }
    });
    let sink = RabbitMqSink::new(RabbitMqOptions {
        url: amqp_url(),
        ..RabbitMqOptions::default()
    });
    let route = Route {
        name: "billing".into(),
        matcher: Glob::new("order.**").unwrap(),
        sink: "rabbit".into(),
        destination: exchange.clone(),
        routing_key: None,
    };
    // The consumer declares and binds its queue; publish once `check` (which
    // asks the management API for bindings) says the exchange reaches it.
    wait("the consumer's queue is bound", || async {
        sink.check(&route).await.is_ok()
    })
    .await;
    let paid = |seq, customer: &str, cents: i64| {
        event(
            seq,
            "order.paid",
            Some(customer),
            json!({ "customer": customer, "cents": cents }),
        )
    };
    let (a, b) = (paid(1, "acme", 4200), paid(2, "globex", 100));
    // `a` twice, as a relay that crashed before recording would send it.
    for batch in [vec![a.clone(), b], vec![a]] {
        assert!(sink.publish(&route, &batch).await.iter().all(Result::is_ok));
    }
    let credits = || async {
        sqlx::query_as::<_, (String, i64)>("SELECT customer, cents FROM credits ORDER BY customer")
            .fetch_all(&db.pool)
            .await
            .unwrap_or_default()
    };
    wait("both payments credited", || async { credits().await.len() >= 2 }).await;
    wait("the second delivery of the first payment skipped", || async {
        counts.get(ferry_inbox::metrics::DUPLICATES, &queue) >= 1
    })
    .await;
    let _ = stop.send(());
    let report = consumer.await.unwrap().unwrap();
    assert_eq!(credits().await, [("acme".to_owned(), 4200), ("globex".to_owned(), 100)]);
    assert_eq!((report.processed, report.duplicates), (2, 1), "{report:?}");

    sink.close().await;
    for q in [queue.clone(), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for x in [exchange.clone(), format!("{queue}.dlx")] {
        let _ = channel
            .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
}
