//! Failover under load, end to end: the payments example runs on a primary with a
//! synchronous streaming standby (private clusters on loopback ports), reached through a TCP
//! proxy that plays the part of the database's virtual IP. Clients pay with keys, retrying
//! each key until it is answered with something else than `503` or `409`. Mid-load the
//! primary is killed with `SIGKILL`, the standby promoted, and the proxy switched to it.
//!
//! What must hold: no answer is a `500` (or any other error); every `503` comes within the
//! store timeout and a margin (no hang); no payment is charged twice (the provider's charges
//! equal the keys that were paid, and each order's total is the sum of its payments once);
//! no completed key is lost: every answer given before the failover is replayed byte for byte
//! after it. With synchronous replication every commit a client heard of is on the standby.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use support::cluster::Cluster;
use support::proxy::Proxy;

/// The example's store timeout (`IDEMPOTENCY_STORE_TIMEOUT_MS`).
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// A `503` must come within the store timeout and this margin. A payment makes up to two
/// store calls in a row that may each stall for the store timeout (the payments layer's and
/// the provider's, nested), hence twice the timeout, plus time for a noisy machine.
const BOUND_503: Duration = Duration::from_secs(2 * 2 + 3);
/// The example's lease (`IDEMPOTENCY_LEASE_MS`): longer than a payment takes, and short enough
/// that a payment the failover cut off frees its key soon (the default, 30 s, kept every such
/// key's retries at `409` for most of the test's time).
const LEASE: Duration = Duration::from_secs(3);
/// Longer than any answer may take: a request still pending then hangs.
const HANG: Duration = Duration::from_secs(30);
/// Concurrent clients.
const CLIENTS: usize = 8;

/// The payments example, started on a `DATABASE_URL`; killed when dropped.
struct Example {
    child: Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
}

impl Example {
    fn start(database_url: &str, log: std::path::PathBuf) -> Example {
        let mut command = Command::new(support::example_path("payments"));
        for var in [
            "BIND",
            "DATABASE_URL",
            "IDEMPOTENCY_TTL_SECS",
            "IDEMPOTENCY_LEASE_MS",
            "IDEMPOTENCY_STORE_TIMEOUT_MS",
            "CHARGE_DELAY_MS",
            "MAX_BODY_BYTES",
            "IDEMPOTENCY",
        ] {
            command.env_remove(var);
        }
        let mut child = command
            .env("BIND", "127.0.0.1:0")
            .env("DATABASE_URL", database_url)
            .env(
                "IDEMPOTENCY_STORE_TIMEOUT_MS",
                STORE_TIMEOUT.as_millis().to_string(),
            )
            // Each charge takes a moment: more payments are in flight when the primary dies.
            .env("CHARGE_DELAY_MS", "20")
            // A payment cut off by the failover holds its key until its lease runs out: its
            // retries get `409` until then.
            .env("IDEMPOTENCY_LEASE_MS", LEASE.as_millis().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the payments example");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!(
                    "the example printed {line:?}; its log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        Example { child, addr, log }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer of the example, read in full.
#[derive(Clone, Debug)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    content_type: String,
    body: Bytes,
}

#[derive(Clone)]
struct Api {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Api {
    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: String,
    ) -> Reply {
        let mut request = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::from(body))).unwrap();
        let exchange = async {
            let response = self.client.request(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let header = |name: &str| {
                parts
                    .headers
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default()
            };
            Reply {
                status: parts.status,
                replayed: header("idempotent-replayed") == "true",
                content_type: header("content-type"),
                body: body.collect().await.unwrap().to_bytes(),
            }
        };
        tokio::time::timeout(HANG, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method} {path}: no answer within {HANG:?}"))
    }

    async fn pay(&self, key: &str, order_id: u64, amount_cents: u64) -> Reply {
        let body = json!({ "order_id": order_id, "amount_cents": amount_cents }).to_string();
        self.send(
            Method::POST,
            "/payments",
            &[("idempotency-key", key), ("authorization", "Bearer acme")],
            body,
        )
        .await
    }

    async fn get_json(&self, path: &str) -> Value {
        let reply = self
            .send(
                Method::GET,
                path,
                &[("authorization", "Bearer acme")],
                String::new(),
            )
            .await;
        assert_eq!(reply.status, 200, "GET {path}: {reply:?}");
        serde_json::from_slice(&reply.body).unwrap()
    }
}

/// A key a client paid with, and the answer that ended its retries.
struct Paid {
    key: String,
    order_id: u64,
    amount_cents: u64,
    answer: Reply,
    /// When the answer came.
    at: Instant,
}

/// What every client saw, over all its requests.
#[derive(Default)]
struct Seen {
    statuses: HashMap<u16, usize>,
    slowest_503: Duration,
    /// Answers that are neither `201`, `409` nor `503`.
    unexpected: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_synchronous_standby_loses_no_key_and_charges_nothing_twice() {
    let primary = Cluster::primary(true);
    let standby = Arc::new(Cluster::standby(&primary));
    let proxy = Proxy::start(primary.addr()).await;
    let url = support::with_isolation(proxy.pg_url("postgres"));
    let example = Example::start(&url, standby.dir.join("example.log"));
    let api = Api {
        client: Client::builder(TokioExecutor::new()).build_http(),
        base: format!("http://{}", example.addr),
    };

    let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (api, seen, stop) = (api.clone(), seen.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut paid = Vec::new();
            let order_id = 1000 + client as u64;
            for n in 0u64.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let key = format!("failover-{client}-{n}");
                let amount_cents = 100 + n;
                let started = Instant::now();
                loop {
                    let sent = Instant::now();
                    let answer = api.pay(&key, order_id, amount_cents).await;
                    let took = sent.elapsed();
                    let done = {
                        let mut s = seen.lock().unwrap();
                        *s.statuses.entry(answer.status.as_u16()).or_default() += 1;
                        match answer.status.as_u16() {
                            201 => {
                                paid.push(Paid {
                                    key: key.clone(),
                                    order_id,
                                    amount_cents,
                                    answer,
                                    at: Instant::now(),
                                });
                                true
                            }
                            503 => {
                                s.slowest_503 = s.slowest_503.max(took);
                                false
                            }
                            409 => false,
                            _ => {
                                s.unexpected.push(format!(
                                    "{key}: {} {}",
                                    answer.status,
                                    String::from_utf8_lossy(&answer.body)
                                ));
                                true
                            }
                        }
                    };
                    if done {
                        break;
                    }
                    assert!(
                        started.elapsed() < Duration::from_secs(60),
                        "{key}: still not paid after 60 s"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            paid
        }));
    }

