//! What `check` asks Redis before a relay starts: that it answers, that it
//! is no Redis Cluster node, that it has the replicas `wait_replicas` asks
//! for, and that a plain stream key is a stream a consumer group reads.
//!
//! Publishing needs only XADD (and WAIT with `wait_replicas`). A user whose
//! ACL allows no more (`+xadd`) is refused the other commands with NOPERM:
//! that leaves only the check blind, so it is a caveat naming the command
//! and the grant that would let `check` see, never a refusal to start.

use std::time::Duration;

use ::redis::RedisError;
use ::redis::aio::ConnectionManager;
use ferry_core::{Route, SinkError};
use tokio::time::timeout;
use tracing::{debug, info};

use super::{Link, RedisSink, codes};

/// A check's request Redis answered with an error, classified; a cluster
/// redirect says what it means.
fn refused(sink: &str, what: &str, e: RedisError) -> SinkError {
    let mut message = format!("{what} Redis: {e}");
    if let Some(fix) = e.code().and_then(|code| codes::fix_for(code, sink)) {
        message.push_str("; ");
        message.push_str(&fix);
    }
    codes::error(codes::redis_error_kind(&e), message)
}

fn is_noperm(e: &RedisError) -> bool {
    e.code() == Some("NOPERM")
}

/// The answer to a request bounded by `limit`; a failed or unanswered one
/// is transient and gives the connection up.
fn answered<T>(
    link: &mut Link,
    what: &str,
    limit: Duration,
    answer: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
) -> Result<T, SinkError> {
    let error = match answer {
        Ok(Ok(value)) => return Ok(value),
        Ok(Err(e)) => SinkError::transient(format!("{what}: {e}")),
        Err(_) => SinkError::transient(format!("{what}: no answer within {limit:?}")),
    };
    link.failed(&error);
    Err(error)
}

/// `field` from an `INFO` section.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim().strip_prefix(field)?.strip_prefix(':'))
}

