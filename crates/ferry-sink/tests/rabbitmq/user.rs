//! A RabbitMQ user of the test's own, made through the management API (on
//! the test broker's host, port 15672, with its credentials), for limits and
//! permissions no other test shares.

use ferry_testkit::rabbit::{amqp_url, unique_name};
use reqwest::Url;
use serde_json::json;

pub struct TestUser {
    name: String,
    password: String,
    api: Url,
    admin: (String, String),
    vhost: String,
    client: reqwest::Client,
}

impl TestUser {
    /// A user with full permissions on the test vhost, except writes, which
    /// go only to exchanges matching `write` (a regex).
    pub async fn create(write: &str) -> Self {
        // reqwest is built without a default TLS provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let amqp = Url::parse(&amqp_url()).expect("the test broker's URL");
        let host = amqp.host_str().unwrap_or("127.0.0.1");
        let api = Url::parse(&format!("http://{host}:15672/api/")).unwrap();
        let decode = |s: &str| s.replace("%40", "@").replace("%3A", ":");
        let admin = match amqp.username() {
            "" => ("guest".to_owned(), "guest".to_owned()),
            user => (decode(user), decode(amqp.password().unwrap_or(""))),
        };
        let vhost = match amqp.path().trim_start_matches('/') {
            "" => "%2F".to_owned(),
            v => v.to_owned(),
        };
        let user = Self {
            name: unique_name("user"),
            password: format!("pw-{:x}", rand_suffix()),
            api,
            admin,
            vhost,
            client: reqwest::Client::new(),
        };
        user.put(
            &format!("users/{}", user.name),
            json!({ "password": user.password, "tags": "" }),
        )
        .await;
        user.put(
            &format!("permissions/{}/{}", user.vhost, user.name),
            json!({ "configure": ".*", "write": write, "read": ".*" }),
        )
        .await;
        user
    }

    /// Lets the user hold at most `n` channels, over all its connections.
    pub async fn limit_channels(&self, n: i64) {
        self.put(
            &format!("user-limits/{}/max-channels", self.name),
            json!({ "value": n }),
        )
        .await;
    }

    /// The channels open on this user's connections, as the management API
    /// last heard (its statistics lag by a few seconds).
    pub async fn channels_open(&self) -> i64 {
        let url = self.api.join("connections?columns=user,channels").unwrap();
        let connections: Vec<serde_json::Value> = self
            .client
            .get(url.clone())
            .basic_auth(&self.admin.0, Some(&self.admin.1))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        connections
            .iter()
            .filter(|c| c["user"] == self.name.as_str())
            .map(|c| c["channels"].as_i64().unwrap_or(0))
            .sum()
    }

    /// The test broker's URL, logged in as this user.
    pub fn url(&self) -> String {
        let mut url = Url::parse(&amqp_url()).unwrap();
        url.set_username(&self.name).unwrap();
        url.set_password(Some(&self.password)).unwrap();
        url.to_string()
    }

    pub async fn delete(self) {
        let url = self.api.join(&format!("users/{}", self.name)).unwrap();
        let _ = self
            .client
            .delete(url)
            .basic_auth(&self.admin.0, Some(&self.admin.1))
            .send()
            .await;
    }

    async fn put(&self, path: &str, body: serde_json::Value) {
        let url = self.api.join(path).unwrap();
        let response = self
            .client
            .put(url.clone())
            .basic_auth(&self.admin.0, Some(&self.admin.1))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("the management API at {url} is needed: {e}"));
        assert!(response.status().is_success(), "PUT {url}: {}", response.status());
    }
}

fn rand_suffix() -> u64 {
    let name = unique_name("x");
    u64::from_str_radix(name.rsplit('-').next().unwrap(), 16).unwrap()
}
