use super::raw::field_path;
use super::*;

const EXAMPLE: &str = include_str!("../../ferry.example.toml");
const MINIMAL: &str = "[database]\nurl = \"postgres://root@127.0.0.1:5432/test\"\n";

fn errors(toml: &str) -> String {
    from_toml_str(toml).expect_err("config should be rejected").to_string()
}

/// `MINIMAL` plus `extra`, so each error test shows only what it breaks.
fn errors_with(extra: &str) -> String {
    errors(&format!("{MINIMAL}{extra}"))
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn the_example_file_parses_to_its_documented_values() {
    let c = from_toml_str(EXAMPLE).unwrap();
    assert_eq!(c.database.url, "postgres://root@127.0.0.1:5432/test");
    assert_eq!(c.database.max_connections, 10);
    // Unset, so that relays sharing the file do not share an id: each run
    // draws its own.
    assert_ne!(c.relay.id, from_toml_str(EXAMPLE).unwrap().relay.id);
    assert_eq!(
        c.relay,
        RelaySettings {
            id: c.relay.id.clone(),
            batch_size: 500,
            lease: Duration::from_secs(30),
            max_attempts: 12,
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            poll_interval: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(10),
            mode: RelayMode::Poll,
            wal_slot: "ferry".into(),
            wal_publication: "ferry".into(),
            wal_lag_budget: 1 << 30,
            wal_read_ahead: 64 << 20,
            wal_publish_timeout: Duration::from_secs(20),
            direct_publish_timeout: Duration::from_secs(30),
        }
    );
    assert_eq!(c.metrics, Some("127.0.0.1:9464".parse().unwrap()));
    assert_eq!(
        c.log,
        LogConfig {
            format: LogFormat::Text,
            level: "info".into()
        }
    );
    assert_eq!(
        c.sinks["rabbit"],
        SinkSpec::RabbitMq {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            publish_timeout: Duration::from_secs(10),
            max_message_bytes: 16_777_216,
            management_url: Some("http://guest:guest@127.0.0.1:15672".into()),
            channels: 2,
        }
    );
    assert_eq!(c.sinks["out"], SinkSpec::Stdout);
    assert_eq!(
        c.sinks["kafka"],
        SinkSpec::Kafka(KafkaSpec {
            bootstrap_servers: "127.0.0.1:9092".into(),
            publish_timeout: Duration::from_secs(10),
            max_message_bytes: 1_000_000,
            source: "ferry".into(),
            extra: [("linger.ms".to_owned(), "5".to_owned())].into(),
        })
    );
    assert_eq!(
        c.sinks["redis"],
        SinkSpec::Redis(RedisSpec {
            url: "redis://127.0.0.1:6379".into(),
            publish_timeout: Duration::from_secs(10),
            reconnect_max_delay: Duration::from_secs(30),
            max_message_bytes: 16_777_216,
            maxlen_default: Some(1_000_000),
            maxlen_per_route: [("order-stream".to_owned(), 100_000)].into(),
            source: "ferry".into(),
            wait_replicas: 0,
        })
    );
    assert_eq!(
        c.sinks["archive"],
        SinkSpec::File(FileSpec {
            max_file_bytes: 104_857_600
        })
    );
    assert!(matches!(&c.sinks["nats"], SinkSpec::Nats(_)));
    assert!(matches!(&c.sinks["hooks"], SinkSpec::Webhook(w) if w.secrets.len() == 1 && w.headers.len() == 1));
    assert_eq!(c.sinks.len(), 7);
    let names: Vec<&str> = c.routes[2..].iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "kafka:events.{domain}",
            "nats:events.{domain}.{type}",
            "order-stream",
            "hooks:https://billing.example.com/hooks/{domain}",
            "archive:/var/lib/ferry/events-{domain}.jsonl"
        ]
    );
    assert_eq!(
        c.routes[..2],
        vec![
            Route {
                name: "orders".into(),
                matcher: Glob::new("order.*").unwrap(),
                sink: "rabbit".into(),
                destination: "orders".into(),
                routing_key: Some("{type}".into()),
            },
            Route {
                name: "out:all-events".into(),
                matcher: Glob::new("**").unwrap(),
                sink: "out".into(),
                destination: "all-events".into(),
                routing_key: None,
            },
        ]
    );
}

#[test]
fn the_example_file_states_the_real_defaults() {
    // Every default the example writes out must be what omitting it gives.
    let defaults = from_toml_str(&format!(
        "{MINIMAL}[sinks.rabbit]\nkind = \"rabbitmq\"\nurl = \"amqp://127.0.0.1\"\n"
    ))
    .unwrap();
    let example = from_toml_str(EXAMPLE).unwrap();
    assert_eq!(defaults.database.max_connections, example.database.max_connections);
    assert_eq!(
        RelaySettings {
            id: example.relay.id.clone(),
            ..defaults.relay.clone()
        },
        example.relay
    );
    assert_eq!(defaults.log, example.log);
    assert_eq!(
        RetentionConfig {
            archive_dir: defaults.retention.archive_dir.clone(),
            ..example.retention.clone()
        },
        defaults.retention
    );
    assert_eq!(
        example.retention.archive_dir.as_deref(),
        Some(std::path::Path::new("/var/lib/ferry/archive"))
    );
    assert_eq!(example.alerts.max_dead, Some(0));
    let timeouts = |c: &Config| match &c.sinks["rabbit"] {
        SinkSpec::RabbitMq {
            publish_timeout,
            max_message_bytes,
            ..
        } => (*publish_timeout, *max_message_bytes),
        other => panic!("{other:?}"),
    };
    assert_eq!(timeouts(&defaults), timeouts(&example));
    // The other kinds: everything the example writes out but what it marks
    // as not the default (Kafka's publish_timeout, the optional tables).
    let defaults = from_toml_str(&format!("{MINIMAL}{}", sink_kinds::ALL_KINDS_BARE)).unwrap();
    let mut example_sinks = example.sinks.clone();
    for (_, sink) in example_sinks.iter_mut() {
        match sink {
            SinkSpec::Kafka(k) => {
                k.publish_timeout = Duration::from_secs(10);
                k.extra.clear();
            }
            SinkSpec::Redis(r) => {
                r.maxlen_default = None;
                r.maxlen_per_route.clear();
            }
            SinkSpec::Webhook(w) => {
                w.secrets.clear();
                w.headers.clear();
            }
            _ => {}
        }
    }
    for name in ["kafka", "nats", "redis", "hooks", "archive"] {
        assert_eq!(defaults.sinks[name], example_sinks[name], "sinks.{name}");
    }
    assert_eq!(defaults.metrics, None);
    assert_eq!(defaults.tracing, None);
    let tracing_defaults = from_toml_str(&format!(
        "{MINIMAL}[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"
    ))
    .unwrap();
    assert_eq!(tracing_defaults.tracing, example.tracing);
    // A config without routes loads: migrate, status, check and the admin
    // verbs need none. Only `ferry run` refuses it.
    assert!(defaults.routes.is_empty());
}

