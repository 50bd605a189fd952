//! One connection's life: join the group, report entries trimmed before the
//! group read them, read this member's own pending entries, then claim idle
//! ones and read new ones, handling each.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::{AsyncConnectionConfig, RedisError, Value};
use sqlx::PgConnection;
use tokio::time::Instant;
use tracing::{debug, error, warn};

use super::trim::{self, TRIMMED, TRIMMED_REASON, Unread};
use super::{DEAD_GROUP_FIELD, DEAD_REASON_FIELD, DEAD_SOURCE_FIELD, RedisConsumerOptions, decode};
use crate::runner::Counters;
use crate::{HandlerError, Inbox, InboxError, Outcome, ReceivedEvent, metrics};

/// Why a session ended, other than by shutdown.
pub(super) enum Failure {
    /// The connection or a command failed: connect again.
    Lost(RedisError),
    /// The dead-letter stream's key holds something else: do not go on.
    Refused(String),
    /// The inbox cannot use its table: do not go on.
    Inbox(InboxError),
}

impl From<RedisError> for Failure {
    fn from(error: RedisError) -> Self {
        Failure::Lost(error)
    }
}

/// One entry of `XPENDING`'s extended form: id, owner, idle ms, deliveries.
type Pending = (String, String, u64, u64);

/// An entry waiting out its retry backoff; still pending in the group, so
/// if this session ends it is read again from the pending list.
struct Later {
    due: Instant,
    entry: StreamId,
}

pub(super) struct Session<'a, H> {
    inbox: &'a Inbox,
    options: &'a RedisConsumerOptions,
    handler: &'a H,
    counters: &'a Counters,
    later: Vec<Later>,
    started: bool,
    /// The server refused the renewal of waiting entries ([`Self::keep_waiting`]).
    renew_refused: bool,
    /// The trim check could not count, and said so ([`Self::report_trimmed`]).
    untold_said: bool,
}

