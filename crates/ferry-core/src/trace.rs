//! W3C trace context in event headers (feature `otel`).
//!
//! A producer's span context travels in the event's `traceparent` and
//! `tracestate` headers, so that every sink forwards it and the relay's
//! publish span can link back to the transaction that wrote the event. The
//! W3C format is used whatever propagator the process installed globally:
//! the header names are part of Ferry's event contract, and consumers read
//! them by name.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::Headers;

/// The W3C header naming the trace and the producer's span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// The context of the current `tracing` span (through
/// `tracing-opentelemetry`), or else OpenTelemetry's current context, for
/// producers that use the OpenTelemetry API directly.
pub fn current_context() -> Context {
    let from_tracing = tracing::Span::current().context();
    if from_tracing.span().span_context().is_valid() {
        from_tracing
    } else {
        Context::current()
    }
}

/// Writes `cx` into `headers` as `traceparent` and `tracestate`, unless
/// they already carry a context that [`span_context`] reads back: a context
/// the caller set explicitly wins, but only a valid one. Its name may be in
/// any case (HTTP header names ignore case, and the relay reads it so);
/// AMQP, Kafka and NATS consumers usually look for the exact lowercase name.
/// A `traceparent` that does not parse gives way to the current context,
/// written under the exact name (a webhook, which folds the names, sends
/// that one: it sorts after any other case), with its `tracestate`. A
/// context without a valid span writes nothing.
pub fn inject(cx: &Context, headers: &mut Headers) {
    if span_context(headers).is_some() {
        return;
    }
    TraceContextPropagator::new().inject_context(cx, &mut HeaderWriter(headers));
}

/// The producer's span context from an event's headers, if they carry a
/// valid `traceparent`.
pub fn span_context(headers: &Headers) -> Option<SpanContext> {
    // From an empty context: `extract` falls back to the current one, and
    // would return the reader's own span for headers without a context.
    let cx = TraceContextPropagator::new().extract_with_context(&Context::new(), &HeaderReader(headers));
    let span = cx.span().span_context().clone();
    span.is_valid().then_some(span)
}

struct HeaderWriter<'a>(&'a mut Headers);

impl Injector for HeaderWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct HeaderReader<'a>(&'a Headers);

