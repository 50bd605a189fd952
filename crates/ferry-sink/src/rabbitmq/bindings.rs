//! Whether a route's exchange reaches any queue, asked of RabbitMQ's
//! management API: AMQP itself cannot list bindings. At run time the same
//! question is answered per message by `mandatory` returns; this answers it
//! before the first event, so `ferry check` can say "nobody home".
//!
//! A message no binding takes goes on to the exchange's alternate exchange
//! (its `alternate-exchange` argument, or else a policy's), and from there
//! to that one's, with the same routing key; RabbitMQ confirms it and
//! returns nothing if a queue there takes it. The check follows that chain.

use std::time::Duration;

use ferry_core::SinkError;
use reqwest::Url;
use serde::Deserialize;
use serde_json::Value;

/// The management API's default port beside AMQP's (TLS beside AMQPS).
const HTTP_PORT: u16 = 15672;
const HTTPS_PORT: u16 = 15671;

/// How many alternate exchanges in a row the check follows. RabbitMQ sets
/// no limit (it stops at a loop); a longer chain is taken as reaching a
/// queue, with a caveat.
const MAX_ALTERNATES: usize = 8;

/// The argument, and the policy key, naming an alternate exchange.
const ALTERNATE_EXCHANGE: &str = "alternate-exchange";

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
    /// No binding takes the messages, but an alternate exchange may: why it
    /// could not be followed, for the operator. Taken as reaching a queue.
    Uncertain(String),
}

#[derive(Deserialize)]
struct Exchange {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    arguments: Value,
    /// The name of the policy applying to the exchange, if one does.
    #[serde(default)]
    policy: Option<Value>,
    /// What the policies applying to it define, where the API tells (it
    /// does for queues; some versions may for exchanges).
    #[serde(default)]
    effective_policy_definition: Option<Value>,
}

#[derive(Deserialize)]
struct Policy {
    #[serde(default)]
    definition: Value,
}

/// The exchange's alternate exchange, as far as its own answer tells.
enum Alternate {
    None,
    Named(String),
    /// Set, if at all, by this policy, whose definition must be asked for.
    InPolicy(String),
}

impl Exchange {
    /// The exchange's argument wins over a policy, as in RabbitMQ.
    fn alternate(&self) -> Alternate {
        let named = |v: &Value| v.get(ALTERNATE_EXCHANGE).and_then(Value::as_str).map(str::to_owned);
        if let Some(name) = named(&self.arguments) {
            return Alternate::Named(name);
        }
        if let Some(definition) = &self.effective_policy_definition {
            return named(definition).map_or(Alternate::None, Alternate::Named);
        }
        match self.policy.as_ref().and_then(Value::as_str) {
            Some(policy) if !policy.is_empty() => Alternate::InPolicy(policy.to_owned()),
            _ => Alternate::None,
        }
    }
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
    /// counts), or, failing that, its alternate exchange, and so on.
    pub(crate) async fn reach(&self, exchange: &str, routing_key: Option<&str>) -> Result<Reach, SinkError> {
        let (info, taking) = match self.takers(exchange, routing_key).await {
            Ok(Some(found)) => found,
            Ok(None) => return self.unknown("HTTP 404 Not Found".to_owned()),
            Err(problem) => return self.unknown(problem),
        };
        let mut what = match routing_key {
            Some(key) => format!(
                "no queue is bound to {} exchange {exchange:?} for routing key {key:?}",
                info.kind
            ),
            None => format!("no queue is bound to {} exchange {exchange:?}", info.kind),
        };
        if taking > 0 {
            return Ok(Reach::Bound(taking));
        }
        let mut visited = vec![exchange.to_owned()];
        let mut info = info;
        loop {
            let current = visited.last().expect("starts with one").clone();
            let alternate = match info.alternate() {
                Alternate::None => return Ok(Reach::Nobody(what)),
                Alternate::Named(name) => name,
                Alternate::InPolicy(policy) => match self.policy_alternate(&policy).await {
                    Ok(None) => return Ok(Reach::Nobody(what)),
                    Ok(Some(name)) => name,
                    Err(problem) => {
                        return Ok(Reach::Uncertain(format!(
                            "{what}, but policy {policy:?} applies to exchange {current:?} and may give \
                             it an alternate exchange, which could not be read ({problem}); give the \
                             management user the policymaker tag to have it checked. An unroutable \
                             event still comes back at publish time"
                        )));
                    }
                },
            };
            if visited.contains(&alternate) {
                return Ok(Reach::Nobody(format!(
                    "{what}, and the alternate exchanges loop back to {alternate:?}"
                )));
            }
            if visited.len() > MAX_ALTERNATES {
                return Ok(Reach::Uncertain(format!(
                    "{what}; the chain of alternate exchanges goes on to {alternate:?}, past the \
                     {MAX_ALTERNATES} this check follows. An unroutable event still comes back at \
                     publish time"
                )));
            }
            let (next, taking) = match self.takers(&alternate, routing_key).await {
                Ok(Some(found)) => found,
                Ok(None) => {
                    return Ok(Reach::Nobody(format!(
                        "{what}, and its alternate exchange {alternate:?} does not exist"
                    )));
                }
                Err(problem) => {
                    return Ok(Reach::Uncertain(format!(
                        "{what}, and its alternate exchange {alternate:?} could not be looked at \
                         ({problem}). An unroutable event still comes back at publish time"
                    )));
                }
            };
            if taking > 0 {
                tracing::debug!(
                    exchange,
                    alternate,
                    "exchange reaches queues through its alternate exchange"
                );
                return Ok(Reach::Bound(taking));
            }
            what = format!(
                "{what}, nor to its alternate exchange, {} exchange {alternate:?}",
                next.kind
            );
            visited.push(alternate);
            info = next;
        }
    }

    /// The exchange, and how many of its bindings take messages published
    /// with `routing_key`; `None` when it does not exist.
    async fn takers(&self, exchange: &str, routing_key: Option<&str>) -> Result<Option<(Exchange, usize)>, String> {
        let name = encode_segment(exchange);
        let Some(info) = self
            .get_optional::<Exchange>(&format!("api/exchanges/{}/{name}", self.vhost))
            .await?
        else {
            return Ok(None);
        };
        let bindings: Vec<Binding> = self
            .get(&format!("api/exchanges/{}/{name}/bindings/source", self.vhost))
            .await?;
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
        }
        let taking = taking.len();
        Ok(Some((info, taking)))
    }

    /// The alternate exchange that policy `policy` sets, if any.
    async fn policy_alternate(&self, policy: &str) -> Result<Option<String>, String> {
        let path = format!("api/policies/{}/{}", self.vhost, encode_segment(policy));
        let policy: Policy = self.get(&path).await?;
        Ok(policy
            .definition
            .get(ALTERNATE_EXCHANGE)
            .and_then(Value::as_str)
            .map(str::to_owned))
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
        self.get_optional(path)
            .await?
            .ok_or_else(|| "HTTP 404 Not Found".to_owned())
    }

    /// As [`Self::get`], with `None` for a 404.
    async fn get_optional<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<Option<T>, String> {
        let url = self.base.join(path).map_err(|e| e.to_string())?;
        let response = self
            .client
            .get(url)
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|e| crate::http::chain(&e.without_url()))?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        response.json().await.map(Some).map_err(|e| crate::http::chain(&e))
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
