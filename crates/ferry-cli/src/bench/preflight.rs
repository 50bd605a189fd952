//! Before the first scenario: every server the chosen scenarios need must
//! answer a connection within a few seconds. A server that is down would
//! otherwise fail its scenario minutes into the run (Kafka's topic creation
//! retries for a while), after the scenarios before it have taken their
//! time.

use std::fmt::Write as _;
use std::time::Duration;

use clap::ValueEnum;
use sqlx::{Connection, PgConnection};

use super::{BenchArgs, Scenario, topology};

/// How long each server has to answer.
const WITHIN: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Postgres,
    RabbitMq,
    Kafka,
    Nats,
    Redis,
}

const SERVERS: [Server; 5] = [
    Server::Postgres,
    Server::RabbitMq,
    Server::Kafka,
    Server::Nats,
    Server::Redis,
];

impl Server {
    fn label(self) -> &'static str {
        match self {
            Server::Postgres => "PostgreSQL",
            Server::RabbitMq => "RabbitMQ",
            Server::Kafka => "Kafka",
            Server::Nats => "NATS (with JetStream)",
            Server::Redis => "Redis",
        }
    }

    /// The flag that names it.
    fn flag(self) -> &'static str {
        match self {
            Server::Postgres => "--database-url",
            Server::RabbitMq => "--amqp-url",
            Server::Kafka => "--kafka-brokers",
            Server::Nats => "--nats-url",
            Server::Redis => "--redis-url",
        }
    }

    fn address(self, args: &BenchArgs) -> String {
        let redact = ferry_core::redact::url;
        match self {
            Server::Postgres => redact(&args.database_url),
            Server::RabbitMq => redact(&args.amqp_url),
            Server::Kafka => args.sinks.kafka_brokers.clone(),
            Server::Nats => redact(&args.sinks.nats_url),
            Server::Redis => redact(&args.sinks.redis_url),
        }
    }

    /// Connects and asks one harmless question.
    async fn reach(self, args: &BenchArgs) -> anyhow::Result<()> {
        match self {
            Server::Postgres => {
                let conn = PgConnection::connect(&args.database_url).await?;
                let _ = conn.close().await;
            }
            Server::RabbitMq => {
                let connection = topology::connect(&args.amqp_url, "ferry-bench-check").await?;
                let _ = connection.close(200, "OK".into()).await;
            }
            #[cfg(feature = "bench-sinks")]
            Server::Kafka => {
                use anyhow::Context;
                use rdkafka::ClientConfig;
                use rdkafka::producer::{BaseProducer, Producer};
                let producer: BaseProducer = ClientConfig::new()
                    .set("bootstrap.servers", &args.sinks.kafka_brokers)
                    .create()
                    .context("creating a Kafka client")?;
                tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, WITHIN))
                    .await?
                    .context("asking for the brokers' metadata")?;
            }
            #[cfg(feature = "bench-sinks")]
            Server::Nats => {
                let client = async_nats::connect(&args.sinks.nats_url).await?;
                let info = super::dest::js_api(&client, "$JS.API.INFO", None).await?;
                if let Some(error) = info.get("error") {
                    anyhow::bail!("JetStream: {error}");
                }
            }
            #[cfg(feature = "bench-sinks")]
            Server::Redis => {
                let client = redis::Client::open(args.sinks.redis_url.as_str())?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            }
            #[cfg(not(feature = "bench-sinks"))]
            Server::Kafka | Server::Nats | Server::Redis => {}
        }
        Ok(())
    }
}

/// The servers `scenario` talks to.
fn needs(scenario: Scenario) -> &'static [Server] {
    match scenario {
        Scenario::Producer => &[Server::Postgres],
        Scenario::Sinks if cfg!(feature = "bench-sinks") => &SERVERS,
        // Skipped, or refused, without the feature.
        Scenario::Sinks => &[Server::Postgres],
        _ => &[Server::Postgres, Server::RabbitMq],
    }
}

fn name(scenario: Scenario) -> String {
    scenario
        .to_possible_value()
        .map_or_else(|| format!("{scenario:?}"), |v| v.get_name().to_owned())
}

