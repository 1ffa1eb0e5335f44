//! A Redis Cluster master killed (SIGKILL) under load, its replica promoted with
//! `CLUSTER FAILOVER TAKEOVER`, the clients retrying: what asynchronous replication loses, and
//! what `with_wait_replicas` keeps. The test starts a cluster of its own (three masters,
//! three replicas, on free loopback ports), so the shared one is never broken.
//!
//! Run with `--nocapture` to see the counts.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, RedisStore, Store, StoredResponse,
};

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli is installed (scripts/test.sh installs it)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Six nodes of the test's own; killed on drop.
struct Cluster {
    ports: Vec<u16>,
    dir: std::path::PathBuf,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = std::env::temp_dir().join(format!("ti-redis-failover-{}", support::unique()));
        let mut ports = Vec::new();
        while ports.len() < 6 {
            let p = support::cluster::free_port();
            // The cluster bus listens on port + 10000.
            if p < 55000 && !ports.contains(&p) {
                ports.push(p);
            }
        }
        for p in &ports {
            let d = dir.join(p.to_string());
            std::fs::create_dir_all(&d).unwrap();
            let ok = Command::new("redis-server")
                .args(["--port", &p.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--daemonize", "yes", "--save", "", "--appendonly", "no"])
                .arg("--cluster-config-file")
                .arg(d.join("nodes.conf"))
                .arg("--dir")
                .arg(&d)
                .arg("--pidfile")
                .arg(d.join("pid"))
                .arg("--logfile")
                .arg(d.join("log"))
                .status()
                .expect("redis-server is installed")
                .success();
            assert!(ok);
        }
        let cluster = Cluster { ports, dir };
        for p in &cluster.ports {
            let started = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", *p)).is_err() {
                assert!(started.elapsed() < Duration::from_secs(10));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let started = Instant::now();
        while !cluster
            .ports
            .iter()
            .all(|p| cli(*p, &["cluster", "info"]).contains("cluster_state:ok"))
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "cluster not ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    fn pid(&self, port: u16) -> String {
        std::fs::read_to_string(self.dir.join(port.to_string()).join("pid"))
            .unwrap()
            .trim()
            .to_owned()
    }

    fn kill(&self, port: u16) {
        let _ = Command::new("kill").args(["-9", &self.pid(port)]).status();
    }

    /// A master's port and its replica's port.
    fn master_and_replica(&self) -> (u16, u16) {
        let nodes = cli(self.ports[0], &["cluster", "nodes"]);
        let port_of = |addr: &str| -> u16 {
            addr.split('@')
                .next()
                .unwrap()
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        for line in nodes.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f[2].contains("master") {
                let id = f[0];
                if let Some(replica) = nodes.lines().find(|l| l.split(' ').nth(3) == Some(id)) {
                    return (port_of(f[1]), port_of(replica.split(' ').nth(1).unwrap()));
                }
            }
        }
        panic!("no master with a replica:\n{nodes}");
    }

    async fn store(&self, prefix: &str) -> RedisStore {
        let urls: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        let client = ::redis::cluster::ClusterClient::builder(urls)
            .connection_timeout(Duration::from_millis(500))
            .response_timeout(Duration::from_secs(1))
            .retries(2)
            .build()
            .unwrap();
        RedisStore::cluster(client.get_async_connection().await.unwrap())
            .with_prefix(prefix)
            .with_timeout(Duration::from_secs(2))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in self.ports.clone() {
            self.kill(p);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one run under load saw.
#[derive(Debug, Default)]
struct Counts {
    keys: usize,
    /// Handler runs in all (one per key when nothing is lost).
    executions: usize,
    /// Completions the store acknowledged (`complete` gave `Ok(true)`).
    acknowledged: usize,
    /// Completions that failed (an error, or `WAIT` short of the replicas).
    unacknowledged: usize,
    /// Keys whose acknowledged completion was gone after the failover: the retry ran again.
    acknowledged_then_lost: usize,
    /// Keys run more than once.
    run_twice: usize,
    /// Calls that failed during the failover and were retried.
    retried_errors: usize,
}

/// Runs `keys` keys through claim/complete with `workers` workers while, after `kill_after`,
/// one master is killed and its replica promoted; then checks every acknowledged key.
async fn run(cluster: &Cluster, store: RedisStore, keys: usize, kill_after: Duration) -> Counts {
    let runs: Arc<Mutex<HashMap<usize, usize>>> = Arc::default();
    let acked: Arc<Mutex<Vec<usize>>> = Arc::default();
    let counts: Arc<Mutex<Counts>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let answer = StoredResponse::new(StatusCode::CREATED, HeaderMap::new(), Bytes::from("ok"));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (store, runs, acked, counts, next, answer) = (
            store.clone(),
            runs.clone(),
            acked.clone(),
            counts.clone(),
            next.clone(),
            answer.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= keys {
                    return;
                }
                let key = IdempotencyKey::parse(&format!("k{i}")).unwrap();
                // Retries until the key is answered: by this worker, or as a replay.
                loop {
                    let claim = ClaimRequest {
                        scope: "",
                        key: &key,
                        fingerprint: Fingerprint::from_bytes([1; 32]),
                        lease: Duration::from_millis(500),
                        ttl: Duration::from_secs(600),
                    };
                    match store.claim(claim).await {
                        Ok(ClaimOutcome::Acquired { token, .. }) => {
                            *runs.lock().unwrap().entry(i).or_default() += 1;
                            match store
                                .complete("", &key, token, &answer, Duration::from_secs(600))
                                .await
                            {
                                Ok(true) => {
                                    counts.lock().unwrap().acknowledged += 1;
                                    acked.lock().unwrap().push(i);
                                    break;
                                }
                                // Not acknowledged: the client gets its answer all the same,
                                // and a retry decides (below, after the failover).
                                _ => {
                                    counts.lock().unwrap().unacknowledged += 1;
                                    break;
                                }
                            }
                        }
                        Ok(ClaimOutcome::Completed(_)) => break,
                        Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        Err(_) => {
                            counts.lock().unwrap().retried_errors += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(kill_after).await;
    let (master, replica) = cluster.master_and_replica();
    cluster.kill(master);
    let promoted = cli(replica, &["cluster", "failover", "takeover"]);
    assert!(promoted.contains("OK"), "{promoted}");
    for t in tasks {
        t.await.unwrap();
    }
    // After the failover: every acknowledged key must replay; one that is claimable lost its
    // completion, and its retry (after the lease) runs again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut c = std::mem::take(&mut *counts.lock().unwrap());
    let acked_now = acked.lock().unwrap().clone();
    for &i in acked_now.iter() {
        let key = IdempotencyKey::parse(&format!("k{i}")).unwrap();
        let claim = ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_millis(500),
            ttl: Duration::from_secs(600),
        };
        let outcome = loop {
            match store.claim(claim).await {
                Ok(o) => break o,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        if matches!(outcome, ClaimOutcome::Acquired { .. }) {
            c.acknowledged_then_lost += 1;
            *runs.lock().unwrap().entry(i).or_default() += 1;
        }
    }
    let runs = runs.lock().unwrap();
    c.keys = keys;
    c.executions = runs.values().sum();
    c.run_twice = runs.values().filter(|n| **n > 1).count();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "unfinished: the half with WAIT did not finish within 300 s on a 2-core machine \
            (each completion on the promoted master, which has no replica, waits the WAIT \
            timeout); the half without WAIT measured 447 of 3000 acknowledged completions lost"]
async fn a_master_killed_mid_load_loses_only_unacknowledged_completions() {
    // Without WAIT: asynchronous replication may lose acknowledged completions.
    let cluster = Cluster::start();
    let plain = cluster.store(&support::redis_support::prefix()).await;
    let without = run(&cluster, plain, 3000, Duration::from_millis(300)).await;
    drop(cluster);
    println!("failover without WAIT: {without:?}");

    // With WAIT 1: a completion counts only once the replica has it.
    let cluster = Cluster::start();
    let waiting = cluster
        .store(&support::redis_support::prefix())
        .await
        .with_wait_replicas(1, Duration::from_millis(500));
    let with = run(&cluster, waiting, 3000, Duration::from_millis(300)).await;
    println!("failover with WAIT 1: {with:?}");
    assert_eq!(
        with.acknowledged_then_lost, 0,
        "a completion acknowledged by the replica was lost: {with:?}"
    );
    // Every key ran at least once, and each run beyond the first is accounted for by a
    // completion that was not durably acknowledged.
    assert!(with.executions >= with.keys);
    assert!(
        with.run_twice <= with.unacknowledged,
        "a key ran twice without a lost, unacknowledged completion: {with:?}"
    );
}
