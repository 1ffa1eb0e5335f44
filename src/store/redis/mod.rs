//! [`RedisStore`]: keys in Redis or Redis Cluster (feature `redis`).

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use ::redis::{Cmd, RedisError, RedisFuture, Value};
use sha2::{Digest, Sha256};

use super::KeyNotifier;
#[cfg(doc)]
use super::Store;
use crate::error::StoreError;
use crate::key::IdempotencyKey;

mod ops;
mod replicate;
mod scripts;
mod subscribe;
mod wire;

use replicate::Replication;
use scripts::Scripts;
use subscribe::RedisNotifier;
use wire::*;

/// The default bound of each call to Redis ([`RedisStore::with_timeout`]).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default grace ([`RedisStore::with_grace`]).
const DEFAULT_GRACE: Duration = Duration::from_secs(24 * 3600);
/// The default prefix of the store's keys ([`RedisStore::with_prefix`]).
const DEFAULT_PREFIX: &str = "tower-idempotency:";

/// A store in Redis (a single server, or a Redis Cluster), shared by every app instance that
/// uses it. Plain mode only: Redis has no transaction that could hold the handler's own
/// writes, so there is no transactional mode on Redis.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::open("redis://127.0.0.1:6379")?;
/// store.check_eviction_policy().await?; // refuse to start on an evicting Redis
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Atomicity and clocks
///
/// Claim, complete, release, renew and the purge's delete are each one Lua script (sent with
/// `EVALSHA`, loaded again if the server's script cache was flushed), so each runs atomically
/// on the server: of fifty racing claims of a key, one is acquired. Every time (leases,
/// expiry, tokens) is the server's: `TIME` inside the script, and `PEXPIREAT` / `PXAT`
/// relative to it. App instances with skewed clocks agree.
///
/// # Keys
///
/// A record lives under `<prefix>{<digest>}:r`, a hash; its fence under
/// `<prefix>{<digest>}:f`, a string holding the last token given for the key. The digest is
/// the first 128 bits of SHA-256 of the scope and the key, in hex: a fixed length whatever
/// the scope and key hold, and no braces, so the hash tag is always the digest and a record
/// and its fence share one Cluster slot (scripts touch only their own slot). Records of
/// different keys spread over all slots: nothing is shared between keys, not even a token
/// counter. With [`with_wait_replicas`](Self::with_wait_replicas), each `WAIT` round also
/// sets and deletes `<prefix>{<digest>}:w` of a record it covers, in one script: the key never
/// outlives the script.
///
/// # Fencing tokens
///
/// A claim's token is `max(last + 1, now_µs)`, where `last` is the highest token given for
/// the key so far (kept in the record and in its fence) and `now_µs` is the server's time
/// in microseconds. Why a stale owner can never act after another claim:
///
/// 1. complete, renew and release act only when the record is in progress and its `tok`
///    equals the caller's token, checked and written in one script;
/// 2. while the fence exists, each new token of the key is greater than every earlier one
///    (`last + 1`), so it differs from every token ever handed out for the key;
/// 3. the fence outlives the record by the grace ([`with_grace`](Self::with_grace), 24 h)
///    and is written by every script that changes the record. Once it is gone, the key has
///    had no record for a grace; a new token is then at least the server's time, which is
///    past every earlier token of the key (each was at most its claim's time plus the number
///    of claims that ran ahead of the clock, a few microseconds) unless the server's clock
///    went back by more than the grace.
///
/// Tokens are unique per key (all the contract needs: a token is always presented with its
/// key), not across keys: two keys claimed in the same microsecond get the same token.
///
/// # Expiry and memory
///
/// A completed record leaves by Redis's own expiry at the end of its TTL. An in-progress
/// record stays a grace past its logical end, so that an owner that stalled past its lease
/// and TTL, with nobody claiming the key, can still renew or complete it (as the
/// [`Store`] contract says); [`purge_expired`](Store::purge_expired) deletes such records
/// early (it `SCAN`s the store's prefix on every master: run it rarely, or never). Each key
/// thus costs two Redis keys: the record (with its answer) and the fence (a few dozen
/// bytes), the fence lasting a grace longer.
///
/// **Eviction**: with `maxmemory` set and a `maxmemory-policy` other than `noeviction`, Redis
/// may drop any record under memory pressure, an in-progress one included: a retry then runs
/// the handler again. [`check_eviction_policy`](Self::check_eviction_policy) refuses such a
/// server.
///
/// # Durability
///
/// Redis acknowledges a write before its replicas have it. If a master fails before
/// replicating a completion, the promoted replica does not have it: the key is in progress
/// (or absent) there, and a retry after the lease runs the handler again.
/// [`with_wait_replicas`](Self::with_wait_replicas) makes a completion wait for replicas
/// (`WAIT`) and count as stored only when they have it, whatever happened to the connection
/// in between (a reconnect, an address that now leads to another server). Persistence (AOF,
/// RDB) is the server's configuration.
///
/// # Bounds and errors
///
/// Each call is bounded by [`with_timeout`](Self::with_timeout) (5 s), which becomes
/// [`StoreError::Timeout`]; a connection error is [`StoreError::Backend`]. Either way, the
/// layer answers `503` before the handler runs.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    scripts: Arc<Scripts>,
    prefix: Arc<str>,
    timeout: Duration,
    grace: Duration,
    wait: Option<Arc<Replication>>,
    notifier: Option<Arc<RedisNotifier>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &matches!(self.conn, Conn::Cluster(_)))
            .field("prefix", &&*self.prefix)
            .field("timeout", &self.timeout)
            .field("grace", &self.grace)
            .field("wait_replicas", &self.wait)
            .field("notifications", &self.notifier.is_some())
            .finish()
    }
}

