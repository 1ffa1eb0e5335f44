//! Redis-only behaviour (feature `redis`): the eviction check, and a master's failover under
//! load, with and without `with_wait_replicas`. Each test starts the servers it breaks, on
//! free loopback ports, so the shared Redis and cluster are never touched.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};

use tower_idempotency::{ClaimRequest, Fingerprint, IdempotencyKey, RedisStore, Store, StoreError};

/// A redis-server of the test's own, shut down (SIGKILL) on drop.
struct Server {
    port: u16,
    dir: std::path::PathBuf,
}

impl Server {
    fn start(port: u16, args: &[&str]) -> Server {
        let dir = std::env::temp_dir().join(format!("ti-redis-test-{}", support::unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--daemonize", "yes", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .arg("--pidfile")
            .arg(dir.join("pid"))
            .arg("--logfile")
            .arg(dir.join("log"))
            .args(args)
            .status()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        assert!(status.success());
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Server { port, dir }
    }

    fn pid(&self) -> Option<String> {
        let started = Instant::now();
        loop {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
                return Some(pid.trim().to_owned());
            }
            if started.elapsed() > Duration::from_secs(2) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&self) {
        self.signal("-KILL");
    }

    fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args([signal, &pid]).status();
        }
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// These tests time replication and failures (`WAIT` timeouts of a few hundred milliseconds)
/// on servers of their own: one at a time, however many test threads run, so that none of
/// them waits on another's load.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn an_evicting_redis_is_refused_and_noeviction_accepted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let port = support::cluster::free_port();
    let server = Server::start(
        port,
        &["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let store = RedisStore::open(&format!("redis://127.0.0.1:{port}")).unwrap();
    match store.check_eviction_policy().await {
        Err(StoreError::Misconfigured(why)) => assert!(why.contains("allkeys-lru"), "{why}"),
        other => panic!("an evicting Redis gave {other:?}"),
    }
    server.cli(&["config", "set", "maxmemory-policy", "noeviction"]);
    store.check_eviction_policy().await.unwrap();
    // A Redis that is gone is a backend error (the example then starts and answers 503).
    drop(server);
    assert!(matches!(
        store.check_eviction_policy().await,
        Err(StoreError::Backend(_) | StoreError::Timeout(_))
    ));
}

#[tokio::test]
async fn the_eviction_check_covers_every_master_of_the_cluster() {
    let _one = ONE_AT_A_TIME.lock().await;
    let prefix = support::redis_support::prefix();
    let store = support::redis_support::cluster_store(&prefix).await;
    store.check_eviction_policy().await.unwrap();
}

/// A store that is down: calls fail fast with a backend error (the layer answers 503).
#[tokio::test]
async fn a_store_that_is_down_fails_within_its_bound() {
    let _one = ONE_AT_A_TIME.lock().await;
    let store = RedisStore::open(&format!(
        "redis://127.0.0.1:{}",
        support::cluster::free_port()
    ))
    .unwrap()
    .with_timeout(Duration::from_secs(1));
    let key = IdempotencyKey::parse("k").unwrap();
    let started = Instant::now();
    let claim = store.claim(claim_of(&key)).await;
    assert!(
        matches!(claim, Err(StoreError::Backend(_) | StoreError::Timeout(_))),
        "{claim:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// How many `WAIT`s a server has answered (`INFO commandstats`).
fn waits(server: &Server) -> usize {
    let stats = server.cli(&["info", "commandstats"]);
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// `count` keys claimed and completed at once; the completions' results.
async fn complete_at_once(store: &RedisStore, count: usize) -> Vec<Result<bool, StoreError>> {
    let answer = tower_idempotency::StoredResponse::new(
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        bytes::Bytes::from("ok"),
    );
    let mut tokens = Vec::new();
    for i in 0..count {
        let key = IdempotencyKey::parse(&format!("k{i}")).unwrap();
        match store.claim(claim_of(&key)).await.unwrap() {
            tower_idempotency::ClaimOutcome::Acquired { token, .. } => tokens.push((key, token)),
            other => panic!("{other:?}"),
        }
    }
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(count));
    let tasks: Vec<_> = tokens
        .into_iter()
        .map(|(key, token)| {
            let (store, answer, barrier) = (store.clone(), answer.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .complete("", &key, token, &answer, Duration::from_secs(60))
                    .await
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    results
}

fn claim_of(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: "",
        key,
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    }
}

/// `with_wait_replicas`: concurrent completions share `WAIT`s (a `WAIT` blocks the
/// connection it is sent on, which every call of the store shares), a completion counts as
/// stored only when the replica has it, and a replica that is gone makes completions fail
/// after about the `WAIT` timeout rather than queue one timeout behind another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_waiting_for_replicas_share_their_waits() {
    let _one = ONE_AT_A_TIME.lock().await;
    let master = Server::start(support::cluster::free_port(), &[]);
    let replica = Server::start(
        support::cluster::free_port(),
        &["--replicaof", "127.0.0.1", &master.port.to_string()],
    );
    let started = Instant::now();
    while !master
        .cli(&["info", "replication"])
        .contains("connected_slaves:1")
        || !replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "replica not up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let store = RedisStore::open(&format!("redis://127.0.0.1:{}", master.port))
        .unwrap()
        .with_prefix(support::redis_support::prefix())
        .with_timeout(Duration::from_secs(2))
        .with_wait_replicas(1, Duration::from_millis(300));

    let results = complete_at_once(&store, 50).await;
    assert!(results.iter().all(|r| matches!(r, Ok(true))), "{results:?}");
    let shared = waits(&master);
    assert!(
        (1..50).contains(&shared),
        "50 concurrent completions sent {shared} WAITs"
    );

    // The replica gone: every completion fails (not acknowledged) within a few WAIT timeouts,
    // though 50 of them are waiting at once; the records are complete on the master all the
    // same (a retry replays them there).
    drop(replica);
    let store = store.with_prefix(support::redis_support::prefix());
    let before = waits(&master);
    let started = Instant::now();
    let results = complete_at_once(&store, 50).await;
    let took = started.elapsed();
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Err(StoreError::Backend(_)))),
        "{results:?}"
    );
    let sent = waits(&master) - before;
    assert!(
        sent < 10,
        "50 completions without a replica sent {sent} WAITs"
    );
    assert!(
        took < Duration::from_secs(2),
        "50 completions without a replica took {took:?}: their WAITs queued"
    );
    let key = IdempotencyKey::parse("k7").unwrap();
    assert!(matches!(
        store.claim(claim_of(&key)).await.unwrap(),
        tower_idempotency::ClaimOutcome::Completed(_)
    ));
}

/// What [`WaitProxy`] does to the next request that carries a `WAIT`.
#[derive(Debug, Clone, Copy)]
enum OnWait {
    /// Closes its connection to the server and forwards the request (and whatever follows) on
    /// a fresh one: the server sees the request arrive as after a reconnect, on a connection
    /// that made no write.
    Reconnect,
    /// Closes the client's connection (both ways) without forwarding the request: a client
    /// that sends it again does so on a fresh connection of its own.
    Cut,
}

/// A TCP proxy on 127.0.0.1 in front of one Redis server. Armed, it breaks the connection
/// between a completion and the `WAIT` that follows it (the store sends its `WAIT` once the
/// completion is answered, so the completion is done when the `WAIT` comes).
struct WaitProxy {
    port: u16,
    armed: Arc<Mutex<Option<OnWait>>>,
    fired: Arc<AtomicUsize>,
    tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

/// How a `WAIT` starts on the wire (the `redis` crate sends `WAIT numreplicas timeout`).
const WAIT_ON_THE_WIRE: &[u8] = b"*3\r\n$4\r\nWAIT\r\n";

impl WaitProxy {
    /// Listens on a free port and forwards each connection to the server on `target`.
    async fn start(target: u16) -> WaitProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = WaitProxy {
            port: listener.local_addr().unwrap().port(),
            armed: Arc::default(),
            fired: Arc::default(),
            tasks: Arc::default(),
        };
        let (armed, fired, tasks) = (
            proxy.armed.clone(),
            proxy.fired.clone(),
            proxy.tasks.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                let conn = tokio::spawn(serve(client, target, armed.clone(), fired.clone()));
                tasks.lock().unwrap().push(conn.abort_handle());
            }
        });
        proxy.tasks.lock().unwrap().push(accept.abort_handle());
        proxy
    }

    /// Breaks the next request that carries a `WAIT`, once.
    fn arm(&self, on_wait: OnWait) {
        *self.armed.lock().unwrap() = Some(on_wait);
    }

    /// How many requests it broke so far.
    fn fired(&self) -> usize {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Drop for WaitProxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// One connection through a [`WaitProxy`].
async fn serve(
    client: TcpStream,
    target: u16,
    armed: Arc<Mutex<Option<OnWait>>>,
    fired: Arc<AtomicUsize>,
) {
    let connect = || async {
        let server = TcpStream::connect(("127.0.0.1", target)).await.ok()?;
        let _ = server.set_nodelay(true);
        Some(server.into_split())
    };
    let Some((from_server, mut to_server)) = connect().await else {
        return;
    };
    let (mut from_client, to_client) = client.into_split();
    let to_client = Arc::new(tokio::sync::Mutex::new(to_client));
    // The server's answers, copied to the client by a task per server connection.
    let answers = |mut from_server: OwnedReadHalf| {
        let to_client = to_client.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = from_server.read(&mut buf).await {
                if to_client.lock().await.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            let _ = to_client.lock().await.shutdown().await;
        })
    };
    let mut down = answers(from_server);
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n @ 1..) = from_client.read(&mut buf).await {
        let request = &buf[..n];
        let carries_wait = request
            .windows(WAIT_ON_THE_WIRE.len())
            .any(|w| w == WAIT_ON_THE_WIRE);
        let on_wait = if carries_wait {
            armed.lock().unwrap().take()
        } else {
            None
        };
        if let Some(on_wait) = on_wait {
            fired.fetch_add(1, Ordering::SeqCst);
            // Stopped for good before the old connection closes: its end must not reach the
            // client.
            down.abort();
            let _ = (&mut down).await;
            match on_wait {
                OnWait::Cut => return,
                OnWait::Reconnect => {
                    let Some((from_server, fresh)) = connect().await else {
                        return;
                    };
                    to_server = fresh;
                    down = answers(from_server);
                }
            }
        }
        if to_server.write_all(request).await.is_err() {
            break;
        }
    }
    down.abort();
}

/// What a master says of its first replica: the replication offset that replica has
/// acknowledged, and the master's own.
fn acknowledged_offsets(master: &Server) -> (u64, u64) {
    let info = master.cli(&["info", "replication"]);
    let field = |line: &str, name: &str| -> Option<u64> {
        line.split([',', ':'])
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.trim().parse().ok())
    };
    let acked = info
        .lines()
        .find(|l| l.starts_with("slave0:"))
        .and_then(|l| field(l, "offset"))
        .unwrap_or(0);
    let own = info
        .lines()
        .find_map(|l| l.strip_prefix("master_repl_offset:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    (acked, own)
}

/// Waits until the master's first replica is online and has acknowledged everything.
fn wait_replicated(master: &Server) {
    let started = Instant::now();
    loop {
        let info = master.cli(&["info", "replication"]);
        let (acked, own) = acknowledged_offsets(master);
        if info.contains("state=online") && acked == own {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "replica not in sync:\n{info}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn acquire(store: &RedisStore, key: &IdempotencyKey) -> tower_idempotency::LeaseToken {
    match store.claim(claim_of(key)).await.unwrap() {
        tower_idempotency::ClaimOutcome::Acquired { token, .. } => token,
        other => panic!("{other:?}"),
    }
}

fn created() -> tower_idempotency::StoredResponse {
    tower_idempotency::StoredResponse::new(
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        bytes::Bytes::from("ok"),
    )
}

/// `WAIT` counts the writes of the connection it is sent on. When the store's connection to
/// the server is replaced between a completion and its `WAIT` (the client reconnected, or the
/// address now leads through another connection), the `WAIT` arrives on a connection that made
/// no write and returns at once with every replica connected. Here the replica is connected but
/// receives nothing (its link stalled): a completion it never received must not be confirmed.
/// With the replica's link back, a completion whose `WAIT` crosses a fresh connection is
/// confirmed once the replica has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_after_a_reconnect_confirms_no_completion_the_replica_lacks() {
    let _one = ONE_AT_A_TIME.lock().await;
    let master = Server::start(support::cluster::free_port(), &[]);
    // The replica's link goes through a proxy the test stalls: the replica stays connected (the
    // master counts it), but receives and acknowledges nothing.
    let link = support::proxy::Proxy::start(([127, 0, 0, 1], master.port).into()).await;
    let _replica = Server::start(
        support::cluster::free_port(),
        &["--replicaof", "127.0.0.1", &link.addr().port().to_string()],
    );
    let proxy = WaitProxy::start(master.port).await;
    let store = RedisStore::open(&format!("redis://127.0.0.1:{}", proxy.port))
        .unwrap()
        .with_prefix(support::redis_support::prefix())
        .with_timeout(Duration::from_secs(2))
        .with_wait_replicas(1, Duration::from_secs(1));

    let key = IdempotencyKey::parse("k").unwrap();
    let token = acquire(&store, &key).await;
    wait_replicated(&master);
    link.pause();
    proxy.arm(OnWait::Reconnect);
    let completed = store
        .complete("", &key, token, &created(), Duration::from_secs(60))
        .await;
    assert_eq!(proxy.fired(), 1, "the WAIT never crossed the proxy");
    let (acked, own) = acknowledged_offsets(&master);
    assert!(
        acked < own,
        "the replica acknowledged everything ({acked} of {own}): nothing to prove"
    );
    assert!(
        matches!(completed, Err(StoreError::Backend(_))),
        "a completion the replica never received (it acknowledged offset {acked} of {own}) \
         was confirmed: {completed:?}"
    );

    link.resume();
    wait_replicated(&master);
    let key = IdempotencyKey::parse("k2").unwrap();
    let token = acquire(&store, &key).await;
    proxy.arm(OnWait::Reconnect);
    let completed = store
        .complete("", &key, token, &created(), Duration::from_secs(60))
        .await;
    assert_eq!(proxy.fired(), 2, "the WAIT never crossed the proxy");
    assert!(matches!(completed, Ok(true)), "{completed:?}");
}

/// A free port whose cluster bus port (`port + 10000`) is a port too.
fn cluster_port() -> u16 {
    loop {
        let port = support::cluster::free_port();
        if port < 55000 {
            return port;
        }
    }
}

/// The same in a Redis Cluster, on a cluster of the test's own: one master, which holds every
/// slot and announces the proxy's address (so clients reach it through the proxy), and its
/// replica, stopped (SIGSTOP) while the completions are made: connected, it receives nothing.
/// The proxy breaks the connection between each completion and its `WAIT`: it sends the
/// `WAIT` to the server on a fresh connection, or cuts the client's connection, and the
/// cluster client sends the `WAIT` again to the same node on a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_wait_after_a_reconnect_confirms_no_completion_the_replica_lacks() {
    let _one = ONE_AT_A_TIME.lock().await;
    let master_port = cluster_port();
    let proxy = WaitProxy::start(master_port).await;
    let node = |announced: u16, bus: u16| {
        [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "5000",
            "--cluster-announce-ip",
            "127.0.0.1",
        ]
        .map(str::to_owned)
        .into_iter()
        .chain([
            "--cluster-announce-port".to_owned(),
            announced.to_string(),
            "--cluster-announce-bus-port".to_owned(),
            bus.to_string(),
        ])
        .collect::<Vec<_>>()
    };
    let args = node(proxy.port, master_port + 10000);
    let master = Server::start(
        master_port,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let replica_port = cluster_port();
    let args = node(replica_port, replica_port + 10000);
    let replica = Server::start(
        replica_port,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(
        master
            .cli(&["cluster", "addslotsrange", "0", "16383"])
            .contains("OK")
    );
    let id = master.cli(&["cluster", "myid"]).trim().to_owned();
    replica.cli(&["cluster", "meet", "127.0.0.1", &master_port.to_string()]);
    let started = Instant::now();
    while !replica.cli(&["cluster", "replicate", &id]).contains("OK") {
        assert!(started.elapsed() < Duration::from_secs(20), "no replica");
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    while !(master
        .cli(&["cluster", "info"])
        .contains("cluster_state:ok")
        && replica
            .cli(&["cluster", "info"])
            .contains("cluster_state:ok"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "cluster not ok"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_replicated(&master);
    let client =
        ::redis::cluster::ClusterClient::builder(vec![format!("redis://127.0.0.1:{}", proxy.port)])
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
    let store = RedisStore::cluster(client.get_async_connection().await.unwrap())
        .with_prefix(support::redis_support::prefix())
        .with_timeout(Duration::from_secs(3))
        .with_wait_replicas(1, Duration::from_secs(1));

    // With the replica there, a completion is confirmed (and the scripts are loaded on every
    // node, the replica included, before it stops).
    let key = IdempotencyKey::parse("first").unwrap();
    let token = acquire(&store, &key).await;
    let completed = store
        .complete("", &key, token, &created(), Duration::from_secs(60))
        .await;
    assert!(matches!(completed, Ok(true)), "{completed:?}");

    let breaks = [OnWait::Reconnect, OnWait::Cut];
    let mut claimed = Vec::new();
    for on_wait in breaks {
        let key = IdempotencyKey::parse(&format!("{on_wait:?}")).unwrap();
        let token = acquire(&store, &key).await;
        claimed.push((on_wait, key, token));
    }
    wait_replicated(&master);
    replica.signal("-STOP");
    let mut outcomes = Vec::new();
    for (on_wait, key, token) in claimed {
        proxy.arm(on_wait);
        let completed = store
            .complete("", &key, token, &created(), Duration::from_secs(60))
            .await;
        outcomes.push((on_wait, completed, acknowledged_offsets(&master)));
    }
    replica.signal("-CONT");
    assert_eq!(
        proxy.fired(),
        breaks.len(),
        "a WAIT never crossed the proxy"
    );
    for (on_wait, completed, (acked, own)) in outcomes {
        assert!(
            acked < own,
            "{on_wait:?}: the replica acknowledged everything ({acked} of {own})"
        );
        assert!(
            matches!(completed, Err(StoreError::Backend(_))),
            "{on_wait:?}: a completion the replica never received (it acknowledged offset \
             {acked} of {own}) was confirmed: {completed:?}"
        );
    }
}
