//! A producer: an order and its event, committed together or not at all.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1:5432/test cargo run -p ferry --example produce
//! ```

use ferry::Event;
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let pool = sqlx::PgPool::connect(&url).await?;
    ferry::migrate(&mut *pool.acquire().await?).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)")
        .execute(&pool)
        .await?;

    let id: i64 = rand_id();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, $2)")
        .bind(id)
        .bind(4_200_i64)
        .execute(&mut *tx)
        .await?;
    let sent = ferry::enqueue(
        &mut tx,
        Event::new("shop.order.created", json!({ "id": id, "total_cents": 4200 }))
            .key(format!("order-{id}"))
            .header("tenant", "acme"),
    )
    .await?;
    tx.commit().await?;
    println!("order {id} committed with event {}", sent.id);
    Ok(())
}

fn rand_id() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(1)
}
