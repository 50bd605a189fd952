//! From replication events to Ferry events: pgoutput inserts into
//! `ferry.events` (decoded with pg_walstream) and `ferry` logical messages,
//! gathered per committed transaction.

use std::collections::HashMap;

use base64::Engine;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use ferry_core::{EventId, Headers, StoreError, StoredEvent};
use pg_walstream::protocol::{LogicalReplicationMessage, LogicalReplicationParser, TupleData};
use pgwire_replication::ReplicationEvent;

use super::WalItem;

/// The logical decoding message prefix of tableless events.
pub(crate) const MESSAGE_PREFIX: &str = "ferry";

/// The type of the event that stands for a `ferry` message no relay can
/// read ([`WalEvent::undecodable`]).
pub const UNDECODABLE_TYPE: &str = "ferry.message.undecodable";

/// One event as the slot handed it over.
#[derive(Debug, Clone, PartialEq)]
pub struct WalEvent {
    /// For an outbox row, its seq; for a tableless event, the seq
    /// `ferry._emit` reserved for it (migration 0010), which the event takes
    /// if it is written to the outbox (only if its delivery fails). 0 for a
    /// message emitted before that migration: such an event draws its seq
    /// when it is written.
    pub event: StoredEvent,
    /// The outbox partition of a row; `None` for a tableless event.
    pub partition: Option<i32>,
    /// A `ferry` message that does not decode (one emitted by something
    /// other than `ferry.emit`, by `pg_logical_emit_message('ferry', ...)`
    /// by hand, say): why, with its WAL position and what to do. It would
    /// fail every session that reads it, and hold the slot where it is for
    /// good, so it stands as an event of its own ([`UNDECODABLE_TYPE`],
    /// no key, the message's bytes as its payload, an id made from its
    /// position so a replay writes it once), not published but settled as
    /// dead: there for an operator to see, cancel or requeue.
    pub undecodable: Option<String>,
}

impl WalEvent {
    pub fn tableless(&self) -> bool {
        self.partition.is_none()
    }

    /// The seq a tableless event's message carries, if any.
    pub(crate) fn reserved_seq(&self) -> Option<i64> {
        (self.tableless() && self.event.seq > 0).then_some(self.event.seq)
    }
}

/// A committed transaction's Ferry events, in the order it wrote them, or a
/// part of them: a large transaction is handed over in parts of at most
/// [`PART_EVENTS`] events or about [`PART_BYTES`] bytes of payload, so the
/// relay never holds more than that of it at once. Every part but the last
/// has `end_lsn` 0: the transaction is confirmed only with its last part.
/// A part settled before a restart is not handed over again
/// ([`Settlement::part`](super::Settlement::part)).
#[derive(Debug, Clone, PartialEq)]
pub struct WalTxn {
    /// The transaction id (32 bits, as the stream gives it).
    pub xid: u32,
    /// Confirming this position confirms the transaction; 0 on a part that
    /// more of the transaction follows.
    pub end_lsn: u64,
    /// The position of the transaction's commit record, which names it.
    pub commit_lsn: u64,
    /// How many of the transaction's events the stream has handed over,
    /// this part's included (and any skipped as settled before).
    pub read: u64,
    pub commit_time: DateTime<Utc>,
    pub events: Vec<WalEvent>,
}

/// Column positions of `ferry.events` in the relation the stream announced.
#[derive(Debug, Clone, Default)]
struct Columns {
    seq: usize,
    id: usize,
    event_type: usize,
    key: usize,
    partition: usize,
    payload: usize,
    content_type: usize,
    headers: usize,
    created_at: usize,
}

/// A transaction is handed over in parts of at most this many events...
pub const PART_EVENTS: usize = 2_000;
/// ...or once its part holds this many bytes of payload.
pub const PART_BYTES: usize = 16 * 1024 * 1024;

