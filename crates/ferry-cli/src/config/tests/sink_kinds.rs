//! The sink kinds beyond RabbitMQ and stdout: defaults, every field, each
//! invalid field, fields of another kind, and the README's examples.

use super::*;

/// One sink of each newer kind with nothing but its kind; Kafka's default
/// publish_timeout (30s) needs a lease above the default 30s.
pub(super) const ALL_KINDS_BARE: &str = r#"
[relay]
lease = "31s"
[sinks.kafka]
kind = "kafka"
[sinks.nats]
kind = "nats"
[sinks.redis]
kind = "redis"
[sinks.hooks]
kind = "webhook"
[sinks.archive]
kind = "file"
"#;

const WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[test]
fn every_sink_kind_parses_with_its_defaults() {
    let c = from_toml_str(&format!("{MINIMAL}{ALL_KINDS_BARE}")).unwrap();
    assert_eq!(
        c.sinks["kafka"],
        SinkSpec::Kafka(KafkaSpec {
            bootstrap_servers: "127.0.0.1:9092".into(),
            publish_timeout: Duration::from_secs(10),
            max_message_bytes: 1_000_000,
            source: "ferry".into(),
            extra: BTreeMap::new(),
        })
    );
    assert_eq!(
        c.sinks["nats"],
        SinkSpec::Nats(NatsSpec {
            url: "nats://127.0.0.1:4222".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 1024 * 1024,
            source: "ferry".into(),
        })
    );
    assert_eq!(
        c.sinks["redis"],
        SinkSpec::Redis(RedisSpec {
            url: "redis://127.0.0.1:6379".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 16 * 1024 * 1024,
            maxlen_default: None,
            maxlen_per_route: BTreeMap::new(),
            source: "ferry".into(),
            wait_replicas: 0,
        })
    );
    assert_eq!(
        c.sinks["hooks"],
        SinkSpec::Webhook(WebhookSpec {
            secrets: Vec::new(),
            timeout: Duration::from_secs(10),
            concurrency: 8,
            max_body_bytes: 1024 * 1024,
            source: "ferry".into(),
            headers: BTreeMap::new(),
            error_response_bytes: 256,
        })
    );
    assert_eq!(
        c.sinks["archive"],
        SinkSpec::File(FileSpec {
            max_file_bytes: 100 * 1024 * 1024
        })
    );
}

/// The config's defaults are the sink options' own.
#[test]
#[cfg(all(
    feature = "kafka",
    feature = "nats",
    feature = "redis",
    feature = "webhook",
    feature = "file"
))]
fn config_defaults_are_the_sink_options_defaults() {
    let c = from_toml_str(&format!("{MINIMAL}{ALL_KINDS_BARE}")).unwrap();
    let SinkSpec::Kafka(k) = &c.sinks["kafka"] else {
        panic!()
    };
    assert_eq!(k.options(), ferry_sink::kafka::KafkaOptions::default());
    let SinkSpec::Nats(n) = &c.sinks["nats"] else { panic!() };
    assert_eq!(n.options(), ferry_sink::nats::NatsOptions::default());
    let SinkSpec::Redis(r) = &c.sinks["redis"] else {
        panic!()
    };
    assert_eq!(r.options(), ferry_sink::redis::RedisOptions::default());
    let SinkSpec::Webhook(w) = &c.sinks["hooks"] else {
        panic!()
    };
    assert_eq!(w.options(), ferry_sink::webhook::WebhookOptions::default());
    let SinkSpec::File(f) = &c.sinks["archive"] else {
        panic!()
    };
    assert_eq!(f.options(), ferry_sink::file::FileOptions::default());
}

