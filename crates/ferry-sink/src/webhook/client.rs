//! The HTTP client: TLS with rustls and the ring provider passed explicitly,
//! no redirects, and turning responses and transport errors into outcomes.

use std::error::Error as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{ErrorKind, SinkError};
use reqwest::header::{HeaderMap, LOCATION, RETRY_AFTER};
use reqwest::{Response, Url};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::message::redact;
use super::status::{parse_retry_after, status_kind};

/// The CA bundles of the common Linux distributions, macOS and the BSDs,
/// tried in order after `SSL_CERT_FILE`.
const CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
    "/usr/local/share/certs/ca-root-nss.crt",
];
/// How much of an error response's body goes into the error message.
const SNIPPET_BYTES: usize = 256;
/// Response bodies are read up to this much so the connection can be reused;
/// a longer body is dropped with its connection.
const DRAIN_BYTES: usize = 64 * 1024;

/// Builds the client. The crypto provider is handed to rustls here, so the
/// sink works whether or not the process installed a global default.
pub(crate) fn build(timeout: Duration) -> Result<(reqwest::Client, usize), SinkError> {
    let mut roots = rustls::RootCertStore::empty();
    let loaded = load_roots(&mut roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| SinkError::config(format!("webhook TLS setup failed: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| SinkError::config(format!("webhook HTTP client setup failed: {}", chain(&e))))?;
    Ok((client, loaded))
}

/// Adds the system's CA certificates; returns how many were added.
fn load_roots(roots: &mut rustls::RootCertStore) -> usize {
    let from_env = std::env::var_os("SSL_CERT_FILE");
    let candidates = from_env.iter().map(Path::new).chain(CA_BUNDLES.iter().map(Path::new));
    for path in candidates {
        let Ok(certs) = CertificateDer::pem_file_iter(path) else {
            continue;
        };
        let (added, _ignored) = roots.add_parsable_certificates(certs.filter_map(Result::ok));
        if added > 0 {
            tracing::debug!(path = %path.display(), added, "loaded CA certificates for webhooks");
            return added;
        }
    }
    tracing::warn!("no CA certificates found (set SSL_CERT_FILE); https webhooks will fail");
    0
}

/// Turns a response into an outcome, reading a little of an error body for
/// the message and the rest (up to a bound) so the connection is reused.
pub(crate) async fn outcome(method: &str, url: &Url, mut response: Response) -> Result<(), SinkError> {
    let status = response.status();
    let kind = status_kind(status.as_u16());
    let headers = response.headers().clone();
    let mut snippet = Vec::new();
    let mut read = 0;
    while read < DRAIN_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                read += chunk.len();
                let room = SNIPPET_BYTES.saturating_sub(snippet.len());
                snippet.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            // The status is what counts; a broken error body only shortens the message.
            Ok(None) | Err(_) => break,
        }
    }
    let Some(kind) = kind else {
        return Ok(());
    };
    Err(status_error(method, url, status, &headers, &snippet, kind))
}

fn status_error(
    method: &str,
    url: &Url,
    status: reqwest::StatusCode,
    headers: &HeaderMap,
    snippet: &[u8],
    kind: ErrorKind,
) -> SinkError {
    let mut message = format!("{method} {}: HTTP {status}", redact(url.as_str()));
    if status.is_redirection() {
        let location = headers.get(LOCATION).and_then(|v| v.to_str().ok()).unwrap_or("(none)");
        message.push_str(&format!(
            "; redirects are not followed: point routes[].destination at the Location, {location:?}"
        ));
    }
    if let Some(value) = headers.get(RETRY_AFTER).and_then(|v| v.to_str().ok()) {
        match parse_retry_after(value, chrono::Utc::now()) {
            Some(delay) => message.push_str(&format!("; retry after {}s (Retry-After: {value})", delay.as_secs())),
            None => message.push_str(&format!("; unreadable Retry-After: {value:?}")),
        }
    }
    let text = String::from_utf8_lossy(snippet);
    let text = text.trim();
    if !text.is_empty() {
        message.push_str(&format!("; response: {text:?}"));
    }
    match kind {
        ErrorKind::Transient => SinkError::transient(message),
        ErrorKind::Config => SinkError::config(message),
        _ => SinkError::permanent(message),
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
        redact(url.as_str()),
        chain(&err.without_url())
    ))
}

/// An error with its sources: reqwest's own text rarely names the cause.
fn chain(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
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
    }

    #[test]
    fn the_client_builds_without_a_process_wide_crypto_provider() {
        // Nothing in this crate installs a default provider; reqwest would
        // panic at build() if it needed one.
        build(Duration::from_secs(1)).unwrap();
    }
}