#[test]
fn tracing_is_off_unless_an_endpoint_is_set() {
    let example = from_toml_str(EXAMPLE).unwrap();
    assert_eq!(
        example.tracing,
        Some(TracingConfig {
            traces_url: "http://127.0.0.1:4318/v1/traces".into(),
            service_name: "ferry".into(),
            sample_ratio: 1.0,
        })
    );
    assert_eq!(from_toml_str(MINIMAL).unwrap().tracing, None);
    let full = from_toml_str(&format!(
        "{MINIMAL}[tracing]\notlp_endpoint = \"http://otel:4318/v1/traces/\"\nservice_name = \"relay-eu\"\nsample_ratio = 0.25\n"
    ))
    .unwrap();
    assert_eq!(
        full.tracing,
        Some(TracingConfig {
            traces_url: "http://otel:4318/v1/traces".into(),
            service_name: "relay-eu".into(),
            sample_ratio: 0.25,
        })
    );
}

#[test]
fn tracing_problems_name_the_field() {
    let e = errors_with("[tracing]\nservice_name = \"relay\"\n");
    assert!(e.starts_with("tracing.otlp_endpoint: is missing"), "{e}");
    let e = errors_with("[tracing]\notlp_endpoint = \"127.0.0.1:4318\"\n");
    assert!(
        e.starts_with("tracing.otlp_endpoint: \"127.0.0.1:4318\" is not an http:// URL"),
        "{e}"
    );
    let e = errors_with("[tracing]\notlp_endpoint = \"https://otel.example.com\"\n");
    assert!(e.contains("uses https"), "{e}");
    let e = errors_with("[tracing]\notlp_endpoint = \"http://otel:4318\"\nsample_ratio = 1.5\n");
    assert!(
        e.starts_with("tracing.sample_ratio: must be between 0.0 and 1.0"),
        "{e}"
    );
    let e = errors_with("[tracing]\notlp_endpoint = \"http://otel:4318\"\nservice_name = \" \"\n");
    assert!(e.starts_with("tracing.service_name: must be non-empty"), "{e}");
    let e = errors_with("[tracing]\nendpoint = \"http://otel:4318\"\n");
    assert!(e.contains("endpoint"), "{e}");
    // A collector address may carry credentials: the error hides them.
    let e = errors_with("[tracing]\notlp_endpoint = \"https://u:otel-pw@otel.example.com?api_key=k-123\"\n");
    assert!(
        e.contains("uses https") && !e.contains("otel-pw") && !e.contains("k-123"),
        "{e}"
    );
}

#[test]
fn debug_output_hides_the_collectors_credentials() {
    let c = from_toml_str(&format!(
        "{MINIMAL}[tracing]\notlp_endpoint = \"http://u:otel-pw@otel:4318?api_key=k-123\"\n"
    ))
    .unwrap();
    let debug = format!("{:?}", c.tracing.unwrap());
    assert!(!debug.contains("otel-pw") && !debug.contains("k-123"), "{debug}");
    assert!(debug.contains("otel:4318"), "{debug}");
}

#[test]
fn tracing_from_the_environment() {
    let c = load_with_env(
        None,
        env(&[
            ("FERRY_DATABASE__URL", "postgres://h/db"),
            ("FERRY_TRACING__OTLP_ENDPOINT", "http://collector:4318"),
            ("FERRY_TRACING__SAMPLE_RATIO", "0.5"),
        ]),
    )
    .unwrap();
    let t = c.tracing.unwrap();
    assert_eq!(t.traces_url, "http://collector:4318/v1/traces");
    assert_eq!(t.sample_ratio, 0.5);
}

#[test]
fn default_relay_id_is_host_pid_and_random_hex() {
    let c = from_toml_str(MINIMAL).unwrap();
    let pid = format!("-{}-", std::process::id());
    let (host, hex) = c.relay.id.split_once(&pid).expect(&c.relay.id);
    assert!(!host.is_empty());
    assert!(
        hex.len() == 4 && hex.chars().all(|c| c.is_ascii_hexdigit()),
        "{}",
        c.relay.id
    );
}

#[test]
fn retry_policy_comes_from_relay_settings() {
    let c = from_toml_str(&format!(
        "{MINIMAL}[relay]\nmax_attempts = 3\nbackoff_base = \"1s\"\nbackoff_max = \"1m\"\n"
    ))
    .unwrap();
    let p = c.retry_policy();
    assert_eq!(
        (p.max_attempts, p.base_delay, p.max_delay, p.jitter),
        (3, Duration::from_secs(1), Duration::from_secs(60), 0.2)
    );
}

#[test]
fn unknown_sink_in_a_route() {
    let e = errors(EXAMPLE.replace("sink = \"rabbit\"", "sink = \"rabit\"").as_str());
    assert_eq!(
        e,
        "routes[0].sink: no sink named \"rabit\"; define [sinks.rabit] or use one of: archive, hooks, kafka, nats, \
         out, rabbit, redis"
    );
}

#[test]
fn a_sink_with_its_own_problem_is_not_also_unknown() {
    let e = errors_with("[sinks.k]\nkind = \"kafca\"\n[[routes]]\nmatch = \"**\"\nsink = \"k\"\ndestination = \"d\"\n");
    assert_eq!(
        e,
        "sinks.k.kind: unknown kind \"kafca\"; supported kinds: rabbitmq, kafka, nats, redis, webhook, file, stdout"
    );
}

