//! The HTTP client: TLS with rustls and the ring provider passed explicitly,
//! no redirects, and turning responses and transport errors into outcomes.

use std::time::Duration;

use ferry_core::{ErrorKind, SinkError, redact};
use reqwest::header::{HeaderMap, LOCATION, RETRY_AFTER};
use reqwest::{Response, Url};

use super::status::{parse_retry_after, status_kind};

/// Response bodies are read up to this much so the connection can be reused;
/// a longer body is dropped with its connection.
const DRAIN_BYTES: usize = 64 * 1024;

/// Builds the webhook client (see [`crate::http::client`]).
pub(crate) fn build(timeout: Duration) -> Result<(reqwest::Client, usize), SinkError> {
    crate::http::client(timeout, "webhook")
}

/// Turns a response into an outcome, quoting the first `quote` bytes of an
/// error body in the message and reading the rest (up to a bound) so the
/// connection is reused.
pub(crate) async fn outcome(method: &str, url: &Url, mut response: Response, quote: usize) -> Result<(), SinkError> {
    let status = response.status();
    let Some(kind) = status_kind(status.as_u16()) else {
        drain(&mut response, 0).await;
        return Ok(());
    };
    // Only a failure reads its headers (Location, Retry-After) again.
    let headers = response.headers().clone();
    let snippet = drain(&mut response, quote).await;
    Err(status_error(method, url, status, &headers, &snippet, kind))
}

/// Reads the body up to [`DRAIN_BYTES`]; returns its first `quote` bytes.
async fn drain(response: &mut Response, quote: usize) -> Vec<u8> {
    let mut snippet = Vec::new();
    let mut read = 0;
    while read < DRAIN_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                read += chunk.len();
                let room = quote.saturating_sub(snippet.len());
                snippet.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            // The status is what counts; a broken error body only shortens the message.
            Ok(None) | Err(_) => break,
        }
    }
    snippet
}

fn status_error(
    method: &str,
    url: &Url,
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    snippet: &[u8],
    kind: ErrorKind,
) -> SinkError {
    let mut message = format!("{method} {}: HTTP {status}", redact::url(url.as_str()));
    if status.is_redirection() {
        let location = location(url, headers);
        message.push_str(&format!(
            "; redirects are not followed: point routes[].destination at the Location, {location:?}"
        ));
    }
    let mut retry_after = None;
    if let Some(value) = headers.get(RETRY_AFTER).and_then(|v| v.to_str().ok()) {
        match parse_retry_after(value, chrono::Utc::now()) {
            Some(delay) => {
                message.push_str(&format!("; retry after {}s (Retry-After: {value})", delay.as_secs()));
                retry_after = Some(delay);
            }
            None => message.push_str(&format!("; unreadable Retry-After: {value:?}")),
        }
    }
    let text = String::from_utf8_lossy(snippet);
    let text = text.trim();
    if !text.is_empty() {
        message.push_str(&format!("; response: {text:?}"));
    }
    match (kind, retry_after) {
        (ErrorKind::Transient, Some(delay)) => SinkError::transient(message).with_retry_after(delay),
        (ErrorKind::Transient, None) => SinkError::transient(message),
        (ErrorKind::Config, _) => SinkError::config(message),
        _ => SinkError::permanent(message),
    }
}

/// Where a redirect points, resolved against `url` and redacted: the
/// Location may carry the receiver's token as the destination may.
pub(crate) fn location(url: &Url, headers: &HeaderMap) -> String {
    match headers.get(LOCATION).and_then(|v| v.to_str().ok()) {
        None => "(none)".to_owned(),
        Some(l) => url.join(l).map_or_else(|_| redact::url(l), |u| redact::url(u.as_str())),
    }
}

/// A transport failure: refused, reset, timed out, a TLS error. All are
/// transient; a timed-out request may still have reached the receiver, which
/// is why every request carries the event id as `webhook-id`.
pub(crate) fn transport_error(method: &str, url: &Url, err: reqwest::Error, sink: &str) -> SinkError {
    let what = if err.is_timeout() {
        format!("timed out (sinks.{sink}.timeout)")
    } else if err.is_connect() {
        "could not connect".to_owned()
    } else {
        "failed".to_owned()
    };
    SinkError::transient(format!(
        "{method} {} {what}: {}",
        redact::url(url.as_str()),
        chain(&err.without_url())
    ))
}

/// An error with its sources: reqwest's own text rarely names the cause.
fn chain(err: &reqwest::Error) -> String {
    crate::http::chain(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::StatusCode;
    use reqwest::header::HeaderValue;

    fn url() -> Url {
        Url::parse("https://user:pw@hooks.example/in?token=secret").unwrap()
    }

    #[test]
    fn status_messages_name_location_retry_after_and_the_response() {
        let mut headers = HeaderMap::new();
        headers.insert(LOCATION, HeaderValue::from_static("https://new.example/in"));
        let err = status_error(
            "POST",
            &url(),
            StatusCode::MOVED_PERMANENTLY,
            &headers,
            b"",
            ErrorKind::Permanent,
        );
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("HTTP 301 Moved Permanently"), "{}", err.message);
        assert!(err.message.contains("\"https://new.example/in\""), "{}", err.message);
        assert!(
            !err.message.contains("secret") && !err.message.contains("pw"),
            "{}",
            err.message
        );

        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("30"));
        let err = status_error(
            "POST",
            &url(),
            StatusCode::TOO_MANY_REQUESTS,
            &headers,
            b" slow down\n",
            ErrorKind::Transient,
        );
        assert_eq!(err.kind, ErrorKind::Transient);
        assert!(
            err.message.contains("retry after 30s (Retry-After: 30)"),
            "{}",
            err.message
        );
        assert!(err.message.ends_with("response: \"slow down\""), "{}", err.message);
        // The relay's backoff reads the delay, not the text.
        assert_eq!(err.retry_after, Some(std::time::Duration::from_secs(30)));
        let err = status_error(
            "POST",
            &url(),
            StatusCode::SERVICE_UNAVAILABLE,
            &HeaderMap::new(),
            b"",
            ErrorKind::Transient,
        );
        assert_eq!(err.retry_after, None);
    }

    #[test]
    fn the_client_builds_without_a_process_wide_crypto_provider() {
        // Nothing in this crate installs a default provider; reqwest would
        // panic at build() if it needed one.
        build(Duration::from_secs(1)).unwrap();
    }
}
