use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{StoreError, Wake, WakeSource};
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use super::error::store_error;

/// How long the listener waits without a notification before it asks its
/// connection for an answer. A connection gone silent (a failover, a
/// dropped network, a proxy that stops answering) brings no error and no
/// notification: the relay then found new events only by its fallback
/// poll, up to `relay.poll_interval` late, for as long as the socket lived
/// (about 15 minutes of retransmissions, or for ever behind such a proxy).
/// A minute keeps an idle relay's cost to the database at one statement a
/// minute more.
const IDLE_CHECK: Duration = Duration::from_secs(60);

/// How long the check's `SELECT 1` may take before the connection counts as
/// gone silent.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Commit notifications on channel `ferry`: the partition from
/// `ferry._enqueue` (new events), `due:` and the partition from an operator's
/// action or a settle that parked deliveries.
pub struct PgWakeSource {
    listener: PgListener,
    idle_check: Duration,
    check_timeout: Duration,
}

impl PgWakeSource {
    pub async fn connect(pool: &PgPool) -> Result<Self, StoreError> {
        Self::connect_checking(pool, IDLE_CHECK, CHECK_TIMEOUT).await
    }

    /// As [`connect`](Self::connect), asking the connection for an answer
    /// after `idle_check` without a notification, and giving it
    /// `check_timeout` to answer.
    pub async fn connect_checking(
        pool: &PgPool,
        idle_check: Duration,
        check_timeout: Duration,
    ) -> Result<Self, StoreError> {
        let mut listener = PgListener::connect_with(pool).await.map_err(store_error)?;
        listener.listen("ferry").await.map_err(store_error)?;
        Ok(Self {
            listener,
            idle_check,
            check_timeout,
        })
    }
}

#[async_trait]
impl WakeSource for PgWakeSource {
    /// The next notification; `Ok(None)` when the connection dropped and
    /// notifications may have been lost (the listener reconnects on the
    /// next call), an error when the connection went silent (the caller
    /// listens anew, on another connection).
    async fn wait(&mut self) -> Result<Option<Wake>, StoreError> {
        loop {
            // Dropping a wait cut short loses nothing: what arrived whole
            // stays buffered, and what the check's statement meets on the
            // way is kept for the next call.
            if let Ok(received) = tokio::time::timeout(self.idle_check, self.listener.try_recv()).await {
                return match received.map_err(store_error)? {
                    Some(n) => Ok(parse(n.payload())),
                    None => Ok(None),
                };
            }
            let check = sqlx::raw_sql("SELECT 1").execute(&mut self.listener);
            match tokio::time::timeout(self.check_timeout, check).await {
                Ok(Ok(_)) => continue,
                Ok(Err(e)) => return Err(store_error(e)),
                Err(_) => {
                    return Err(StoreError::transient(format!(
                        "the commit listener's connection did not answer within {:?} after {:?} without a \
                         notification: gone silent; listening anew on another connection",
                        self.check_timeout, self.idle_check
                    )));
                }
            }
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

    /// A listener whose connection goes silent (kept open, nothing passes)
    /// says so within its idle check and the check's timeout, so the relay
    /// listens anew; it used to wait on the socket for as long as it lived,
    /// while the relay found new events only by its fallback poll. A
    /// listener on a connection that answers waits on.
    #[tokio::test]
    async fn a_listener_whose_connection_goes_silent_says_so() {
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
        let db = ferry_testkit::pg::TestDb::create().await;
        let direct: PgConnectOptions = db.url().parse().unwrap();
        let upstream = tokio::net::lookup_host((direct.get_host(), direct.get_port()))
            .await
            .unwrap()
            .next()
            .unwrap();
        let proxy = ferry_testkit::proxy::Proxy::start(upstream).unwrap();
        let pool = PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(direct.host("127.0.0.1").port(proxy.addr().port()));
        let (idle_check, check_timeout) = (Duration::from_millis(200), Duration::from_millis(500));
        let mut source = PgWakeSource::connect_checking(&pool, idle_check, check_timeout)
            .await
            .unwrap();
        // Answering, the connection is checked and the wait goes on.
        let quiet = tokio::time::timeout(Duration::from_secs(2), source.wait()).await;
        assert!(quiet.is_err(), "a listener that answers waits on: {quiet:?}");
        let sender = db.pool().await;
        sqlx::query("SELECT pg_notify('ferry', '7')")
            .execute(&sender)
            .await
            .unwrap();
        assert_eq!(source.wait().await.unwrap(), Some(Wake::Events(7)));

        proxy.silence();
        let silent = tokio::time::timeout(Duration::from_secs(30), source.wait())
            .await
            .expect("a silent connection is told within the check");
        let error = silent.expect_err("a silent connection is an error");
        assert!(error.to_string().contains("gone silent"), "{error}");
        proxy.cut();
    }

    #[test]
    fn payloads_say_what_woke_the_relay() {
        assert_eq!(parse("7"), Some(Wake::Events(7)));
        assert_eq!(parse("due:31"), Some(Wake::Due(31)));
        assert_eq!(parse("due:"), None);
        assert_eq!(parse("something else"), None);
    }
}
