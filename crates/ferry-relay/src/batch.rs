use std::collections::HashSet;

use ferry_core::{Claimed, PublishOutcome, Route, Sink, SinkError, StoredEvent, prepare_in_key_order};

/// The outcome of publishing one claimed batch.
#[derive(Debug)]
pub(crate) struct Published {
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
pub(crate) async fn publish_in_order(sink: &dyn Sink, route: &Route, claimed: &[Claimed]) -> Published {
    let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; claimed.len()];
    let send: Vec<usize> = if sink.admits_in_publish() {
        (0..claimed.len()).collect()
    } else {
        let admitted = prepare_in_key_order(claimed.iter().map(|c| &c.event), |e| sink.admit(route, e));
        let mut send = Vec::with_capacity(claimed.len());
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
        let events: Vec<StoredEvent> = send.iter().map(|&i| claimed[i].event.clone()).collect();
        let mut results = sink.publish(route, &events).await;
        results.resize_with(events.len(), || {
            Err(SinkError::transient("the sink returned no outcome"))
        });
        for (i, r) in send.iter().zip(results) {
            // Not sent, to keep its key's order: it stays pending.
            outcomes[*i] = match r {
                Err(e) if e.held_back => None,
                r => Some(r),
            };
        }
    }
    let mut failed: HashSet<&str> = HashSet::new();
    let mut order_breaks = 0;
    for (c, o) in claimed.iter().zip(&outcomes) {
        let (Some(key), Some(o)) = (c.event.key.as_deref(), o) else {
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
    Published { outcomes, order_breaks }
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
            let batch = [
                claimed(1, "k", "a.ok"),
                claimed(2, "k", "a.big"),
                claimed(3, "j", "a.ok"),
                claimed(4, "k", "a.ok"),
            ];
            let p = publish_in_order(&sink, &route(), &batch).await;
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
        let batch = [
            claimed(1, "k", "a.ok"),
            claimed(2, "j", "a.ok"),
            claimed(3, "k", "a.ok"),
        ];
        let p = publish_in_order(&sink, &route(), &batch).await;
        assert!(p.outcomes.iter().all(|o| matches!(o, Some(Ok(())))));
        assert_eq!(*sink.admitted.lock().unwrap(), [1, 2, 3], "each event admitted once");
    }

    #[tokio::test]
    async fn a_failure_after_later_events_were_in_flight_is_counted() {
        let sink = Scripted {
            rejects: "a.bad",
            ..Scripted::default()
        };
        let batch = [
            claimed(1, "k", "a.bad"),
            claimed(2, "k", "a.ok"),
            claimed(3, "j", "a.ok"),
            claimed(4, "k", "a.ok"),
        ];
        let p = publish_in_order(&sink, &route(), &batch).await;
        assert!(matches!(p.outcomes[0], Some(Err(_))));
        assert_eq!(p.order_breaks, 2);
    }
}