#[test]
fn bad_durations() {
    let e = errors_with("[relay]\nlease = \"30\"\n");
    assert_eq!(
        e,
        "relay.lease: \"30\" is not a duration; write it like \"30s\", \"500ms\" or \"2m\""
    );
    // A TOML number gets the same message, not a type error.
    let e = errors_with("[relay]\nlease = 30\n");
    assert_eq!(
        e,
        "relay.lease: \"30\" is not a duration; write it like \"30s\", \"500ms\" or \"2m\""
    );
    let e = errors_with("[relay]\nlease = \"1s\"\n");
    assert_eq!(e, "relay.lease: 1s is too short; it must be at least 2s");
    let e = errors_with("[relay]\npoll_interval = \"0s\"\n");
    assert_eq!(e, "relay.poll_interval: 0s is too short; it must be more than 0s");
    let e = errors_with("[relay]\nshutdown_timeout = \"0s\"\n");
    assert_eq!(e, "relay.shutdown_timeout: 0s is too short; it must be at least 1s");
    let e = errors_with("[relay]\nbackoff_base = \"10s\"\nbackoff_max = \"1s\"\n");
    assert_eq!(
        e,
        "relay.backoff_max: 1s is less than relay.backoff_base (10s); raise backoff_max or lower backoff_base"
    );
}

#[test]
fn lease_must_outlast_a_publish() {
    let e = errors_with("[relay]\nlease = \"5s\"\n[sinks.r]\nkind = \"rabbitmq\"\nurl = \"amqp://h\"\n");
    assert!(
        e.starts_with("relay.lease: 5s is not longer than sinks.r.publish_timeout (10s)"),
        "{e}"
    );
}

#[test]
fn bad_glob() {
    let e = errors(&EXAMPLE.replacen("match = \"order.*\"", "match = \"Order.*\"", 1));
    assert!(
        e.starts_with("routes[0].match: \"Order.*\" has an invalid segment \"Order\""),
        "{e}"
    );
    let e = errors_with("[sinks.o]\nkind = \"stdout\"\n[[routes]]\nsink = \"o\"\ndestination = \"d\"\n");
    assert!(e.starts_with("routes[0].match: missing"), "{e}");
}

#[test]
fn duplicate_route_names() {
    let routes = "[sinks.o]\nkind = \"stdout\"\n\
        [[routes]]\nmatch = \"a.*\"\nsink = \"o\"\ndestination = \"d\"\n\
        [[routes]]\nmatch = \"b.*\"\nsink = \"o\"\ndestination = \"d\"\n";
    let e = errors_with(routes);
    assert_eq!(
        e,
        "routes[1].name: the default name (<sink>:<destination>) \"o:d\" is already used by routes[0]; \
         set name = \"...\" to tell them apart"
    );
    let named = routes
        .replace("match = \"a.*\"", "name = \"x\"\nmatch = \"a.*\"")
        .replace("match = \"b.*\"", "name = \"x\"\nmatch = \"b.*\"");
    assert!(errors_with(&named).starts_with("routes[1].name: the name \"x\" is already used by routes[0]"));
    let distinct = named.replacen("name = \"x\"", "name = \"y\"", 1);
    assert_eq!(from_toml_str(&format!("{MINIMAL}{distinct}")).unwrap().routes.len(), 2);
}

#[test]
fn a_route_may_not_take_a_name_ferry_keeps() {
    // `(no route)` holds the dead deliveries of events no route matched: a
    // route by that name would be held back behind them.
    for name in ["(no route)", "(direct)"] {
        let e = errors_with(&format!(
            "[sinks.o]\nkind = \"stdout\"\n[[routes]]\nname = \"{name}\"\nmatch = \"a.*\"\nsink = \"o\"\ndestination = \"d\"\n"
        ));
        assert!(
            e.starts_with(&format!("routes[0].name: \"{name}\" starts with '('")),
            "{e}"
        );
    }
}

#[test]
fn a_destination_with_credentials_needs_a_name_of_its_own() {
    // The name is a metric label, a log field and a column.
    let route = |destination: &str| {
        format!(
            "[sinks.hooks]\nkind = \"webhook\"\n[[routes]]\nmatch = \"a.*\"\nsink = \"hooks\"\n\
             destination = \"{destination}\"\n"
        )
    };
    for destination in [
        "https://hooks.example/in?token=T0K3N",
        "https://ferry:T0K3N@hooks.example/in",
        "https://hooks.example/in?tenant={key}&sig=T0K3N",
    ] {
        let e = errors_with(&route(destination));
        assert!(e.starts_with("routes[0].name: missing; the default name"), "{e}");
        assert!(e.contains("set name = \"...\""), "{e}");
        assert!(!e.contains("T0K3N"), "{e}");
        let named = format!(
            "{MINIMAL}{}",
            route(destination).replace("[[routes]]\n", "[[routes]]\nname = \"in\"\n")
        );
        assert_eq!(from_toml_str(&named).unwrap().routes[0].name, "in");
    }
    // A placeholder in the query is no credential.
    let c = from_toml_str(&format!("{MINIMAL}{}", route("https://hooks.example/in?tenant={key}"))).unwrap();
    assert_eq!(c.routes[0].name, "hooks:https://hooks.example/in?tenant={key}");
}

/// A Slack-style webhook carries its token in the path: the default name
/// would carry it wherever the name goes, so the route needs a name, and
/// the message shows the path's shape but not the token.
#[test]
fn a_destination_with_a_token_in_its_path_needs_a_name_of_its_own() {
    let destination = "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX";
    let route = format!(
        "[sinks.hooks]\nkind = \"webhook\"\n[[routes]]\nmatch = \"a.*\"\nsink = \"hooks\"\n\
         destination = \"{destination}\"\n"
    );
    let e = errors_with(&route);
    assert!(
        e.starts_with(
            "routes[0].name: missing; the default name <sink>:<destination> would carry the \
             destination's credentials, query or a token in its path \
             (https://hooks.slack.com/services/T00000000/B00000000/***) into metrics"
        ),
        "{e}"
    );
    assert!(e.contains("set name = \"...\""), "{e}");
    assert!(!e.contains("XXXXXXXXXXXXXXXX"), "{e}");
    // Named after the old default name, it keeps its deliveries.
    let old_name = format!("hooks:{destination}");
    let named = format!(
        "{MINIMAL}{}",
        route.replace("[[routes]]\n", &format!("[[routes]]\nname = \"{old_name}\"\n"))
    );
    assert_eq!(from_toml_str(&named).unwrap().routes[0].name, old_name);
    // A path of words and placeholders is no token.
    let plain = "https://hooks.example/notifications-webhook-receiver/{domain}/{type}-{key}-events";
    let c = from_toml_str(&format!("{MINIMAL}{}", route.replace(destination, plain))).unwrap();
    assert_eq!(c.routes[0].name, format!("hooks:{plain}"));
}

