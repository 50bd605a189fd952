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
        // The first wait is short: the test need not sit through it.
        slow(ev).then(|| match waits.fetch_add(1, Ordering::SeqCst) {
            0 => Duration::from_millis(200),
            _ => Duration::from_secs(30),
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
    s.direct_publish_timeout = Duration::from_secs(60);
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
            Duration::from_secs(15),
            || e.sink.delivered_ids("orders").contains(&ids[1]),
        )
        .await;
    }
    relay.stop().await;
}
