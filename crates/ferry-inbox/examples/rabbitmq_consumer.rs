//! A consumer with the inbox: each paid order (`order.paid`,
//! `shop.order.paid`, ...) credits the customer exactly once, however often
//! RabbitMQ delivers it.
//!
//! Run `ferry migrate` against the database first, then:
//! `DATABASE_URL=postgres://... cargo run -p ferry-inbox --features rabbitmq --example rabbitmq_consumer`

use ferry_inbox::rabbitmq::{RabbitMqConsumer, RabbitMqConsumerOptions};
use ferry_inbox::{ConsumerReport, HandlerError, Inbox, ReceivedEvent};
use sqlx::{PgConnection, PgPool};

#[derive(serde::Deserialize)]
struct OrderPaid {
    customer: String,
    cents: i64,
}

/// Consumes paid orders from `exchange` through `queue` until `shutdown`.
pub async fn consume(
    pool: PgPool,
    amqp_url: &str,
    (exchange, queue): (&str, &str),
    shutdown: impl Future<Output = ()>,
) -> Result<ConsumerReport, Box<dyn std::error::Error>> {
    sqlx::query("CREATE TABLE IF NOT EXISTS credits (customer text, cents bigint)")
        .execute(&pool)
        .await?;
    let options = RabbitMqConsumerOptions::new(amqp_url, queue, format!("{queue}.dlx")).bind(exchange, "#.order.paid");
    let consumer = RabbitMqConsumer::new(Inbox::new(pool, queue)?, options)?;
    let handler = async |tx: &mut PgConnection, event: &ReceivedEvent| {
        let paid: OrderPaid = event.json().map_err(|e| HandlerError::permanent(e.to_string()))?;
        sqlx::query("INSERT INTO credits (customer, cents) VALUES ($1, $2)")
            .bind(paid.customer)
            .bind(paid.cents)
            .execute(tx)
            .await?;
        Ok(())
    };
    Ok(consumer.run(handler, shutdown).await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let stop = async { tokio::signal::ctrl_c().await.unwrap_or(()) };
    println!("consuming paid orders from exchange shop through queue billing; Ctrl-C stops");
    let report = consume(pool, amqp, ("shop", "billing"), stop).await?;
    println!("stopped: {report:?}");
    Ok(())
}
