//! AMQP reply codes, classified once so the rest of the sink branches on an
//! [`ErrorKind`] instead of on broker text.

use ferry_core::{ErrorKind, SinkError};
use lapin::ErrorKind as LapinErrorKind;
use lapin::protocol::AMQPErrorKind;

/// `basic.return`: the message was larger than the broker accepts.
pub const CONTENT_TOO_LARGE: u16 = 311;
/// `basic.return`: a mandatory message matched no binding.
pub const NO_ROUTE: u16 = 312;
/// `basic.return`: an immediate message found no consumer.
pub const NO_CONSUMERS: u16 = 313;
/// The connection was closed by an operator or by the broker shutting down.
pub const CONNECTION_FORCED: u16 = 320;
/// The virtual host in the URL does not exist.
pub const INVALID_PATH: u16 = 402;
/// The user lacks a permission (write on the exchange, access to the vhost).
pub const ACCESS_REFUSED: u16 = 403;
/// The exchange (or queue) does not exist.
pub const NOT_FOUND: u16 = 404;
/// The user may not do this at all, e.g. open the vhost, or one more
/// channel past a channel limit.
pub const NOT_ALLOWED: u16 = 530;
/// A channel-level refusal; on `basic.publish`, a message over the broker's
/// `max_message_size` among others (see [`too_large`]).
pub(crate) const PRECONDITION_FAILED: u16 = 406;

/// How a failure carrying this AMQP reply code should be handled.
///
/// Only codes that name a fault retrying cannot cure are permanent or
/// configuration errors. Everything else, including `406 PRECONDITION_FAILED`,
/// is transient: RabbitMQ uses 406 for unrelated conditions (a message over
/// its `max_message_size`, but also delivery-tag mix-ups, or a policy
/// changed under an exchange), and an event that keeps failing reaches the
/// retry policy's attempt limit anyway, whereas a wrong "permanent" would
/// send healthy events to dead. The one exception is decided on the
/// broker's text, not its code: a message sent alone that the broker
/// refuses as over its size limit ([`too_large`]) is permanent.
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::rabbitmq::reply_code_kind;
/// assert_eq!(reply_code_kind(312), ErrorKind::Permanent);
/// assert_eq!(reply_code_kind(320), ErrorKind::Transient);
/// ```
pub fn reply_code_kind(code: u16) -> ErrorKind {
    match code {
        CONTENT_TOO_LARGE | NO_ROUTE | NO_CONSUMERS | NOT_FOUND => ErrorKind::Permanent,
        INVALID_PATH | ACCESS_REFUSED | NOT_ALLOWED => ErrorKind::Config,
        // 320 CONNECTION_FORCED, 405 RESOURCE_LOCKED, 406 PRECONDITION_FAILED,
        // 501 FRAME_ERROR .. 506 RESOURCE_ERROR, 540 NOT_IMPLEMENTED,
        // 541 INTERNAL_ERROR, and codes this table does not know.
        _ => ErrorKind::Transient,
    }
}

/// The broker's reply code inside a lapin error, when the broker sent one.
pub(crate) fn reply_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        LapinErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// Whether the broker refused a message as over its `max_message_size`
/// (`406 PRECONDITION_FAILED - message size N is larger than [configured]
/// max size M`): sent again, that message would be refused again. The only
/// place the reply text is read, as RabbitMQ gives this 406 no code of its
/// own.
pub(crate) fn too_large(err: &lapin::Error) -> bool {
    let LapinErrorKind::ProtocolError(e) = err.kind() else {
        return false;
    };
    let text = e.get_message().as_str();
    e.get_id() == PRECONDITION_FAILED && text.contains("message size") && text.contains("max size")
}

/// Whether the broker closed the channel (a soft error) over something sent
/// on it: one message it refused, not the link.
pub(crate) fn closed_channel(err: &lapin::Error) -> bool {
    matches!(err.kind(), LapinErrorKind::ProtocolError(e) if matches!(e.kind(), AMQPErrorKind::Soft(_)))
}

/// Whether opening a channel was refused for a channel limit: lapin's own
/// (the negotiated `channel_max`), or the broker's 530 NOT_ALLOWED (a
/// user's `max-channels` limit, a node's channel limit), which RabbitMQ
/// sends as a connection close.
pub(crate) fn channel_refused(err: &lapin::Error) -> bool {
    matches!(err.kind(), LapinErrorKind::ChannelsLimitReached) || reply_code(err) == Some(NOT_ALLOWED)
}