impl<'a, H> Session<'a, H>
where
    H: AsyncFn(&mut PgConnection, &ReceivedEvent) -> Result<(), HandlerError>,
{
    pub(super) fn new(
        inbox: &'a Inbox,
        options: &'a RedisConsumerOptions,
        handler: &'a H,
        counters: &'a Counters,
    ) -> Self {
        Self {
            inbox,
            options,
            handler,
            counters,
            later: Vec::new(),
            renew_refused: false,
            started: false,
            untold_said: false,
        }
    }

    /// Whether the session got as far as reading.
    pub(super) fn started(&self) -> bool {
        self.started
    }

    /// Returns `Ok` on shutdown, an error when the connection failed.
    pub(super) async fn run(&mut self, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> Result<(), Failure> {
        let o = self.options;
        let client = redis::Client::open(o.url.as_str())?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(o.timeout))
            .set_response_timeout(Some(o.block + o.timeout));
        let mut conn = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(()),
            c = client.get_multiplexed_async_connection_with_config(&config) => c?,
        };
        if o.create_group {
            let created: Result<(), RedisError> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&o.stream)
                .arg(&o.group)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await;
            match created {
                Err(e) if e.code() != Some("BUSYGROUP") => return Err(e.into()),
                _ => {}
            }
        }
        let kind: String = redis::cmd("TYPE")
            .arg(&o.dead_letter_stream)
            .query_async(&mut conn)
            .await?;
        if kind != "none" && kind != "stream" {
            return Err(Failure::Refused(not_a_stream(o, &kind)));
        }
        self.started = true;
        self.report_trimmed(&mut conn, true).await?;
        // This member's own pending entries first: read before a restart,
        // never acknowledged.
        // While the inbox is down every entry waits in `later`: past a
        // batch of them the rest stay in the pending list, where XAUTOCLAIM
        // hands them back once idle.
        let mut cursor = "0".to_owned();
        while !self.full() {
            let entries = self.read(&mut conn, &cursor, None).await?;
            let Some(last) = entries.last() else { break };
            cursor = last.id.clone();
            for entry in entries {
                self.handle(&mut conn, entry, true).await?;
            }
        }
        let claim_every = (o.claim_idle / 2).max(Duration::from_millis(100));
        let mut next_claim = Instant::now();
        let mut claim_cursor = "0-0".to_owned();
        loop {
            let now = Instant::now();
            let (due, waiting): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.later).into_iter().partition(|l| l.due <= now);
            self.later = waiting;
            for l in due {
                self.handle(&mut conn, l.entry, false).await?;
            }
            if Instant::now() >= next_claim {
                self.keep_waiting(&mut conn).await?;
                if !self.full() {
                    claim_cursor = self.claim(&mut conn, &claim_cursor).await?;
                }
                self.report_trimmed(&mut conn, false).await?;
                next_claim = Instant::now() + claim_every;
            }
            let wake = self
                .later
                .iter()
                .map(|l| l.due)
                .min()
                .unwrap_or(next_claim)
                .min(next_claim);
            let block = wake
                .saturating_duration_since(Instant::now())
                .min(o.block)
                .max(Duration::from_millis(1));
            // Reads no new entries while a batch waits: they would only
            // wait too, in this process's memory, for as long as an outage.
            let entries = if self.full() {
                tokio::select! {
                    biased;
                    () = shutdown.as_mut() => return Ok(()),
                    () = tokio::time::sleep(block) => Vec::new(),
                }
            } else {
                tokio::select! {
                    biased;
                    () = shutdown.as_mut() => return Ok(()),
                    read = self.read(&mut conn, ">", Some(block)) => read?,
                }
            };
            for entry in entries {
                self.handle(&mut conn, entry, false).await?;
            }
        }
    }

    /// Whether a batch of entries waits out a backoff or an outage.
    fn full(&self) -> bool {
        self.later.len() >= self.options.batch
    }

    /// Keeps `entry` until `due`, once: XAUTOCLAIM hands a waiting entry
    /// back to this member when it has been idle long enough.
    fn defer(&mut self, entry: StreamId, due: Instant) {
        match self.later.iter_mut().find(|l| l.entry.id == entry.id) {
            Some(waiting) => waiting.due = waiting.due.max(due),
            None => self.later.push(Later { due, entry }),
        }
    }

    /// Resets the idle time of the entries this member keeps for a backoff
    /// (`XCLAIM` to itself, `JUSTID`: no delivery counted), every claim
    /// interval, half of `claim_idle`. A backoff longer than `claim_idle`
    /// (the inbox's reaches a minute, plus jitter) would otherwise let
    /// another member's `XAUTOCLAIM` take such an entry and try it early:
    /// attempts spent, the event dead sooner, perhaps dead-lettered twice.
    ///
    /// Only entries the pending list still gives this member are renewed:
    /// one another member took meanwhile (this loop ran late) is theirs to
    /// handle, and is forgotten here rather than taken back in the middle
    /// of their run; one they take between the `XPENDING` and the `XCLAIM`
    /// is left to them too ([`renewal`]), and forgotten at the next round.
    /// A user not allowed `XPENDING` or `XCLAIM` keeps the consumer going
    /// without the renewal, said once.
    async fn keep_waiting(&mut self, conn: &mut MultiplexedConnection) -> Result<(), RedisError> {
        if self.later.is_empty() || self.renew_refused {
            return Ok(());
        }
        let o = self.options;
        let mut owners = redis::pipe();
        for waiting in &self.later {
            owners
                .cmd("XPENDING")
                .arg(&o.stream)
                .arg(&o.group)
                .arg(&waiting.entry.id)
                .arg(&waiting.entry.id)
                .arg(1);
        }
        let owners: Vec<Vec<Pending>> = match owners.query_async(conn).await {
            Ok(owners) => owners,
            Err(e) if e.code() == Some("NOPERM") => {
                self.renewal_refused(&e);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let (mine, theirs): (Vec<Pending>, Vec<Pending>) = owners
            .into_iter()
            .flatten()
            .partition(|(_, owner, _, _)| *owner == o.consumer);
        // Taken by another member: theirs to handle. One no longer pending
        // at all (trimmed from the stream, which Redis 7 then drops from the
        // pending list) is still here in memory, and handled when due.
        let theirs: HashSet<String> = theirs.into_iter().map(|(id, ..)| id).collect();
        self.later.retain(|waiting| !theirs.contains(&waiting.entry.id));
        if mine.is_empty() {
            return Ok(());
        }
        match renewal(o, &mine).query_async::<redis::Value>(conn).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("NOPERM") => {
                self.renewal_refused(&e);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn renewal_refused(&mut self, e: &RedisError) {
        self.renew_refused = true;
        warn!(
            stream = %self.options.stream,
            error = %e,
            "the user may not run XPENDING or XCLAIM: entries kept for a retry backoff longer than claim_idle may be \
             taken and tried early by another member; allow both, or raise claim_idle above the inbox's longest \
             backoff"
        );
    }

    /// `XREADGROUP`: `>` for new entries, an id for this member's pending ones.
    async fn read(
        &self,
        conn: &mut MultiplexedConnection,
        from: &str,
        block: Option<Duration>,
    ) -> Result<Vec<StreamId>, RedisError> {
        let o = self.options;
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&o.group)
            .arg(&o.consumer)
            .arg("COUNT")
            .arg(o.batch);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS").arg(&o.stream).arg(from);
        let reply: Option<StreamReadReply> = cmd.query_async(conn).await?;
        Ok(reply
            .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect())
            .unwrap_or_default())
    }

    /// One `XAUTOCLAIM` round from `cursor`; returns where the next starts.
    async fn claim(&mut self, conn: &mut MultiplexedConnection, cursor: &str) -> Result<String, Failure> {
        let o = self.options;
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&o.stream)
            .arg(&o.group)
            .arg(&o.consumer)
            .arg(o.claim_idle.as_millis() as u64)
            .arg(cursor)
            .arg("COUNT")
            .arg(o.batch)
            .query_async(conn)
            .await?;
        if !reply.claimed.is_empty() {
            debug!(stream = %o.stream, n = reply.claimed.len(), "claimed idle entries");
        }
        // Redis 7 drops pending entries that were trimmed from the pending
        // list and names them here; Redis 6.2 returns them with no fields,
        // which `handle` reports the same way.
        for id in reply.deleted_ids {
            let gone = StreamId {
                id,
                ..StreamId::default()
            };
            self.trimmed(conn, gone).await?;
        }
        for entry in reply.claimed {
            // One this member keeps for a backoff comes back idle: it is
            // handled when its backoff ends, not twice.
            if self.later.iter().any(|l| l.entry.id == entry.id) {
                continue;
            }
            self.handle(conn, entry, true).await?;
        }
        Ok(reply.next_stream_id)
    }

    /// Reports entries removed from the stream (trimmed, or deleted with
    /// XDEL) before the group read them: an error and [`metrics::LOST`], once
    /// per loss (the check records it in the group); at start, also when this
    /// Redis cannot tell; the first time the check cannot count, why.
    async fn report_trimmed(&mut self, conn: &mut MultiplexedConnection, at_start: bool) -> Result<(), RedisError> {
        let o = self.options;
        let consumer = self.inbox.consumer();
        match trim::unread_lost(conn, &o.stream, &o.group).await? {
            Unread::NoneLost => {}
            Unread::Lost { count, after, before } => {
                metrics::lost(consumer, TRIMMED, count);
                error!(
                    consumer,
                    stream = %o.stream,
                    group = %o.group,
                    lost = count,
                    after = %after,
                    before = before.as_deref().unwrap_or("(read past)"),
                    "{count} entries were removed from the stream (MAXLEN, XTRIM or XDEL) before the group read them: \
                     their events are lost to this consumer; raise the trimming limit above the backlog the \
                     group may fall behind by, and delete no entry it has yet to read (see the README, Redis \
                     Streams)"
                );
            }
            Unread::Unsupported(why) => {
                if at_start {
                    warn!(stream = %o.stream, group = %o.group, "entries trimmed before the group reads them cannot be detected: {why}");
                }
            }
            Unread::Untold(why) => {
                if !std::mem::replace(&mut self.untold_said, true) {
                    warn!(stream = %o.stream, group = %o.group, "entries removed before the group read them cannot be counted now (said once per connection): {why}");
                }
            }
        }
        Ok(())
    }

    /// A pending entry whose fields are gone: trimmed (or deleted) before it
    /// was handled.
    /// Counted as lost and dead-lettered with the reason and its id.
    async fn trimmed(&self, conn: &mut MultiplexedConnection, entry: StreamId) -> Result<(), Failure> {
        let o = self.options;
        let consumer = self.inbox.consumer();
        metrics::lost(consumer, TRIMMED, 1);
        error!(
            consumer,
            stream = %o.stream,
            group = %o.group,
            entry = %entry.id,
            "a pending entry was removed from the stream (MAXLEN, XTRIM or XDEL) before it was processed: its event is \
             lost to this consumer; dead-lettered with its id"
        );
        self.dead_letter(conn, &entry, TRIMMED_REASON).await
    }

    /// One entry; an error means the connection failed, and the entry stays
    /// pending for the next session. `replay` for an entry that may have
    /// been handed out before (read again from this member's pending list,
    /// or claimed from another member): its attempt's start is marked
    /// first, so that an attempt the process died in is counted. An entry
    /// kept here for a retry is not: should the process die in its retry,
    /// the entry comes back pending, and that attempt is marked.
    async fn handle(&mut self, conn: &mut MultiplexedConnection, entry: StreamId, replay: bool) -> Result<(), Failure> {
        if entry.map.is_empty() {
            // XADD needs a field, so an entry without any was removed.
            return self.trimmed(conn, entry).await;
        }
        let consumer = self.inbox.consumer();
        let event = match decode(&entry.map) {
            Ok(event) => event,
            Err(e) => {
                Counters::bump(&self.counters.malformed);
                metrics::malformed(consumer);
                warn!(consumer, entry = %entry.id, error = %e, "malformed entry");
                return self.dead_letter(conn, &entry, &e.to_string()).await;
            }
        };
        let handler = self.handler;
        let run = async |tx: &mut PgConnection, ev: &ReceivedEvent| handler(tx, ev).await;
        let outcome = if replay {
            self.inbox.process_redelivered(&event, run).await
        } else {
            self.inbox.process(&event, run).await
        };
        match outcome {
            Ok(Outcome::Processed) => {
                Counters::bump(&self.counters.processed);
                self.ack(conn, &entry.id).await?;
            }
            Ok(Outcome::Duplicate) => {
                Counters::bump(&self.counters.duplicates);
                self.ack(conn, &entry.id).await?;
            }
            Ok(Outcome::Retry { delay, .. }) => {
                Counters::bump(&self.counters.retried);
                self.defer(entry, Instant::now() + delay);
            }
            Ok(Outcome::InProgress { .. }) => {
                // Another attempt holds the event. Left pending and not
                // kept for renewal: once idle for claim_idle, XAUTOCLAIM
                // hands it to a member again, by when that attempt has
                // committed (a duplicate) or given the row up.
                Counters::bump(&self.counters.in_progress);
            }
            Ok(Outcome::Dead { reason, .. }) => {
                Counters::bump(&self.counters.dead);
                return self.dead_letter(conn, &entry, &reason).await;
            }
            // Left pending, for a member to claim once the table is fixed.
            Err(e @ InboxError::Schema(_)) => return Err(Failure::Inbox(e)),
            Err(e) => {
                Counters::bump(&self.counters.inbox_unavailable);
                warn!(consumer, event = %event.id, error = %e, "inbox unavailable; the entry waits");
                self.defer(entry, Instant::now() + self.options.database_retry_delay);
            }
        }
        Ok(())
    }

    async fn ack(&self, conn: &mut MultiplexedConnection, id: &str) -> Result<(), RedisError> {
        redis::cmd("XACK")
            .arg(&self.options.stream)
            .arg(&self.options.group)
            .arg(id)
            .query_async::<i64>(conn)
            .await
            .map(drop)
    }

    /// Adds the entry, with its reason, to the dead-letter stream, and only
    /// then acknowledges it: a failure in between leaves it pending, to be
    /// dead-lettered again rather than lost. A dead-letter key that holds
    /// something else than a stream stops the consumer.
    async fn dead_letter(
        &self,
        conn: &mut MultiplexedConnection,
        entry: &StreamId,
        reason: &str,
    ) -> Result<(), Failure> {
        let o = self.options;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&o.dead_letter_stream).arg("*");
        let fields: &HashMap<String, Value> = &entry.map;
        for (name, value) in fields {
            if let Ok(bytes) = redis::from_redis_value_ref::<Vec<u8>>(value) {
                cmd.arg(name).arg(bytes);
            }
        }
        cmd.arg(DEAD_REASON_FIELD)
            .arg(reason)
            .arg(DEAD_GROUP_FIELD)
            .arg(&o.group)
            .arg(DEAD_SOURCE_FIELD)
            .arg(format!("{} {}", o.stream, entry.id));
        match cmd.query_async::<String>(conn).await {
            Ok(_) => {}
            Err(e) if e.code() == Some("WRONGTYPE") => {
                let kind: String = redis::cmd("TYPE").arg(&o.dead_letter_stream).query_async(conn).await?;
                return Err(Failure::Refused(format!(
                    "dead-lettering entry {} failed ({e}); {}; the entry stays pending until then",
                    entry.id,
                    not_a_stream(o, &kind)
                )));
            }
            Err(e) => return Err(e.into()),
        }
        Ok(self.ack(conn, &entry.id).await?)
    }
}

