//! One pipelined batch: every XADD in one write, every reply read back, then
//! one outcome per event.
//!
//! What a partial pipeline means: Redis executes a pipeline's commands in
//! order and answers each. An error reply fails only its own XADD; the
//! others still run. When the connection breaks (or the replies do not come
//! within the timeout), the commands that reached Redis before the break
//! were executed and the rest were not, but which is which is unknown: every
//! event of the batch is reported transient and retried. The stream then
//! holds the executed prefix twice (entry ids are `*`, so Redis cannot
//! deduplicate); consumers deduplicate by the `id` field. A key's first
//! occurrences stay in commit order, because the prefix is in order and the
//! retry starts from the first failed event.
//!
//! An error reply in a pipeline that Redis otherwise ran (an `OOM`, a
//! `WRONGTYPE` on one of several streams) leaves the later events of its
//! key stored ahead of it. Each is reported as Redis answered: stored is
//! published, and the relay counts the key's order break
//! (`ferry_order_breaks_total`), as for any destination that confirms a
//! later event after refusing an earlier one. Reporting it failed would
//! not take it back out of the stream; it would only hide the break and
//! add the entry a second time on retry.

use ::redis::Value;
use ::redis::aio::ConnectionManager;
use ferry_core::{ErrorKind, PublishOutcome, SinkError};
use std::time::Duration;
use tokio::time::timeout;

use super::codes;
use super::message::Entry;

/// Why WAIT's `reply` does not confirm the batch on `wanted` replicas, if
/// it does not.
fn unconfirmed(reply: Option<Value>, wanted: u32, bound: Duration) -> Option<SinkError> {
    let why = match reply {
        Some(Value::Int(n)) if n >= i64::from(wanted) => return None,
        Some(Value::Int(n)) => format!("{n} of {wanted} replicas confirmed it within {bound:?}"),
        Some(Value::ServerError(e)) => format!(
            "WAIT failed ({}: {}), so no replica confirmed it",
            e.code(),
            e.details().unwrap_or("")
        ),
        other => format!("WAIT answered {other:?}, not a replica count"),
    };
    Some(SinkError::transient(format!(
        "stored on the Redis primary, but {why}: a failover could lose it, so it is sent again (the \
         stream may hold it more than once)"
    )))
}

pub(super) struct Published {
    pub(super) outcomes: Vec<PublishOutcome>,
    /// Set when the request itself failed, which puts the connection in
    /// doubt; the caller then replaces it.
    pub(super) connection_in_doubt: Option<SinkError>,
    /// Whether any of the batch was sent (some events may have been
    /// refused before sending).
    pub(super) sent: bool,
    /// Whether Redis answered the pipeline, even if the answers put the
    /// connection in doubt (`READONLY`).
    pub(super) answered: bool,
}

/// `sink` is the sink's name in the config, for the fixes errors name.
pub(super) async fn publish_batch(
    sink: &str,
    connection: &mut ConnectionManager,
    prepared: Vec<Result<Entry, SinkError>>,
    publish_timeout: Duration,
    wait_replicas: u32,
) -> Published {
    let mut pipe = ::redis::pipe();
    pipe.ignore_errors();
    let mut keys = Vec::with_capacity(prepared.len());
    // Each command moves into the pipeline; what stays is whether it was sent.
    let prepared: Vec<Result<(), SinkError>> = prepared
        .into_iter()
        .map(|entry| {
            entry.map(|Entry { stream_key, command }| {
                pipe.add_command(command);
                keys.push(stream_key);
            })
        })
        .collect();
    // WAIT answers, within its own bound, how many replicas hold every
    // write this connection made before it: the whole batch.
    let wait_for = (wait_replicas > 0 && !keys.is_empty()).then(|| (publish_timeout / 2).max(Duration::from_millis(1)));
    if let Some(bound) = wait_for {
        pipe.cmd("WAIT").arg(wait_replicas).arg(bound.as_millis() as u64);
    }
    let expected = keys.len() + usize::from(wait_for.is_some());
    let mut unreplicated: Option<SinkError> = None;
    let replies: Result<Vec<Value>, SinkError> = if keys.is_empty() {
        Ok(Vec::new())
    } else {
        match timeout(publish_timeout, pipe.query_async::<Vec<Value>>(connection)).await {
            Ok(Ok(mut replies)) if replies.len() == expected => {
                if let Some(bound) = wait_for {
                    unreplicated = unconfirmed(replies.pop(), wait_replicas, bound);
                }
                Ok(replies)
            }
            Ok(Ok(replies)) => Err(SinkError::transient(format!(
                "Redis answered {} of {} commands; part of the batch may be stored",
                replies.len(),
                expected
            ))),
            Ok(Err(e)) => {
                // Refusals of single commands come back as replies (the
                // pipeline ignores errors), so this is the connection's own
                // failure: a break, or a refusal while connecting (its
                // credentials, say), which the connection manager would
                // give every later batch without trying again.
                let message = format!("XADD pipeline to Redis failed: {e}; part of the batch may be stored");
                match codes::redis_error_kind(&e) {
                    // A refused login: a configuration error to `check`,
                    // which runs before a relay starts, but transient here,
                    // as a server restarting may refuse a user until its
                    // ACL is loaded; each batch that met it would go dead.
                    ErrorKind::Config => Err(SinkError::transient(format!(
                        "{message}; retried, as a server may refuse a login for a moment (`ferry check` reports \
                         it as a configuration error): fix sinks.<redis>.url if it persists"
                    ))),
                    kind => Err(codes::error(kind, message)),
                }
            }
            Err(_) => Err(SinkError::transient(format!(
                "no reply from Redis within {publish_timeout:?}; part of the batch may be stored"
            ))),
        }
    };

    // Whatever failed the request as a whole puts the connection in doubt;
    // so does a reply that says the server at its end is no primary (any
    // more): after a failover behind one address, a new connection reaches
    // the new primary, this one never will.
    let connection_in_doubt = match &replies {
        Err(e) => Some(e.clone()),
        Ok(replies) => replies.iter().find_map(|reply| match reply {
            Value::ServerError(e) if matches!(e.code(), "READONLY" | "MASTERDOWN") => {
                Some(SinkError::transient(format!(
                    "Redis answered {}: the connection reaches a replica, not the primary",
                    e.code()
                )))
            }
            _ => None,
        }),
    };
    let sent = !keys.is_empty();
    let answered = sent && replies.is_ok();
    let mut replies = replies.map(|r| r.into_iter().zip(keys));
    let outcomes: Vec<PublishOutcome> = prepared
        .into_iter()
        .map(|entry| {
            entry?;
            match &mut replies {
                Ok(replies) => match replies.next() {
                    Some((Value::ServerError(e), key)) => {
                        Err(codes::reply_error(sink, &key, e.code(), e.details().unwrap_or("")))
                    }
                    Some(_) => unreplicated.clone().map_or(Ok(()), Err),
                    None => Err(SinkError::transient("no reply for this XADD")),
                },
                Err(e) => Err(e.clone()),
            }
        })
        .collect();
    Published {
        outcomes,
        connection_in_doubt,
        sent,
        answered,
    }
}
