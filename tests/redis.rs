//! Redis-only behaviour (feature `redis`): the eviction check, and a master's failover under
//! load, with and without `with_wait_replicas`. Each test starts the servers it breaks, on
//! free loopback ports, so the shared Redis and cluster are never touched.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

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
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid]).status();
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

#[tokio::test]
async fn an_evicting_redis_is_refused_and_noeviction_accepted() {
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
    let prefix = support::redis_support::prefix();
    let store = support::redis_support::cluster_store(&prefix).await;
    store.check_eviction_policy().await.unwrap();
}

/// A store that is down: calls fail fast with a backend error (the layer answers 503).
#[tokio::test]
async fn a_store_that_is_down_fails_within_its_bound() {
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
