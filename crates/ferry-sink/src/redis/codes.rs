//! Redis error replies and client errors, classified once so the rest of the
//! sink branches on an [`ErrorKind`] instead of on server text.

use ::redis::{ErrorKind as RedisErrorKind, RedisError, ServerErrorKind};
use ferry_core::{ErrorKind, SinkError};

/// How an error reply with this code (its first word, e.g. `OOM`) should be
/// handled; `detail` is the rest of the reply, consulted only for `ERR`.
///
/// ```
/// use ferry_core::ErrorKind;
/// use ferry_sink::redis::server_code_kind;
/// assert_eq!(server_code_kind("WRONGTYPE", ""), ErrorKind::Config);
/// assert_eq!(server_code_kind("OOM", ""), ErrorKind::Transient);
/// ```
pub fn server_code_kind(code: &str, detail: &str) -> ErrorKind {
    match code {
        // The key holds another type; the route points at the wrong key.
        "WRONGTYPE" => ErrorKind::Config,
        // The user lacks a permission, or is not (correctly) authenticated.
        "NOPERM" | "NOAUTH" | "WRONGPASS" => ErrorKind::Config,
        // This is a cluster node; the sink talks to one server (or a proxy).
        "MOVED" | "ASK" | "CROSSSLOT" => ErrorKind::Config,
        // Over maxmemory, loading a dump, a busy script, a failover, a failing
        // RDB save (stop-writes-on-bgsave-error), too few replicas.
        "OOM" | "LOADING" | "BUSY" | "READONLY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "MISCONF"
        | "NOREPLICAS" | "NOTREADY" => ErrorKind::Transient,
        "ERR" => err_kind(detail),
        _ => ErrorKind::Transient,
    }
}

/// Plain `ERR` replies: only the ones that name a fault retrying cannot cure
/// are not transient.
fn err_kind(detail: &str) -> ErrorKind {
    let detail = detail.to_ascii_lowercase();
    if detail.contains("unknown command") {
        // XADD needs Redis 5.
        ErrorKind::Config
    } else if detail.contains("exceeds maximum")
        || detail.contains("too big")
        || detail.contains("too large")
        || detail.contains("invalid bulk length")
    {
        ErrorKind::Permanent
    } else {
        ErrorKind::Transient
    }
}

/// Classifies a whole-request failure (no per-command reply).
pub(crate) fn redis_error_kind(err: &RedisError) -> ErrorKind {
    match err.kind() {
        RedisErrorKind::AuthenticationFailed | RedisErrorKind::InvalidClientConfig => ErrorKind::Config,
        RedisErrorKind::RESP3NotSupported => ErrorKind::Config,
        RedisErrorKind::Server(ServerErrorKind::NoPerm) => ErrorKind::Config,
        RedisErrorKind::Server(_) | RedisErrorKind::Extension => {
            server_code_kind(err.code().unwrap_or("ERR"), err.detail().unwrap_or(""))
        }
        // Io (connection refused, reset, dropped, timed out), Parse,
        // UnexpectedReturnType, Client and the cluster and sentinel kinds:
        // the state of the request is unknown, so retry.
        _ => ErrorKind::Transient,
    }
}

pub(crate) fn error(kind: ErrorKind, message: String) -> SinkError {
    match kind {
        ErrorKind::Permanent => SinkError::permanent(message),
        ErrorKind::Config => SinkError::config(message),
        _ => SinkError::transient(message),
    }
}

/// What a reply with this code means for a sink named `sink`, and its fix,
/// where the code alone says: a cluster redirect (`MOVED 3999 host:port`)
/// means the server is a Redis Cluster node.
pub(crate) fn fix_for(code: &str, sink: &str) -> Option<String> {
    match code {
        "MOVED" | "ASK" | "CROSSSLOT" => Some(format!(
            "the Redis server is a node of a Redis Cluster, which the sink does not support (it does not \
             follow cluster redirects): point sinks.{sink}.url at a Redis server that is not in cluster mode"
        )),
        _ => None,
    }
}