/// A routing key on a route to a sink that has none would be read by
/// nothing: refused, naming the route and the sink's kind.
#[test]
fn only_rabbitmq_routes_take_a_routing_key() {
    let e = errors_with(
        "[sinks.bus]\nkind = \"nats\"\n\n[[routes]]\nmatch = \"order.*\"\nsink = \"bus\"\n\
         destination = \"orders\"\nrouting_key = \"orders.{type}\"\n",
    );
    assert!(
        e.starts_with("routes[0].routing_key: sink \"bus\" is a nats sink, which takes no routing key"),
        "{e}"
    );
    assert!(e.contains("put what it should select in destination"), "{e}");
    // The example's RabbitMQ route keeps its own.
    assert_eq!(
        from_toml_str(EXAMPLE).unwrap().routes[0].routing_key.as_deref(),
        Some("{type}")
    );
}

#[test]
fn bad_template_placeholders() {
    let e = errors(&EXAMPLE.replace("routing_key = \"{type}\"", "routing_key = \"{tpye}.{key}\""));
    assert_eq!(
        e,
        "routes[0].routing_key: unknown placeholder {tpye}; use {type}, {domain}, {key}, {id}"
    );
    let e = errors(&EXAMPLE.replace("destination = \"orders\"", "destination = \"orders.{type\""));
    assert!(
        e.starts_with("routes[0].destination: \"orders.{type\" has an unclosed {"),
        "{e}"
    );
}

#[test]
fn unknown_fields_are_named() {
    let e = errors_with("[relay]\nleese = \"30s\"\n");
    assert!(
        e.starts_with("relay.leese: unknown field; remove it or use one of: id, batch_size, lease,"),
        "{e}"
    );
    let e = errors_with("[[routes]]\nmatch = \"**\"\nsink = \"o\"\ndestination = \"d\"\nexchange = \"x\"\n");
    assert!(e.starts_with("routes[0].exchange: unknown field"), "{e}");
    let e = errors_with("[databse]\nurl = \"x\"\n");
    assert!(
        e.starts_with("databse: unknown field; remove it or use one of: database, relay,"),
        "{e}"
    );
}

#[test]
fn unknown_and_missing_sink_kind() {
    let e = errors_with("[sinks.k]\nkind = \"kafca\"\n");
    assert_eq!(
        e,
        "sinks.k.kind: unknown kind \"kafca\"; supported kinds: rabbitmq, kafka, nats, redis, webhook, file, stdout"
    );
    let e = errors_with("[sinks.k]\nurl = \"amqp://h\"\n");
    assert_eq!(
        e,
        "sinks.k.kind: missing; set kind to one of: rabbitmq, kafka, nats, redis, webhook, file, stdout"
    );
}

#[test]
fn fields_of_another_sink_kind() {
    let e = errors_with("[sinks.o]\nkind = \"stdout\"\nurl = \"amqp://h\"\n");
    assert_eq!(
        e,
        "sinks.o.url: stdout sinks take no url (it belongs to rabbitmq, nats, redis sinks); remove it"
    );
    let e = errors_with("[sinks.r]\nkind = \"rabbitmq\"\n");
    assert!(e.starts_with("sinks.r.url: missing"), "{e}");
    let e = errors_with("[sinks.r]\nkind = \"rabbitmq\"\nurl = \"http://h\"\n");
    assert!(e.starts_with("sinks.r.url: must start with amqp:// or amqps://"), "{e}");
    let e = errors_with("[sinks.r]\nkind = \"rabbitmq\"\nurl = \"amqp://h\"\nmax_message_bytes = 0\n");
    assert_eq!(e, "sinks.r.max_message_bytes: must be between 1 and 536870912, got 0");
}

#[test]
fn database_url_problems() {
    assert_eq!(
        errors(""),
        "database.url: missing; set it in the config file or FERRY_DATABASE__URL"
    );
    let e = errors("[database]\nurl = \"mysql://u:hunter2@h/db\"\n");
    assert_eq!(
        e,
        "database.url: unsupported database \"mysql\"; use a postgres:// or sqlite:// URL"
    );
    let e = errors("[database]\nurl = \"postgres://u:hunter2@h:notaport/db\"\n");
    assert!(e.starts_with("database.url: not a valid PostgreSQL URL"), "{e}");
    assert!(!e.contains("hunter2"), "the password leaked: {e}");
    assert!(from_toml_str("[database]\nurl = \"postgresql://h/db\"\n").is_ok());
    for sqlite in [
        "sqlite://ferry.db",
        "sqlite:ferry.db",
        "sqlite:///var/lib/ferry/ferry.db?mode=rwc",
    ] {
        let cfg = from_toml_str(&format!("[database]\nurl = \"{sqlite}\"\n"));
        assert!(cfg.is_ok(), "{sqlite}: {:?}", cfg.err().map(|e| e.to_string()));
    }
}

#[test]
fn numbers_out_of_range() {
    assert_eq!(
        errors_with("[relay]\nbatch_size = 0\n"),
        "relay.batch_size: must be between 1 and 10000, got 0"
    );
    assert_eq!(
        errors_with("[relay]\nbatch_size = 10001\n"),
        "relay.batch_size: must be between 1 and 10000, got 10001"
    );
    assert_eq!(
        errors_with("[relay]\nmax_attempts = 0\n"),
        "relay.max_attempts: must be at least 1, got 0"
    );
    assert_eq!(
        errors("[database]\nurl = \"postgres://h/db\"\nmax_connections = -1\n"),
        "database.max_connections: must be at least 1, got -1"
    );
    // Past what the field's type holds: the range, not only "too large".
    assert_eq!(
        errors("[database]\nurl = \"postgres://h/db\"\nmax_connections = 5000000000\n"),
        "database.max_connections: must be at most 4294967295, got 5000000000"
    );
    // Its bytes overflowed (a panic, or a budget of 0 that always failed).
    assert_eq!(
        errors_with("[relay]\nwal_lag_budget_mb = 9223372036854775807\n"),
        "relay.wal_lag_budget_mb: must be between 1 and 1048576, got 9223372036854775807"
    );
}

