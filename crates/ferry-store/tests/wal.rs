//! The WAL source's queries against a real PostgreSQL.

use ferry_store::postgres::migrate;
use ferry_store::postgres::wal::{WalConfig, WalSource};
use ferry_testkit::pg::TestDb;
use sqlx::Connection;

/// The slot can hand a transaction over before other sessions see it
/// commit. `look` must tell such a transaction apart from one whose rows
/// were routed already, or the relay would skip its events for good.
#[tokio::test]
async fn look_reports_transactions_not_yet_visible() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    migrate(&mut pool.acquire().await.unwrap()).await.unwrap();
    let source = WalSource::new(
        pool.clone(),
        WalConfig {
            url: db.url().to_owned(),
            slot: db.name().to_owned(),
            publication: "ferry".into(),
        },
    )
    .unwrap();
    let mut open = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let mut tx = open.begin().await.unwrap();
    let xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let xid = (xid & 0xffff_ffff) as u32;
    let look = source.look(&[], &[], &[], &[xid]).await.unwrap();
    assert!(look.invisible.contains(&xid), "an open transaction counts as visible");
    tx.commit().await.unwrap();
    let look = source.look(&[], &[], &[], &[xid]).await.unwrap();
    assert!(
        look.invisible.is_empty(),
        "a committed transaction is still invisible: {look:?}"
    );
    // One from long ago (a small xid of this epoch) is visible too.
    let look = source.look(&[], &[], &[], &[3]).await.unwrap();
    assert!(look.invisible.is_empty(), "{look:?}");
    drop(open);
    db.drop_db().await;
}
