//! The Redis Streams sink against a real server (`FERRY_TEST_REDIS_URL`,
//! default the local one). Every test uses its own uniquely named keys.
#![cfg(feature = "redis")]

#[path = "redis/acl.rs"]
mod acl;
#[path = "redis/faults.rs"]
mod faults;
#[path = "redis/replicas.rs"]
mod replicas;
#[path = "redis/support.rs"]
mod support;

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use ferry_core::{ErrorKind, Route, Sink, StoredEvent};
use ferry_sink::redis::RedisOptions;
use ferry_testkit::sink_suite::{self, ARRIVAL_TIMEOUT, QUIET_PERIOD, ReceivedMessage, SinkHarness, event};
use serde_json::json;
use support::{LIMIT, TestStream, connect, expect_err, keyed, redis_url, route, sink_at, sink_with, unique};

struct Harness {
    stream: TestStream,
    wrong_type: String,
}

#[async_trait]
impl SinkHarness for Harness {
    fn route(&self) -> Route {
        route("test", &self.stream.key)
    }
    fn missing_route(&self) -> Option<Route> {
        Some(route("test", &self.wrong_type))
    }
    fn max_payload_bytes(&self) -> Option<usize> {
        Some(LIMIT)
    }
    async fn received(&self, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
        self.stream
            .receive(n, timeout)
            .await
            .into_iter()
            .map(|e| ReceivedMessage {
                id: e.id(),
                key: e.text("key"),
                body: e.fields.get("payload").cloned().unwrap_or_default(),
            })
            .collect()
    }
}

/// A plain string key: XADD to it fails with WRONGTYPE.
async fn string_key(prefix: &str) -> String {
    let key = unique(prefix);
    let _: () = ::redis::cmd("SET")
        .arg(&key)
        .arg("not a stream")
        .query_async(&mut connect().await)
        .await
        .unwrap();
    key
}

async fn delete(key: &str) {
    let _: i64 = ::redis::cmd("DEL")
        .arg(key)
        .query_async(&mut connect().await)
        .await
        .unwrap();
}

#[tokio::test]
async fn passes_the_sink_conformance_suite() {
    let harness = Harness {
        stream: TestStream::new("suite").await,
        wrong_type: string_key("suite-string").await,
    };
    let sink = sink_at(redis_url());
    sink_suite::run(&sink, &harness).await;
    // The missing route must have failed as a configuration error.
    let outcomes = sink
        .publish(&harness.missing_route().unwrap(), &keyed(2, |s| format!("m{s}")))
        .await;
    for outcome in &outcomes {
        expect_err(outcome, ErrorKind::Config, "WRONGTYPE");
    }
    sink.close().await;
    harness.stream.delete().await;
    delete(&harness.wrong_type).await;
}

#[tokio::test]
async fn entries_carry_every_field() {
    let stream = TestStream::new("wire").await;
    let sink = sink_at(redis_url());
    let mut traced = event(1, "order.item.created", Some("o-1"), json!({ "n": 1 }));
    traced.headers.insert("traceparent".into(), "00-4bf92f35-01".into());
    let mut raw = event(2, "order.item.archived", None, json!(null));
    raw.payload = bytes::Bytes::from_static(b"\x00\x01\xffplain");
    raw.content_type = "application/octet-stream".into();
    let events = [traced, raw];
    let templated = route("test", &format!("{}:{{domain}}", stream.key));
    sink.check(&templated)
        .await
        .expect("a template checks connectivity only");
    assert_eq!(sink.publish(&templated, &events).await, vec![Ok(()), Ok(())]);

    let target = TestStream::at(format!("{}:order", stream.key)).await;
    let entries = target.receive(2, ARRIVAL_TIMEOUT).await;
    assert_eq!(entries.len(), 2);
    for (e, entry) in events.iter().zip(&entries) {
        assert_eq!(entry.id(), e.id.to_string());
        assert_eq!(entry.text("type").as_deref(), Some(e.event_type.as_str()));
        assert_eq!(entry.text("key"), e.key);
        assert_eq!(entry.fields["payload"], e.payload.to_vec());
        assert_eq!(entry.text("content-type").as_deref(), Some(e.content_type.as_str()));
        assert_eq!(entry.text("source").as_deref(), Some("ferry"));
        assert_eq!(entry.text("specversion").as_deref(), Some("1.0"));
        let time = chrono::DateTime::parse_from_rfc3339(&entry.text("time").unwrap()).expect("RFC 3339");
        assert_eq!(time, e.created_at);
        let headers: HashMap<String, String> = serde_json::from_slice(&entry.fields["headers"]).unwrap();
        let expected: HashMap<String, String> = e.headers.clone().into_iter().collect();
        assert_eq!(headers, expected);
    }
    sink.close().await;
    target.delete().await;
}

