//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256>`
//! over `"{webhook-id}.{webhook-timestamp}.{body}"`, keyed by the decoded
//! `whsec_` secret. See <https://www.standardwebhooks.com/>.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ferry_core::SinkError;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix every secret carries, as in the Standard Webhooks libraries.
pub const SECRET_PREFIX: &str = "whsec_";
/// Shorter keys are refused: HMAC-SHA256 with a few bytes of key is guessable.
pub const MIN_SECRET_BYTES: usize = 16;

/// A decoded signing key. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct SigningKey(Vec<u8>);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(..)")
    }
}

impl SigningKey {
    /// Decodes `whsec_<base64>`; `index` names the entry in `secrets[]`.
    pub(crate) fn parse(secret: &str, index: usize) -> Result<Self, SinkError> {
        let field = format!("secrets[{index}]");
        let Some(encoded) = secret.strip_prefix(SECRET_PREFIX) else {
            return Err(SinkError::config(format!(
                "{field} does not start with {SECRET_PREFIX:?}; give the secret as \
                 \"whsec_<base64 of the key>\", as the Standard Webhooks libraries print it"
            )));
        };
        let key = STANDARD.decode(encoded.trim()).map_err(|e| {
            SinkError::config(format!(
                "{field}: the part after {SECRET_PREFIX:?} is not standard base64 ({e}); \
                 copy the whole secret as the receiver printed it"
            ))
        })?;
        if key.len() < MIN_SECRET_BYTES {
            return Err(SinkError::config(format!(
                "{field} decodes to {} bytes, at least {MIN_SECRET_BYTES} are required; \
                 generate a new secret of 24 to 64 random bytes",
                key.len()
            )));
        }
        Ok(Self(key))
    }
}

/// The `webhook-signature` value: one `v1,<sig>` per key, space-separated, so
/// a receiver that rotates its secret accepts either during the change.
pub(crate) fn signature_header(keys: &[SigningKey], id: &str, timestamp: i64, body: &[u8]) -> String {
    keys.iter()
        .map(|key| sign(key, id, timestamp, body))
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn sign(key: &SigningKey, id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::ErrorKind;

    // The test vector published with the Standard Webhooks specification.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TIMESTAMP: i64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn matches_the_standard_webhooks_reference_vector() {
        let key = SigningKey::parse(SECRET, 0).unwrap();
        assert_eq!(sign(&key, ID, TIMESTAMP, BODY), EXPECTED);
        assert_eq!(
            signature_header(std::slice::from_ref(&key), ID, TIMESTAMP, BODY),
            EXPECTED
        );
        assert_ne!(sign(&key, ID, TIMESTAMP + 1, BODY), EXPECTED);
        assert_ne!(sign(&key, "msg_other", TIMESTAMP, BODY), EXPECTED);
    }

    #[test]
    fn several_secrets_give_one_signature_each() {
        let old = SigningKey::parse(SECRET, 0).unwrap();
        let new = SigningKey::parse("whsec_c2VjcmV0LW9mLWEtcm90YXRlZC1lbmRwb2ludA==", 1).unwrap();
        let header = signature_header(&[old, new.clone()], ID, TIMESTAMP, BODY);
        let parts: Vec<&str> = header.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], EXPECTED);
        assert_eq!(parts[1], sign(&new, ID, TIMESTAMP, BODY));
        assert!(parts[1].starts_with("v1,"));
        assert_eq!(signature_header(&[], ID, TIMESTAMP, BODY), "");
    }

    #[test]
    fn malformed_secrets_are_config_errors_naming_the_field() {
        for (secret, text) in [
            ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "does not start with \"whsec_\""),
            ("whsec_not base64!", "not standard base64"),
            ("whsec_c2hvcnQ=", "decodes to 5 bytes"),
            ("whsec_", "decodes to 0 bytes"),
        ] {
            let err = SigningKey::parse(secret, 2).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config, "{secret}");
            assert!(err.message.starts_with("secrets[2]"), "{}", err.message);
            assert!(err.message.contains(text), "{secret}: {}", err.message);
            assert!(!err.message.contains("c2hvcnQ"), "the secret leaked: {}", err.message);
        }
        assert_eq!(format!("{:?}", SigningKey::parse(SECRET, 0).unwrap()), "SigningKey(..)");
    }
}
