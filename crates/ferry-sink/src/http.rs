//! The HTTP client shared by the webhook sink and RabbitMQ's management API
//! checks: rustls with the ring provider passed explicitly (the process may
//! not install a global one), the system's CA bundle, no redirects.

use std::ffi::OsStr;
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
/// names the user in error messages. A set `SSL_CERT_FILE` that is missing
/// or holds no certificate is a configuration error.
pub(crate) fn client(timeout: Duration, what: &str) -> Result<(reqwest::Client, usize), SinkError> {
    let mut roots = rustls::RootCertStore::empty();
    let loaded = load_roots(&mut roots, std::env::var_os("SSL_CERT_FILE").as_deref())?;
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

/// Adds the CA certificates of `ssl_cert_file` (the value of
/// `SSL_CERT_FILE`) when it is set, otherwise those of the system's first
/// bundle that has any; returns how many were added. A set file that cannot
/// be read or holds no certificate is an error: falling back to the
/// system's bundle would fail every connection to a private CA's endpoint
/// as `UnknownIssuer`, retried until dead, for what is a typo in a path.
fn load_roots(roots: &mut rustls::RootCertStore, ssl_cert_file: Option<&OsStr>) -> Result<usize, SinkError> {
    if let Some(path) = ssl_cert_file.filter(|value| !value.is_empty()).map(Path::new) {
        let added = add_bundle(roots, path).map_err(|problem| {
            SinkError::config(format!(
                "SSL_CERT_FILE is set to {}, which {problem}; point SSL_CERT_FILE at a PEM file of CA \
                 certificates, or unset it to use the system's CA bundle",
                path.display()
            ))
        })?;
        tracing::debug!(path = %path.display(), added, "loaded CA certificates from SSL_CERT_FILE");
        return Ok(added);
    }
    for path in CA_BUNDLES.iter().map(Path::new) {
        if let Ok(added) = add_bundle(roots, path) {
            tracing::debug!(path = %path.display(), added, "loaded CA certificates");
            return Ok(added);
        }
    }
    tracing::warn!("no CA certificates found (set SSL_CERT_FILE); https connections will fail");
    Ok(0)
}

/// Adds the certificates of the PEM file at `path`; when it adds none, says
/// why, completing `SSL_CERT_FILE is set to <path>, which ...`.
fn add_bundle(roots: &mut rustls::RootCertStore, path: &Path) -> Result<usize, String> {
    let sections = CertificateDer::pem_file_iter(path).map_err(|e| format!("cannot be opened ({e})"))?;
    let mut unreadable = None;
    let certs: Vec<CertificateDer<'static>> = sections
        .filter_map(|section| section.map_err(|e| unreadable.get_or_insert(e.to_string())).ok())
        .collect();
    let found = certs.len();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    match (added, unreadable) {
        (1.., _) => Ok(added),
        (0, Some(e)) => Err(format!("cannot be read as PEM ({e})")),
        (0, None) if found == 0 => Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned()),
        (0, None) => Err(format!(
            "holds {found} certificates, none of them a usable CA certificate"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(value: &str) -> Result<usize, SinkError> {
        load_roots(&mut rustls::RootCertStore::empty(), Some(OsStr::new(value)))
    }

    fn refused(value: &str, problem: &str) {
        let err = load(value).expect_err("an unusable SSL_CERT_FILE is refused");
        assert_eq!(err.kind, ferry_core::ErrorKind::Config, "{err}");
        for text in [&format!("SSL_CERT_FILE is set to {value}, which "), problem, "unset it"] {
            assert!(err.message.contains(text), "{err} should mention {text:?}");
        }
    }

    /// A set `SSL_CERT_FILE` that gives no certificate was skipped for the
    /// system's bundle: every endpoint of a private CA then failed
    /// `UnknownIssuer`, retried until dead, and `check` said to set the
    /// variable that was set.
    #[test]
    fn a_set_ssl_cert_file_without_certificates_is_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        refused(&missing.to_string_lossy(), "cannot be opened");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, b"").unwrap();
        refused(&empty.to_string_lossy(), "holds no PEM certificate");
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, b"-----BEGIN CERTIFICATE-----\nnot base64 at all!\n").unwrap();
        refused(&garbage.to_string_lossy(), "cannot be read as PEM");
        let key_only = dir.path().join("key.pem");
        std::fs::write(
            &key_only,
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        refused(&key_only.to_string_lossy(), "holds no PEM certificate");
        refused(&dir.path().to_string_lossy(), "cannot be read as PEM");
    }

    #[test]
    fn a_usable_ssl_cert_file_is_used_and_an_empty_one_is_unset() {
        let Some(bundle) = CA_BUNDLES.iter().find(|path| Path::new(path).exists()) else {
            eprintln!("skipped: no system CA bundle to copy as SSL_CERT_FILE");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("private-ca.pem");
        std::fs::copy(bundle, &copy).unwrap();
        assert!(load(&copy.to_string_lossy()).unwrap() > 0);
        assert!(
            load("").unwrap() > 0,
            "an empty SSL_CERT_FILE is unset: the system's bundle"
        );
    }
}