#[test]
fn every_sink_kind_parses_with_every_field() {
    let c = from_toml_str(&format!(
        r#"{MINIMAL}
[relay]
lease = "1m"
[sinks.k]
kind = "kafka"
bootstrap_servers = "k1:9092,k2:9092"
publish_timeout = "45s"
max_message_bytes = 2000
source = "billing"
[sinks.k.extra]
"compression.type" = "lz4"
[sinks.n]
kind = "nats"
url = "nats://u:p@n:4222"
publish_timeout = "3s"
reconnect_max_delay = "4s"
max_message_bytes = 5000
source = "n-src"
[sinks.r]
kind = "redis"
url = "redis://:pw@r:6380/2"
publish_timeout = "6s"
reconnect_max_delay = "7s"
max_message_bytes = 8000
source = "r-src"
maxlen = 900
wait_replicas = 1
[sinks.r.maxlen_per_route]
audit = 0
orders = 50
[sinks.w]
kind = "webhook"
secrets = ["{WEBHOOK_SECRET}"]
timeout = "2s"
concurrency = 3
max_body_bytes = 4096
source = "w-src"
error_response_bytes = 0
[sinks.w.headers]
Authorization = "Bearer t"
[sinks.f]
kind = "file"
max_file_bytes = 3000000
[[routes]]
name = "orders"
match = "order.*"
sink = "r"
destination = "s:orders"
[[routes]]
name = "audit"
match = "**"
sink = "r"
destination = "s:audit"
"#
    ))
    .unwrap();
    assert_eq!(
        c.sinks["k"],
        SinkSpec::Kafka(KafkaSpec {
            bootstrap_servers: "k1:9092,k2:9092".into(),
            publish_timeout: Duration::from_secs(45),
            max_message_bytes: 2000,
            source: "billing".into(),
            extra: [("compression.type".to_owned(), "lz4".to_owned())].into(),
        })
    );
    assert_eq!(
        c.sinks["n"],
        SinkSpec::Nats(NatsSpec {
            url: "nats://u:p@n:4222".into(),
            publish_timeout: Duration::from_secs(3),
            reconnect_max_delay: Duration::from_secs(4),
            max_message_bytes: 5000,
            source: "n-src".into(),
        })
    );
    assert_eq!(
        c.sinks["r"],
        SinkSpec::Redis(RedisSpec {
            url: "redis://:pw@r:6380/2".into(),
            publish_timeout: Duration::from_secs(6),
            reconnect_max_delay: Duration::from_secs(7),
            max_message_bytes: 8000,
            maxlen_default: Some(900),
            maxlen_per_route: [("audit".to_owned(), 0), ("orders".to_owned(), 50)].into(),
            source: "r-src".into(),
            wait_replicas: 1,
        })
    );
    assert_eq!(
        c.sinks["w"],
        SinkSpec::Webhook(WebhookSpec {
            secrets: vec![WEBHOOK_SECRET.into()],
            timeout: Duration::from_secs(2),
            concurrency: 3,
            max_body_bytes: 4096,
            source: "w-src".into(),
            headers: [("Authorization".to_owned(), "Bearer t".to_owned())].into(),
            error_response_bytes: 0,
        })
    );
    assert_eq!(
        c.sinks["f"],
        SinkSpec::File(FileSpec {
            max_file_bytes: 3_000_000
        })
    );
}

#[test]
#[cfg(feature = "rabbitmq")]
fn rabbitmq_config_defaults_are_the_sink_options_defaults() {
    let c = from_toml_str(&format!(
        "{MINIMAL}[sinks.rabbit]\nkind = \"rabbitmq\"\nurl = \"amqp://h\"\n"
    ))
    .unwrap();
    let SinkSpec::RabbitMq {
        publish_timeout,
        max_message_bytes,
        channels,
        ..
    } = &c.sinks["rabbit"]
    else {
        panic!()
    };
    let defaults = ferry_sink::rabbitmq::RabbitMqOptions::default();
    assert_eq!(
        (*publish_timeout, *max_message_bytes, *channels),
        (defaults.publish_timeout, defaults.max_message_bytes, defaults.channels)
    );
}

