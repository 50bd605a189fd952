//! Nobody home, through alternate exchanges: RabbitMQ routes a message no
//! binding takes to the exchange's alternate exchange (set by an argument
//! or a policy), confirms it and returns nothing, so a route that reaches
//! a queue only that way works and must pass the check.

use std::time::Duration;

use ferry_core::{ErrorKind, Sink};
use ferry_testkit::rabbit::{amqp_url, unique_name};
use reqwest::Url;
use serde_json::{Value, json};

use super::support::{keyed, route, sink_at};

/// The test broker's management API, as its admin user.
struct Api {
    base: Url,
    user: (String, String),
    client: reqwest::Client,
    /// What to delete at the end, as API paths, in order.
    made: Vec<String>,
}

impl Api {
    fn new() -> Self {
        // reqwest is built without a default TLS provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let amqp = Url::parse(&amqp_url()).expect("the test broker's URL");
        let host = amqp.host_str().unwrap_or("127.0.0.1");
        let user = match amqp.username() {
            "" => ("guest".to_owned(), "guest".to_owned()),
            user => (user.to_owned(), amqp.password().unwrap_or("").to_owned()),
        };
        Self {
            base: Url::parse(&format!("http://{host}:15672/api/")).unwrap(),
            user,
            client: reqwest::Client::new(),
            made: Vec::new(),
        }
    }

    fn vhost() -> String {
        let amqp = Url::parse(&amqp_url()).unwrap();
        match amqp.path().trim_start_matches('/') {
            "" => "%2F".to_owned(),
            v => v.to_owned(),
        }
    }

    /// A non-durable exchange of `kind`, with `arguments`.
    async fn exchange(&mut self, name: &str, kind: &str, arguments: Value) {
        let path = format!("exchanges/{}/{name}", Self::vhost());
        self.put(&path, json!({ "type": kind, "durable": false, "arguments": arguments }))
            .await;
        self.made.push(path);
    }

    /// A queue bound to `exchange` by `key`.
    async fn bound_queue(&mut self, name: &str, exchange: &str, key: &str) {
        let path = format!("queues/{}/{name}", Self::vhost());
        self.put(&path, json!({ "durable": false })).await;
        self.made.insert(0, path);
        let url = self
            .base
            .join(&format!("bindings/{}/e/{exchange}/q/{name}", Self::vhost()))
            .unwrap();
        let response = self
            .client
            .post(url.clone())
            .basic_auth(&self.user.0, Some(&self.user.1))
            .json(&json!({ "routing_key": key }))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        assert!(response.status().is_success(), "POST {url}: {}", response.status());
    }

    /// A policy giving `exchange` the alternate exchange `alternate`, once
    /// the API shows it applied.
    async fn alternate_by_policy(&mut self, exchange: &str, alternate: &str) {
        let name = unique_name("policy");
        let path = format!("policies/{}/{name}", Self::vhost());
        self.put(
            &path,
            json!({
                "pattern": format!("^{exchange}$"),
                "definition": { "alternate-exchange": alternate },
                "apply-to": "exchanges",
            }),
        )
        .await;
        self.made.insert(0, path);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let info = self.get(&format!("exchanges/{}/{exchange}", Self::vhost())).await;
            if info["policy"] == name.as_str() {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "policy not applied: {info}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn get(&self, path: &str) -> Value {
        let url = self.base.join(path).unwrap();
        self.client
            .get(url.clone())
            .basic_auth(&self.user.0, Some(&self.user.1))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
    }

    async fn put(&self, path: &str, body: Value) {
        let url = self.base.join(path).unwrap();
        let response = self
            .client
            .put(url.clone())
            .basic_auth(&self.user.0, Some(&self.user.1))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("the management API at {url} is needed: {e}"));
        assert!(response.status().is_success(), "PUT {url}: {}", response.status());
    }
}

/// Deletes what the test made, even when it failed: on a thread of its
/// own, as the test's runtime may be gone or busy panicking.
impl Drop for Api {
    fn drop(&mut self) {
        let made = std::mem::take(&mut self.made);
        let (base, user) = (self.base.clone(), self.user.clone());
        let deleting = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to clean up with");
            runtime.block_on(async {
                let client = reqwest::Client::new();
                for path in &made {
                    let url = base.join(path).unwrap();
                    let _ = client.delete(url).basic_auth(&user.0, Some(&user.1)).send().await;
                }
            });
        });
        let _ = deleting.join();
    }
}

#[tokio::test]
async fn a_route_reaching_a_queue_only_through_an_alternate_exchange_passes_check() {
    let mut api = Api::new();
    let alternate = unique_name("ae");
    let by_argument = unique_name("ae-arg");
    let by_policy = unique_name("ae-policy");
    let chained = unique_name("ae-chain");
    api.exchange(&alternate, "fanout", json!({})).await;
    api.bound_queue(&format!("{alternate}.q"), &alternate, "").await;
    api.exchange(&by_argument, "direct", json!({ "alternate-exchange": alternate }))
        .await;
    api.exchange(&by_policy, "topic", json!({})).await;
    api.alternate_by_policy(&by_policy, &alternate).await;
    // Two hops: an argument to an exchange whose policy names the last.
    api.exchange(&chained, "direct", json!({ "alternate-exchange": by_policy }))
        .await;

    let sink = sink_at(amqp_url());
    for exchange in [&by_argument, &by_policy, &chained] {
        let routed = route(exchange, Some("nobody.binds.this"));
        sink.check(&routed).await.unwrap_or_else(|e| panic!("{exchange}: {e}"));
        // And it does work: confirmed, nothing returned.
        let outcomes = sink.publish(&routed, &keyed(3, |seq| format!("k{seq}"))).await;
        assert!(outcomes.iter().all(Result::is_ok), "{exchange}: {outcomes:?}");
    }
    sink.close().await;
    drop(api);
}

#[tokio::test]
async fn alternate_exchanges_that_loop_or_are_missing_reach_nobody() {
    let mut api = Api::new();
    let (first, second) = (unique_name("ae-loop"), unique_name("ae-loop"));
    let orphan = unique_name("ae-orphan");
    let missing = unique_name("ae-missing");
    api.exchange(&first, "direct", json!({ "alternate-exchange": second }))
        .await;
    api.exchange(&second, "topic", json!({ "alternate-exchange": first }))
        .await;
    api.exchange(&orphan, "direct", json!({ "alternate-exchange": missing }))
        .await;

    let sink = sink_at(amqp_url());
    for (exchange, why) in [
        (&first, format!("loop back to {first:?}")),
        (&orphan, format!("alternate exchange {missing:?} does not exist")),
    ] {
        let err = sink.check(&route(exchange, Some("k"))).await.expect_err("nobody home");
        assert_eq!(err.kind, ErrorKind::Config, "{err}");
        assert!(err.message.contains("reaches nobody"), "{err}");
        assert!(err.message.contains(&why), "{err}");
    }
    sink.close().await;
    drop(api);
}