/// Classifies a lapin error; errors without a reply code (I/O, a closed
/// channel, a missed heartbeat) are transient.
pub(crate) fn from_lapin(context: &str, err: &lapin::Error) -> SinkError {
    let kind = reply_code(err).map_or(ErrorKind::Transient, reply_code_kind);
    let message = format!("{context}: {err}");
    match kind {
        ErrorKind::Permanent => SinkError::permanent(message),
        ErrorKind::Config => SinkError::config(message),
        _ => SinkError::transient(message),
    }
}

/// The outcome for a message RabbitMQ handed back with `basic.return`.
pub(crate) fn returned(exchange: &str, routing_key: &str, code: u16, text: &str) -> SinkError {
    if code == NO_ROUTE {
        // Nobody home may be brief (a consumer's queue redeclared on its
        // restart): retried, and dead once the attempts are spent.
        return SinkError::transient(format!(
            "unroutable: exchange {exchange:?} has no queue bound for routing key \
             {routing_key:?} (reply 312 NO_ROUTE)"
        ));
    }
    let message = format!(
        "returned by RabbitMQ from exchange {exchange:?}, routing key {routing_key:?}: \
         {text} (reply {code})"
    );
    match reply_code_kind(code) {
        ErrorKind::Config => SinkError::config(message),
        ErrorKind::Permanent => SinkError::permanent(message),
        _ => SinkError::transient(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPHardError, AMQPSoftError};

    #[test]
    fn reply_codes() {
        for code in [311, 312, 313, 404] {
            assert_eq!(reply_code_kind(code), ErrorKind::Permanent, "{code}");
        }
        for code in [402, 403, 530] {
            assert_eq!(reply_code_kind(code), ErrorKind::Config, "{code}");
        }
        for code in [200, 320, 405, 406, 501, 502, 503, 504, 505, 506, 540, 541, 999] {
            assert_eq!(reply_code_kind(code), ErrorKind::Transient, "{code}");
        }
    }

    #[test]
    fn lapin_errors() {
        let not_found = lapin::Error::from(LapinErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        )));
        assert_eq!(reply_code(&not_found), Some(404));
        let err = from_lapin("publish", &not_found);
        assert_eq!(err.kind, ErrorKind::Permanent);
        assert!(err.message.contains("no exchange 'x'"), "{}", err.message);

        let io = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(reply_code(&io), None);
        assert_eq!(from_lapin("publish", &io).kind, ErrorKind::Transient);
    }

    #[test]
    fn channel_closes_and_channel_refusals() {
        let not_found = lapin::Error::from(LapinErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        )));
        assert!(closed_channel(&not_found));
        assert!(!channel_refused(&not_found));
        let limit = lapin::Error::from(LapinErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED),
            "NOT_ALLOWED - number of channels opened for user 'u' has reached the maximum allowed user limit of (1)"
                .into(),
        )));
        assert!(!closed_channel(&limit), "a hard error closes the connection");
        assert!(channel_refused(&limit));
        assert!(channel_refused(&lapin::Error::from(
            LapinErrorKind::ChannelsLimitReached
        )));
        let io = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!closed_channel(&io) && !channel_refused(&io));
    }

    #[test]
    fn only_a_406_for_the_message_size_is_too_large() {
        let closed = |soft, text: &str| {
            lapin::Error::from(LapinErrorKind::ProtocolError(AMQPError::new(
                AMQPErrorKind::Soft(soft),
                text.into(),
            )))
        };
        assert!(too_large(&closed(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - message size 17000000 is larger than configured max size 16777216"
        )));
        assert!(!too_large(&closed(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - unknown delivery tag 7"
        )));
        // The text without the code: not this refusal.
        assert!(!too_large(&closed(
            AMQPSoftError::NOTFOUND,
            "NOT_FOUND - message size of exchange 'max size'"
        )));
        let io = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!too_large(&io));
        // The rule for the code stands.
        assert_eq!(reply_code_kind(PRECONDITION_FAILED), ErrorKind::Transient);
    }

    #[test]
    fn returns() {
        let err = returned("orders", "order.created", NO_ROUTE, "NO_ROUTE");
        assert_eq!(err.kind, ErrorKind::Transient);
        assert_eq!(
            err.message,
            "unroutable: exchange \"orders\" has no queue bound for routing key \
             \"order.created\" (reply 312 NO_ROUTE)"
        );
        assert_eq!(returned("x", "k", 541, "INTERNAL_ERROR").kind, ErrorKind::Transient);
    }
}
