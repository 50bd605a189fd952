use std::collections::HashMap;
use std::sync::Arc;

use ferry_core::Sink;

use crate::commands::UsageError;
use crate::config::{Config, SinkSpec};

/// Builds every configured sink. Connections are made lazily, on first use.
pub fn build(cfg: &Config) -> Result<HashMap<String, Arc<dyn Sink>>, UsageError> {
    let mut sinks: HashMap<String, Arc<dyn Sink>> = HashMap::new();
    for (name, spec) in &cfg.sinks {
        let sink: Arc<dyn Sink> = match spec {
            #[cfg(feature = "rabbitmq")]
            SinkSpec::RabbitMq {
                url,
                publish_timeout,
                max_message_bytes,
                management_url,
                channels,
            } => {
                use ferry_sink::rabbitmq::{RabbitMqOptions, RabbitMqSink};
                Arc::new(RabbitMqSink::new(RabbitMqOptions {
                    url: url.clone(),
                    publish_timeout: *publish_timeout,
                    max_message_bytes: *max_message_bytes,
                    management_url: management_url.clone(),
                    channels: *channels,
                    ..RabbitMqOptions::default()
                }))
            }
            #[cfg(feature = "kafka")]
            SinkSpec::Kafka(spec) => Arc::new(
                ferry_sink::kafka::KafkaSink::new(spec.options())
                    .map_err(|e| UsageError(format!("sinks.{name}: {e}")))?,
            ),
            #[cfg(feature = "nats")]
            SinkSpec::Nats(spec) => Arc::new(ferry_sink::nats::NatsSink::new(spec.options())),
            #[cfg(feature = "redis")]
            SinkSpec::Redis(spec) => Arc::new(ferry_sink::redis::RedisSink::new(spec.options())),
            #[cfg(feature = "webhook")]
            SinkSpec::Webhook(spec) => Arc::new(
                ferry_sink::webhook::WebhookSink::new(ferry_sink::webhook::WebhookOptions {
                    // A paused endpoint's events are retried after the pause.
                    max_pause: cfg.relay.backoff_max,
                    ..spec.options()
                })
                .map_err(|e| UsageError(format!("sinks.{name}: {e}")))?,
            ),
            #[cfg(feature = "file")]
            SinkSpec::File(spec) => Arc::new(
                ferry_sink::file::FileSink::new(spec.options())
                    .map_err(|e| UsageError(format!("sinks.{name}: {e}")))?,
            ),
            #[cfg(feature = "stdout")]
            SinkSpec::Stdout => Arc::new(ferry_sink::stdout::StdoutSink::new()),
            #[allow(unreachable_patterns)]
            _ => {
                return Err(UsageError(format!(
                    "sinks.{name}: this ferry was built without support for this sink kind; \
                     rebuild with its cargo feature"
                )));
            }
        };
        sinks.insert(name.clone(), sink);
    }
    Ok(sinks)
}
