//! Whether a route's exchange reaches any queue, asked of RabbitMQ's
//! management API: AMQP itself cannot list bindings. At run time the same
//! question is answered per message by `mandatory` returns; this answers it
//! before the first event, so `ferry check` can say "nobody home".

use std::time::Duration;

use ferry_core::SinkError;
use reqwest::Url;
use serde::Deserialize;

/// The management API's default port beside AMQP's (TLS beside AMQPS).
const HTTP_PORT: u16 = 15672;
const HTTPS_PORT: u16 = 15671;

/// Where the management API is and how to log in.
#[derive(Clone)]
pub(crate) struct Management {
    base: Url,
    user: String,
    password: String,
    /// The vhost as one URL path segment (`%2F` for `/`).
    vhost: String,
    /// Configured by the user, so being unreachable is an error; a derived
    /// address that does not answer only means the plugin is off.
    explicit: bool,
    client: reqwest::Client,
}

/// What the bindings say about a route.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// This many bindings could take the route's messages.
    Bound(usize),
    /// None could: what is missing, for the message.
    Nobody(String),
    /// The API could not be asked; why, with the fix, for the operator.
    Unknown(String),
}

#[derive(Deserialize)]
struct Exchange {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct Binding {
    destination: String,
    destination_type: String,
    routing_key: String,
}

impl Management {
    /// The API for the broker at `amqp_url`: `management_url` when given,
    /// otherwise the same host on the management port with the AMQP
    /// credentials.
    pub(crate) fn new(amqp_url: &str, management_url: Option<&str>, timeout: Duration) -> Result<Self, SinkError> {
        let amqp = Url::parse(amqp_url).map_err(|e| SinkError::config(format!("sink url: {e}")))?;
        let vhost = match amqp.path().trim_start_matches('/') {
            "" => "%2F".to_owned(),
            v => v.to_owned(),
        };
        let (mut base, explicit) = match management_url {
            Some(url) => (
                Url::parse(url).map_err(|e| {
                    SinkError::config(format!(
                        "management_url: {e}; write it like http://user:password@rabbit:15672"
                    ))
                })?,
                true,
            ),
            None => {
                let (scheme, port) = if amqp.scheme() == "amqps" {
                    ("https", HTTPS_PORT)
                } else {
                    ("http", HTTP_PORT)
                };
                let host = amqp.host_str().unwrap_or("127.0.0.1");
                let url = format!("{scheme}://{host}:{port}/");
                (
                    Url::parse(&url).map_err(|e| SinkError::config(format!("sink url: {e}")))?,
                    false,
                )
            }
        };
        let decode = |s: &str| {
            percent_decode(s)
                .map_err(|()| SinkError::config("sink url: the credentials are not valid percent-encoding"))
        };
        let creds = if base.username().is_empty() { &amqp } else { &base };
        let user = match creds.username() {
            "" => "guest".to_owned(),
            u => decode(u)?,
        };
        let password = decode(creds.password().unwrap_or("guest"))?;
        let _ = base.set_username("");
        let _ = base.set_password(None);
        let (client, _) = crate::http::client(timeout, "RabbitMQ management API")?;
        Ok(Self {
            base,
            user,
            password,
            vhost,
            explicit,
            client,
        })
    }

    /// Whether `exchange` has a binding that takes messages published with
    /// `routing_key` (`None`: the key varies per event, so any binding
    /// counts).
    pub(crate) async fn reach(&self, exchange: &str, routing_key: Option<&str>) -> Result<Reach, SinkError> {
        let name = encode_segment(exchange);
        let info: Exchange = match self.get(&format!("api/exchanges/{}/{name}", self.vhost)).await {
            Ok(v) => v,
            Err(problem) => return self.unknown(problem),
        };
        let bindings: Vec<Binding> = match self
            .get(&format!("api/exchanges/{}/{name}/bindings/source", self.vhost))
            .await
        {
            Ok(v) => v,
            Err(problem) => return self.unknown(problem),
        };
        let taking: Vec<&Binding> = bindings
            .iter()
            .filter(|b| match (info.kind.as_str(), routing_key) {
                (_, None) => true,
                ("direct", Some(key)) => b.routing_key == key,
                ("topic", Some(key)) => topic_matches(&b.routing_key, key),
                // fanout ignores keys; headers and plugin types route on
                // what only a message has.
                _ => true,
            })
            .collect();
        if !taking.is_empty() {
            tracing::debug!(
                exchange,
                bindings = ?taking.iter().map(|b| format!("{} {}", b.destination_type, b.destination)).collect::<Vec<_>>(),
                "exchange reaches queues"
            );
            return Ok(Reach::Bound(taking.len()));
        }
        let what = match routing_key {
            Some(key) => format!(
                "no queue is bound to {} exchange {exchange:?} for routing key {key:?}",
                info.kind
            ),
            None => format!("no queue is bound to {} exchange {exchange:?}", info.kind),
        };
        Ok(Reach::Nobody(what))
    }

