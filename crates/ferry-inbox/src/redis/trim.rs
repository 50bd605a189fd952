//! Entries lost to trimming. `XADD ... MAXLEN` and `XTRIM` remove a stream's
//! oldest entries whether or not a group has read or acknowledged them;
//! `XREADGROUP >` then carries on after the gap and a pending entry comes
//! back with no fields, neither with a word from Redis. The session asks
//! [`unread_lost`] at start and now and then, and reports trimmed pending
//! entries as it meets them.

use redis::RedisError;
use redis::aio::MultiplexedConnection;

/// The `reason` label of [`crate::metrics::LOST`] for trimmed entries.
pub(super) const TRIMMED: &str = "trimmed";

/// Why a trimmed pending entry is dead-lettered without its data.
pub(super) const TRIMMED_REASON: &str = "trimmed from the stream (MAXLEN or XTRIM) before it was processed; \
     its fields, and so its event, are gone";

/// Entries counted after the last-delivered id, at most, to tell a gap the
/// group has already skipped; beyond that the check waits for the group to
/// catch up.
const COUNT_AT_MOST: u64 = 100;

/// Sent whole with EVAL: a few hundred bytes now and then.
const SCRIPT: &str = include_str!("unread_lost.lua");

/// What [`unread_lost`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unread {
    /// No entry was trimmed before the group read it, or none can be told now.
    NoneLost,
    /// `count` entries were trimmed unread, after the group's last-delivered
    /// id `after` (and before `before`, the stream's first entry, when the
    /// group has not read past the gap yet). Recorded in the group, so the
    /// next check does not report them again.
    Lost {
        count: u64,
        after: String,
        before: Option<String>,
    },
    /// This Redis cannot tell (before 7.0, or scripts not permitted).
    Unsupported(String),
}

/// Counts the entries of `stream` trimmed before `group` read them, and
/// records the count in the group's `entries-read` (one script, atomic).
pub(super) async fn unread_lost(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
) -> Result<Unread, RedisError> {
    let reply: Result<(i64, String, String), RedisError> = redis::cmd("EVAL")
        .arg(SCRIPT)
        .arg(1)
        .arg(stream)
        .arg(group)
        .arg(COUNT_AT_MOST)
        .query_async(conn)
        .await;
    match reply {
        Ok((-1, _, _)) => Ok(Unread::Unsupported(
            "this Redis keeps no read counters per group (they came with 7.0)".into(),
        )),
        Ok((count, after, before)) if count > 0 => Ok(Unread::Lost {
            count: count.unsigned_abs(),
            after,
            before: Some(before).filter(|b| !b.is_empty()),
        }),
        Ok(_) => Ok(Unread::NoneLost),
        Err(e) if e.code() == Some("NOPERM") => Ok(Unread::Unsupported(format!(
            "the user may not run the check's script ({e}); allow it EVAL"
        ))),
        // The server refused the script itself (EVAL renamed or disabled, a
        // script error): a refusal every session would meet again, which
        // must not stop the consumer from consuming.
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) => Ok(
            Unread::Unsupported(format!("the server refused the check's script: {e}")),
        ),
        Err(e) => Err(e),
    }
}