/// A duration past 100 years overflowed the clock arithmetic it fed: a
/// first failed publish panicked the worker (and routed nothing, for
/// ever), a lease panicked the relay at start, a retention window the
/// purge. Refused, naming the field.
#[test]
fn durations_past_a_hundred_years_are_refused_by_field() {
    for (section, field) in [
        ("relay", "backoff_base"),
        ("relay", "backoff_max"),
        ("relay", "lease"),
        ("retention", "published_window"),
        ("retention", "dead_window"),
    ] {
        let e = errors_with(&format!("[{section}]\n{field} = \"3000000000h\"\n"));
        assert!(
            e.contains(&format!(
                "{section}.{field}: \"3000000000h\" is too long; a duration is at most 876000h"
            )),
            "{field}: {e}"
        );
    }
}

#[test]
fn other_section_problems() {
    let e = errors_with("[metrics]\nlisten = \"localhost:9464\"\n");
    assert!(
        e.starts_with("metrics.listen: \"localhost:9464\" is not an address"),
        "{e}"
    );
    assert!(errors_with("[log]\nformat = \"xml\"\n").starts_with("log.format: unknown format \"xml\""));
    assert!(errors_with("[log]\nlevel = \"verbose\"\n").starts_with("log.level: unknown level \"verbose\""));
    assert!(
        errors_with("[log]\nlevel = \"info,ferry=nope\"\n")
            .starts_with("log.level: \"info,ferry=nope\" is not a valid filter")
    );
    let ok = from_toml_str(&format!(
        "{MINIMAL}[log]\nformat = \"json\"\nlevel = \"info,ferry=debug\"\n"
    ))
    .unwrap();
    assert_eq!(
        ok.log,
        LogConfig {
            format: LogFormat::Json,
            level: "info,ferry=debug".into()
        }
    );
    assert!(errors_with("[relay]\nid = \" \"\n").starts_with("relay.id: must be non-empty"));
}

#[test]
fn alert_thresholds_are_optional_and_checked() {
    assert_eq!(from_toml_str(MINIMAL).unwrap().alerts, AlertsConfig::default());
    let ok = from_toml_str(&format!(
        "{MINIMAL}[alerts]\nmax_pending_age = \"5m\"\nmax_dead = 0\nmax_blocked_keys = 10\n"
    ))
    .unwrap();
    assert_eq!(
        ok.alerts,
        AlertsConfig {
            max_pending_age: Some(Duration::from_secs(300)),
            max_dead: Some(0),
            max_blocked_keys: Some(10),
        }
    );
    let e = errors_with("[alerts]\nmax_pending_age = \"500ms\"\nmax_dead = -1\n");
    assert!(
        e.contains("alerts.max_pending_age: 500ms is too short; it must be at least 1s"),
        "{e}"
    );
    assert!(e.contains("alerts.max_dead: must be at least 0, got -1"), "{e}");
    let e = errors_with("[alerts]\nmax_pending = \"5m\"\n");
    assert!(e.starts_with("alerts.max_pending: unknown field"), "{e}");
}

#[test]
fn all_problems_are_reported_at_once() {
    let e = from_toml_str("[relay]\nbatch_size = 0\nlease = \"soon\"\n").unwrap_err();
    let fields: Vec<&str> = e.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, ["database.url", "relay.batch_size", "relay.lease"]);
    assert!(
        e.to_string()
            .starts_with("3 problems in the configuration:\n  database.url: missing"),
        "{e}"
    );
}

#[test]
fn toml_syntax_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.toml");
    std::fs::write(&path, "[database\nurl = 1\n").unwrap();
    let e = load_with_env(Some(&path), []).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: ", path.display())), "{e}");
    assert!(e.contains("line 1"), "{e}");
}

#[test]
fn a_missing_file_is_named() {
    let path = Path::new("/nonexistent/ferry.toml");
    let e = load_with_env(Some(path), []).unwrap_err().to_string();
    assert!(
        e.starts_with("/nonexistent/ferry.toml: cannot read the config file (")
            && e.ends_with("check the path given with --config or FERRY_CONFIG"),
        "{e}"
    );
}

#[test]
fn environment_overrides_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.toml");
    std::fs::write(&path, EXAMPLE).unwrap();
    let c = load_with_env(
        Some(&path),
        env(&[
            ("FERRY_DATABASE__URL", "postgres://app:12345@db:5432/prod"),
            ("FERRY_DATABASE__MAX_CONNECTIONS", "20"),
            ("ferry_relay__lease", "1m"),
            // Looks like a number, must stay text.
            ("FERRY_RELAY__ID", "12345"),
            ("FERRY_SINKS__RABBIT__URL", "amqps://broker/%2f"),
            // Not config fields, read for something else: no "__" after
            // the prefix, and not refused.
            ("FERRY_CONFIG", "/elsewhere.toml"),
            ("FERRY_TEST_PG_URL", "postgres://x"),
            ("OTHER__THING", "1"),
        ]),
    )
    .unwrap();
    assert_eq!(c.database.url, "postgres://app:12345@db:5432/prod");
    assert_eq!(c.database.max_connections, 20);
    assert_eq!(c.relay.lease, Duration::from_secs(60));
    assert_eq!(c.relay.id, "12345");
    // Fields the environment does not set keep the file's values.
    assert_eq!(c.relay.batch_size, 500);
    assert!(
        matches!(&c.sinks["rabbit"], SinkSpec::RabbitMq { url, publish_timeout, .. }
        if url == "amqps://broker/%2f" && *publish_timeout == Duration::from_secs(10))
    );
    assert_eq!(c.routes.len(), 7);
}