/// The outcome for one XADD, by the sink named `sink`, that Redis answered
/// with an error reply.
pub(crate) fn reply_error(sink: &str, stream_key: &str, code: &str, detail: &str) -> SinkError {
    let kind = server_code_kind(code, detail);
    let mut message = format!("Redis refused XADD to {stream_key:?}: {code} {detail}");
    match code {
        "WRONGTYPE" => message.push_str(&format!(
            "; key {stream_key:?} holds another type, not a stream: delete it or fix routes[].destination"
        )),
        "OOM" => message.push_str("; Redis is over maxmemory: trim streams or raise maxmemory"),
        "NOPERM" => message.push_str(&format!(
            "; grant the user of sinks.{sink}.url XADD on this key (ACL SETUSER <user> +xadd ~{stream_key})"
        )),
        _ => {
            if let Some(fix) = fix_for(code, sink) {
                message.push_str("; ");
                message.push_str(&fix);
            }
        }
    }
    error(kind, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_codes() {
        let table = [
            ("WRONGTYPE", "", ErrorKind::Config),
            ("NOPERM", "", ErrorKind::Config),
            ("NOAUTH", "", ErrorKind::Config),
            ("WRONGPASS", "", ErrorKind::Config),
            ("MOVED", "", ErrorKind::Config),
            ("ASK", "", ErrorKind::Config),
            ("CROSSSLOT", "", ErrorKind::Config),
            (
                "OOM",
                "command not allowed when used memory > 'maxmemory'.",
                ErrorKind::Transient,
            ),
            ("LOADING", "", ErrorKind::Transient),
            ("BUSY", "", ErrorKind::Transient),
            ("READONLY", "", ErrorKind::Transient),
            ("TRYAGAIN", "", ErrorKind::Transient),
            ("CLUSTERDOWN", "", ErrorKind::Transient),
            ("MASTERDOWN", "", ErrorKind::Transient),
            ("MISCONF", "", ErrorKind::Transient),
            ("NOREPLICAS", "", ErrorKind::Transient),
            ("ERR", "unknown command 'XADD'", ErrorKind::Config),
            (
                "ERR",
                "string exceeds maximum allowed size (proto-max-bulk-len)",
                ErrorKind::Permanent,
            ),
            ("ERR", "Protocol error: invalid bulk length", ErrorKind::Permanent),
            ("ERR", "response too big", ErrorKind::Permanent),
            ("ERR", "something new", ErrorKind::Transient),
            ("SOMETHINGELSE", "", ErrorKind::Transient),
        ];
        for (code, detail, kind) in table {
            assert_eq!(server_code_kind(code, detail), kind, "{code} {detail}");
        }
    }

    #[test]
    fn client_errors() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(redis_error_kind(&io), ErrorKind::Transient);
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(redis_error_kind(&refused), ErrorKind::Transient);
        let auth = RedisError::from((RedisErrorKind::AuthenticationFailed, "bad password"));
        assert_eq!(redis_error_kind(&auth), ErrorKind::Config);
        let config = RedisError::from((RedisErrorKind::InvalidClientConfig, "bad url"));
        assert_eq!(redis_error_kind(&config), ErrorKind::Config);
        let parse = RedisError::from((RedisErrorKind::Parse, "garbage"));
        assert_eq!(redis_error_kind(&parse), ErrorKind::Transient);
        let oom = ::redis::make_extension_error("OOM".into(), Some("over maxmemory".into()));
        assert_eq!(redis_error_kind(&oom), ErrorKind::Transient);
        let wrongtype = ::redis::make_extension_error("WRONGTYPE".into(), None);
        assert_eq!(redis_error_kind(&wrongtype), ErrorKind::Config);
    }

    #[test]
    fn reply_errors_explain_the_fix() {
        let err = reply_error(
            "events",
            "orders",
            "WRONGTYPE",
            "Operation against a key holding the wrong kind of value",
        );
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.contains("not a stream"), "{err}");
        assert!(err.message.contains("routes[].destination"), "{err}");
        assert_eq!(reply_error("events", "orders", "OOM", "").kind, ErrorKind::Transient);
        let err = reply_error("events", "orders", "NOPERM", "this user has no permissions");
        assert_eq!(err.kind, ErrorKind::Config);
        assert!(err.message.contains("+xadd"), "{err}");
        assert!(err.message.contains("sinks.events.url"), "{err}");
    }

    /// A cluster redirect went dead as "MOVED 3999 host:port", with no
    /// word of what it means or what to do.
    #[test]
    fn a_cluster_redirect_says_the_server_is_a_cluster_node_and_the_fix() {
        for (code, detail) in [("MOVED", "3999 10.0.0.7:6379"), ("ASK", "3999 10.0.0.7:6379")] {
            let err = reply_error("events", "orders", code, detail);
            assert_eq!(err.kind, ErrorKind::Config, "{err}");
            assert!(err.message.contains(&format!("{code} {detail}")), "{err}");
            assert!(
                err.message.contains("Redis Cluster, which the sink does not support"),
                "{err}"
            );
            assert!(
                err.message.contains("point sinks.events.url at a Redis server"),
                "{err}"
            );
        }
        let moved = ::redis::make_extension_error("MOVED".into(), Some("3999 10.0.0.7:6379".into()));
        assert_eq!(redis_error_kind(&moved), ErrorKind::Config);
        assert_eq!(fix_for("WRONGTYPE", "events"), None);
    }
}
