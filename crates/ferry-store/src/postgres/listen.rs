use async_trait::async_trait;
use ferry_core::{Partition, StoreError, WakeSource};
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use super::error::store_error;

/// Commit notifications from `ferry._enqueue`, on channel `ferry`.
pub struct PgWakeSource {
    listener: PgListener,
}

impl PgWakeSource {
    pub async fn connect(pool: &PgPool) -> Result<Self, StoreError> {
        let mut listener = PgListener::connect_with(pool).await.map_err(store_error)?;
        listener.listen("ferry").await.map_err(store_error)?;
        Ok(Self { listener })
    }
}

#[async_trait]
impl WakeSource for PgWakeSource {
    async fn wait(&mut self) -> Result<Option<Partition>, StoreError> {
        match self.listener.try_recv().await.map_err(store_error)? {
            Some(n) => Ok(n.payload().parse().ok()),
            // The connection dropped and notifications may be lost; the
            // listener reconnects on the next call.
            None => Ok(None),
        }
    }
}