impl Extractor for HeaderReader<'_> {
    /// The exact name first, else the same name in another case: HTTP
    /// header names ignore case, and a webhook sends `Traceparent` as
    /// `traceparent`.
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .or_else(|| {
                self.0
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(key))
                    .map(|(_, v)| v)
            })
            .map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Event;
    use opentelemetry::trace::{TraceId, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    const EXPLICIT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// Runs `f` inside a sampled `tracing` span exported through
    /// `tracing-opentelemetry`, and returns the span's trace id with `f`'s
    /// result.
    fn in_span<T>(f: impl FnOnce() -> T) -> (TraceId, T) {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("checkout");
            let _entered = span.enter();
            let trace_id = span.context().span().span_context().trace_id();
            (trace_id, f())
        })
    }

    #[test]
    fn the_current_span_goes_into_the_headers() {
        let (trace_id, event) =
            in_span(|| Event::new("order.paid", serde_json::json!({})).with_current_trace_context());
        let traceparent = &event.headers()[TRACEPARENT];
        assert!(traceparent.starts_with(&format!("00-{trace_id}-")), "{traceparent}");
        assert!(traceparent.ends_with("-01"), "sampled: {traceparent}");
        assert_eq!(span_context(event.headers()).unwrap().trace_id(), trace_id);
    }

    #[test]
    fn an_explicit_traceparent_wins() {
        let (_, event) = in_span(|| {
            Event::new("order.paid", serde_json::json!({}))
                .header(TRACEPARENT, EXPLICIT)
                .with_current_trace_context()
        });
        assert_eq!(event.headers()[TRACEPARENT], EXPLICIT);
        assert!(!event.headers().contains_key(TRACESTATE));
    }

    #[test]
    fn a_valid_traceparent_in_another_case_wins_and_reads_back() {
        // The relay read only the exact name: the explicit context won, but
        // the relay's span was left unlinked.
        let (trace_id, event) = in_span(|| {
            Event::new("order.paid", serde_json::json!({}))
                .header("Traceparent", EXPLICIT)
                .with_current_trace_context()
        });
        assert_eq!(event.headers().len(), 1, "{:?}", event.headers());
        assert_eq!(event.headers()["Traceparent"], EXPLICIT);
        let read = span_context(event.headers()).unwrap().trace_id();
        assert_eq!(read.to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_ne!(read, trace_id);
    }

    #[test]
    fn an_unparsable_traceparent_in_another_case_gives_way_under_the_exact_name() {
        let (trace_id, event) = in_span(|| {
            Event::new("order.paid", serde_json::json!({}))
                .header("Traceparent", "garbage")
                .with_current_trace_context()
        });
        assert_eq!(span_context(event.headers()).unwrap().trace_id(), trace_id);
        assert_eq!(event.headers()["Traceparent"], "garbage");
    }

    #[test]
    fn a_traceparent_that_does_not_parse_gives_way_to_the_current_span() {
        let (trace_id, event) = in_span(|| {
            Event::new("order.paid", serde_json::json!({}))
                .header(TRACEPARENT, "garbage")
                .header(TRACESTATE, "vendor=abc")
                .header("tenant", "acme")
                .with_current_trace_context()
        });
        assert_eq!(span_context(event.headers()).unwrap().trace_id(), trace_id);
        assert_eq!(event.headers()[TRACESTATE], "", "the state went with its traceparent");
        assert_eq!(event.headers()["tenant"], "acme");
    }

    #[test]
    fn outside_any_span_a_traceparent_is_left_as_it_is() {
        for name in [TRACEPARENT, "TRACEPARENT"] {
            let event = Event::new("order.paid", serde_json::json!({}))
                .header(name, "garbage")
                .with_current_trace_context();
            assert_eq!(event.headers().len(), 1, "{:?}", event.headers());
            assert_eq!(event.headers()[name], "garbage");
        }
    }

    /// `inject` backs off exactly when `span_context` would read a context:
    /// within a span, whatever the headers, the relay finds one afterwards.
    #[test]
    fn inject_backs_off_only_for_a_context_that_reads_back() {
        let other_case = [("TraceParent", EXPLICIT)];
        let unparsable = [(TRACEPARENT, "00-not-a-trace")];
        let zero = [(TRACEPARENT, "00-00000000000000000000000000000000-b7ad6b7169203331-01")];
        let explicit = [(TRACEPARENT, EXPLICIT)];
        for given in [&other_case[..], &unparsable, &zero, &explicit, &[]] {
            let (trace_id, event) = in_span(|| {
                given
                    .iter()
                    .fold(Event::new("order.paid", serde_json::json!({})), |e, (n, v)| {
                        e.header(*n, *v)
                    })
                    .with_current_trace_context()
            });
            let read = span_context(event.headers()).unwrap_or_else(|| panic!("{given:?}: {:?}", event.headers()));
            if given == explicit || given == other_case {
                assert_eq!(
                    read.trace_id().to_string(),
                    "0af7651916cd43dd8448eb211c80319c",
                    "{given:?}"
                );
            } else {
                assert_eq!(read.trace_id(), trace_id, "{given:?}");
            }
        }
    }

    #[test]
    fn outside_any_span_nothing_is_written() {
        let event = Event::new("order.paid", serde_json::json!({})).with_current_trace_context();
        assert!(event.headers().is_empty());
    }

    #[test]
    fn headers_without_a_context_read_as_none_inside_a_span() {
        let (_, read) = in_span(|| span_context(&Headers::new()));
        assert!(read.is_none(), "the reader's own span: {read:?}");
    }

    #[test]
    fn headers_read_back_and_garbage_is_ignored() {
        let mut headers = Headers::new();
        headers.insert(TRACEPARENT.into(), EXPLICIT.into());
        headers.insert(TRACESTATE.into(), "vendor=abc".into());
        let span = span_context(&headers).unwrap();
        assert_eq!(span.trace_id().to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert!(span.is_sampled() && span.is_remote());
        assert_eq!(span.trace_state().get("vendor"), Some("abc"));
        headers.insert(TRACEPARENT.into(), "00-not-a-trace".into());
        assert!(span_context(&headers).is_none());
    }
}