/// The `XCLAIM`s that renew this member's waiting entries (`mine`, as
/// `XPENDING` listed them), one per entry, each with the idle time listed as
/// its minimum: an entry idle at least that long is untouched since, still
/// this member's; one another member claimed in between (its idle time
/// starting over) is skipped, not taken back from them.
fn renewal(o: &RedisConsumerOptions, mine: &[Pending]) -> redis::Pipeline {
    let mut renew = redis::pipe();
    for (id, _, idle, _) in mine {
        renew
            .cmd("XCLAIM")
            .arg(&o.stream)
            .arg(&o.group)
            .arg(&o.consumer)
            .arg(*idle)
            .arg(id)
            .arg("JUSTID");
    }
    renew
}

/// The refusal for a dead-letter key that is not a stream.
fn not_a_stream(o: &RedisConsumerOptions, kind: &str) -> String {
    format!(
        "dead_letter_stream {:?} is a {kind}, not a stream: no entry given up on could be set aside, and it would \
         come back for ever; remove or rename that key, or name another dead_letter_stream",
        o.dead_letter_stream
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis_url() -> String {
        std::env::var("FERRY_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    }

    async fn pending(conn: &mut MultiplexedConnection, stream: &str) -> Vec<Pending> {
        redis::cmd("XPENDING")
            .arg(stream)
            .arg("billing")
            .arg("-")
            .arg("+")
            .arg(10)
            .query_async(conn)
            .await
            .unwrap()
    }

    /// Another member claims an entry between this member's `XPENDING`
    /// (which still listed it as this member's) and its renewal: the
    /// renewal leaves it with them. An `XCLAIM` with no minimum idle time
    /// took it back in the middle of their run.
    #[tokio::test]
    async fn a_renewal_leaves_an_entry_another_member_just_claimed() {
        let stream = format!("inbox-redis-renewal-{}", uuid::Uuid::now_v7());
        let mut conn = redis::Client::open(redis_url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg("billing")
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await
            .unwrap();
        for _ in 0..2 {
            let _: String = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("id")
                .arg("x")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("billing")
            .arg("a")
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(&mut conn)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mine = pending(&mut conn, &stream).await;
        assert_eq!(mine.len(), 2);
        assert!(
            mine.iter().all(|(_, owner, idle, _)| owner == "a" && *idle >= 100),
            "{mine:?}"
        );
        // Another member's XAUTOCLAIM takes the first.
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&stream)
            .arg("billing")
            .arg("b")
            .arg(0)
            .arg(&mine[0].0)
            .arg("JUSTID")
            .query_async(&mut conn)
            .await
            .unwrap();
        let o = RedisConsumerOptions::new(redis_url(), &stream, "billing", "a", format!("{stream}.dead"));
        let _: redis::Value = renewal(&o, &mine).query_async(&mut conn).await.unwrap();
        let after = pending(&mut conn, &stream).await;
        let _: i64 = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
        let owners: Vec<&str> = after.iter().map(|(_, owner, ..)| owner.as_str()).collect();
        assert_eq!(owners, ["b", "a"], "{after:?}");
        // The second, untouched, was renewed: its idle time started over.
        assert!(after[1].2 < 100, "{after:?}");
    }
}