/// The transaction being read.
struct Open {
    xid: u32,
    commit_lsn: u64,
    commit_time: DateTime<Utc>,
    events: Vec<WalEvent>,
    bytes: usize,
    /// Its events read so far.
    read: u64,
    /// How many of its first events were settled before: they are dropped.
    skip: u64,
}

#[derive(Default)]
pub(crate) struct Decoder {
    parser: Option<LogicalReplicationParser>,
    /// Relations of `ferry.events` by oid (a table rewrite announces a new one).
    relations: HashMap<u32, Columns>,
    open: Option<Open>,
    /// (commit position, events): the part of a transaction an earlier
    /// session settled.
    resume: Option<(u64, u64)>,
}

impl Decoder {
    /// A decoder that drops the first `events` events of the transaction
    /// committing at `commit_lsn`, given as `Some((commit_lsn, events))`.
    pub(crate) fn resuming(resume: Option<(u64, u64)>) -> Self {
        Self {
            resume,
            ..Self::default()
        }
    }

    pub(crate) fn feed(&mut self, event: ReplicationEvent) -> Result<Option<WalItem>, StoreError> {
        match event {
            ReplicationEvent::Begin {
                xid,
                final_lsn,
                commit_time_micros,
            } => {
                let commit_lsn = final_lsn.as_u64();
                let skip = match self.resume {
                    Some((lsn, events)) if lsn == commit_lsn => events,
                    _ => 0,
                };
                self.open = Some(Open {
                    xid,
                    commit_lsn,
                    commit_time: pg_time(commit_time_micros),
                    events: Vec::new(),
                    bytes: 0,
                    read: 0,
                    skip,
                });
                Ok(None)
            }
            ReplicationEvent::Commit {
                lsn: commit_lsn,
                end_lsn,
                commit_time_micros,
                ..
            } => {
                let (xid, read, events) = match self.open.take() {
                    Some(open) => (open.xid, open.read, open.events),
                    None => (0, 0, Vec::new()),
                };
                Ok(Some(WalItem::Txn(WalTxn {
                    xid,
                    end_lsn: end_lsn.as_u64(),
                    commit_lsn: commit_lsn.as_u64(),
                    read,
                    commit_time: pg_time(commit_time_micros),
                    events,
                })))
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => Ok(match self.open {
                None => Some(WalItem::Idle { lsn: wal_end.as_u64() }),
                Some(_) => None,
            }),
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if prefix != MESSAGE_PREFIX {
                    return Ok(None);
                }
                let lsn = lsn.as_u64();
                let Some(open) = self.open.as_mut().filter(|_| transactional) else {
                    tracing::warn!(
                        lsn = %lsn_text(lsn),
                        "a non-transactional `ferry` message was ignored; ferry.emit writes transactional ones"
                    );
                    return Ok(None);
                };
                let event = match tableless(&content) {
                    Ok(event) => event,
                    // Nothing is lost while the relay waits: the slot keeps
                    // the message until a relay that reads it comes.
                    Err(Unreadable::Newer(v)) => {
                        let message = format!(
                            "the `ferry` message at WAL position {} is of version {v}, newer than this relay \
                             reads: upgrade the relays in WAL mode to the release of the schema (`ferry migrate`); \
                             the slot keeps it, and every later event, until then",
                            lsn_text(lsn)
                        );
                        tracing::error!(lsn = %lsn_text(lsn), "{message}");
                        return Err(StoreError::config(message));
                    }
                    Err(Unreadable::Malformed(why)) => undecodable(lsn, open.commit_time, content, &why),
                };
                Ok(open.push(event))
            }
            ReplicationEvent::XLogData { data, .. } => self.change(data),
            ReplicationEvent::StoppedAt { .. } => Err(StoreError::transient("replication stream stopped")),
        }
    }