#[test]
fn invalid_fields_of_the_new_kinds_are_named() {
    let cases: [(&str, &str); 22] = [
        (
            "kind = \"rabbitmq\"\nurl = \"amqp://h\"\nchannels = 0",
            "sinks.s.channels: must be between 1 and 64, got 0",
        ),
        (
            "kind = \"rabbitmq\"\nurl = \"amqp://h\"\nchannels = 65",
            "sinks.s.channels: must be between 1 and 64, got 65",
        ),
        (
            "kind = \"kafka\"\npublish_timeout = \"0s\"",
            "sinks.s.publish_timeout: 0s is too short",
        ),
        (
            "kind = \"kafka\"\nmax_message_bytes = 0",
            "sinks.s.max_message_bytes: must be at least 1, got 0",
        ),
        (
            "kind = \"kafka\"\nbootstrap_servers = \" \"",
            "sinks.s.bootstrap_servers: must not be empty",
        ),
        ("kind = \"kafka\"\nsource = \"\"", "sinks.s.source: must not be empty"),
        (
            "kind = \"nats\"\nreconnect_max_delay = \"soon\"",
            "sinks.s.reconnect_max_delay: ",
        ),
        (
            "kind = \"nats\"\nmax_message_bytes = -1",
            "sinks.s.max_message_bytes: must be at least 1, got -1",
        ),
        (
            "kind = \"redis\"\nmaxlen = 0",
            "sinks.s.maxlen: must be at least 1, got 0",
        ),
        (
            "kind = \"redis\"\npublish_timeout = \"0ms\"",
            "sinks.s.publish_timeout: 0s is too short",
        ),
        (
            "kind = \"redis\"\n[sinks.s.maxlen_per_route]\nx = -5",
            "sinks.s.maxlen_per_route.x: must be at least 0",
        ),
        (
            "kind = \"webhook\"\ntimeout = \"0s\"",
            "sinks.s.timeout: 0s is too short",
        ),
        (
            "kind = \"webhook\"\nconcurrency = 0",
            "sinks.s.concurrency: must be between 1 and 1024, got 0",
        ),
        // Past tokio's limit `Semaphore::new` panicked at the first send.
        (
            "kind = \"webhook\"\nconcurrency = 1025",
            "sinks.s.concurrency: must be between 1 and 1024, got 1025",
        ),
        (
            "kind = \"webhook\"\nconcurrency = 9223372036854775807",
            "sinks.s.concurrency: must be between 1 and 1024, got 9223372036854775807",
        ),
        (
            "kind = \"webhook\"\nmax_body_bytes = 0",
            "sinks.s.max_body_bytes: must be at least 1, got 0",
        ),
        (
            "kind = \"webhook\"\nerror_response_bytes = -1",
            "sinks.s.error_response_bytes: must be between 0 and 65536, got -1",
        ),
        (
            "kind = \"webhook\"\nerror_response_bytes = 100000",
            "sinks.s.error_response_bytes: must be between 0 and 65536, got 100000",
        ),
        (
            "kind = \"file\"\nmax_file_bytes = 0",
            "sinks.s.max_file_bytes: must be at least 65536, got 0",
        ),
        // A file too small for most events.
        (
            "kind = \"file\"\nmax_file_bytes = 1",
            "sinks.s.max_file_bytes: must be at least 65536, got 1",
        ),
        (
            "kind = \"file\"\nmax_file_bytes = 65535",
            "sinks.s.max_file_bytes: must be at least 65536, got 65535",
        ),
        (
            "kind = \"file\"\nmax_file_bytes = \"big\"",
            "sinks.s.max_file_bytes: expected",
        ),
    ];
    for (sink, expected) in cases {
        let e = errors_with(&format!("[relay]\nlease = \"1m\"\n[sinks.s]\n{sink}\n"));
        assert!(e.starts_with(expected), "{sink:?}: {e}");
    }
}

