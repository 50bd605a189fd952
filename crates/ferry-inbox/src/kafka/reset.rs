//! Records lost to an offset reset. A group's committed offset can fall
//! out of its partition's log: retention or `kafka-delete-records` removed
//! the records from it on while the consumer was stopped or behind, or an
//! unclean leader election truncated the log. librdkafka then resets the
//! partition's position to `auto.offset.reset` (the log start, or its end
//! with `latest`) and goes on reading, with nothing for the application but
//! a warning in its log (`rd_kafka_offset_reset` in `rdkafka_offset.c`,
//! facility `OFFSET`). The member's context reads that line ([`parse`]),
//! and the session reports the reset ([`report`]): an error, and the
//! records skipped in [`crate::metrics::LOST`].

use std::sync::Mutex;

use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio::sync::Notify;
use tracing::{error, warn};

use super::KafkaConsumerOptions;
use crate::metrics;

/// The `reason` label of [`crate::metrics::LOST`] for records skipped by an
/// offset reset.
pub(super) const OFFSET_RESET: &str = "offset_reset";

/// One reset of a partition's position, as librdkafka logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Reset {
    pub(super) topic: String,
    pub(super) partition: i32,
    /// The offset the partition was to be read from (the committed one,
    /// right after an assignment), when librdkafka names one.
    pub(super) from: Option<i64>,
    pub(super) to: Target,
    /// librdkafka's own words for why, with the broker's error.
    pub(super) why: String,
}

/// Where librdkafka sent the partition's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// The log start (`auto.offset.reset` earliest), not known yet.
    Beginning,
    /// The log end (`auto.offset.reset` latest).
    End,
    Offset(i64),
}

/// Resets seen by the member's context, for the session to report.
#[derive(Default)]
pub(super) struct Resets {
    seen: Mutex<Vec<Reset>>,
    noticed: Notify,
}

impl Resets {
    /// Called from librdkafka's threads.
    pub(super) fn push(&self, reset: Reset) {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).push(reset);
        self.noticed.notify_one();
    }

    /// Resolves once a reset was pushed since the last [`Resets::take`].
    pub(super) async fn noticed(&self) {
        self.noticed.notified().await;
    }

    pub(super) fn take(&self) -> Vec<Reset> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The reset a librdkafka log line (facility `OFFSET`) reports, if it is
/// one librdkafka made for an error: those are logged as warnings, in the
/// form `TOPIC [PARTITION]: offset reset (at offset N (leader epoch E),
/// broker B) to [cached BEGINNING offset ]offset X (leader epoch E): WHY`.
/// A group's first start, without a committed offset, is logged at debug
/// level only, and is not a loss.
pub(super) fn parse(line: &str) -> Option<Reset> {
    let (topic, rest) = line.split_once(" [")?;
    let (partition, rest) = rest.split_once("]: offset reset (at offset ")?;
    let (from, rest) = rest.split_once(' ')?;
    let (_, rest) = rest.split_once(") to ")?;
    let rest = rest.strip_prefix("cached BEGINNING offset ").unwrap_or(rest);
    let rest = rest.strip_prefix("offset ")?;
    let (to, rest) = rest.split_once(' ')?;
    let why = rest.split_once("): ").map_or("", |(_, why)| why);
    let to = match to {
        "BEGINNING" => Target::Beginning,
        "END" => Target::End,
        offset => Target::Offset(offset.parse().ok()?),
    };
    Some(Reset {
        topic: topic.to_owned(),
        partition: partition.parse().ok()?,
        from: from.parse().ok().filter(|offset: &i64| *offset >= 0),
        to,
        why: why.to_owned(),
    })
}

/// Reports each reset: an error naming the partition, the offset it was to
/// be read from and where it resumed, and the records in between counted in
/// [`metrics::LOST`]. Where it resumed is asked of the cluster (the
/// partition's low watermark, on a client of its own) unless librdkafka
/// said; if the cluster cannot say, the reset is reported without a count.
/// A reset to the log's end is reported without one too: the end it went
/// to is the high watermark when it reset, which asked now would count the
/// records produced since, which the consumer reads, as lost.
/// The watermark calls block for up to the options' timeout each: the
/// session runs this beside its loop, not in it.
pub(super) async fn report(o: &KafkaConsumerOptions, consumer: &str, resets: Vec<Reset>) {
    if resets.is_empty() {
        return;
    }
    let config = o.consumer_config();
    let (timeout, asked) = (o.timeout, resets.clone());
    // librdkafka's watermark call blocks.
    let resumed = tokio::task::spawn_blocking(move || {
        if asked.iter().all(|r| r.to == Target::End) {
            return vec![Err(END_UNKNOWN.to_owned()); asked.len()];
        }
        let client: BaseConsumer = match config.create() {
            Ok(client) => client,
            Err(e) => return vec![Err(format!("creating a Kafka client: {e}")); asked.len()],
        };
        asked
            .iter()
            .map(|r| match r.to {
                Target::Offset(offset) => Ok(offset),
                Target::End => Err(END_UNKNOWN.to_owned()),
                Target::Beginning => client
                    .fetch_watermarks(&r.topic, r.partition, timeout)
                    .map(|(low, _)| low)
                    .map_err(|e| format!("reading the partition's watermarks: {e}")),
            })
            .collect()
    })
    .await
    .unwrap_or_else(|e| vec![Err(format!("reading the partition's watermarks: {e}")); resets.len()]);
    for (reset, resumed) in resets.iter().zip(resumed) {
        report_one(consumer, reset, resumed);
    }
}