/// Fails, naming every server that did not answer, its flag and the
/// scenarios that need it, unless each server the chosen scenarios need
/// answers within [`WITHIN`].
pub(crate) async fn check(args: &BenchArgs) -> anyhow::Result<()> {
    let chosen: Vec<Scenario> = Scenario::value_variants()
        .iter()
        .copied()
        .filter(|s| args.runs(*s))
        .collect();
    let wanted = SERVERS
        .into_iter()
        .filter(|server| chosen.iter().any(|s| needs(*s).contains(server)));
    let answers = futures::future::join_all(wanted.map(async |server| {
        let answer = match tokio::time::timeout(WITHIN, server.reach(args)).await {
            Ok(answer) => answer,
            Err(_) => Err(anyhow::anyhow!("no answer within {}s", WITHIN.as_secs())),
        };
        (server, answer)
    }))
    .await;
    let down: Vec<(Server, anyhow::Error)> = answers
        .into_iter()
        .filter_map(|(server, answer)| answer.err().map(|e| (server, e)))
        .collect();
    if down.is_empty() {
        return Ok(());
    }
    let mut message = String::new();
    for (server, error) in &down {
        let users: Vec<String> = chosen
            .iter()
            .filter(|s| needs(**s).contains(server))
            .map(|s| name(*s))
            .collect();
        let _ = writeln!(
            message,
            "cannot reach {} at {} (set with {}), which the {} scenario{} need{}: {}",
            server.label(),
            server.address(args),
            server.flag(),
            users.join(", "),
            if users.len() == 1 { "" } else { "s" },
            if users.len() == 1 { "s" } else { "" },
            error.root_cause(),
        );
    }
    let rest: Vec<String> = chosen
        .iter()
        .filter(|s| !down.iter().any(|(server, _)| needs(**s).contains(server)))
        .map(|s| name(*s))
        .collect();
    if rest.is_empty() {
        message.push_str("start it, or point the flag at it");
    } else {
        let _ = write!(
            message,
            "start it, point the flag at it, or leave those scenarios out with --only {}",
            rest.join(",")
        );
    }
    Err(anyhow::anyhow!(message))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    /// `ferry bench` with `flags`, on the tests' PostgreSQL and RabbitMQ
    /// unless `flags` name others.
    fn args(flags: &[&str]) -> BenchArgs {
        let amqp = ferry_testkit::rabbit::amqp_url();
        let pg = ferry_testkit::pg::admin_url();
        let mut argv = vec!["bench"];
        for (flag, value) in [("--database-url", &pg), ("--amqp-url", &amqp)] {
            if !flags.contains(&flag) {
                argv.extend([flag, value.as_str()]);
            }
        }
        argv.extend_from_slice(flags);
        Cli::parse_from(argv).bench
    }

    /// A port on which nothing listens.
    fn closed_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn only_the_sinks_scenario_needs_kafka_nats_and_redis() {
        for scenario in Scenario::value_variants() {
            let needed = needs(*scenario);
            assert!(needed.contains(&Server::Postgres), "{scenario:?}");
            let sinks = *scenario == Scenario::Sinks && cfg!(feature = "bench-sinks");
            for server in [Server::Kafka, Server::Nats, Server::Redis] {
                assert_eq!(needed.contains(&server), sinks, "{scenario:?} {server:?}");
            }
        }
    }

    #[cfg(feature = "bench-sinks")]
    #[tokio::test]
    async fn a_server_that_is_down_is_named_with_its_flag_before_any_scenario() {
        let kafka = format!("127.0.0.1:{}", closed_port());
        let nats = format!("nats://127.0.0.1:{}", closed_port());
        let redis = format!("redis://127.0.0.1:{}", closed_port());
        let down = args(&["--kafka-brokers", &kafka, "--nats-url", &nats, "--redis-url", &redis]);
        let err = check(&down).await.unwrap_err().to_string();
        for flag in ["--kafka-brokers", "--nats-url", "--redis-url"] {
            assert!(err.contains(flag), "{flag}: {err}");
        }
        assert!(err.contains(&format!("cannot reach Kafka at {kafka}")), "{err}");
        assert!(err.contains("which the sinks scenario needs"), "{err}");
        assert!(!err.contains("--amqp-url"), "{err}");
        // The default set without the scenario that needs them.
        assert!(
            err.contains("--only drain,latency,wal-latency,wal-drain,idle,producer,hotkey"),
            "{err}"
        );

        // Scenarios that do not need them do not wait for them.
        let only = args(&["--only", "producer,idle", "--kafka-brokers", &kafka]);
        check(&only).await.unwrap();
    }

    #[cfg(feature = "bench-sinks")]
    #[tokio::test]
    async fn the_servers_the_tests_use_answer() {
        let kafka = ferry_testkit::kafka::broker();
        check(&args(&["--kafka-brokers", &kafka])).await.unwrap();
    }

    #[tokio::test]
    async fn rabbitmq_down_names_every_scenario_that_needs_it() {
        let amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
        let down = args(&["--only", "producer,drain,latency", "--amqp-url", &amqp]);
        let err = check(&down).await.unwrap_err().to_string();
        assert!(err.contains("(set with --amqp-url)"), "{err}");
        assert!(err.contains("the drain, latency scenarios need"), "{err}");
        assert!(err.contains("--only producer"), "{err}");
    }
}