/// A sink named with capitals in the file is reached from the environment,
/// whose names are capitals whatever the file says: read as lowercase, the
/// variable named a second sink (refused for its missing kind) and the
/// file's kept its value. A sink's signing secrets, a list, are set whole,
/// comma-separated; routes are refused with the fix, not with a type error.
#[test]
fn environment_overrides_reach_capitalised_sinks_and_lists() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.toml");
    std::fs::write(
        &path,
        format!(
            "{MINIMAL}[sinks.Rabbit]\nkind = \"rabbitmq\"\nurl = \"amqp://file/%2f\"\n\
             [sinks.hooks]\nkind = \"webhook\"\n\
             [[routes]]\nmatch = \"order.*\"\nsink = \"Rabbit\"\ndestination = \"orders\"\n\
             [[routes]]\nmatch = \"user.*\"\nsink = \"hooks\"\ndestination = \"http://h/in\"\n"
        ),
    )
    .unwrap();
    let (a, b) = (
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "whsec_c2VjcmV0LWtleS1udW1iZXItdHdvISE=",
    );
    let c = load_with_env(
        Some(&path),
        env(&[
            ("FERRY_SINKS__RABBIT__URL", "amqp://env/%2f"),
            ("FERRY_SINKS__HOOKS__SECRETS", &format!("{a}, {b}")),
        ]),
    )
    .unwrap();
    assert_eq!(c.sinks.len(), 2, "{:?}", c.sinks.keys().collect::<Vec<_>>());
    assert!(matches!(&c.sinks["Rabbit"], SinkSpec::RabbitMq { url, .. } if url == "amqp://env/%2f"));
    assert!(matches!(&c.sinks["hooks"], SinkSpec::Webhook(w) if w.secrets == [a, b]));
    for (name, text) in [
        ("FERRY_ROUTES__0__SINK", "routes cannot be set from the environment"),
        ("FERRY_SINKS__HOOKS__SECRETS__0", "a list is set whole"),
    ] {
        let e = load_with_env(Some(&path), env(&[(name, "x")])).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{name}: {text}")), "{e}");
    }
}

#[test]
fn environment_alone_is_enough() {
    let c = load_with_env(None, env(&[("FERRY_DATABASE__URL", "postgres://h/db")])).unwrap();
    assert_eq!(c.database.url, "postgres://h/db");
    let e = load_with_env(None, []).unwrap_err().to_string();
    assert!(e.contains("pass --config FILE or set FERRY_CONFIG"), "{e}");
}

