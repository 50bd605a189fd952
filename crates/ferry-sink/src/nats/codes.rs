//! What NATS and JetStream answer, classified once so the rest of the sink
//! branches on an [`ErrorKind`] instead of on server text.
//!
//! A JetStream publish is answered by a PubAck on the reply subject: either
//! `{"stream":..,"seq":..,"duplicate":..}` or `{"error":{"code":..,"err_code":..,"description":..}}`.
//! A subject that no stream captures is answered by the server itself with a
//! `503` status message (no responders), and so is a publish while the
//! stream has no leader (an election in a cluster): the two cannot be told
//! apart, so a `503` is retried, with a reason that names both.

use async_nats::StatusCode;
use async_nats::{ConnectErrorKind, PublishErrorKind};
use ferry_core::{ErrorKind, SinkError};
use serde::Deserialize;

/// JetStream API error codes (`err_code`) the sink classifies explicitly.
pub const ACCOUNT_RESOURCES_EXCEEDED: u16 = 10002;
pub const CLUSTER_NOT_AVAILABLE: u16 = 10008;
pub const CLUSTER_NOT_LEADER: u16 = 10009;
pub const INSUFFICIENT_RESOURCES: u16 = 10023;
pub const MEMORY_RESOURCES_EXCEEDED: u16 = 10028;
pub const JETSTREAM_NOT_ENABLED_FOR_ACCOUNT: u16 = 10039;
pub const STORAGE_RESOURCES_EXCEEDED: u16 = 10047;
/// "message size exceeds maximum allowed": over the stream's `max_msg_size`.
pub const MESSAGE_EXCEEDS_MAXIMUM: u16 = 10054;
pub const STREAM_NOT_FOUND: u16 = 10059;
/// "expected stream does not match" (`Nats-Expected-Stream`).
pub const EXPECTED_STREAM_MISMATCH: u16 = 10060;
/// "wrong last msg ID" (`Nats-Expected-Last-Msg-Id`).
pub const WRONG_LAST_MSG_ID: u16 = 10070;
/// "wrong last sequence" (`Nats-Expected-Last-Sequence`).
pub const WRONG_LAST_SEQUENCE: u16 = 10071;
pub const JETSTREAM_NOT_ENABLED: u16 = 10076;
/// The stream could not store the message (e.g. "maximum messages exceeded"
/// with `discard: new`); space may free up.
pub const STORE_FAILED: u16 = 10077;
/// "header size exceeds maximum allowed".
pub const HEADER_EXCEEDS_MAXIMUM: u16 = 10097;
pub const STREAM_SEALED: u16 = 10109;
pub const STREAM_OFFLINE: u16 = 10118;

/// How a PubAck error with this `err_code` should be handled.
///
/// Permanent: this message can never be stored as it is. Config: the stream
/// or the account is set up wrongly for this route. Everything else, and any
/// code this table does not know, is transient: a wrong "permanent" would
/// send healthy events to dead, while a wrong "transient" only costs retries
/// until the retry policy gives up.
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::nats::api_error_kind;
/// assert_eq!(api_error_kind(10054), ErrorKind::Permanent);
/// assert_eq!(api_error_kind(10077), ErrorKind::Transient);
/// ```
pub fn api_error_kind(err_code: u16) -> ErrorKind {
    match err_code {
        MESSAGE_EXCEEDS_MAXIMUM | HEADER_EXCEEDS_MAXIMUM | WRONG_LAST_SEQUENCE | WRONG_LAST_MSG_ID => {
            ErrorKind::Permanent
        }
        EXPECTED_STREAM_MISMATCH
        | STREAM_NOT_FOUND
        | STREAM_SEALED
        | JETSTREAM_NOT_ENABLED
        | JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => ErrorKind::Config,
        // STORE_FAILED, *_RESOURCES_EXCEEDED, INSUFFICIENT_RESOURCES,
        // CLUSTER_NOT_AVAILABLE, CLUSTER_NOT_LEADER, STREAM_OFFLINE, unknown.
        _ => ErrorKind::Transient,
    }
}

