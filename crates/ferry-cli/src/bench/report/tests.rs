use std::time::Duration;

use hdrhistogram::Histogram;

use super::*;

#[test]
fn percentiles_of_a_known_distribution() {
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    for us in 1..=1000 {
        h.record(us * 10).unwrap();
    }
    let p = Percentiles::of(&h).unwrap();
    assert_eq!(p.count, 1000);
    // Three significant figures: within 0.1% of the exact value.
    assert!((4995..=5005).contains(&p.p50), "{p:?}");
    assert!((8991..=9009).contains(&p.p90), "{p:?}");
    assert!((9890..=9910).contains(&p.p99), "{p:?}");
    assert!((9990..=10_010).contains(&p.max), "{p:?}");
    assert_eq!(Percentiles::of(&Histogram::<u64>::new(3).unwrap()), None);
    assert_eq!(
        Percentiles {
            count: 1,
            p50: 2_100,
            p90: 4_000,
            p99: 15_000,
            max: 123_456
        }
        .describe(),
        "p50 2.10 ms, p90 4.00 ms, p99 15.00 ms, max 123.46 ms"
    );
}

#[test]
fn numbers_read_well() {
    assert_eq!(thousands(0), "0");
    assert_eq!(thousands(999), "999");
    assert_eq!(thousands(1_000), "1,000");
    assert_eq!(thousands(13_300), "13,300");
    assert_eq!(thousands(1_234_567), "1,234,567");
    assert_eq!(rate(12_345.6), "12,346");
    assert_eq!(pct(0.7671), "76.7%");
    assert_eq!(mib(46_080), "45.0 MiB");
    assert_eq!(minutes(Duration::from_secs(605)), "10 min 05 s");
}

fn drain(events: u64, secs: u64) -> DrainResult {
    DrainResult {
        events,
        keys: 1000,
        batch_size: 500,
        prefill: Duration::from_secs(10),
        drain: Duration::from_secs(secs),
        rss_before_kib: Some(20_480),
        peak_rss_kib: Some(40_960),
        transactions: Some(1_040),
        retried: 0,
    }
}

#[test]
fn the_table_marks_targets_met_and_missed() {
    let report = Report {
        broker: Some(BrokerResult {
            events: 100_000,
            window: 500,
            elapsed: Duration::from_secs(10),
        }),
        // 8,000/s against 10,000/s: 80%, met.
        drain: Some(drain(80_000, 10)),
        // 3,000/s against 8,000/s: 37.5%, missed.
        hotkey: Some(drain(30_000, 10)),
        idle: Some(IdleResult {
            window: Duration::from_secs(30),
            transactions: 9,
        }),
        ..Report::default()
    };
    let text = report.render();
    assert!(text.contains("| scenario | figure | target | met? |"), "{text}");
    assert!(text.contains("| broker | 10,000 confirmed publishes/s"), "{text}");
    assert!(
        text.contains("| drain | 8,000 events/s = 80.0% of broker | ≥ 75% of broker | yes |"),
        "{text}"
    );
    assert!(
        text.contains("| hot key (1 key) | 3,000 events/s = 37.5% of drain | ≥ 50% of drain | **no** |"),
        "{text}"
    );
    assert!(
        text.contains("| idle | 0.300 transactions/s (9 in 30 s) | < 0.2/s | **no** |"),
        "{text}"
    );
    assert!(
        text.contains("| drain: database | 6.5 transactions per batch of 500 |"),
        "{text}"
    );
    assert!(!text.contains("latency"), "scenarios not run have no rows");
}

#[test]
fn writing_keeps_the_prose_around_the_marks() {
    let fresh = splice("", "## Results\n");
    assert_eq!(fresh, format!("{BEGIN_MARK}\n## Results\n{END_MARK}\n"));
    let doc = format!("# Benchmarks\n\nintro\n\n{BEGIN_MARK}\nold\n{END_MARK}\n\n## Analysis\n");
    let updated = splice(&doc, "new\n");
    assert_eq!(
        updated,
        format!("# Benchmarks\n\nintro\n\n{BEGIN_MARK}\nnew\n{END_MARK}\n\n## Analysis\n")
    );
    let appended = splice("# Notes\n", "new");
    assert_eq!(appended, format!("# Notes\n\n{BEGIN_MARK}\nnew\n{END_MARK}\n"));
}