/// `connected_slaves` from `INFO replication`.
fn connected_replicas(info: &str) -> u32 {
    info_field(info, "connected_slaves")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl RedisSink {
    /// The ACL user the sink logs in as (`default` when the URL names none).
    fn user(&self) -> String {
        ::redis::parse_redis_url(&self.options.url)
            .map(|url| url.username().to_owned())
            .filter(|user| !user.is_empty())
            .unwrap_or_else(|| "default".into())
    }

    /// The caveat for a check-only `command` Redis refused with NOPERM:
    /// what `check` could not see, and the grant that would let it.
    fn blind(&self, route: &Route, command: &str, unseen: &str, grant: &str, e: &RedisError) -> String {
        format!(
            "route {:?}: Redis refuses this user {command} ({}), so check cannot tell {unseen}; publishing \
             does not need {command}. To let check see it: ACL SETUSER {} {grant}",
            route.name,
            e.detail().unwrap_or("NOPERM").trim(),
            self.user()
        )
    }

    pub(super) async fn checked(&self, route: &Route) -> Result<Vec<String>, SinkError> {
        let mut link = self.link.lock().await;
        let mut connection = self.connection(&mut link)?;
        let limit = self.options.publish_timeout;
        let mut caveats = Vec::new();
        match timeout(limit, ::redis::cmd("PING").query_async::<String>(&mut connection)).await {
            Ok(Ok(_)) => link.succeeded(),
            // Refused PING, the server answered all the same: it is there,
            // and took the login; nothing is left unseen.
            Ok(Err(e)) if is_noperm(&e) => {
                debug!(error = %e, "Redis refuses PING; its answer shows it is reachable");
                link.succeeded();
            }
            Ok(Err(e)) => {
                // Replaced whatever the failure: one refused while it
                // connected would give the same refusal for ever.
                let error = refused(&route.sink, "pinging", e);
                link.failed(&error);
                return Err(error);
            }
            Err(_) => {
                let error = SinkError::transient(format!("pinging Redis: no answer within {limit:?}"));
                link.failed(&error);
                return Err(error);
            }
        }
        caveats.extend(self.check_not_cluster(route, &mut link, &mut connection).await?);
        // Too few replicas is reported last: a replica reconnecting must not
        // hide a route that reaches nobody.
        let shortfall = match self.options.wait_replicas {
            0 => None,
            wanted => self.check_replicas(wanted, &mut link, &mut connection).await?,
        };
        caveats.extend(self.check_key(route, &mut link, &mut connection).await?);
        shortfall.map_or(Ok(caveats), Err)
    }

    /// A Redis Cluster node answers a key another node serves with a
    /// redirect (`MOVED`), which the sink does not follow: every event to
    /// such a key would go dead. `INFO cluster` says which it is; a server
    /// or proxy that does not know INFO is taken for what it seems.
    async fn check_not_cluster(
        &self,
        route: &Route,
        link: &mut Link,
        connection: &mut ConnectionManager,
    ) -> Result<Option<String>, SinkError> {
        let limit = self.options.publish_timeout;
        let mut asked = ::redis::cmd("INFO");
        asked.arg("cluster");
        let info = match timeout(limit, asked.query_async::<String>(connection)).await {
            Ok(Err(e)) if is_noperm(&e) => {
                let unseen = "whether the server is a Redis Cluster node, which the sink does not support";
                return Ok(Some(self.blind(route, "INFO", unseen, "+info", &e)));
            }
            Ok(Err(e)) if e.code().is_some() => {
                debug!(error = %e, "Redis answers INFO cluster with an error; taken for no cluster");
                return Ok(None);
            }
            other => answered(link, "INFO cluster", limit, other)?,
        };
        if info_field(&info, "cluster_enabled") != Some("1") {
            return Ok(None);
        }
        let unsupported = format!(
            "sinks.{sink}.url reaches a Redis Cluster node (INFO cluster: cluster_enabled:1), which the sink \
             does not support: it does not follow cluster redirects, so an event whose stream key another \
             node serves goes dead with MOVED",
            sink = route.sink
        );
        let fix = format!(
            "point sinks.{sink}.url at a Redis server that is not in cluster mode",
            sink = route.sink
        );
        // A cluster of one shard serves every key and publishes fine,
        // until it is scaled out: a caveat. Of several, a refusal.
        let mut asked = ::redis::cmd("CLUSTER");
        asked.arg("INFO");
        let shards = match timeout(limit, asked.query_async::<String>(connection)).await {
            Ok(Ok(info)) => info_field(&info, "cluster_size").and_then(|n| n.trim().parse::<u64>().ok()),
            Ok(Err(e)) if e.code().is_some() => {
                debug!(error = %e, "Redis answers CLUSTER INFO with an error; its shards go uncounted");
                None
            }
            other => answered(link, "CLUSTER INFO", limit, other).map(|_| None)?,
        };
        match shards {
            Some(n) if n > 1 => Err(SinkError::config(format!(
                "{unsupported}: this cluster has {n} shards (CLUSTER INFO: cluster_size:{n}); {fix}"
            ))),
            Some(_) => Ok(Some(format!(
                "{unsupported} once the cluster, of one shard now, is scaled out; {fix}"
            ))),
            None => Ok(Some(format!(
                "{unsupported} (a cluster of one shard serves every key; CLUSTER INFO could not be read to \
                 count them); {fix}"
            ))),
        }
    }

    /// For `wait_replicas`: Redis must allow the user WAIT (or every batch
    /// fails), and should have `wanted` replicas. `Ok(Some(_))` says it has
    /// fewer, which is transient: a replica reconnecting after a restart
    /// must not stop a relay from starting.
    async fn check_replicas(
        &self,
        wanted: u32,
        link: &mut Link,
        connection: &mut ConnectionManager,
    ) -> Result<Option<SinkError>, SinkError> {
        let limit = self.options.publish_timeout;
        let same = connection.clone();
        let wait = |replicas: u32, within: Duration| {
            // A clone of a multiplexed connection is the same connection.
            let mut connection = same.clone();
            async move {
                let mut asked = ::redis::cmd("WAIT");
                asked.arg(replicas).arg(within.as_millis().max(1) as u64);
                timeout(limit, asked.query_async::<u32>(&mut connection)).await
            }
        };
        // WAIT for none answers at once: may the user WAIT at all?
        match wait(0, Duration::from_millis(1)).await {
            // An ACL without WAIT, or a proxy that lacks it, fails every batch.
            Ok(Err(e)) if e.code().is_some() => {
                return Err(SinkError::config(format!(
                    "wait_replicas is set but Redis refuses WAIT ({e}); allow the user WAIT \
                     (ACL SETUSER {} +wait) or set wait_replicas = 0",
                    self.user()
                )));
            }
            other => answered(link, "WAIT", limit, other)?,
        };
        // INFO says how many are connected, but is among the commands a
        // hardened user (-@dangerous) is denied: then WAIT counts them (WAIT
        // for none would not: a replica acknowledges only once a second),
        // within a second, as the health probe gives a check 4 s.
        let info = timeout(
            limit,
            ::redis::cmd("INFO")
                .arg("replication")
                .query_async::<String>(connection),
        )
        .await;
        let replicas = match info {
            Ok(Err(e)) if e.code().is_some() => {
                let within = (limit / 2).min(Duration::from_secs(1));
                answered(link, "WAIT", limit, wait(wanted, within).await)?
            }
            other => connected_replicas(&answered(link, "INFO replication", limit, other)?),
        };
        Ok((replicas < wanted).then(|| {
            SinkError::transient(format!(
                "wait_replicas is {wanted} but the Redis server has {replicas} connected replica(s): no \
                 entry can be confirmed until enough are; attach replicas or lower wait_replicas"
            ))
        }))
    }

    /// For a plain key: it must be a stream with a consumer group. A
    /// template names many keys, known only per event: it is not checked.
    async fn check_key(
        &self,
        route: &Route,
        link: &mut Link,
        connection: &mut ConnectionManager,
    ) -> Result<Option<String>, SinkError> {
        let limit = self.options.publish_timeout;
        let key = route.destination.as_str();
        if key.contains('{') {
            return Ok(None);
        }
        if key.is_empty() {
            return Err(SinkError::config(format!(
                "route {:?}: the stream key is empty; set routes[].destination",
                route.name
            )));
        }
        let kind = match timeout(limit, ::redis::cmd("TYPE").arg(key).query_async::<String>(connection)).await {
            Ok(Ok(kind)) => kind,
            Ok(Err(e)) if is_noperm(&e) => {
                let unseen = format!("whether stream {key:?} exists and a consumer group reads it");
                let grant = format!("+type +xinfo|groups ~{key}");
                return Ok(Some(self.blind(route, "TYPE", &unseen, &grant, &e)));
            }
            Ok(Err(e)) => return Err(refused(&route.sink, "asking the type of a key in", e)),
            Err(_) => {
                let error = SinkError::transient(format!("TYPE {key:?}: no answer within {limit:?}"));
                link.failed(&error);
                return Err(error);
            }
        };
        match kind.as_str() {
            "stream" => {}
            // Nobody home: without a consumer group, nothing reads the
            // stream the way a consumer that must not miss events does.
            "none" => {
                return Err(SinkError::config(format!(
                    "route {:?} reaches nobody: stream {key:?} does not exist and no consumer group \
                     reads it; create the consumer's group first (XGROUP CREATE {key} <group> 0 \
                     MKSTREAM), or fix routes[].destination",
                    route.name
                )));
            }
            other => {
                return Err(SinkError::config(format!(
                    "route {:?}: key {key:?} holds a {other}, not a stream; delete it or fix \
                     routes[].destination",
                    route.name
                )));
            }
        }
        let groups = match timeout(
            limit,
            ::redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(key)
                .query_async::<Vec<::redis::Value>>(connection),
        )
        .await
        {
            Ok(Ok(groups)) => groups.len(),
            Ok(Err(e)) if is_noperm(&e) => {
                let unseen = format!("whether a consumer group reads stream {key:?}");
                let grant = format!("+xinfo|groups ~{key}");
                return Ok(Some(self.blind(route, "XINFO GROUPS", &unseen, &grant, &e)));
            }
            Ok(Err(e)) => {
                return Err(refused(&route.sink, "listing the consumer groups of a stream in", e));
            }
            Err(_) => {
                let error = SinkError::transient(format!("XINFO GROUPS {key:?}: no answer within {limit:?}"));
                link.failed(&error);
                return Err(error);
            }
        };
        if groups == 0 {
            return Err(SinkError::config(format!(
                "route {:?} reaches nobody: stream {key:?} has no consumer group; create the \
                 consumer's group first (XGROUP CREATE {key} <group> 0), or fix routes[].destination",
                route.name
            )));
        }
        info!(route = %route.name, key, groups, "stream has consumer groups");
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_fields() {
        let info = "# Cluster\r\ncluster_enabled:1\r\n";
        assert_eq!(info_field(info, "cluster_enabled"), Some("1"));
        assert_eq!(info_field("cluster_enabled_x:1\r\n", "cluster_enabled"), None);
        assert_eq!(connected_replicas("# Replication\r\nconnected_slaves:2\r\n"), 2);
        assert_eq!(connected_replicas(""), 0);
    }
}