    // Load on the primary, then the failover: kill, promote, switch the proxy.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let killed_at = Instant::now();
    primary.kill9();
    let promote = standby.clone();
    tokio::task::spawn_blocking(move || promote.promote())
        .await
        .unwrap();
    proxy.set_target(standby.addr());
    proxy.cut_all();
    let switched_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut paid = Vec::new();
    for c in clients {
        paid.extend(c.await.unwrap());
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());

    // No key lost: every answer given, before the failover or after it, replays byte for
    // byte from the new primary.
    let mut lost = Vec::new();
    for p in &paid {
        let replay = api.pay(&p.key, p.order_id, p.amount_cents).await;
        if !(replay.replayed
            && replay.status == p.answer.status
            && replay.content_type == p.answer.content_type
            && replay.body == p.answer.body)
        {
            lost.push(format!(
                "{} (answered {}): now {} {}",
                p.key,
                if p.at < killed_at {
                    "before the kill"
                } else {
                    "after the kill"
                },
                replay.status,
                String::from_utf8_lossy(&replay.body)
            ));
        }
    }

    // Nothing charged twice: one charge per key paid, and every order's total is its
    // payments once.
    let charges = api.get_json("/provider/charges").await["count"]
        .as_u64()
        .unwrap();
    let mut orders_wrong = Vec::new();
    for client in 0..CLIENTS {
        let order_id = 1000 + client as u64;
        let mine: Vec<&Paid> = paid.iter().filter(|p| p.order_id == order_id).collect();
        let order = api.get_json(&format!("/orders/{order_id}")).await;
        let total: u64 = mine.iter().map(|p| p.amount_cents).sum();
        if order["payments"] != json!(mine.len()) || order["total_cents"] != json!(total) {
            orders_wrong.push(format!(
                "order {order_id}: {order}, expected {} payments totalling {total}",
                mine.len()
            ));
        }
    }

    let requests: usize = seen.statuses.values().sum();
    let before = paid.iter().filter(|p| p.at < killed_at).count();
    let after = paid.iter().filter(|p| p.at > switched_at).count();
    let turned_away = seen.statuses.get(&503).copied().unwrap_or(0);
    println!(
        "failover: {requests} requests for {} keys ({before} paid before the kill, {after} after \
         the switch); answers by status {:?}; 503s {turned_away}, slowest 503 {:?}; kill to \
         switch {:?}; charges {charges}; doubled {}, lost {}",
        paid.len(),
        seen.statuses,
        seen.slowest_503,
        switched_at - killed_at,
        charges.saturating_sub(paid.len() as u64),
        lost.len()
    );

    // Never a 500, never another error; 503s were quick.
    assert!(
        seen.unexpected.is_empty(),
        "answers other than 201, 409 and 503: {:#?}\nthe example's log:\n{}",
        seen.unexpected,
        example.log_tail()
    );
    assert!(
        seen.slowest_503 < BOUND_503,
        "a 503 took {:?}",
        seen.slowest_503
    );
    assert!(
        turned_away > 0,
        "no request was turned away: the failover did not happen under load"
    );
    assert!(
        before > 0 && after > 0,
        "paid before {before}, after {after}"
    );
    assert!(lost.is_empty(), "completed keys lost: {lost:#?}");
    assert_eq!(
        charges,
        paid.len() as u64,
        "the provider made {charges} charges for {} keys paid",
        paid.len()
    );
    assert!(orders_wrong.is_empty(), "{orders_wrong:#?}");
    drop(example);
    drop(proxy);
}
