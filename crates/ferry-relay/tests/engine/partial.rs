//! A destination that fails part of every direct publish.

use super::*;

/// One part of a destination hangs (a Kafka partition without a leader):
/// a publish holding one of its keys waits out the sink's own timeout and
/// fails that key transiently, while the rest of it is confirmed. The
/// route was put down only when nothing was confirmed, so every batch with
/// a fresh such key went directly to it again, and held every route and
/// the router up for the whole wait.
#[tokio::test]
async fn a_route_failing_part_of_a_batch_holds_the_others_up_once_not_batch_after_batch() {
    let e = env().await;
    let slow = |ev: &ferry_core::StoredEvent| ev.key.as_deref().is_some_and(|k| k.starts_with("slow-"));
    let waits = Arc::new(std::sync::atomic::AtomicU64::new(0));
    e.other.delay_when(move |ev| {
        // The first wait is short, though slow enough to tell from a quick
        // failure (a tenth of the direct publish bound): the test need not
        // sit through a long one.
        slow(ev).then(|| match waits.fetch_add(1, Ordering::SeqCst) {
            0 => Duration::from_millis(2500),
            _ => Duration::from_secs(18),
        })
    });
    e.other
        .fail_when(move |ev| slow(ev).then(|| SinkError::transient("message timed out: partition has no leader")));
    let audit = Route {
        sink: "other".into(),
        ..route("audit", "**")
    };
    let mut s = settings("partial", 4);
    s.retry.max_attempts = u32::MAX;
    // The slow part answers within it: a partial failure, not a timeout.
    s.direct_publish_timeout = Duration::from_secs(20);
    let relay = start_with(&e, s, vec![route("orders", "order.**"), audit]);
    for round in 0..5 {
        let ids = produce(
            &e.pool,
            vec![
                Event::new("audit.entry.recorded", json!({ "round": round })).key(format!("slow-{round}")),
                Event::new("order.item.created", json!({ "round": round })).key(format!("fast-{round}")),
            ],
        )
        .await;
        // Half the slow part's wait: a batch waiting for it would not make it.
        eventually(
            &format!("round {round}'s order event on its own route"),
            Duration::from_secs(9),
            || e.sink.delivered_ids("orders").contains(&ids[1]),
        )
        .await;
    }
    relay.stop().await;
}

/// A destination that fails some events at once, every time (a RabbitMQ
/// return for a routing key nothing is bound to), and confirms the rest.
/// The route was put down for it as for a part that hangs, and a route is
/// back on the direct path only once nothing of it is pending: with the
/// failed delivery retried for ever, never, and every later event of the
/// route waited for its worker. Here the worker cannot claim, so what it
/// would publish never arrives.
#[tokio::test]
async fn a_route_failing_some_events_at_once_keeps_publishing_directly() {
    use ferry_testkit::hooked::Hook;
    let e = env().await;
    e.sink.fail_when(|ev| {
        (ev.key.as_deref() == Some("unbound")).then(|| SinkError::transient("message returned: NO_ROUTE"))
    });
    let hook: Hook = Arc::new(|called| {
        Box::pin(async move {
            if called == "claim" {
                return Err(ferry_core::StoreError::transient("claims are off in this test"));
            }
            Ok(())
        })
    });
    let store = Hooked::new(PgStore::new(e.pool.clone()), hook);
    let mut s = settings("quick-partial", 4);
    s.retry.max_attempts = u32::MAX;
    let relay = start_on(&e, store, s, vec![route("orders", "order.**")]);
    // One transaction: one batch, failed in part.
    let first = produce(
        &e.pool,
        vec![
            Event::new("order.item.created", json!({ "n": 0 })).key("unbound"),
            Event::new("order.item.created", json!({ "n": 1 })).key("fine-0"),
        ],
    )
    .await;
    eventually("the first batch's confirmed event", Duration::from_secs(20), || {
        e.sink.delivered_ids("orders").contains(&first[1])
    })
    .await;
    eventually_async(
        "the failed event written for a retry",
        Duration::from_secs(20),
        async || {
            let attempts: Option<i32> =
                sqlx::query_scalar("SELECT attempts FROM ferry.deliveries WHERE key = 'unbound'")
                    .fetch_optional(&e.pool)
                    .await
                    .unwrap();
            attempts == Some(1)
        },
    )
    .await;
    for round in 1..4 {
        let ids = produce(
            &e.pool,
            vec![Event::new("order.item.created", json!({ "round": round })).key(format!("fine-{round}"))],
        )
        .await;
        eventually(
            &format!("round {round}'s event, published directly"),
            Duration::from_secs(20),
            || e.sink.delivered_ids("orders").contains(&ids[0]),
        )
        .await;
    }
    relay.stop().await;
}