    fn change(&mut self, data: Bytes) -> Result<Option<WalItem>, StoreError> {
        let parser = self
            .parser
            .get_or_insert_with(|| LogicalReplicationParser::with_protocol_version(1));
        let message = parser
            .parse_wal_message_bytes(data)
            .map_err(|e| StoreError::permanent(format!("undecodable pgoutput message: {e}")))?
            .message;
        match message {
            LogicalReplicationMessage::Relation {
                relation_id,
                namespace,
                relation_name,
                columns,
                ..
            } if &*namespace == "ferry" && &*relation_name == "events" => {
                let names: Vec<&str> = columns.iter().map(|c| &*c.name).collect();
                self.relations.insert(relation_id, columns_of(&names)?);
            }
            LogicalReplicationMessage::Insert { relation_id, tuple } => {
                if let Some(columns) = self.relations.get(&relation_id) {
                    let event = row(columns, &tuple)?;
                    return match &mut self.open {
                        Some(open) => Ok(open.push(event)),
                        None => Err(StoreError::permanent("an insert arrived outside a transaction")),
                    };
                }
            }
            _ => {}
        }
        Ok(None)
    }
}

impl Open {
    /// Adds `event` (unless it was settled before); returns the part read
    /// so far once it is full.
    fn push(&mut self, event: WalEvent) -> Option<WalItem> {
        self.read += 1;
        if self.read <= self.skip {
            return None;
        }
        self.bytes += event.event.payload.len();
        self.events.push(event);
        if self.events.len() < PART_EVENTS && self.bytes < PART_BYTES {
            return None;
        }
        self.bytes = 0;
        Some(WalItem::Txn(WalTxn {
            xid: self.xid,
            end_lsn: 0,
            commit_lsn: self.commit_lsn,
            read: self.read,
            commit_time: self.commit_time,
            events: std::mem::take(&mut self.events),
        }))
    }
}

fn columns_of(names: &[&str]) -> Result<Columns, StoreError> {
    let at = |name: &str| {
        names.iter().position(|n| *n == name).ok_or_else(|| {
            StoreError::config(format!(
                "ferry.events as streamed has no column {name}; run `ferry migrate`"
            ))
        })
    };
    Ok(Columns {
        seq: at("seq")?,
        id: at("id")?,
        event_type: at("type")?,
        key: at("key")?,
        partition: at("partition")?,
        payload: at("payload")?,
        content_type: at("content_type")?,
        headers: at("headers")?,
        created_at: at("created_at")?,
    })
}

fn row(c: &Columns, tuple: &TupleData) -> Result<WalEvent, StoreError> {
    let text = |i: usize, name: &str| -> Result<Option<String>, StoreError> {
        let col = tuple
            .get_column(i)
            .ok_or_else(|| StoreError::permanent(format!("streamed row lacks column {name}")))?;
        if col.is_null() {
            return Ok(None);
        }
        col.as_string()
            .map(Some)
            .ok_or_else(|| StoreError::permanent(format!("streamed column {name} is not text")))
    };
    let need = |i: usize, name: &str| {
        text(i, name)?.ok_or_else(|| StoreError::permanent(format!("streamed column {name} is NULL")))
    };
    let bad = |name: &str, e: &dyn std::fmt::Display| StoreError::permanent(format!("streamed column {name}: {e}"));
    let seq: i64 = need(c.seq, "seq")?.parse().map_err(|e| bad("seq", &e))?;
    let id: uuid::Uuid = need(c.id, "id")?.parse().map_err(|e| bad("id", &e))?;
    let partition: i32 = need(c.partition, "partition")?
        .parse()
        .map_err(|e| bad("partition", &e))?;
    let payload = need(c.payload, "payload")?;
    let payload = payload
        .strip_prefix("\\x")
        .ok_or_else(|| bad("payload", &"not hex bytea"))
        .and_then(|h| hex(h).map_err(|e| bad("payload", &e)))?;
    let headers: Headers = serde_json::from_str(&need(c.headers, "headers")?).map_err(|e| bad("headers", &e))?;
    let created_at = need(c.created_at, "created_at")?;
    let created_at = DateTime::parse_from_str(&created_at, "%Y-%m-%d %H:%M:%S%.f%#z")
        .map_err(|e| bad("created_at", &e))?
        .with_timezone(&Utc);
    Ok(WalEvent {
        event: StoredEvent {
            id: EventId(id),
            seq,
            event_type: need(c.event_type, "type")?,
            key: text(c.key, "key")?,
            payload: Bytes::from(payload),
            content_type: need(c.content_type, "content_type")?,
            headers,
            created_at,
        },
        partition: Some(partition),
        undecodable: None,
    })
}

