//! Subject templates in `check`: a template whose own text cannot make a
//! subject is refused before any event goes dead to it, one no stream
//! captures any subject of is warned of, and the streams that capture its
//! subjects are held to what a plain subject's stream is. In publishing, an
//! event cannot make a subject NATS reserves.

use ferry_core::{ErrorKind, Sink};
use ferry_testkit::sink_suite::event;
use serde_json::json;

use crate::support::{TestStream, expect_err, keyed, nats_url, route, sink_at, unique};

/// `events.>.{type}` and the like passed `check` (only JetStream itself
/// was asked about), then every event went dead at its first attempt.
#[tokio::test]
async fn check_refuses_a_template_whose_own_text_is_no_subject() {
    let stream = TestStream::create("badtemplate").await;
    let sink = sink_at(nats_url());
    let base = &stream.subject;
    for bad in [
        format!("{base}.>.{{type}}"),
        format!("{base}.{{type}}."),
        format!("{base}..{{domain}}"),
        format!("{base}.*.{{domain}}"),
    ] {
        let err = sink.check(&route(&bad)).await.expect_err(&bad);
        assert_eq!(err.kind, ErrorKind::Config, "{bad}: {err}");
        assert!(err.message.contains(&format!("subject template {bad:?}")), "{err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
        // What publishing would have done with each event.
        let e = event(1, "order.item.created", Some("k"), json!({}));
        let refused = sink.admit(&route(&bad), &e).expect_err(&bad);
        assert_eq!(refused.kind, ErrorKind::Config, "{bad}: {refused}");
    }
    sink.close().await;
    stream.delete().await;
}

#[tokio::test]
async fn check_warns_of_a_template_no_stream_captures() {
    let stream = TestStream::create("template").await;
    let sink = sink_at(nats_url());
    let captured = route(&format!("{}.{{domain}}.{{type}}", stream.subject));
    let caveats = sink.check_with_caveats(&captured).await.expect("captured");
    assert!(caveats.is_empty(), "{caveats:?}");

    let nowhere = unique("ferry.nowhere").replace('_', ".");
    let missing = route(&format!("{nowhere}.{{domain}}.{{type}}"));
    let caveats = sink
        .check_with_caveats(&missing)
        .await
        .expect("a warning, not a refusal");
    assert_eq!(caveats.len(), 1, "{caveats:?}");
    assert!(caveats[0].contains("no JetStream stream captures"), "{caveats:?}");
    assert!(
        caveats[0].contains(&format!("--subjects '{nowhere}.*.>'")),
        "{caveats:?}"
    );
    sink.check(&missing)
        .await
        .expect("check passes with the warning logged");

    // The key's caveat says where a dotted key really goes.
    let keyed = route(&format!("{}.{{key}}", stream.subject));
    let caveats = sink.check_with_caveats(&keyed).await.expect("captured");
    assert_eq!(caveats.len(), 1, "{caveats:?}");
    let deeper = format!("published to \"{}.a.b\"", stream.subject);
    assert!(caveats[0].contains(&deeper), "{caveats:?}");
    sink.close().await;
    stream.delete().await;
}

/// A template's stream was found, and not looked at: a stream that never
/// acknowledges, or that deletes every event on arrival, passed `check`.
#[tokio::test]
async fn check_holds_a_templates_streams_to_what_a_plain_subjects_stream_is() {
    let sink = sink_at(nats_url());
    let silent = TestStream::create_with("tnoack", json!({ "no_ack": true })).await;
    let by_domain = route(&format!("{}.{{domain}}", silent.subject));
    let err = sink.check(&by_domain).await.expect_err("no_ack");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("no_ack"), "{err}");
    silent.delete().await;

    let short = TestStream::create_with("tshortdupe", json!({ "duplicate_window": 30_000_000_000u64 })).await;
    let by_type = route(&format!("{}.{{domain}}.{{type}}", short.subject));
    let caveats = sink.check_with_caveats(&by_type).await.expect("usable");
    assert!(
        caveats.len() == 1 && caveats[0].contains("30s") && caveats[0].contains("--dupe-window"),
        "{caveats:?}"
    );
    short.delete().await;

    let interest = TestStream::create_with("tinterest", json!({ "retention": "interest" })).await;
    let base = interest.subject.clone();
    let by_domain = route(&format!("{base}.{{domain}}"));
    let by_type = route(&format!("{base}.{{domain}}.{{type}}"));
    let err = sink.check(&by_domain).await.expect_err("no consumer");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains("no consumer"), "{err}");

    let payments = format!("{base}.payment.>");
    interest
        .add_consumer_with("payments", json!({ "filter_subject": payments }))
        .await;
    // `<base>.{domain}` is one token after the base: never `<base>.payment.x`.
    let err = sink.check(&by_domain).await.expect_err("no consumer can match");
    assert_eq!(err.kind, ErrorKind::Config, "{err}");
    assert!(err.message.contains(&format!("{payments:?}")), "{err}");
    // `<base>.{domain}.{type}` makes `<base>.payment.payment.paid`, which the
    // consumer wants, and `<base>.order.order.created`, which nobody does.
    let caveats = sink
        .check_with_caveats(&by_type)
        .await
        .expect("some subjects are wanted");
    assert_eq!(caveats.len(), 1, "{caveats:?}");
    assert!(
        caveats[0].contains("only some") && caveats[0].contains(&format!("{payments:?}")),
        "{caveats:?}"
    );
    // A consumer of everything the stream holds: no caveat left.
    interest.add_consumer("everything").await;
    let caveats = sink.check_with_caveats(&by_type).await.expect("usable");
    assert!(caveats.is_empty(), "{caveats:?}");
    sink.check(&by_domain).await.expect("usable");
    interest.delete().await;
    sink.close().await;
}

/// With a subject's first token from the event, a key
/// `$JS.API.STREAM.PURGE.<stream>` made a JetStream API request that purged
/// the stream, on every attempt; an `_INBOX.` or `_R_.` key, a forged reply.
#[tokio::test]
async fn an_event_cannot_render_a_subject_nats_reserves() {
    let victim = TestStream::create("victim").await;
    let sink = sink_at(nats_url());
    let kept = keyed(2, |seq| format!("k{seq}"));
    assert_eq!(sink.publish(&route(&victim.subject), &kept).await, vec![Ok(()), Ok(())]);
    assert_eq!(victim.count().await, 2);

    let by_key = route("{key}");
    let purge = format!("$JS.API.STREAM.PURGE.{}", victim.name);
    let forged = format!("_INBOX.{}", victim.name);
    let imported = format!("_R_.{}", victim.name);
    for key in [purge.as_str(), forged.as_str(), imported.as_str()] {
        let e = event(9, "order.item.created", Some(key), json!({}));
        let err = sink.admit(&by_key, &e).expect_err(key);
        assert_eq!(err.kind, ErrorKind::Permanent, "{key}: {err}");
        assert!(err.message.contains("{key}"), "{err}");
        let outcomes = sink.publish(&by_key, &[e]).await;
        expect_err(&outcomes[0], ErrorKind::Permanent, "reserve");
    }
    assert_eq!(victim.count().await, 2, "an event purged the stream");

    // A subject written so in the route is the user's own: published.
    let literal = route(&format!("$JS.API.STREAM.INFO.{}", victim.name));
    let outcomes = sink.publish(&literal, &keyed(1, |_| "i".into())).await;
    assert!(
        !matches!(&outcomes[0], Err(e) if e.message.contains("reserve")),
        "{outcomes:?}"
    );
    sink.close().await;
    victim.delete().await;
}
