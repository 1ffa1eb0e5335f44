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
        let cluster = Cluster { ports, dir };
        for p in &cluster.ports {
            cluster.spawn(*p);
        }
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
        // And every replica in sync with its master, so that the load starts replicated.
        let started = Instant::now();
        while cluster
            .ports
            .iter()
            .map(|p| cli(*p, &["info", "replication"]))
            .filter(|info| info.contains("master_link_status:up"))
            .count()
            < 3
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "replicas not in sync"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// Starts (or restarts, with its cluster configuration) the node on `port`.
    fn spawn(&self, port: u16) {
        let d = self.dir.join(port.to_string());
        std::fs::create_dir_all(&d).unwrap();
        let ok = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
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

    fn pid(&self, port: u16) -> String {
        std::fs::read_to_string(self.dir.join(port.to_string()).join("pid"))
            .unwrap()
            .trim()
            .to_owned()
    }

    fn kill(&self, port: u16) {
        self.signal(port, "-KILL");
    }

    fn signal(&self, port: u16, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, &self.pid(port)])
            .status();
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

/// How long the replica lags behind its master before the master is killed.
const LAG: Duration = Duration::from_millis(300);

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
    /// Keys whose unacknowledged completion was gone after the failover: the retry ran
    /// again (which the failed completion warned of).
    unacknowledged_then_lost: usize,
    /// Keys run more than once.
    run_twice: usize,
    /// Calls that failed during the failover and were retried.
    retried_errors: usize,
}

/// Runs `keys` keys through claim/complete with `workers` workers while, after `kill_after`,
/// one master is killed and its replica promoted; then retries every key.
async fn run(cluster: &Cluster, store: RedisStore, keys: usize, kill_after: Duration) -> Counts {
    let started = Instant::now();
    let runs: Arc<Mutex<HashMap<usize, usize>>> = Arc::default();
    let answered: Arc<Mutex<Vec<(usize, bool)>>> = Arc::default();
    let counts: Arc<Mutex<Counts>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let answer = StoredResponse::new(StatusCode::CREATED, HeaderMap::new(), Bytes::from("ok"));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (store, runs, answered, counts, next, answer) = (
            store.clone(),
            runs.clone(),
            answered.clone(),
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
                                    answered.lock().unwrap().push((i, true));
                                    break;
                                }
                                // Not acknowledged: the client gets its answer all the same,
                                // and a retry decides (below, after the failover).
                                _ => {
                                    counts.lock().unwrap().unacknowledged += 1;
                                    answered.lock().unwrap().push((i, false));
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
    // The replica falls behind (stopped, and cut from its master, as a partition would
    // leave it) while its master goes on acknowledging writes; then the master dies and the
    // replica, resumed, takes over with what it had. (Stopping the replica alone loses
    // nothing on loopback: what the master sent waits in the replica's socket buffer.)
    cluster.signal(replica, "-STOP");
    cli(master, &["client", "kill", "type", "replica"]);
    tokio::time::sleep(LAG).await;
    cluster.kill(master);
    cluster.signal(replica, "-CONT");
    let promoted = cli(replica, &["cluster", "failover", "takeover"]);
    assert!(promoted.contains("OK"), "{promoted}");
    // The killed node comes back, as operators bring it back: it rejoins as the replica of
    // the master that replaced it (until then, that master has no replica to wait for).
    cluster.spawn(master);
    for t in tasks {
        t.await.unwrap();
    }
    println!("{keys} keys in {:?}", started.elapsed());
    // After the failover, each key answered by its handler is retried: it replays, or it is
    // claimable (its completion was lost) and the retry runs the handler again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut c = std::mem::take(&mut *counts.lock().unwrap());
    let answered = answered.lock().unwrap().clone();
    for &(i, acknowledged) in answered.iter() {
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
            if acknowledged {
                c.acknowledged_then_lost += 1;
            } else {
                c.unacknowledged_then_lost += 1;
            }
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
async fn a_master_killed_mid_load_loses_only_unacknowledged_completions() {
    // Two clusters of their own, started at once (each takes seconds to form and sync).
    let (first, second) = tokio::join!(
        tokio::task::spawn_blocking(Cluster::start),
        tokio::task::spawn_blocking(Cluster::start)
    );
    let (cluster, second) = (first.unwrap(), second.unwrap());

    // Without WAIT: asynchronous replication may lose acknowledged completions.
    let plain = cluster.store(&support::redis_support::prefix()).await;
    let without = run(&cluster, plain, 3000, Duration::from_millis(300)).await;
    drop(cluster);
    println!("failover without WAIT: {without:?}");
    // The failover does lose acknowledged completions (so the half below proves something),
    // and each lost key runs again.
    assert!(
        without.acknowledged_then_lost > 0,
        "the lagging replica lost nothing: {without:?}"
    );
    assert_eq!(
        without.run_twice,
        without.acknowledged_then_lost + without.unacknowledged_then_lost
    );

    // With WAIT 1: a completion counts only once the replica has it.
    let cluster = second;
    let waiting = cluster
        .store(&support::redis_support::prefix())
        .await
        .with_wait_replicas(1, Duration::from_millis(200));
    let with = run(&cluster, waiting, 3000, Duration::from_millis(300)).await;
    println!("failover with WAIT 1: {with:?}");
    assert_eq!(
        with.acknowledged_then_lost, 0,
        "a completion acknowledged by the replica was lost: {with:?}"
    );
    // Every key ran, and each key that ran twice had a completion that said it might not
    // last.
    assert!(with.executions >= with.keys);
    assert_eq!(with.run_twice, with.unacknowledged_then_lost);
    assert!(with.unacknowledged_then_lost <= with.unacknowledged);
}