/// A message of version 1 (its `v`, read first, is left out).
#[derive(serde::Deserialize)]
struct Message {
    id: uuid::Uuid,
    /// Reserved by `ferry._emit` since migration 0010; absent before.
    #[serde(default)]
    seq: Option<i64>,
    #[serde(rename = "type")]
    event_type: String,
    key: Option<String>,
    content_type: String,
    headers: Headers,
    payload: String,
    created_at: DateTime<Utc>,
}

/// Why a `ferry` message does not decode.
#[derive(Debug, PartialEq)]
enum Unreadable {
    /// Written by a newer `ferry.emit`: a newer relay reads it.
    Newer(u32),
    /// Not one `ferry.emit` writes: nothing ever reads it.
    Malformed(String),
}

fn tableless(content: &[u8]) -> Result<WalEvent, Unreadable> {
    /// What every version has: a message that lacks it is not Ferry's,
    /// whatever version it claims.
    #[derive(serde::Deserialize)]
    struct Version {
        v: u32,
        #[serde(rename = "id")]
        _id: uuid::Uuid,
        #[serde(rename = "type")]
        _type: String,
    }
    let bad = |e: &dyn std::fmt::Display| Unreadable::Malformed(e.to_string());
    // The version first: a newer message may have other fields.
    match serde_json::from_slice::<Version>(content) {
        Ok(Version { v, .. }) if v > 1 => return Err(Unreadable::Newer(v)),
        Ok(Version { v: 1, .. }) => {}
        Ok(Version { v, .. }) => return Err(bad(&format!("version {v}"))),
        Err(e) => return Err(bad(&e)),
    }
    let m: Message = serde_json::from_slice(content).map_err(|e| bad(&e))?;
    let payload = base64::engine::general_purpose::STANDARD
        .decode(m.payload.as_bytes())
        .map_err(|e| bad(&e))?;
    Ok(WalEvent {
        event: StoredEvent {
            id: EventId(m.id),
            seq: m.seq.unwrap_or(0),
            event_type: m.event_type,
            key: m.key,
            payload: Bytes::from(payload),
            content_type: m.content_type,
            headers: m.headers,
            created_at: m.created_at,
        },
        partition: None,
        undecodable: None,
    })
}

/// The event that stands for the undecodable `ferry` message at `lsn`, of
/// a transaction committed `at` ([`WalEvent::undecodable`]).
fn undecodable(lsn: u64, at: DateTime<Utc>, content: Bytes, why: &str) -> WalEvent {
    // A UUID v7 of the commit's time whose random bits are the position:
    // the same id each time the message is read.
    let mut tail = [0u8; 10];
    tail[..8].copy_from_slice(&lsn.to_be_bytes());
    let id = uuid::Builder::from_unix_timestamp_millis(at.timestamp_millis().max(0) as u64, &tail).into_uuid();
    let position = lsn_text(lsn);
    let reason = format!(
        "undecodable `ferry` logical message at WAL position {position} ({why}): ferry.emit did not write it, \
         and it was not published; its bytes are this event's payload. Find what emits `ferry` messages \
         (pg_logical_emit_message) and give it another prefix; cancel this event, or requeue it to deliver \
         the bytes as they are to the routes matching {UNDECODABLE_TYPE}"
    );
    WalEvent {
        event: StoredEvent {
            id: EventId(id),
            seq: 0,
            event_type: UNDECODABLE_TYPE.to_owned(),
            key: None,
            payload: content,
            content_type: "application/octet-stream".to_owned(),
            headers: Headers::from([("ferry-wal-lsn".to_owned(), position)]),
            created_at: at,
        },
        partition: None,
        undecodable: Some(reason),
    }
}