    fn unknown(&self, problem: String) -> Result<Reach, SinkError> {
        if self.explicit {
            Err(SinkError::transient(format!(
                "asking the RabbitMQ management API at {}: {problem}",
                self.base
            )))
        } else {
            Ok(Reach::Unknown(format!(
                "could not ask the management API at {} ({problem}); enable the rabbitmq_management \
                 plugin, or set the sink's management_url to one that answers, for a user with the \
                 management tag",
                self.base
            )))
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let url = self.base.join(path).map_err(|e| e.to_string())?;
        let response = self
            .client
            .get(url)
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|e| crate::http::chain(&e.without_url()))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        response.json().await.map_err(|e| crate::http::chain(&e))
    }
}

/// AMQP topic matching: words split on `.`, `*` matches one word, `#`
/// zero or more.
pub(crate) fn topic_matches(pattern: &str, key: &str) -> bool {
    fn go(p: &[&str], k: &[&str]) -> bool {
        match p.split_first() {
            None => k.is_empty(),
            Some((&"#", rest)) => (0..=k.len()).any(|skip| go(rest, &k[skip..])),
            Some((&word, rest)) => match k.split_first() {
                Some((first, k_rest)) => (word == "*" || word == *first) && go(rest, k_rest),
                None => false,
            },
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    go(&p, &k)
}

/// `s` as one URL path segment.
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> Result<String, ()> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or(())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| ())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns() {
        for (pattern, key, expected) in [
            ("shop.order.*", "shop.order.paid", true),
            ("shop.order.*", "shop.order.item.paid", false),
            ("shop.#", "shop.order.item.paid", true),
            ("shop.#", "shop", true),
            ("#", "anything.at.all", true),
            ("*.order.#", "shop.order", true),
            ("*.order.#", "order", false),
            ("shop.order.paid", "shop.order.paid", true),
            ("shop.order.paid", "shop.order.created", false),
            ("#.paid", "shop.order.paid", true),
            ("#.paid", "shop.order.created", false),
        ] {
            assert_eq!(topic_matches(pattern, key), expected, "{pattern} vs {key}");
        }
    }

    #[test]
    fn the_api_address_follows_the_amqp_url() {
        let t = Duration::from_secs(1);
        let m = Management::new("amqp://ferry:s%40cret@rabbit:5672/%2f", None, t).unwrap();
        assert_eq!(m.base.as_str(), "http://rabbit:15672/");
        assert_eq!((m.user.as_str(), m.password.as_str()), ("ferry", "s@cret"));
        assert_eq!(m.vhost, "%2f");
        assert!(!m.explicit);
        let m = Management::new("amqps://rabbit/prod", None, t).unwrap();
        assert_eq!(m.base.as_str(), "https://rabbit:15671/");
        assert_eq!((m.user.as_str(), m.vhost.as_str()), ("guest", "prod"));
        let m = Management::new("amqp://a:b@rabbit/", Some("http://admin:pw@mgmt:8080/rabbit/"), t).unwrap();
        assert_eq!(m.base.as_str(), "http://mgmt:8080/rabbit/");
        assert_eq!((m.user.as_str(), m.password.as_str()), ("admin", "pw"));
        assert_eq!(m.vhost, "%2F");
        assert!(m.explicit);
        assert!(Management::new("amqp://h/", Some("not a url"), t).is_err());
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(encode_segment("shop/orders v2"), "shop%2Forders%20v2");
        assert_eq!(encode_segment("amq.topic"), "amq.topic");
    }
}
