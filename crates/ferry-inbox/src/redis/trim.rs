//! Entries lost to trimming. `XADD ... MAXLEN` and `XTRIM` remove a stream's
//! oldest entries whether or not a group has read or acknowledged them, and
//! `XDEL` removes any; `XREADGROUP >` then carries on after the gap and a
//! pending entry comes back with no fields, neither with a word from Redis.
//! The session asks [`unread_lost`] at start and now and then, and reports
//! removed pending entries as it meets them. Once a group has read past a
//! gap, Redis keeps nothing that tells an `XDEL` from trimming: entries
//! deleted unread are counted with the trimmed ones.

use redis::RedisError;
use redis::aio::MultiplexedConnection;

/// The `reason` label of [`crate::metrics::LOST`] for entries removed from
/// the stream before they were processed: trimmed (MAXLEN, XTRIM) or
/// deleted (XDEL), which Redis does not tell apart. Named `trimmed`, as it
/// always has been.
pub(super) const TRIMMED: &str = "trimmed";

/// Why a removed pending entry is dead-lettered without its data.
pub(super) const TRIMMED_REASON: &str = "trimmed from the stream (MAXLEN or XTRIM) or deleted from it (XDEL) \
     before it was processed; its fields, and so its event, are gone";

/// Entries counted on either side of the group's last-delivered id, at
/// most, to tell a gap the group has already read past. Redis returns the
/// entries it counts, a few microseconds each with Ferry's fields: a check
/// counting both sides in full takes about 3 ms, whatever the stream's
/// length, and blocks the server meanwhile. With more on both sides the
/// check cannot tell until the group is within this many entries of the
/// stream's first or last entry.
pub(super) const COUNT_AT_MOST: u64 = 500;

/// Sent whole with EVAL: a few kilobytes now and then.
const SCRIPT: &str = include_str!("unread_lost.lua");

/// What [`unread_lost`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unread {
    /// No entry was removed before the group read it.
    NoneLost,
    /// `count` entries were removed unread (trimmed, or deleted with XDEL),
    /// after the group's last-delivered
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
    /// The check cannot count now; a later one may (the loss it finds then
    /// includes any of now). Why, for the log.
    Untold(String),
}

