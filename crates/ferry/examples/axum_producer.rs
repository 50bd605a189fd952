//! A producer in an axum handler: the order row and its event commit in one
//! transaction, or neither does.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1:5432/test cargo run -p ferry --example axum_producer
//! curl -i localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"id": 42, "customer": "acme", "total_cents": 4200}'
//! ```
//!
//! Then `ferry run` delivers `shop.order.created` to wherever the routes say.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use ferry::Event;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;

#[derive(Deserialize)]
pub struct NewOrder {
    pub id: i64,
    pub customer: String,
    pub total_cents: i64,
}

#[derive(Serialize)]
pub struct Created {
    pub order: i64,
    pub event: String,
}

/// The service's routes.
pub fn app(pool: PgPool) -> Router {
    Router::new().route("/orders", post(create_order)).with_state(pool)
}

async fn create_order(
    State(pool): State<PgPool>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<Created>), (StatusCode, String)> {
    if order.total_cents <= 0 {
        return Err((StatusCode::UNPROCESSABLE_ENTITY, "total_cents must be positive".into()));
    }
    let mut tx = pool.begin().await.map_err(internal)?;
    let inserted =
        sqlx::query("INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
            .bind(order.id)
            .bind(&order.customer)
            .bind(order.total_cents)
            .execute(&mut *tx)
            .await
            .map_err(internal)?;
    if inserted.rows_affected() == 0 {
        // Dropping `tx` rolls back: no order, no event.
        return Err((StatusCode::CONFLICT, format!("order {} exists", order.id)));
    }
    let event = Event::new(
        "shop.order.created",
        json!({ "id": order.id, "customer": order.customer, "total_cents": order.total_cents }),
    )
    .key(format!("order-{}", order.id));
    let sent = ferry::enqueue(&mut tx, event).await.map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    let created = Created {
        order: order.id,
        event: sent.id.to_string(),
    };
    Ok((StatusCode::CREATED, Json(created)))
}

fn internal(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// The `ferry` schema and the service's own table.
pub async fn prepare(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    ferry::migrate(&mut *pool.acquire().await?).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let pool = PgPool::connect(&url).await?;
    prepare(&pool).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("POST http://{}/orders", listener.local_addr()?);
    axum::serve(listener, app(pool)).await?;
    Ok(())
}
