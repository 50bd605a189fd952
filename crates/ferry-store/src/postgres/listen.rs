use async_trait::async_trait;
use ferry_core::{StoreError, Wake, WakeSource};
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use super::error::store_error;

/// Commit notifications on channel `ferry`: the partition from
/// `ferry._enqueue` (new events), `due:` and the partition from an operator's
/// action or a settle that parked deliveries.
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
    async fn wait(&mut self) -> Result<Option<Wake>, StoreError> {
        match self.listener.try_recv().await.map_err(store_error)? {
            Some(n) => Ok(parse(n.payload())),
            // The connection dropped and notifications may be lost; the
            // listener reconnects on the next call.
            None => Ok(None),
        }
    }
}

/// A payload nothing here recognises wakes everything (`None`).
fn parse(payload: &str) -> Option<Wake> {
    match payload.strip_prefix("due:") {
        Some(p) => p.parse().ok().map(Wake::Due),
        None => payload.parse().ok().map(Wake::Events),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_say_what_woke_the_relay() {
        assert_eq!(parse("7"), Some(Wake::Events(7)));
        assert_eq!(parse("due:31"), Some(Wake::Due(31)));
        assert_eq!(parse("due:"), None);
        assert_eq!(parse("something else"), None);
    }
}
