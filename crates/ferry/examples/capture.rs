//! Table capture: triggers turn every write to `customers` into an event in
//! the same transaction, whatever code path made it (ORM, raw SQL, a bulk
//! job). The same as `ferry capture add customers --type-prefix crm.customer
//! --key id --exclude password_hash --soft-delete deleted_at`.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1:5432/test cargo run -p ferry --example capture
//! ```

use ferry::capture::{self, CaptureSpec};
use sqlx::PgPool;

/// Captures `customers`, then changes it the way any application would.
/// Returns the events written, oldest first: `(type, key, payload)`.
pub async fn run(pool: &PgPool) -> Result<Vec<(String, String, serde_json::Value)>, Box<dyn std::error::Error>> {
    ferry::migrate(&mut *pool.acquire().await?).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS customers (
             id bigint PRIMARY KEY, email text NOT NULL, password_hash text, deleted_at timestamptz)",
    )
    .execute(pool)
    .await?;
    let spec = CaptureSpec::new("customers", "crm.customer", "id")
        .exclude(["password_hash"])
        .soft_delete("deleted_at");
    if capture::list(&mut *pool.acquire().await?).await?.is_empty() {
        capture::add(&mut *pool.acquire().await?, &spec).await?;
    }
    // Plain SQL, no Ferry call: the triggers write the events.
    sqlx::raw_sql(
        "INSERT INTO customers (id, email, password_hash) VALUES (7, 'ada@example.com', 'x');
         UPDATE customers SET email = 'ada@example.org' WHERE id = 7;
         UPDATE customers SET password_hash = 'y' WHERE id = 7;  -- excluded column: no event
         UPDATE customers SET deleted_at = now() WHERE id = 7;   -- soft delete",
    )
    .execute(pool)
    .await?;
    let events =
        sqlx::query_as("SELECT type, key, convert_from(payload, 'UTF8')::jsonb FROM ferry.events ORDER BY seq")
            .fetch_all(pool)
            .await?;
    Ok(events)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let pool = PgPool::connect(&url).await?;
    for (event_type, key, payload) in run(&pool).await? {
        println!("{event_type} {key} {payload}");
    }
    Ok(())
}