/// Where a reset to the log's end resumed, as [`report_one`] says it.
const END_UNKNOWN: &str = "the end of the log when it reset";

fn report_one(consumer: &str, reset: &Reset, resumed: Result<i64, String>) {
    let Reset {
        topic, partition, why, ..
    } = reset;
    let from = reset.from.map_or_else(|| "unknown".to_owned(), |o| o.to_string());
    match (reset.from, resumed) {
        (Some(from), Ok(resumed)) if resumed > from => {
            let lost = resumed - from;
            metrics::lost(consumer, OFFSET_RESET, lost.unsigned_abs());
            error!(
                consumer,
                topic = %topic,
                partition,
                offset = from,
                resumed_at = resumed,
                lost,
                "offset {from} of partition {partition} of topic {topic}, where the group was to read next, is \
                 no longer in the log ({why}): librdkafka resumed at offset {resumed} (auto.offset.reset), and the \
                 {lost} records before it are lost to this consumer; their events stay in the outbox until its \
                 retention removes them (ferry list --state published --since T); keep the topic's retention \
                 above the longest the group may be stopped or behind"
            );
        }
        (Some(_), Ok(resumed)) => warn!(
            consumer,
            topic = %topic,
            partition,
            offset = %from,
            resumed_at = resumed,
            "offset {from} of partition {partition} of topic {topic}, where the group was to read next, is past \
             the end of the log ({why}; the log was truncated, or the topic made anew): librdkafka went back to \
             offset {resumed} (auto.offset.reset); records read again are skipped by the inbox"
        ),
        (_, resumed) => {
            let resumed = match resumed {
                Ok(offset) => format!("offset {offset}"),
                Err(e) if e == END_UNKNOWN => e,
                Err(e) => format!("an offset the cluster did not tell ({e})"),
            };
            error!(
                consumer,
                topic = %topic,
                partition,
                offset = %from,
                "offset {from} of partition {partition} of topic {topic}, where the group was to read next, is \
                 not in the log ({why}): librdkafka moved to {resumed} (auto.offset.reset); the records it \
                 skipped, if it moved forward, are lost to this consumer and not counted; keep the topic's \
                 retention above the longest the group may be stopped or behind"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reset_librdkafka_logs_for_an_offset_out_of_range_is_read() {
        let line = "orders.v1 [3]: offset reset (at offset 8 (leader epoch 8), broker 1) to offset BEGINNING \
                    (leader epoch -1): fetch failed due to requested offset not available on the broker: Broker: \
                    Offset out of range";
        assert_eq!(
            parse(line),
            Some(Reset {
                topic: "orders.v1".into(),
                partition: 3,
                from: Some(8),
                to: Target::Beginning,
                why: "fetch failed due to requested offset not available on the broker: Broker: Offset out of range"
                    .into(),
            })
        );
        let cached = "t [0]: offset reset (at offset 2 (leader epoch -1), broker 1) to cached BEGINNING offset \
                      offset 12 (leader epoch -1): fetch failed: Broker: Offset out of range";
        assert_eq!(
            parse(cached).map(|r| (r.from, r.to)),
            Some((Some(2), Target::Offset(12)))
        );
        let latest = "t [1]: offset reset (at offset 5 (leader epoch 0), broker 2) to offset END (leader epoch \
                      -1): fetch failed: Broker: Offset out of range";
        assert_eq!(parse(latest).map(|r| r.to), Some(Target::End));
        let unknown = "t [1]: offset reset (at offset INVALID (leader epoch -1), broker -1) to offset END \
                       (leader epoch -1): non-readable offset file: Local: File error";
        assert_eq!(parse(unknown).map(|r| r.from), Some(None));
    }

    #[test]
    fn other_offset_lines_are_not_resets() {
        for line in [
            "t [0]: Setting offset INVALID (leader epoch -1)",
            "Topic t [0]: stored offset 5 (leader epoch -1), committed offset 3 (leader epoch -1): \
             setting stored offset 5 for commit",
            "",
        ] {
            assert_eq!(parse(line), None, "{line}");
        }
    }
}