/// Counts the entries of `stream` removed (trimmed, or deleted with XDEL)
/// before `group` read them, and
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
        Ok((-2, _, _)) => Ok(Unread::Untold(
            "Redis does not know the group's read counter now (an entry deleted with XDEL after its \
             last-delivered id, or the group created or set to an id without ENTRIESREAD and not read \
             from since, with entries to read); it knows again once the group has read past the deleted \
             entry, at the latest once it has read the stream's last entry, and entries removed unread \
             before then may go untold"
                .into(),
        )),
        Ok((-3, after, _)) => Ok(Unread::Untold(format!(
            "more than {COUNT_AT_MOST} entries lie both before and after the group's last-delivered id \
             {after}; the check counts again once the group is within {COUNT_AT_MOST} entries of the \
             stream's first or last entry"
        ))),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of `entries` entries and a group `billing` reading it from
    /// the start, on the test Redis.
    struct Stream {
        conn: MultiplexedConnection,
        key: String,
    }

    impl Stream {
        async fn new(entries: usize) -> Stream {
            let url = std::env::var("FERRY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
            let mut conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let key = format!("inbox-redis-unread-{}", uuid::Uuid::now_v7());
            let mut setup = redis::pipe();
            setup
                .cmd("XGROUP")
                .arg("CREATE")
                .arg(&key)
                .arg("billing")
                .arg("0")
                .arg("MKSTREAM")
                .ignore();
            for i in 0..entries {
                setup.cmd("XADD").arg(&key).arg("*").arg("n").arg(i).ignore();
            }
            let () = setup.query_async(&mut conn).await.unwrap();
            Stream { conn, key }
        }

        /// Reads the next `count` entries as the group.
        async fn read(&mut self, count: usize) {
            let _: redis::Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("billing")
                .arg("a")
                .arg("COUNT")
                .arg(count)
                .arg("STREAMS")
                .arg(&self.key)
                .arg(">")
                .query_async(&mut self.conn)
                .await
                .unwrap();
        }

        /// The id of the stream's `nth` entry (from 1) as it stands.
        async fn id(&mut self, nth: usize) -> String {
            let ids: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                .arg(&self.key)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(nth)
                .query_async(&mut self.conn)
                .await
                .unwrap();
            ids[nth - 1].0.clone()
        }

        /// Removes the entries before the stream's `nth`.
        async fn trim_before(&mut self, nth: usize) {
            let id = self.id(nth).await;
            let _: i64 = redis::cmd("XTRIM")
                .arg(&self.key)
                .arg("MINID")
                .arg(id)
                .query_async(&mut self.conn)
                .await
                .unwrap();
        }

        async fn last_delivered(&mut self) -> String {
            let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(&self.key)
                .query_async(&mut self.conn)
                .await
                .unwrap();
            redis::from_redis_value_ref(&groups[0]["last-delivered-id"]).unwrap()
        }

        async fn unread_lost(&mut self) -> Unread {
            unread_lost(&mut self.conn, &self.key, "billing").await.unwrap()
        }

        async fn delete(mut self) {
            let _: i64 = redis::cmd("DEL")
                .arg(&self.key)
                .query_async(&mut self.conn)
                .await
                .unwrap();
        }
    }

    /// The group reads 10 of 1,200 entries, the 10 unread after them are
    /// trimmed and the group reads 700 past the gap: 700 entries lead up to
    /// its last-delivered id from the stream's first entry, 480 follow it.
    /// Only the entries after it can be counted within the limit, and the
    /// loss is told, once.
    #[tokio::test]
    async fn a_gap_the_group_read_past_is_counted_from_the_entries_after_it() {
        let mut s = Stream::new(1200).await;
        s.read(10).await;
        s.trim_before(21).await;
        s.read(700).await;
        let last = s.last_delivered().await;
        assert_eq!(
            s.unread_lost().await,
            Unread::Lost {
                count: 10,
                after: last,
                before: None
            }
        );
        assert_eq!(s.unread_lost().await, Unread::NoneLost, "reported once");
        s.delete().await;
    }

    /// The group reads 10 of 1,200 entries, the 10 unread after them are
    /// trimmed and the group reads 140 past the gap: 140 entries lead up to
    /// its last-delivered id from the stream's first entry, 1,040 follow
    /// it. Only those up to it can be counted within the limit, and the
    /// loss is told, once.
    #[tokio::test]
    async fn a_gap_the_group_read_past_is_counted_from_the_stream_s_first_entry() {
        let mut s = Stream::new(1200).await;
        s.read(10).await;
        s.trim_before(21).await;
        s.read(140).await;
        let last = s.last_delivered().await;
        assert_eq!(
            s.unread_lost().await,
            Unread::Lost {
                count: 10,
                after: last,
                before: None
            }
        );
        assert_eq!(s.unread_lost().await, Unread::NoneLost, "reported once");
        s.delete().await;
    }

    /// A group with nothing to read has lost nothing, though Redis does not
    /// know its read counter: one created at 0 on a new stream (as Ferry
    /// creates its own), one created at `$`, one set to `$`.
    #[tokio::test]
    async fn a_group_with_nothing_to_read_is_told_nothing_lost() {
        let mut s = Stream::new(0).await;
        assert_eq!(s.unread_lost().await, Unread::NoneLost, "created at 0 on a new stream");
        let _: String = redis::cmd("XADD")
            .arg(&s.key)
            .arg("*")
            .arg("n")
            .arg(0)
            .query_async(&mut s.conn)
            .await
            .unwrap();
        let () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&s.key)
            .arg("audit")
            .arg("$")
            .query_async(&mut s.conn)
            .await
            .unwrap();
        assert_eq!(
            unread_lost(&mut s.conn, &s.key, "audit").await.unwrap(),
            Unread::NoneLost,
            "created at $"
        );
        let () = redis::cmd("XGROUP")
            .arg("SETID")
            .arg(&s.key)
            .arg("billing")
            .arg("$")
            .query_async(&mut s.conn)
            .await
            .unwrap();
        assert_eq!(s.unread_lost().await, Unread::NoneLost, "set to $");
        s.delete().await;
    }

    /// Redis does not tell an entry deleted with XDEL from a trimmed one
    /// once the group has read past it: the entry after the group's
    /// last-delivered id deleted unread, it is counted as lost, once. Until
    /// the group reads past it Redis does not know the group's counter.
    #[tokio::test]
    async fn an_entry_deleted_unread_is_counted_once_the_group_read_past_it() {
        let mut s = Stream::new(20).await;
        s.read(5).await;
        let deleted = s.id(6).await;
        let _: i64 = redis::cmd("XDEL")
            .arg(&s.key)
            .arg(&deleted)
            .query_async(&mut s.conn)
            .await
            .unwrap();
        assert!(
            matches!(s.unread_lost().await, Unread::Untold(_)),
            "deleted entry ahead"
        );
        s.read(5).await;
        let last = s.last_delivered().await;
        assert_eq!(
            s.unread_lost().await,
            Unread::Lost {
                count: 1,
                after: last,
                before: None
            }
        );
        assert_eq!(s.unread_lost().await, Unread::NoneLost, "reported once");
        s.delete().await;
    }

    /// Past the limit on both sides the check says it cannot count, leaves
    /// the group's counter alone, and tells the loss once the group is
    /// within the limit of the stream's last entry.
    #[tokio::test]
    async fn a_gap_with_too_many_entries_on_both_sides_is_told_later_not_lost() {
        let mut s = Stream::new(2 * COUNT_AT_MOST as usize + 500).await;
        s.read(10).await;
        s.trim_before(21).await;
        s.read(COUNT_AT_MOST as usize + 200).await;
        let last = s.last_delivered().await;
        match s.unread_lost().await {
            Unread::Untold(why) => assert!(why.contains(&last), "{why}"),
            other => panic!("{other:?}"),
        }
        s.read(COUNT_AT_MOST as usize).await;
        assert!(matches!(s.unread_lost().await, Unread::Lost { count: 10, .. }));
        s.delete().await;
    }
}
