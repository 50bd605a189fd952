//! The HTTP client shared by the webhook sink and RabbitMQ's management API
//! checks: rustls with the ring provider passed explicitly (the process may
//! not install a global one), the system's CA bundle, no redirects.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::SinkError;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

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

/// Builds a client whose every request (connect to last byte) is bounded by
/// `timeout`. Returns it with the number of CA certificates loaded; `what`
/// names the user in error messages.
pub(crate) fn client(timeout: Duration, what: &str) -> Result<(reqwest::Client, usize), SinkError> {
    let mut roots = rustls::RootCertStore::empty();
    let loaded = load_roots(&mut roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| SinkError::config(format!("{what} TLS setup failed: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("ferry/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| SinkError::config(format!("{what} HTTP client setup failed: {}", chain(&e))))?;
    Ok((client, loaded))
}

/// An error with its sources, which reqwest keeps out of `Display`; a cause
/// already quoted by its parent is not repeated.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
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
            tracing::debug!(path = %path.display(), added, "loaded CA certificates");
            return added;
        }
    }
    tracing::warn!("no CA certificates found (set SSL_CERT_FILE); https connections will fail");
    0
}