/// How a status-only reply (no PubAck body) should be handled: always
/// transient. A `503` (no responders) may mean that no stream captures the
/// subject, but also that the stream's leader is being elected, which passes
/// within seconds; NATS ADR-22 asks clients to retry it. A route that no
/// stream captures is caught by `check` at start-up, and one that slips
/// through (a templated subject) ends dead after the retry policy's
/// `max_attempts`, with the reason naming the subject.
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::nats::status_kind;
/// assert_eq!(status_kind(503), ErrorKind::Transient);
/// ```
pub fn status_kind(_status: u16) -> ErrorKind {
    // 503 no responders, 408 request timeout, 5xx server trouble, anything
    // unexpected: none of them says this message can never be stored.
    ErrorKind::Transient
}

/// How a client-side publish failure should be handled.
pub(crate) fn publish_error_kind(kind: PublishErrorKind) -> ErrorKind {
    match kind {
        PublishErrorKind::MaxPayloadExceeded | PublishErrorKind::InvalidSubject => ErrorKind::Permanent,
        // The command channel is closed: the connection is gone.
        PublishErrorKind::Send => ErrorKind::Transient,
    }
}

/// How a failed connect should be handled: bad credentials or a URL that
/// does not parse need the operator, the rest is the network.
pub(crate) fn connect_error_kind(kind: ConnectErrorKind) -> ErrorKind {
    match kind {
        ConnectErrorKind::ServerParse | ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
            ErrorKind::Config
        }
        ConnectErrorKind::Dns
        | ConnectErrorKind::TimedOut
        | ConnectErrorKind::Tls
        | ConnectErrorKind::Io
        | ConnectErrorKind::MaxReconnects => ErrorKind::Transient,
    }
}

pub(crate) fn error(kind: ErrorKind, message: String) -> SinkError {
    match kind {
        ErrorKind::Permanent => SinkError::permanent(message),
        ErrorKind::Config => SinkError::config(message),
        _ => SinkError::transient(message),
    }
}

#[derive(Debug, Deserialize)]
struct PubAck {
    stream: Option<String>,
    seq: Option<u64>,
    error: Option<ApiError>,
}

#[derive(Debug, Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u16,
    #[serde(default)]
    description: String,
}

/// The error for a `503` (no responders) to a publish: retried, since a
/// leader election answers the same, but saying what to fix if it persists.
pub(crate) fn no_responders(subject: &str) -> SinkError {
    error(
        status_kind(503),
        format!(
            "no JetStream stream answered the publish to subject {subject:?} (503 no responders): either the \
             stream is electing a leader, which passes, or no stream captures the subject; if it persists, \
             create a stream whose subjects include it (e.g. `nats stream add EVENTS --subjects '{subject}'`) \
             or fix routes[].destination"
        ),
    )
}

