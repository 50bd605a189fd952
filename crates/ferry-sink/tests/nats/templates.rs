//! Subject templates in `check`: a template whose own text cannot make a
//! subject is refused before any event goes dead to it, and one no stream
//! captures any subject of is warned of.

use ferry_core::{ErrorKind, Sink};
use ferry_testkit::sink_suite::event;
use serde_json::json;

use crate::support::{TestStream, nats_url, route, sink_at, unique};

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