#[test]
fn the_sinks_section_reads_against_baselines_and_the_slowest_drain() {
    use crate::bench::sinks::{SinkFigures, SinksResult};
    let figures = |kind, baseline, drain| SinkFigures {
        kind,
        in_flight: None,
        baseline: Duration::from_secs(baseline),
        alone: Duration::from_secs(baseline * 2),
        drain: Duration::from_secs(drain),
        shares: Vec::new(),
    };
    let report = Report {
        sinks: Some(SinksResult {
            events: 20_000,
            window: 500,
            rounds: 1,
            // 4,000/s.
            handover: Some(Duration::from_secs(5)),
            sinks: vec![
                // 2,000/s against 4,000/s: 50% of baseline, 50% of hand-over: missed.
                figures("rabbitmq", 5, 10),
                // 1,000/s against 1,250/s: 80%, met.
                figures("redis", 16, 20),
                // 4,000/s against 10,000/s: 40% of baseline but 100% of hand-over: met.
                figures("nats", 2, 5),
                SinkFigures {
                    in_flight: Some(8),
                    ..figures("webhook", 10, 10)
                },
            ],
            // 20 s against redis' 20 s: 1.00×, met.
            fanout: Some(Duration::from_secs(20)),
            fanout_ratios: Vec::new(),
            latencies: vec![
                ("kafka", latency(5_000, 0, Some((2_100, 4_000, 9_500, 31_000)))),
                ("webhook", latency(5_000, 3, None)),
            ],
        }),
        ..Report::default()
    };
    let table = report.render();
    for line in [
        "| sinks: hand-over | 4,000 events/s (relay into a sink that only counts) | – | – |",
        "| sinks: rabbitmq baseline | 4,000 confirmed publishes/s (20,000 in windows of 500) | baseline | – |",
        "| sinks: rabbitmq alone | 2,000 events/s = 50.0% of baseline; the drain reaches 100.0% of it (the sink publishing batches of 500 one after another, without the database) | – | – |",
        "| sinks: rabbitmq drain | 2,000 events/s = 50.0% of baseline, 50.0% of hand-over | ≥ 75% of baseline or the database's hand-over rate | **no** |",
        "| sinks: redis drain | 1,000 events/s = 80.0% of baseline, 25.0% of hand-over | ≥ 75% of baseline or the database's hand-over rate | yes |",
        "| sinks: nats drain | 4,000 events/s = 40.0% of baseline, 100.0% of hand-over | ≥ 75% of baseline or the database's hand-over rate | yes |",
        "| sinks: webhook baseline | 2,000 confirmed publishes/s (20,000 in 8 requests in flight) | baseline | – |",
        "| sinks: fan-out (3 destinations) | 1,000 events/s to each; 1.00× the time of the slowest single drain (redis, 1,000 events/s) | ≤ 1× the slowest single drain | yes |",
        "| sinks: kafka latency | p50 2.10 ms, p90 4.00 ms, p99 9.50 ms, max 31.00 ms (commit to the destination's confirmation; 5,000 of 5,000 at 500/s, 0 missing) | all delivered | yes |",
        "| sinks: webhook latency | no event confirmed (commit to the destination's confirmation; 4,997 of 5,000 at 500/s, 3 missing) | all delivered | **no** |",
    ] {
        assert!(table.contains(line), "missing {line:?} in\n{table}");
    }
}

/// A latency run of `sent` events over 10 s; percentiles in microseconds.
fn latency(sent: u64, missing: u64, p: Option<(u64, u64, u64, u64)>) -> crate::bench::latency::LatencyResult {
    crate::bench::latency::LatencyResult {
        rate: 500,
        sent,
        sending: Duration::from_secs(10),
        missing,
        latency: p.map(|(p50, p90, p99, max)| Percentiles {
            count: sent - missing,
            p50,
            p90,
            p99,
            max,
        }),
    }
}

#[test]
fn sink_rounds_are_read_by_their_medians_with_their_spread() {
    use crate::bench::sinks::{Round, SinkRound, summarise};
    let s = Duration::from_secs;
    // 20,000 events: rabbitmq's baseline takes 5 s (4,000/s) in every round;
    // its drain 10, 5 and 8 s: shares 50%, 100%, 62.5%, median drain 8 s.
    // redis drains in 4, 3 and 2 s; the fan-out takes 12, 6 and 8 s.
    // The sinks alone take 4, 4 and 6 s (rabbitmq), 1 s (redis).
    let sink = |kind, baseline, alone, drain| SinkRound {
        kind,
        in_flight: None,
        baseline: s(baseline),
        alone: s(alone),
        drain: s(drain),
    };
    let round = |rabbit_alone, rabbit_drain, redis_drain, fanout| Round {
        handover: s(4),
        sinks: vec![
            sink("rabbitmq", 5, rabbit_alone, rabbit_drain),
            sink("redis", 1, 1, redis_drain),
        ],
        fanout: s(fanout),
    };
    let result = summarise(
        20_000,
        500,
        vec![round(4, 10, 4, 12), round(6, 5, 3, 6), round(4, 8, 2, 8)],
    );
    assert_eq!(result.rounds, 3);
    assert_eq!(result.handover, Some(s(4)));
    assert_eq!(result.sinks[0].drain, s(8));
    assert_eq!(result.sinks[0].alone, s(4));
    assert_eq!(result.sinks[1].alone, s(1));
    assert_eq!(result.sinks[0].shares, vec![0.5, 1.0, 0.625]);
    assert_eq!(result.sinks[1].drain, s(3));
    assert_eq!(result.fanout, Some(s(8)));
    // Against rabbitmq, the slowest by median, round by round: 1.2, 1.2, 1.0.
    assert_eq!(result.fanout_ratios, vec![1.2, 1.2, 1.0]);
    let table = Report {
        sinks: Some(result),
        ..Report::default()
    }
    .render();
    for line in [
        "| sinks: hand-over | 5,000 events/s (relay into a sink that only counts, median of 3 rounds) | – | – |",
        "| sinks: rabbitmq baseline | 4,000 confirmed publishes/s (20,000 in windows of 500, median of 3 rounds) | baseline | – |",
        "| sinks: rabbitmq alone | 5,000 events/s = 125.0% of baseline; the drain reaches 50.0% of it (the sink publishing batches of 500 one after another, without the database) | – | – |",
        "| sinks: rabbitmq drain | 2,500 events/s = 62.5% of baseline (rounds 50.0%–100.0%), 50.0% of hand-over | ≥ 75% of baseline or the database's hand-over rate | **no** |",
        "| sinks: fan-out (3 destinations) | 2,500 events/s to each; 1.00× the time of the slowest single drain (rabbitmq, 2,500 events/s) (rounds 1.00–1.20×) | ≤ 1× the slowest single drain | yes |",
    ] {
        assert!(table.contains(line), "missing {line:?} in\n{table}");
    }
}

