use std::collections::HashSet;
use std::time::Duration;

use ferry_core::{Claimed, Partition, PublishOutcome, Route, Sink, SinkError, StoredEvent, prepare_in_key_order};

/// The outcome of publishing one claimed batch.
#[derive(Debug)]
pub(crate) struct Published {
    /// The batch, handed back in its order.
    pub claimed: Vec<Claimed>,
    /// Per claimed delivery: `None` when it was held back and not sent.
    pub outcomes: Vec<Option<PublishOutcome>>,
    /// Events confirmed after an earlier event of their key failed in the same
    /// pipelined batch: they reached the destination out of order.
    pub order_breaks: u64,
}

/// Publishes a claimed batch in order, pipelined. An event the sink refuses
/// before sending holds back the rest of its key: they are not sent and stay
/// pending behind it (`None`). A failure the destination reports after later
/// events of the key were already in flight cannot be undone; those are
/// counted.
///
/// A sink that admits in its own `publish` gets the whole batch and reports
/// the events it held back; for any other, the relay asks `admit` first.
/// The events are handed to the sink as they are, not copied, unless some
/// of them must be left out. A publish slower than `timeout` counts as a
/// transient failure of every event sent.
pub(crate) async fn publish_in_order(
    sink: &dyn Sink,
    route: &Route,
    claimed: Vec<Claimed>,
    timeout: Option<Duration>,
) -> Published {
    let (places, events): (Vec<(Partition, u32)>, Vec<StoredEvent>) = claimed
        .into_iter()
        .map(|c| ((c.partition, c.attempts), c.event))
        .unzip();
    let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
    let send: Vec<usize> = if sink.admits_in_publish() {
        (0..events.len()).collect()
    } else {
        let admitted = prepare_in_key_order(&events, |e| sink.admit(route, e));
        let mut send = Vec::with_capacity(events.len());
        for (i, admission) in admitted.into_iter().enumerate() {
            match admission {
                Ok(()) => send.push(i),
                // Held back: not sent, no outcome.
                Err(e) if e.held_back => {}
                Err(e) => outcomes[i] = Some(Err(e)),
            }
        }
        send
    };
    if !send.is_empty() {
        let subset: Vec<StoredEvent>;
        let sent = if send.len() == events.len() {
            &events
        } else {
            subset = send.iter().map(|&i| events[i].clone()).collect();
            &subset
        };
        let publishing = sink.publish(route, sent);
        let mut results = match timeout {
            None => publishing.await,
            Some(t) => tokio::time::timeout(t, publishing).await.unwrap_or_else(|_| {
                let error = SinkError::transient(format!(
                    "publish took longer than {t:?}; it is retried, and the destination may see it twice"
                ));
                vec![Err(error); send.len()]
            }),
        };
        results.resize_with(send.len(), || Err(SinkError::transient("the sink returned no outcome")));
        for (i, r) in send.iter().zip(results) {
            // Not sent, to keep its key's order: it stays pending.
            outcomes[*i] = match r {
                Err(e) if e.held_back => None,
                r => Some(r),
            };
        }
    }
    let held_back = outcomes.iter().filter(|o| o.is_none()).count() as u64;
    if held_back > 0 {
        ::metrics::counter!(crate::metrics::HELD_BACK, "route" => route.name.clone()).increment(held_back);
    }
    let mut failed: HashSet<&str> = HashSet::new();
    let mut order_breaks = 0;
    for (e, o) in events.iter().zip(&outcomes) {
        let (Some(key), Some(o)) = (e.key.as_deref(), o) else {
            continue;
        };
        match o {
            Err(_) => {
                failed.insert(key);
            }
            Ok(()) if failed.contains(key) => order_breaks += 1,
            Ok(()) => {}
        }
    }
    let claimed = places
        .into_iter()
        .zip(events)
        .map(|((partition, attempts), event)| Claimed {
            partition,
            attempts,
            event,
        })
        .collect();
    Published {
        claimed,
        outcomes,
        order_breaks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use ferry_core::{EventId, Glob};
    use std::sync::Mutex;

    #[derive(Default)]
    struct Scripted {
        too_big: &'static str,
        rejects: &'static str,
        /// Admits in publish, as the shipped sinks do.
        admits_in_publish: bool,
        /// Never answers a publish.
        stalls: bool,
        admitted: Mutex<Vec<i64>>,
        sent: Mutex<Vec<String>>,
    }

    #[async_trait]
    impl Sink for Scripted {
        fn kind(&self) -> &'static str {
            "scripted"
        }
        fn admit(&self, _: &Route, e: &StoredEvent) -> Result<(), SinkError> {
            self.admitted.lock().unwrap().push(e.seq);
            if e.event_type == self.too_big {
                Err(SinkError::permanent("too large"))
            } else {
                Ok(())
            }
        }
        fn admits_in_publish(&self) -> bool {
            self.admits_in_publish
        }
        async fn publish(&self, route: &Route, events: &[StoredEvent]) -> Vec<PublishOutcome> {
            if self.stalls {
                std::future::pending::<()>().await;
            }
            let admitted = if self.admits_in_publish {
                prepare_in_key_order(events, |e| self.admit(route, e))
            } else {
                vec![Ok(()); events.len()]
            };
            let mut sent = self.sent.lock().unwrap();
            events
                .iter()
                .zip(admitted)
                .map(|(e, admission)| {
                    admission?;
                    sent.push(e.event_type.clone());
                    if e.event_type == self.rejects {
                        Err(SinkError::permanent("unroutable"))
                    } else {
                        Ok(())
                    }
                })
                .collect()
        }
        async fn check(&self, _: &Route) -> Result<(), SinkError> {
            Ok(())
        }
    }

    fn claimed(seq: i64, key: &str, t: &str) -> Claimed {
        Claimed {
            partition: 0,
            attempts: 0,
            event: StoredEvent {
                id: EventId::new(),
                seq,
                event_type: t.into(),
                key: Some(key.into()),
                payload: Default::default(),
                content_type: "application/json".into(),
                headers: Default::default(),
                created_at: chrono::Utc::now(),
            },
        }
    }

    fn route() -> Route {
        Route {
            name: "r".into(),
            matcher: Glob::new("**").unwrap(),
            sink: "s".into(),
            destination: "d".into(),
            routing_key: None,
        }
    }

    #[tokio::test]
    async fn a_refused_event_holds_back_the_rest_of_its_key_only() {
        for admits_in_publish in [false, true] {
            let sink = Scripted {
                too_big: "a.big",
                admits_in_publish,
                ..Scripted::default()
            };
            let batch = vec![
                claimed(1, "k", "a.ok"),
                claimed(2, "k", "a.big"),
                claimed(3, "j", "a.ok"),
                claimed(4, "k", "a.ok"),
            ];
            let counts = ferry_testkit::metrics::Counts::by_label("route");
            let recording = metrics::set_default_local_recorder(&counts);
            let p = publish_in_order(&sink, &route(), batch, None).await;
            drop(recording);
            assert_eq!(counts.get(crate::metrics::HELD_BACK, "r"), 1, "held back, and counted");
            let seqs: Vec<i64> = p.claimed.iter().map(|c| c.event.seq).collect();
            assert_eq!(seqs, [1, 2, 3, 4], "the batch comes back in its order");
            assert!(matches!(p.outcomes[0], Some(Ok(()))));
            assert!(matches!(p.outcomes[1], Some(Err(_))));
            assert!(matches!(p.outcomes[2], Some(Ok(()))));
            assert!(p.outcomes[3].is_none(), "k's later event is not sent");
            assert_eq!(sink.sent.lock().unwrap().len(), 2);
            assert_eq!(p.order_breaks, 0);
        }
    }

    #[tokio::test]
    async fn a_sink_that_admits_in_publish_prepares_each_event_once() {
        let sink = Scripted {
            admits_in_publish: true,
            ..Scripted::default()
        };
        let batch = vec![
            claimed(1, "k", "a.ok"),
            claimed(2, "j", "a.ok"),
            claimed(3, "k", "a.ok"),
        ];
        let p = publish_in_order(&sink, &route(), batch, None).await;
        assert!(p.outcomes.iter().all(|o| matches!(o, Some(Ok(())))));
        assert_eq!(*sink.admitted.lock().unwrap(), [1, 2, 3], "each event admitted once");
    }

    #[tokio::test]
    async fn a_failure_after_later_events_were_in_flight_is_counted() {
        let sink = Scripted {
            rejects: "a.bad",
            ..Scripted::default()
        };
        let batch = vec![
            claimed(1, "k", "a.bad"),
            claimed(2, "k", "a.ok"),
            claimed(3, "j", "a.ok"),
            claimed(4, "k", "a.ok"),
        ];
        let p = publish_in_order(&sink, &route(), batch, None).await;
        assert!(matches!(p.outcomes[0], Some(Err(_))));
        assert_eq!(p.order_breaks, 2);
    }

    #[tokio::test]
    async fn a_publish_past_its_timeout_fails_what_was_sent_transiently() {
        for admits_in_publish in [false, true] {
            let sink = Scripted {
                too_big: "a.big",
                admits_in_publish,
                stalls: true,
                ..Scripted::default()
            };
            let mut batch = vec![
                claimed(1, "k", "a.ok"),
                claimed(2, "j", "a.big"),
                claimed(3, "j", "a.ok"),
            ];
            batch[0].attempts = 2;
            batch[0].partition = 7;
            let p = publish_in_order(&sink, &route(), batch, Some(Duration::from_millis(20))).await;
            let err = |i: usize| p.outcomes[i].clone().expect("an outcome").expect_err("a failure");
            assert_eq!(err(0).kind, ferry_core::ErrorKind::Transient);
            assert!(err(0).message.contains("took longer than"), "{}", err(0));
            if admits_in_publish {
                // The sink never answered, so it refused nothing either.
                assert_eq!(err(1).kind, ferry_core::ErrorKind::Transient);
                assert_eq!(err(2).kind, ferry_core::ErrorKind::Transient);
            } else {
                // Refused before sending: its own reason, and its key held back.
                assert_eq!(err(1).kind, ferry_core::ErrorKind::Permanent);
                assert!(p.outcomes[2].is_none());
            }
            let c = &p.claimed[0];
            assert_eq!((c.event.seq, c.attempts, c.partition), (1, 2, 7));
        }
    }
}