/// A connection to a single server or to a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl RedisStore {
    /// A store on a single Redis server, through a connection manager (which reconnects by
    /// itself).
    pub fn new(conn: ConnectionManager) -> Self {
        Self::with_conn(Conn::Single(conn))
    }

    /// A store on a Redis Cluster.
    pub fn cluster(conn: ClusterConnection) -> Self {
        Self::with_conn(Conn::Cluster(conn))
    }

    /// A store on the single server at `url` (`redis://host:port/db`), connected lazily: the
    /// first call connects, and a server that is down answers calls with errors (`503`)
    /// rather than failing here.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when `url` is not a Redis URL.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let client = ::redis::Client::open(url).map_err(StoreError::backend)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_TIMEOUT))
            .set_response_timeout(Some(DEFAULT_TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let manager =
            ConnectionManager::new_lazy_with_config(client, config).map_err(StoreError::backend)?;
        Ok(Self::new(manager))
    }

    fn with_conn(conn: Conn) -> Self {
        Self {
            conn,
            scripts: Arc::new(Scripts::new()),
            prefix: DEFAULT_PREFIX.into(),
            timeout: DEFAULT_TIMEOUT,
            grace: DEFAULT_GRACE,
            wait: None,
            notifier: None,
        }
    }

    /// The prefix of the store's keys (default `tower-idempotency:`), so that several
    /// applications (or tests) share one Redis without meeting. Braces are replaced by `_`:
    /// the hash tag must be the record's digest.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix: String = prefix
            .into()
            .chars()
            .map(|c| if c == '{' || c == '}' { '_' } else { c })
            .collect();
        self.prefix = prefix.into();
        if let Some(n) = &self.notifier {
            let client = n.client().clone();
            self = self.with_notifications(client);
        }
        self
    }

    /// The bound of each call to Redis (default 5 s): past it, the call fails with
    /// [`StoreError::Timeout`] (whether a write took effect is then unknown). Keep it at or
    /// below the layer's
    /// [`with_store_timeout`](crate::IdempotencyLayer::with_store_timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long an in-progress record outlives its logical end, and a key's fence its record
    /// (default 24 h). See [Fencing tokens](Self#fencing-tokens): fencing holds unless the
    /// server's clock goes back by more than this.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Wakes the duplicates waiting for a key
    /// ([`with_wait_for_completion`](crate::IdempotencyLayer::with_wait_for_completion)) when
    /// it is completed or released, in every process sharing the store (default: off, and
    /// waiters poll: they claim again at growing intervals, 20 ms up to 500 ms).
    ///
    /// Completions and releases then `PUBLISH` the key's hash on `<prefix>changes`, and the
    /// store keeps one connection of its own, made from `client` by the first waiter, that
    /// subscribes to it. In a cluster, `client` may point at any node: Redis Cluster carries
    /// `PUBLISH` to every node (which costs every node a little for each completion). While
    /// the subscriber is not connected, waiters poll.
    pub fn with_notifications(mut self, client: ::redis::Client) -> Self {
        let channel = format!("{}changes", self.prefix);
        self.notifier = Some(Arc::new(RedisNotifier::new(client, channel)));
        self
    }

    /// Makes each completion wait (`WAIT numreplicas timeout`) until `replicas` replicas
    /// acknowledge it, at most `timeout` (default: no wait). A completion that fewer replicas
    /// acknowledged in time fails with [`StoreError::Backend`]: the layer logs it and the
    /// client gets the handler's answer all the same. The record is completed on the master
    /// either way, but only an acknowledged completion survives the master's failover.
    ///
    /// `WAIT` counts only the writes of the connection it is sent on, and a connection that
    /// made none (after a reconnect, or behind an address that moved to another server)
    /// returns at once. So the `WAIT` is not trusted alone: the completion script names the
    /// replication ID of the master that stored it, and the `WAIT` follows, on the same
    /// connection, a small write (a key set and deleted) that tells the replication ID it ran
    /// under. The completion counts as acknowledged only when both IDs are the same (one
    /// master process, one stream of writes, in which the completion came before that write)
    /// and `replicas` replicas acknowledged that write. After a failover or a restart of the
    /// master, a completion it stored before fails (unconfirmed), even if it did reach the
    /// replicas. The scripts read the replication ID with `INFO replication`: a Redis user
    /// restricted by ACLs needs `INFO` (category `@dangerous`), or every completion fails
    /// unconfirmed.
    ///
    /// `WAIT` blocks the connection it is sent on, which all the store's calls to that
    /// server share; so concurrent completions share their `WAIT`s (at most one in flight
    /// per server, covering every completion that server had stored before it was sent).
    /// Costs each first request one more round trip and the time the replicas take; with a
    /// replica gone, each completion waits up to about twice `timeout` and fails, and calls
    /// behind a `WAIT` on that server wait for it: keep `timeout` short (tens of
    /// milliseconds to a few hundred).
    pub fn with_wait_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait = (replicas > 0).then(|| Replication::new(replicas, timeout));
        self
    }

    /// Checks that Redis will not evict the store's keys: `maxmemory-policy` must be
    /// `noeviction` (on every master of a cluster). Call it at start.
    ///
    /// # Errors
    ///
    /// [`StoreError::Misconfigured`] when a server evicts keys under memory pressure (it may
    /// then drop in-progress records, and a retry would run its handler again); a backend
    /// error when the servers cannot be asked (or refuse `CONFIG GET`).
    pub async fn check_eviction_policy(&self) -> Result<(), StoreError> {
        let mut cmd = ::redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let value = self
            .bounded(async {
                let mut conn = self.conn.clone();
                match &mut conn {
                    Conn::Single(c) => cmd.query_async::<Value>(c).await,
                    Conn::Cluster(c) => {
                        c.route_command(
                            cmd,
                            RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
                        )
                        .await
                    }
                }
            })
            .await?;
        let mut policies = Vec::new();
        collect_policies(&value, &mut policies);
        if policies.is_empty() {
            return Err(StoreError::Misconfigured(
                "CONFIG GET maxmemory-policy gave no policy".into(),
            ));
        }
        match policies.into_iter().find(|p| p != "noeviction") {
            Some(policy) => Err(StoreError::Misconfigured(format!(
                "Redis evicts keys (maxmemory-policy {policy}): in-progress idempotency keys \
                 could be dropped and their requests run twice; set maxmemory-policy \
                 noeviction, or use a Redis of its own for the store"
            ))),
            None => Ok(()),
        }
    }

    /// The keys of a (scope, key): its record and its fence.
    fn keys(&self, scope: &str, key: &IdempotencyKey) -> (String, String) {
        let mut h = Sha256::new();
        h.update((scope.len() as u64).to_be_bytes());
        h.update(scope.as_bytes());
        h.update(key.as_str().as_bytes());
        let digest = h.finalize();
        let tag = crate::hex::encode(&digest[..16]);
        let prefix = &self.prefix;
        (
            format!("{prefix}{{{tag}}}:r"),
            format!("{prefix}{{{tag}}}:f"),
        )
    }

    /// The channel and message that wake a key's waiters (empty when notifications are off).
    fn wake(&self, scope: &str, key: &IdempotencyKey) -> (String, String) {
        match &self.notifier {
            Some(n) => (
                n.channel().to_owned(),
                KeyNotifier::key_hash(scope, key).to_string(),
            ),
            None => (String::new(), String::new()),
        }
    }

    /// Runs `call` within the store's bound, mapping its error.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) if e.is_timeout() => Err(StoreError::Timeout(timeout)),
            Ok(Err(e)) => Err(StoreError::backend(e)),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    /// Runs a script on the record's keys.
    async fn run<T: ::redis::FromRedisValue>(
        &self,
        script: &::redis::Script,
        keys: &(String, String),
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut invocation = script.key(&keys.0);
        invocation.key(&keys.1);
        for arg in args {
            invocation.arg(*arg);
        }
        let mut conn = self.conn.clone();
        self.bounded(invocation.invoke_async(&mut conn)).await
    }

    /// The addresses of the masters to scan: the server itself, or each master of the
    /// cluster.
    async fn masters(&self) -> Result<Vec<Option<(String, u16)>>, StoreError> {
        let Conn::Cluster(c) = &self.conn else {
            return Ok(vec![None]);
        };
        let mut c = c.clone();
        let mut cmd = ::redis::cmd("CLUSTER");
        cmd.arg("NODES");
        let value = self
            .bounded(c.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)))
            .await?;
        let text: String = ::redis::from_redis_value(value).map_err(StoreError::backend)?;
        Ok(parse_masters(&text).into_iter().map(Some).collect())
    }

    /// One `SCAN` step on a master.
    async fn scan(
        &self,
        node: Option<&(String, u16)>,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut cmd = ::redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(format!("{}{{*}}:r", glob_escape(&self.prefix)))
            .arg("COUNT")
            // SCAN's COUNT is the keyspace visited per call, not the matches returned: on a
            // Redis shared with other data, a small batch would cost one round trip per few
            // unrelated keys.
            .arg(count.max(1000));
        let mut conn = self.conn.clone();
        self.bounded(async {
            match (&mut conn, node) {
                (Conn::Cluster(c), Some((host, port))) => {
                    let v = c
                        .route_command(
                            cmd,
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                host: host.clone(),
                                port: *port,
                            }),
                        )
                        .await?;
                    ::redis::from_redis_value(v).map_err(RedisError::from)
                }
                (c, _) => cmd.query_async(c).await,
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masters_are_read_from_cluster_nodes() {
        let nodes = "\
a 127.0.0.1:21001@31001 myself,master - 0 0 1 connected 0-5460
b 127.0.0.1:21004@31004 slave a 0 0 1 connected
c 127.0.0.1:21002@31002 master,fail - 0 0 2 connected 5461-10922
d 127.0.0.1:21005@31005 master - 0 0 4 connected 10923-16383
";
        assert_eq!(
            parse_masters(nodes),
            vec![
                ("127.0.0.1".to_owned(), 21001),
                ("127.0.0.1".to_owned(), 21005)
            ]
        );
    }

    #[test]
    fn policies_are_found_in_single_and_cluster_answers() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let mut out = Vec::new();
        collect_policies(
            &Value::Array(vec![s("maxmemory-policy"), s("noeviction")]),
            &mut out,
        );
        collect_policies(
            &Value::Map(vec![(
                s("127.0.0.1:21001"),
                Value::Array(vec![s("maxmemory-policy"), s("allkeys-lru")]),
            )]),
            &mut out,
        );
        assert_eq!(out, ["noeviction", "allkeys-lru"]);
    }

    #[test]
    fn slots_follow_the_hash_tag() {
        // The examples of the Redis Cluster specification.
        assert_eq!(slot("123456789"), 0x31c3);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
    }

    #[test]
    fn prefixes_are_escaped_for_scan() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