/// What only the sink's own validation knows is reported under the field.
#[test]
#[cfg(all(feature = "kafka", feature = "nats", feature = "redis", feature = "webhook"))]
fn the_sinks_own_checks_are_named_by_field() {
    let cases: [(&str, &str); 6] = [
        ("kind = \"nats\"\nurl = \"http://h\"", "sinks.s.url: "),
        ("kind = \"redis\"\nurl = \"http://h\"", "sinks.s.url: not a redis://"),
        (
            "kind = \"kafka\"\n[sinks.s.extra]\nacks = \"1\"",
            "sinks.s.extra.\"acks\": is set by Ferry itself",
        ),
        (
            "kind = \"webhook\"\nsecrets = [\"s3cret\"]",
            "sinks.s.secrets[0]: does not start with \"whsec_\"",
        ),
        (
            "kind = \"webhook\"\nsecrets = [\"whsec_c2hvcnQ=\"]",
            "sinks.s.secrets[0]: decodes to 5 bytes",
        ),
        (
            "kind = \"webhook\"\n[sinks.s.headers]\nwebhook-id = \"x\"",
            "sinks.s.headers.webhook-id: this header is set",
        ),
    ];
    for (sink, expected) in cases {
        let e = errors_with(&format!("[relay]\nlease = \"1m\"\n[sinks.s]\n{sink}\n"));
        assert!(e.starts_with(expected), "{sink:?}: {e}");
        assert!(!e.contains("s3cret"), "a rejected secret is not echoed: {e}");
    }
}

#[test]
fn fields_of_another_kind_name_their_kind() {
    let cases: [(&str, &str); 7] = [
        (
            "kind = \"kafka\"\nchannels = 2",
            "sinks.s.channels: kafka sinks take no channels (it belongs to rabbitmq sinks); remove it",
        ),
        (
            "kind = \"webhook\"\npublish_timeout = \"1s\"",
            "sinks.s.publish_timeout: webhook sinks take no publish_timeout (it belongs to rabbitmq, kafka, nats, \
             redis sinks); remove it; webhook sinks bound a request with timeout",
        ),
        (
            "kind = \"kafka\"\nurl = \"kafka://h\"",
            "sinks.s.url: kafka sinks take no url (it belongs to rabbitmq, nats, redis sinks); remove it",
        ),
        (
            "kind = \"nats\"\nmaxlen = 5",
            "sinks.s.maxlen: nats sinks take no maxlen (it belongs to redis sinks); remove it",
        ),
        (
            "kind = \"redis\"\ntimeout = \"1s\"",
            "sinks.s.timeout: redis sinks take no timeout (it belongs to webhook sinks); remove it; use publish_timeout",
        ),
        (
            "kind = \"file\"\nsource = \"x\"",
            "sinks.s.source: file sinks take no source (it belongs to kafka, nats, redis, webhook sinks); remove it",
        ),
        (
            "kind = \"rabbitmq\"\nurl = \"amqp://h\"\nmax_file_bytes = 5",
            "sinks.s.max_file_bytes: rabbitmq sinks take no max_file_bytes (it belongs to file sinks); remove it",
        ),
    ];
    for (sink, expected) in cases {
        assert_eq!(
            errors_with(&format!("[relay]\nlease = \"1m\"\n[sinks.s]\n{sink}\n")),
            expected
        );
    }
}

#[test]
fn maxlen_per_route_must_name_routes_of_its_sink() {
    let sinks = "[sinks.r]\nkind = \"redis\"\n[sinks.o]\nkind = \"stdout\"\n\
                 [[routes]]\nname = \"orders\"\nmatch = \"**\"\nsink = \"r\"\ndestination = \"s\"\n\
                 [[routes]]\nname = \"printed\"\nmatch = \"**\"\nsink = \"o\"\ndestination = \"d\"\n";
    let e = errors_with(&format!("{sinks}[sinks.r.maxlen_per_route]\nordres = 5\n"));
    assert_eq!(
        e,
        "sinks.r.maxlen_per_route.ordres: no route is named \"ordres\"; use the name of one of its routes: orders"
    );
    let e = errors_with(&format!("{sinks}[sinks.r.maxlen_per_route]\nprinted = 5\n"));
    assert_eq!(
        e,
        "sinks.r.maxlen_per_route.printed: route \"printed\" sends to sink \"o\", not to this one; \
         use the name of one of its routes: orders"
    );
    let e = errors_with("[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\nx = 1\n");
    assert!(
        e.ends_with("no route sends to sinks.r yet; remove the entry or add a route with sink = \"r\""),
        "{e}"
    );
    // The default name <sink>:<destination> counts too.
    let c = from_toml_str(&format!(
        "{MINIMAL}[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\n\"r:s\" = 7\n\
         [[routes]]\nmatch = \"**\"\nsink = \"r\"\ndestination = \"s\"\n"
    ))
    .unwrap();
    assert!(matches!(&c.sinks["r"], SinkSpec::Redis(r) if r.maxlen_per_route["r:s"] == 7));
}