/// A WAL position as PostgreSQL writes it (`16/B374D848`).
fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// PostgreSQL's microseconds since 2000-01-01.
fn pg_time(micros: i64) -> DateTime<Utc> {
    const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;
    DateTime::from_timestamp_micros(micros.saturating_add(PG_EPOCH_MICROS)).unwrap_or_else(Utc::now)
}

fn hex(s: &str) -> Result<Vec<u8>, &'static str> {
    fn nibble(b: u8) -> Result<u8, &'static str> {
        match b {
            b'0'..=b'9' => Ok(b - b'0'),
            b'a'..=b'f' => Ok(b - b'a' + 10),
            b'A'..=b'F' => Ok(b - b'A' + 10),
            _ => Err("not a hex digit"),
        }
    }
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return Err("odd number of hex digits");
    }
    b.chunks_exact(2)
        .map(|p| Ok(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_bytea_decodes() {
        assert_eq!(hex("00ff7A").unwrap(), vec![0, 255, 122]);
        assert!(hex("0").is_err());
        assert!(hex("zz").is_err());
    }

    #[test]
    fn tableless_messages_decode_and_refuse_newer_versions() {
        let ok = br#"{"v":1,"id":"0190b6a0-0000-7000-8000-000000000001","type":"order.paid","key":"o-1",
            "content_type":"application/json","headers":{"a":"b"},"payload":"eyJpZCI6MX0=",
            "created_at":"2026-11-30T15:00:00.123456+00:00"}"#;
        let e = tableless(ok).unwrap();
        assert!(e.tableless());
        assert_eq!(e.event.event_type, "order.paid");
        assert_eq!(&e.event.payload[..], br#"{"id":1}"#);
        assert_eq!(e.event.headers["a"], "b");
        // Emitted before migration 0010: no reserved seq, one is drawn when
        // the event is written.
        assert_eq!((e.event.seq, e.reserved_seq()), (0, None));
        let reserved = br#"{"v":1,"id":"0190b6a0-0000-7000-8000-000000000002","seq":42,"type":"order.paid",
            "key":"o-1","content_type":"application/json","headers":{},"payload":"",
            "created_at":"2026-11-30T15:00:00Z"}"#;
        let e = tableless(reserved).unwrap();
        assert_eq!((e.event.seq, e.reserved_seq()), (42, Some(42)));
        let newer = br#"{"v":2,"id":"0190b6a0-0000-7000-8000-000000000001","type":"a.b","key":null,
            "content_type":"x","headers":{},"payload":"","created_at":"2026-11-30T15:00:00Z"}"#;
        assert_eq!(tableless(newer).unwrap_err(), Unreadable::Newer(2));
        let foreign: [&[u8]; 5] = [
            b"not json",
            br#"{"v":1,"id":"x"}"#,
            br#"{"hello":"world"}"#,
            br#"{"v":0,"id":"0190b6a0-0000-7000-8000-000000000001","type":"a.b"}"#,
            // Claims a newer version, but is not Ferry's: no id.
            br#"{"v":2,"type":"a.b"}"#,
        ];
        for foreign in foreign {
            assert!(
                matches!(tableless(foreign), Err(Unreadable::Malformed(_))),
                "{}",
                String::from_utf8_lossy(foreign)
            );
        }
    }

    #[test]
    fn commit_times_count_from_2000() {
        assert_eq!(pg_time(0).to_rfc3339(), "2000-01-01T00:00:00+00:00");
    }
}