#[test]
fn an_even_number_of_rounds_takes_the_mean_of_the_middle_two() {
    use crate::bench::median;
    let ms = Duration::from_millis;
    assert_eq!(median(vec![ms(40), ms(10), ms(30), ms(20)]), Some(ms(25)));
    assert_eq!(median(vec![ms(7)]), Some(ms(7)));
    assert_eq!(median(Vec::new()), None);
}

#[test]
fn drain_rounds_report_the_middle_round_and_the_spread_of_shares() {
    use crate::bench::middle;
    let broker = |secs| BrokerResult {
        events: 100_000,
        window: 500,
        elapsed: Duration::from_secs(secs),
    };
    // Rounds of 100,000 events: broker 10 s with drain 12 s (83.3%), broker
    // 8 s with drain 20 s (40%), broker 12 s with drain 10 s (120%).
    let brokers = vec![broker(10), broker(8), broker(12)];
    let drains = vec![drain(100_000, 12), drain(100_000, 20), drain(100_000, 10)];
    let shares: Vec<f64> = brokers.iter().zip(&drains).map(|(b, d)| d.rate() / b.rate()).collect();
    let report = Report {
        broker: middle(brokers, |b| b.elapsed),
        drain: middle(drains, |d| d.drain),
        drain_shares: shares,
        ..Report::default()
    };
    assert_eq!(report.broker.as_ref().map(|b| b.elapsed), Some(Duration::from_secs(10)));
    assert_eq!(report.drain.as_ref().map(|d| d.drain), Some(Duration::from_secs(12)));
    let text = report.render();
    for line in [
        "| broker | 10,000 confirmed publishes/s (100,000 in windows of 500; middle of 3 rounds) | baseline | – |",
        "| drain | 8,333 events/s = 83.3% of broker (middle of 3 rounds; rounds 40.0%–120.0%) | ≥ 75% of broker | yes |",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert_eq!(middle(Vec::<BrokerResult>::new(), |b| b.elapsed), None);
}

#[test]
fn the_drain_is_also_read_against_the_broker_with_ferrys_messages() {
    let broker = |secs| BrokerResult {
        events: 100_000,
        window: 500,
        elapsed: Duration::from_secs(secs),
    };
    // Plain 10,000/s; with a timestamp, and with the sink's headers, 8,333/s
    // each; the drain 7,000/s misses 75% of the plain rate and reads 84% of
    // the formatted one, and the target stays on the plain rate.
    let report = Report {
        broker: Some(broker(10)),
        broker_stamped: Some(broker(12)),
        broker_ferry_format: Some(broker(12)),
        format_shares: vec![0.80, 0.875, 0.95],
        drain_shares: vec![0.65, 0.70, 0.75],
        drain: Some(drain(70_000, 10)),
        ..Report::default()
    };
    let text = report.render();
    for line in [
        "| broker: one property more | 8,333 confirmed publishes/s = 83.3% of broker (the plain publishes with a \
         timestamp property: 65 bytes of encoded properties against 57; middle of 3 rounds) | – | – |",
        "| broker: Ferry's messages | 8,333 confirmed publishes/s = 83.3% of broker (the same publishes with the \
         properties and CloudEvents headers the RabbitMQ sink sends, spread by key over its 2 channels; middle of 3 \
         rounds) | – | – |",
        "| drain | 7,000 events/s = 70.0% of broker (middle of 3 rounds; rounds 65.0%–75.0%); 84.0% of broker \
         with Ferry's messages (rounds 80.0%–95.0%) | ≥ 75% of broker | **no** |",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let plain = Report {
        broker: Some(broker(10)),
        drain: Some(drain(70_000, 10)),
        ..Report::default()
    };
    let text = plain.render();
    assert!(
        !text.contains("Ferry's messages") && !text.contains("one property more"),
        "no second or third baseline, no rows"
    );
}