#[test]
fn lease_must_outlast_every_kinds_timeout() {
    let e = errors_with("[relay]\nlease = \"10s\"\n[sinks.k]\nkind = \"kafka\"\n");
    assert!(
        e.starts_with("relay.lease: 10s is not longer than sinks.k.publish_timeout (10s)"),
        "{e}"
    );
    let e = errors_with("[relay]\nlease = \"5s\"\n[sinks.w]\nkind = \"webhook\"\ntimeout = \"5s\"\n");
    assert!(
        e.starts_with("relay.lease: 5s is not longer than sinks.w.timeout (5s)"),
        "{e}"
    );
    for kind in ["nats", "redis"] {
        let e = errors_with(&format!("[relay]\nlease = \"10s\"\n[sinks.s]\nkind = \"{kind}\"\n"));
        assert!(
            e.starts_with("relay.lease: 10s is not longer than sinks.s.publish_timeout"),
            "{e}"
        );
    }
    // File and stdout sinks have no bound to outlast.
    from_toml_str(&format!(
        "{MINIMAL}[relay]\nlease = \"2s\"\n[sinks.f]\nkind = \"file\"\n"
    ))
    .unwrap();
}

#[test]
fn debug_output_hides_the_new_kinds_secrets() {
    let c = from_toml_str(&format!(
        r#"{MINIMAL}
[relay]
lease = "1m"
[sinks.n]
kind = "nats"
url = "nats://T0KEN@n:4222"
[sinks.n2]
kind = "nats"
url = "nats://u:np4ss@n:4222"
[sinks.r]
kind = "redis"
url = "redis://:rp4ss@r:6379"
[sinks.w]
kind = "webhook"
secrets = ["{WEBHOOK_SECRET}"]
[sinks.w.headers]
Authorization = "Bearer h3ader"
[sinks.k]
kind = "kafka"
[sinks.k.extra]
"sasl.password" = "kp4ss"
"linger.ms" = "5"
"#
    ))
    .unwrap();
    let debug = format!("{c:?}");
    for secret in ["T0KEN", "np4ss", "rp4ss", &WEBHOOK_SECRET[6..], "h3ader", "kp4ss"] {
        assert!(!debug.contains(secret), "{secret} in {debug}");
    }
    for shown in [
        "nats://***@n:4222",
        "nats://u:***@n:4222",
        "redis://:***@r:6379",
        "Authorization",
        "linger.ms",
    ] {
        assert!(debug.contains(shown), "{shown} missing from {debug}");
    }
}

/// Every TOML block of the README is a working configuration (with a
/// database added where the block leaves it out), so the docs cannot drift.
#[test]
#[cfg(all(
    feature = "kafka",
    feature = "nats",
    feature = "redis",
    feature = "webhook",
    feature = "file"
))]
fn the_readme_toml_examples_parse() {
    let readme = include_str!("../../../../../README.md");
    let blocks: Vec<&str> = readme
        .split("```toml\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap())
        .collect();
    assert!(blocks.len() >= 7, "{} blocks", blocks.len());
    for block in blocks {
        let text = if block.contains("[database]") {
            block.to_owned()
        } else {
            format!("{MINIMAL}{block}")
        };
        if let Err(e) = from_toml_str(&text) {
            panic!("{e}\nin:\n{block}");
        }
    }
}
