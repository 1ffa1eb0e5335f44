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
    let claim = store
        .claim(ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        })
        .await;
    assert!(
        matches!(claim, Err(StoreError::Backend(_) | StoreError::Timeout(_))),
        "{claim:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
}