/// Turns the reply to one JetStream publish into its outcome. A PubAck with
/// `duplicate: true` is a success: the stream already holds this event id.
pub(crate) fn pub_ack(subject: &str, status: Option<StatusCode>, payload: &[u8]) -> Result<(), SinkError> {
    if let Some(status) = status {
        let code = status.as_u16();
        if code == 503 {
            return Err(no_responders(subject));
        }
        if code != 200 {
            return Err(error(
                status_kind(code),
                format!("NATS answered the publish to {subject:?} with status {code}"),
            ));
        }
    }
    let ack: PubAck = serde_json::from_slice(payload).map_err(|e| {
        SinkError::transient(format!(
            "unreadable PubAck for subject {subject:?}: {e} ({:?})",
            String::from_utf8_lossy(&payload[..payload.len().min(200)])
        ))
    })?;
    if let Some(err) = ack.error {
        let kind = api_error_kind(err.err_code);
        let mut message = format!(
            "JetStream rejected the message on {subject:?}: {} (code {}, err_code {})",
            err.description, err.code, err.err_code
        );
        if err.err_code == MESSAGE_EXCEEDS_MAXIMUM {
            message.push_str("; raise the stream's max_msg_size or lower the sink's max_message_bytes");
        }
        return Err(error(kind, message));
    }
    match (ack.stream, ack.seq) {
        (Some(_), Some(_)) => Ok(()),
        _ => Err(SinkError::transient(format!(
            "PubAck for subject {subject:?} names no stream and sequence"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_error_codes() {
        let table = [
            (MESSAGE_EXCEEDS_MAXIMUM, ErrorKind::Permanent),
            (HEADER_EXCEEDS_MAXIMUM, ErrorKind::Permanent),
            (WRONG_LAST_SEQUENCE, ErrorKind::Permanent),
            (WRONG_LAST_MSG_ID, ErrorKind::Permanent),
            (EXPECTED_STREAM_MISMATCH, ErrorKind::Config),
            (STREAM_NOT_FOUND, ErrorKind::Config),
            (STREAM_SEALED, ErrorKind::Config),
            (JETSTREAM_NOT_ENABLED, ErrorKind::Config),
            (JETSTREAM_NOT_ENABLED_FOR_ACCOUNT, ErrorKind::Config),
            (STORE_FAILED, ErrorKind::Transient),
            (STORAGE_RESOURCES_EXCEEDED, ErrorKind::Transient),
            (MEMORY_RESOURCES_EXCEEDED, ErrorKind::Transient),
            (INSUFFICIENT_RESOURCES, ErrorKind::Transient),
            (ACCOUNT_RESOURCES_EXCEEDED, ErrorKind::Transient),
            (CLUSTER_NOT_AVAILABLE, ErrorKind::Transient),
            (CLUSTER_NOT_LEADER, ErrorKind::Transient),
            (STREAM_OFFLINE, ErrorKind::Transient),
            (0, ErrorKind::Transient),
            (19999, ErrorKind::Transient),
        ];
        for (code, kind) in table {
            assert_eq!(api_error_kind(code), kind, "{code}");
        }
    }

    #[test]
    fn statuses() {
        // A leader election answers 503 too: retried, never dead at once.
        assert_eq!(status_kind(503), ErrorKind::Transient);
        for code in [408, 404, 500, 504, 999] {
            assert_eq!(status_kind(code), ErrorKind::Transient, "{code}");
        }
    }

    #[test]
    fn client_errors() {
        assert_eq!(
            publish_error_kind(PublishErrorKind::MaxPayloadExceeded),
            ErrorKind::Permanent
        );
        assert_eq!(
            publish_error_kind(PublishErrorKind::InvalidSubject),
            ErrorKind::Permanent
        );
        assert_eq!(publish_error_kind(PublishErrorKind::Send), ErrorKind::Transient);
        for kind in [
            ConnectErrorKind::ServerParse,
            ConnectErrorKind::Authentication,
            ConnectErrorKind::AuthorizationViolation,
        ] {
            assert_eq!(connect_error_kind(kind), ErrorKind::Config, "{kind:?}");
        }
        for kind in [
            ConnectErrorKind::Dns,
            ConnectErrorKind::TimedOut,
            ConnectErrorKind::Tls,
            ConnectErrorKind::Io,
            ConnectErrorKind::MaxReconnects,
        ] {
            assert_eq!(connect_error_kind(kind), ErrorKind::Transient, "{kind:?}");
        }
    }

    #[test]
    fn pub_acks() {
        assert_eq!(pub_ack("s", None, br#"{"stream":"S","seq":3}"#), Ok(()));
        assert_eq!(
            pub_ack("s", None, br#"{"stream":"S","seq":3,"duplicate":true}"#),
            Ok(()),
            "a duplicate is already stored"
        );
        let too_big =
            br#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#;
        let err = pub_ack("s", None, too_big).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("message size exceeds maximum allowed"), "{err}");
        assert!(err.message.contains("max_msg_size"), "{err}");
        let store = br#"{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#;
        assert_eq!(pub_ack("s", None, store).unwrap_err().kind, ErrorKind::Transient);
        let mismatch = br#"{"error":{"code":400,"err_code":10060,"description":"expected stream does not match"}}"#;
        assert_eq!(pub_ack("s", None, mismatch).unwrap_err().kind, ErrorKind::Config);

        let err = pub_ack("orders.created", Some(StatusCode::NO_RESPONDERS), b"").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Transient, "a leader election answers 503 too");
        assert!(err.message.contains("\"orders.created\""), "{err}");
        assert!(err.message.contains("no stream captures the subject"), "{err}");
        assert!(err.message.contains("create a stream"), "{err}");
        let err = pub_ack("s", Some(StatusCode::TIMEOUT), b"").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Transient);
        assert_eq!(pub_ack("s", None, b"not json").unwrap_err().kind, ErrorKind::Transient);
        assert_eq!(pub_ack("s", None, b"{}").unwrap_err().kind, ErrorKind::Transient);
    }
}