#[test]
fn environment_errors_name_the_variable() {
    let e = load_with_env(
        None,
        env(&[("FERRY_DATABASE__URL", "postgres://h/db"), ("FERRY_RELAY__LEESE", "1s")]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("relay.leese: unknown field (set by FERRY_RELAY__LEESE)"),
        "{e}"
    );
    let e = load_with_env(
        None,
        env(&[
            ("FERRY_DATABASE__URL", "postgres://h/db"),
            ("FERRY_RELAY__BATCH_SIZE", "many"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("relay.batch_size: expected i64, found a string (set by FERRY_RELAY__BATCH_SIZE)"),
        "{e}"
    );
    let e = load_with_env(None, env(&[("FERRY_DATABASE____URL", "x")]))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("FERRY_DATABASE____URL: empty field name"), "{e}");
}

#[test]
fn a_database_parameter_the_driver_would_ignore_and_log_is_refused() {
    // sqlx logs an unknown parameter's value when it connects.
    let e = errors("[database]\nurl = \"postgres://ferry@db/app?pasword=s3cret&sslmode=require\"\n");
    assert!(
        e.starts_with("database.url: query parameter \"pasword\" is not one"),
        "{e}"
    );
    assert!(!e.contains("s3cret"), "{e}");
    for fine in [
        "sslmode=disable&application_name=relay",
        "password=x",
        "options[statement_timeout]=5s",
        "options%5Bsearch_path%5D=app",
        "channel_binding=require&connect_timeout=5&pgbouncer=true",
        "",
    ] {
        let url = format!("postgres://ferry@db/app?{fine}");
        let c = from_toml_str(&format!("[database]\nurl = \"{url}\"\n"));
        assert!(c.is_ok(), "{fine}: {:?}", c.err().map(|e| e.to_string()));
    }
}

#[test]
fn the_direct_publish_bound_leaves_room_for_every_sinks_own_timeout() {
    let hooks = |timeout: &str, bound: Option<&str>| {
        let bound = bound.map_or(String::new(), |b| format!("direct_publish_timeout = \"{b}\"\n"));
        format!(
            "{MINIMAL}[relay]\nlease = \"120s\"\n{bound}[sinks.hooks]\nkind = \"webhook\"\ntimeout = \"{timeout}\"\n\
             [[routes]]\nmatch = \"a.*\"\nsink = \"hooks\"\ndestination = \"http://h.example/in\"\n"
        )
    };
    // Unset, it grows to twice the longest timeout.
    assert_eq!(
        from_toml_str(&hooks("10s", None)).unwrap().relay.direct_publish_timeout,
        Duration::from_secs(30)
    );
    assert_eq!(
        from_toml_str(&hooks("40s", None)).unwrap().relay.direct_publish_timeout,
        Duration::from_secs(80)
    );
    // Set below it, it is refused.
    let e = errors(&hooks("10s", Some("15s")));
    assert!(
        e.starts_with("relay.direct_publish_timeout: 15s is less than twice sinks.hooks.timeout (10s)"),
        "{e}"
    );
    assert!(from_toml_str(&hooks("10s", Some("20s"))).is_ok());
}

#[test]
fn the_wal_publish_bound_leaves_room_for_every_sinks_own_timeout() {
    let hooks = |mode: &str, timeout: &str, bound: Option<&str>| {
        let bound = bound.map_or(String::new(), |b| format!("wal_publish_timeout = \"{b}\"\n"));
        format!(
            "{MINIMAL}[relay]\nmode = \"{mode}\"\nlease = \"120s\"\n{bound}[sinks.hooks]\nkind = \"webhook\"\n\
             timeout = \"{timeout}\"\n[[routes]]\nmatch = \"a.*\"\nsink = \"hooks\"\ndestination = \"http://h.example/in\"\n"
        )
    };
    let wal_bound = |toml: &str| from_toml_str(toml).unwrap().relay.wal_publish_timeout;
    // Unset, it grows from 5 s to twice the longest timeout: a webhook whose
    // batch takes 6 s of its 10 s is not abandoned and sent again.
    assert_eq!(wal_bound(&hooks("wal", "10s", None)), Duration::from_secs(20));
    assert_eq!(wal_bound(&hooks("wal", "40s", None)), Duration::from_secs(80));
    assert_eq!(
        wal_bound(&format!("{MINIMAL}[relay]\nmode = \"wal\"\n")),
        Duration::from_secs(5)
    );
    // Set below it, it is refused in WAL mode...
    let e = errors(&hooks("wal", "10s", Some("5s")));
    assert!(
        e.starts_with("relay.wal_publish_timeout: 5s is less than twice sinks.hooks.timeout (10s)"),
        "{e}"
    );
    assert_eq!(wal_bound(&hooks("wal", "10s", Some("25s"))), Duration::from_secs(25));
    // ...and raised, not refused, while polling, which never reads it.
    assert_eq!(wal_bound(&hooks("poll", "10s", Some("5s"))), Duration::from_secs(20));
}

#[test]
fn a_value_of_the_wrong_kind_is_not_echoed() {
    // Secrets are kept out of files by setting them in the environment, where
    // every value is a string: one set on the wrong field must not be printed.
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    for (name, value) in [
        ("FERRY_SINKS__HOOKS__HEADERS", secret),
        ("FERRY_RELAY__BATCH_SIZE", secret),
    ] {
        let e = load_with_env(None, env(&[("FERRY_DATABASE__URL", "postgres://h/db"), (name, value)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("found a string (set by {name})")), "{e}");
        assert!(!e.contains("MfKQ9r8"), "{e}");
    }
}

/// A syntax error is placed by line and column, without the line's text,
/// which may hold a secret.
#[test]
fn a_syntax_error_does_not_quote_the_file() {
    let e = errors("[database]\nurl = \"postgres://app:s3cret-pw@db:5432/prod\n");
    assert!(!e.contains("s3cret-pw"), "{e}");
    assert!(e.contains("line 2"), "{e}");
}

#[test]
fn a_name_without_a_double_underscore_is_refused_with_the_name_meant() {
    // Read as nothing, it would leave the file's URL in force unsaid.
    let e = load_with_env(
        None,
        env(&[
            ("FERRY_DATABASE__URL", "postgres://h/db"),
            ("FERRY_DATABASE_URL", "postgres://h/other"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("FERRY_DATABASE_URL: not a setting Ferry reads")
            && e.contains("joined by a double underscore, so write FERRY_DATABASE__URL"),
        "{e}"
    );
    // All at once, in name order; a sink's name cannot be guessed.
    let e = load_with_env(
        None,
        env(&[
            ("FERRY_SINKS_RABBIT_URL", "amqp://h"),
            ("ferry_relay_batch_size", "10"),
            ("FERRY_DATABASE__URL", "postgres://h/db"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("2 problems in the configuration:"), "{e}");
    let lines: Vec<&str> = e.lines().skip(1).map(str::trim).collect();
    assert!(lines[0].starts_with("FERRY_SINKS_RABBIT_URL: ") && lines[0].contains("FERRY_SINKS__<NAME>__URL"));
    assert!(lines[1].starts_with("ferry_relay_batch_size: ") && lines[1].contains("write FERRY_RELAY__BATCH_SIZE"));
    // What Kubernetes gives every pod for Services named ferry and
    // ferry-metrics is not refused; a setting mistyped so still is.
    let service = [
        ("FERRY_SERVICE_HOST", "10.96.0.12"),
        ("FERRY_SERVICE_PORT", "9464"),
        ("FERRY_SERVICE_PORT_METRICS", "9464"),
        ("FERRY_PORT", "tcp://10.96.0.12:9464"),
        ("FERRY_PORT_9464_TCP", "tcp://10.96.0.12:9464"),
        ("FERRY_PORT_9464_TCP_PROTO", "tcp"),
        ("FERRY_PORT_9464_TCP_PORT", "9464"),
        ("FERRY_PORT_9464_TCP_ADDR", "10.96.0.12"),
        ("FERRY_METRICS_SERVICE_HOST", "fd00::12"),
        ("FERRY_METRICS_PORT", "tcp://10.96.0.13:9464"),
        ("FERRY_DATABASE__URL", "postgres://h/db"),
    ];
    load_with_env(None, env(&service)).unwrap();
    for (name, value) in [("FERRY_METRICS_PORT", "9464"), ("FERRY_RELAY_SERVICE_HOST", "relay-a")] {
        let e = load_with_env(None, env(&[("FERRY_DATABASE__URL", "postgres://h/db"), (name, value)]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&format!("{name}: not a setting Ferry reads")), "{e}");
    }
    // Names Ferry reads for something else stay allowed.
    for name in ["FERRY_CONFIG", "FERRY_TEST_AMQP_URL", "FERRY_TEST_KAFKA_PORT"] {
        load_with_env(None, env(&[("FERRY_DATABASE__URL", "postgres://h/db"), (name, "x")]))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn debug_output_hides_passwords() {
    let c = from_toml_str(
        &EXAMPLE
            .replace("root@", "root:hunter2@")
            .replace("guest:guest", "guest:s3cret"),
    )
    .unwrap();
    let debug = format!("{c:?}");
    assert!(!debug.contains("hunter2") && !debug.contains("s3cret"), "{debug}");
    assert!(debug.contains("postgres://root:***@127.0.0.1:5432/test"), "{debug}");
}

#[test]
fn field_paths_render_indices() {
    let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(field_path(&keys(&["routes", "1", "sink"])), "routes[1].sink");
    assert_eq!(field_path(&keys(&["sinks", "rabbit", "url"])), "sinks.rabbit.url");
}

#[test]
fn load_reads_the_file() {
    // The process environment is whatever the test runner has; it may hold
    // FERRY_* overrides, so only what it cannot change is asserted.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ferry.toml");
    std::fs::write(&path, EXAMPLE).unwrap();
    let c = load(Some(&path)).unwrap();
    assert_eq!(c.routes.len(), 7);
    assert!(load(Some(&dir.path().join("missing.toml"))).is_err());
}

mod blank_env;
mod route_secrets;
mod sink_kinds;

#[test]
fn retention_defaults_keep_a_week_of_published_and_every_dead_event() {
    let c = from_toml_str(MINIMAL).unwrap();
    assert_eq!(
        c.retention,
        RetentionConfig {
            enabled: true,
            published_window: Duration::from_secs(7 * 86_400),
            dead_window: None,
            batch_size: 1_000,
            batch_pause: Duration::from_millis(50),
            interval: Duration::from_secs(300),
            archive_dir: None,
        }
    );
}

#[test]
fn retention_section_is_read() {
    let c = from_toml_str(&format!(
        "{MINIMAL}[retention]\nenabled = false\npublished_window = \"24h\"\ndead_window = \"never\"\n\
         batch_size = 250\nbatch_pause = \"0s\"\ninterval = \"1m\"\narchive_dir = \"archive\"\n"
    ))
    .unwrap();
    assert_eq!(
        c.retention,
        RetentionConfig {
            enabled: false,
            published_window: Duration::from_secs(86_400),
            dead_window: None,
            batch_size: 250,
            batch_pause: Duration::ZERO,
            interval: Duration::from_secs(60),
            archive_dir: Some("archive".into()),
        }
    );
    let rules = c.retention.rules();
    assert_eq!(
        (rules.published, rules.settled, rules.batch_size, rules.pause),
        (Duration::from_secs(86_400), None, 250, Duration::ZERO)
    );
}

#[test]
fn retention_problems_name_the_field() {
    let e = errors_with("[retention]\npublished_window = \"48h\"\ndead_window = \"24h\"\n");
    assert!(
        e.starts_with("retention.dead_window: 24h is shorter than retention.published_window (48h)"),
        "{e}"
    );
    assert!(e.contains("\"never\""), "{e}");
    let e = errors_with("[retention]\npublished_window = \"0s\"\n");
    assert!(
        e.starts_with("retention.published_window: 0s is too short; it must be at least 1s"),
        "{e}"
    );
    let e = errors_with("[retention]\ndead_window = \"a month\"\n");
    assert!(
        e.starts_with("retention.dead_window: \"a month\" is not a duration"),
        "{e}"
    );
    assert_eq!(
        errors_with("[retention]\nbatch_size = 0\n"),
        "retention.batch_size: must be between 1 and 10000, got 0"
    );
    let e = errors_with("[retention]\narchive_dir = \" \"\n");
    assert!(e.starts_with("retention.archive_dir: must not be empty"), "{e}");
    let e = errors_with("[retention]\nkeep = \"1d\"\n");
    assert!(e.starts_with("retention.keep: unknown field"), "{e}");
    let e = load_with_env(
        None,
        env(&[
            ("FERRY_DATABASE__URL", "postgres://h/db"),
            ("FERRY_RETENTION__INTERVAL", "soon"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("retention.interval: \"soon\" is not a duration"), "{e}");
}

#[test]
fn wal_mode_is_checked_against_the_database_and_names() {
    let c = from_toml_str(
        "[database]\nurl = \"postgres://h/db\"\n[relay]\nmode = \"wal\"\nwal_slot = \"orders_1\"\nwal_lag_budget_mb = 64\nwal_read_ahead_mb = 16\n",
    )
    .unwrap();
    assert_eq!(c.relay.mode, RelayMode::Wal);
    assert_eq!(c.relay.wal_slot, "orders_1");
    assert_eq!(c.relay.wal_lag_budget, 64 << 20);
    assert_eq!(c.relay.wal_read_ahead, 16 << 20);
    for bad in ["0", "4096"] {
        let err = from_toml_str(&format!(
            "[database]\nurl = \"postgres://h/db\"\n[relay]\nwal_read_ahead_mb = {bad}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("relay.wal_read_ahead_mb"), "{err}");
    }
    let err = from_toml_str("[database]\nurl = \"sqlite://x.db\"\n[relay]\nmode = \"wal\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("relay.mode") && err.contains("\"poll\""), "{err}");
    let err =
        from_toml_str("[database]\nurl = \"postgres://h/db\"\n[relay]\nmode = \"stream\"\nwal_slot = \"Bad-Name\"\n")
            .unwrap_err()
            .to_string();
    assert!(err.contains("unknown mode \"stream\""), "{err}");
    assert!(
        err.contains("relay.wal_slot") && err.contains("a-z, 0-9 and _"),
        "{err}"
    );
}

#[test]
fn redis_routes_writing_one_stream_must_trim_it_alike() {
    let routes = "[[routes]]\nname = \"audit\"\nmatch = \"**\"\nsink = \"r\"\ndestination = \"events\"\n\
                  [[routes]]\nname = \"metrics\"\nmatch = \"metric.*\"\nsink = \"r\"\ndestination = \"events\"\n";
    let e = errors_with(&format!(
        "[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\naudit = 0\nmetrics = 100\n{routes}"
    ));
    assert_eq!(
        e,
        "sinks.r.maxlen_per_route.metrics: routes \"audit\" (maxlen none (no trimming)) and \"metrics\" \
         (maxlen 100) both write stream \"events\", and XADD MAXLEN trims the whole stream, so one route's \
         trimming removes the other's entries too; give them the same maxlen, or separate streams"
    );
    // A route on the sink's default counts with it; the field named is the
    // one that sets the later route's trimming.
    let e = errors_with(&format!(
        "[sinks.r]\nkind = \"redis\"\nmaxlen = 100\n[sinks.r.maxlen_per_route]\naudit = 0\n{routes}"
    ));
    assert!(e.starts_with("sinks.r.maxlen: routes \"audit\""), "{e}");
    // The same trimming, separate streams, templates (known only per event)
    // and other sinks' streams of the same name are all accepted.
    for ok in [
        format!("[sinks.r]\nkind = \"redis\"\nmaxlen = 100\n{routes}"),
        format!("[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\naudit = 0\nmetrics = 0\n{routes}"),
        format!(
            "[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\nmetrics = 100\n{}",
            routes.replacen("destination = \"events\"", "destination = \"audit\"", 1)
        ),
        format!(
            "[sinks.r]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\nmetrics = 100\n{}",
            routes.replacen("destination = \"events\"", "destination = \"events{domain}\"", 1)
        ),
        format!(
            "[sinks.r]\nkind = \"redis\"\n[sinks.s]\nkind = \"redis\"\n[sinks.r.maxlen_per_route]\nmetrics = 100\n{}",
            routes.replacen("sink = \"r\"", "sink = \"s\"", 1)
        ),
    ] {
        let toml = format!("{MINIMAL}{ok}");
        assert!(from_toml_str(&toml).is_ok(), "{toml}");
    }
}