#[tokio::test]
async fn maxlen_trims_per_route_with_a_default() {
    let trimmed = TestStream::new("trimmed").await;
    let defaulted = TestStream::new("defaulted").await;
    let untrimmed = TestStream::new("untrimmed").await;
    let sink = sink_with(RedisOptions {
        url: redis_url(),
        maxlen_default: Some(500),
        maxlen_per_route: [("short".to_owned(), 10), ("unbounded".to_owned(), 0)].into(),
        ..RedisOptions::default()
    });
    let events = keyed(1000, |s| format!("k{}", s % 4));
    for (name, stream) in [("short", &trimmed), ("other", &defaulted), ("unbounded", &untrimmed)] {
        for chunk in events.chunks(200) {
            let outcomes = sink.publish(&route(name, &stream.key), chunk).await;
            assert!(
                outcomes.iter().all(Result::is_ok),
                "{name}: {:?}",
                outcomes.iter().find(|o| o.is_err())
            );
        }
    }
    // `MAXLEN ~` trims whole macro nodes (100 entries by default), so a
    // stream keeps at least the limit and less than the limit plus a node.
    let node = 100;
    let short = trimmed.len().await;
    assert!((10..10 + node + 1).contains(&short), "short kept {short}");
    let other = defaulted.len().await;
    assert!((500..500 + node + 1).contains(&other), "default kept {other}");
    assert_eq!(untrimmed.len().await, 1000);
    // What is kept is the newest.
    let kept = trimmed.all().await;
    assert_eq!(kept.last().unwrap().id(), events.last().unwrap().id.to_string());
    sink.close().await;
    for s in [trimmed, defaulted, untrimmed] {
        s.delete().await;
    }
}

#[tokio::test]
async fn check_wants_a_stream_a_consumer_group_reads_and_names_what_is_missing() {
    let stream = TestStream::new("check").await;
    let sink = sink_at(redis_url());
    sink.check(&route("test", &stream.key))
        .await
        .expect("a stream with a group");

    // Nobody home: no stream at all, then a stream that no group reads.
    let lonely = TestStream::at(format!("{}:lonely", stream.key)).await;
    let err = sink.check(&route("lonely", &lonely.key)).await.expect_err("absent");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(err.message.contains("route \"lonely\" reaches nobody"), "{err}");
    assert!(err.message.contains("does not exist"), "{err}");
    assert!(
        sink.publish(&route("lonely", &lonely.key), &keyed(1, |_| "k".into()))
            .await[0]
            .is_ok()
    );
    let err = sink.check(&route("lonely", &lonely.key)).await.expect_err("no group");
    assert!(err.message.contains("has no consumer group"), "{err}");
    assert!(err.message.contains("XGROUP CREATE"), "{err}");

    let wrong = string_key("check-string").await;
    let err = sink.check(&route("test", &wrong)).await.expect_err("a string key");
    assert_eq!(err.kind, ErrorKind::Config);
    assert!(
        err.message.contains(&format!("{wrong:?} holds a string, not a stream")),
        "{err}"
    );
    assert!(err.message.contains("routes[].destination"), "{err}");
    sink.close().await;
    stream.delete().await;
    lonely.delete().await;
    delete(&wrong).await;
}

#[tokio::test]
async fn a_wrong_type_key_fails_its_events_and_what_redis_stored_is_reported_stored() {
    let good = TestStream::new("mixed").await;
    let base = good.key.clone();
    let bad = string_key("mixed-string").await;
    // `{type}` picks the key per event (a StoredEvent's type is not
    // validated again): the good stream for some, the string key for one.
    let sink = sink_at(redis_url());
    let templated = route("test", "{type}");
    let to_good = |seq: i64, key: &str| event(seq, &base, Some(key), json!({ "seq": seq }));
    let events: Vec<StoredEvent> = vec![
        to_good(0, "a"),
        event(1, &bad, Some("a"), json!({ "seq": 1 })),
        to_good(2, "a"),
        to_good(3, "b"),
    ];
    let outcomes = sink.publish(&templated, &events).await;
    assert_eq!(outcomes[0], Ok(()));
    expect_err(&outcomes[1], ErrorKind::Config, "not a stream");
    // Redis ran the later XADD of key a: it is in the stream ahead of the
    // failed one, and reporting it failed would hide that (the relay counts
    // the order break) and add it a second time on retry.
    assert_eq!(outcomes[2], Ok(()));
    assert_eq!(outcomes[3], Ok(()));
    let stored: Vec<String> = good.all().await.iter().map(|e| e.id()).collect();
    let want: Vec<String> = [0, 2, 3].iter().map(|&i| events[i].id.to_string()).collect();
    assert_eq!(stored, want);
    assert_eq!(good.receive(4, QUIET_PERIOD).await.len(), 3, "nothing else arrived");
    sink.close().await;
    good.delete().await;
    delete(&bad).await;
}
