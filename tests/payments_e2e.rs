//! End-to-end tests of `examples/payments/`: each test starts the example as its own process
//! (with the environment it needs), talks to it over real HTTP, and stops it.
//!
//! The example binary is built by `cargo test` along with the other examples; the tests also
//! run `cargo build --example payments` once, so that `cargo test --test payments_e2e` never
//! tests a stale binary (a no-op when it is up to date).
//!
//! The `postgres_*` tests need a Postgres server: `DATABASE_URL`, or
//! `postgres://postgres@127.0.0.1:5432/postgres`. Each creates (and drops) a fresh database,
//! runs the example on it (transactional mode) and looks into its tables: a row and its key
//! are written by one transaction (the same `xmin`), and a process killed mid-request leaves
//! no key, lock or row behind.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead as _, BufReader, Read as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HeaderMap, RETRY_AFTER};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use sqlx::PgPool;

/// How long the example may take to print its address (a cold machine, a busy CI runner).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the example may take to exit after a signal, or after a configuration error.
const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Every variable the example reads; removed from its environment unless a test sets it, so
/// that the developer's own `DATABASE_URL` (say) never changes what a test runs against.
const EXAMPLE_VARS: &[&str] = &[
    "BIND",
    "DATABASE_URL",
    "IDEMPOTENCY_TTL_SECS",
    "IDEMPOTENCY_LEASE_MS",
    "CHARGE_DELAY_MS",
    "MAX_BODY_BYTES",
    "IDEMPOTENCY",
    "IDEMPOTENCY_WAIT_MS",
    "PROVIDER_URL",
    "REDIS_URL",
];

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const JSON: &str = "application/json";
const PROBLEM_JSON: &str = "application/problem+json";

// ---------------------------------------------------------------------------------------------
// Harness: the example binary
// ---------------------------------------------------------------------------------------------

/// `target/<profile>/examples/payments`, built (or found up to date) once per test run.
fn example_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| support::example_path("payments"))
}

/// A running example process. Dropping it kills the process, also when a test panics.
struct Server {
    child: Child,
    api: Api,
    /// The address the example printed.
    addr: SocketAddr,
    /// Lines the example printed to stdout after the `listening on` line.
    stdout: Receiver<String>,
    /// Everything the example printed to stderr so far (for failure messages).
    stderr: Arc<Mutex<String>>,
}

impl Server {
    /// Starts the example on a free port with `env` (on top of a clean environment) and waits
    /// for its `listening on http://ADDR` line.
    fn start(env: &[(&str, &str)]) -> Server {
        Self::try_start(env).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`start`](Server::start); the error describes what went wrong, with stderr.
    fn try_start(env: &[(&str, &str)]) -> Result<Server, String> {
        let (mut child, stdout, stderr) = spawn_example(env);
        let first = match stdout.recv_timeout(STARTUP_TIMEOUT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "the example printed no line within {STARTUP_TIMEOUT:?}; stderr:\n{}",
                    stderr.lock().unwrap()
                ));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = child.wait();
                // Let the stderr thread read the last bytes.
                std::thread::sleep(Duration::from_millis(100));
                return Err(format!(
                    "the example exited before listening ({status:?}); stderr:\n{}",
                    stderr.lock().unwrap()
                ));
            }
        };
        let parsed = first
            .strip_prefix("listening on http://")
            .and_then(|addr| addr.parse::<SocketAddr>().ok());
        let Some(addr) = parsed else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the first line of stdout is {first:?}, not `listening on http://ADDR`"
            ));
        };
        assert_ne!(addr.port(), 0, "the example must print the port it bound");
        Ok(Server {
            child,
            api: Api::new(addr),
            addr,
            stdout,
            stderr,
        })
    }

    /// A client for this server (cheap to clone, for concurrent requests).
    fn api(&self) -> Api {
        self.api.clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends `signal` (`TERM`, `INT`) and waits for the process to exit.
    fn signal_and_wait(&mut self, signal: &str) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("run kill(1)");
        assert!(sent.success(), "kill -s {signal} failed: {sent}");
        self.wait_for_exit()
    }

    /// Kills the process with `SIGKILL`, like a crash, and waits for it.
    fn crash(&mut self) -> ExitStatus {
        self.child.kill().expect("SIGKILL the example");
        self.child.wait().expect("wait for the example")
    }

    fn wait_for_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the example") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the example did not exit within {EXIT_TIMEOUT:?}; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Lines printed to stdout after the `listening on` line, up to end of file (call after
    /// the process exited).
    fn remaining_stdout(&self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Ok(line) = self.stdout.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        lines
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns the example; its stdout lines arrive on the channel (which closes at end of file),
/// its stderr accumulates in the string.
fn spawn_example(env: &[(&str, &str)]) -> (Child, Receiver<String>, Arc<Mutex<String>>) {
    let mut command = Command::new(example_binary());
    for var in EXAMPLE_VARS {
        command.env_remove(var);
    }
    command.env("BIND", "127.0.0.1:0");
    command.envs(env.iter().copied());
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example");

    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr_text = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.stderr.take().expect("piped stderr");
    let sink = stderr_text.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stderr.read(&mut buf) {
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    (child, rx, stderr_text)
}

/// Runs the example with an invalid configuration: it must exit non-zero, without
/// listening, and say what is wrong. Returns its stderr.
fn expect_config_error(env: &[(&str, &str)]) -> String {
    let (mut child, stdout, stderr) = spawn_example(env);
    let deadline = Instant::now() + EXIT_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example with {env:?} did not exit within {EXIT_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{env:?}: exit status {status}");
    // A panic exits with 101; a configuration error must be reported, not panicked.
    assert_ne!(status.code(), Some(101), "{env:?}: the example panicked");
    let printed: Vec<String> = stdout.iter().collect();
    assert!(printed.is_empty(), "{env:?}: printed {printed:?} to stdout");
    // Give the stderr thread a moment to read the last bytes.
    std::thread::sleep(Duration::from_millis(100));
    let text = stderr.lock().unwrap().clone();
    assert!(!text.contains("panicked"), "{env:?}: panicked:\n{text}");
    text
}

// ---------------------------------------------------------------------------------------------
// Harness: HTTP
// ---------------------------------------------------------------------------------------------

/// A client for one server.
#[derive(Clone)]
struct Api {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

/// A response, read in full.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn content_type(&self) -> &str {
        self.header("content-type").unwrap_or("")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a JSON answer with `status`, and returns its body.
    fn expect_json(&self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{self:?}");
        assert!(
            self.content_type().starts_with(JSON),
            "content-type {:?}",
            self.content_type()
        );
        self.json()
    }

    /// Asserts an RFC 9457 problem with `status`, and returns its `type`.
    fn expect_problem(&self, status: StatusCode) -> String {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.content_type(), PROBLEM_JSON, "{self:?}");
        let problem = self.json();
        assert_eq!(problem["status"], status.as_u16(), "{problem}");
        assert!(problem["title"].is_string(), "{problem}");
        problem["type"].as_str().expect("a problem type").to_owned()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Api {
    fn new(addr: SocketAddr) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        self.try_send(method.clone(), path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {path} failed: {e}"))
    }

    /// Like [`send`](Api::send), but a failed exchange (the connection refused or closed
    /// before the answer) is an error, not a panic. Taking longer than [`REQUEST_TIMEOUT`]
    /// still panics.
    async fn try_send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, BoxError> {
        let mut request = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body: Bytes = body.into();
        if !body.is_empty() {
            request = request.header(CONTENT_TYPE, JSON);
        }
        let request = request.body(Full::new(body)).unwrap();
        let exchange = async {
            let response = self.client.request(request).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, BoxError>(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method} {path} took longer than {REQUEST_TIMEOUT:?}"))
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
        self.send(Method::POST, path, headers, body.to_string())
            .await
    }

    async fn patch(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Reply {
        self.send(Method::PATCH, path, headers, body.to_string())
            .await
    }

    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(Method::GET, path, headers, Bytes::new()).await
    }

    /// `POST /payments`.
    async fn pay(&self, headers: &[(&str, &str)], order_id: i64, amount_cents: i64) -> Reply {
        let body = json!({ "order_id": order_id, "amount_cents": amount_cents });
        self.post("/payments", headers, &body).await
    }

    /// `POST /payments`; a failed exchange is an error.
    async fn try_pay(
        &self,
        headers: &[(&str, &str)],
        order_id: i64,
        amount_cents: i64,
    ) -> Result<Reply, BoxError> {
        let body = json!({ "order_id": order_id, "amount_cents": amount_cents });
        self.try_send(Method::POST, "/payments", headers, body.to_string())
            .await
    }

    /// The number of charges the provider made.
    async fn charges(&self) -> i64 {
        let reply = self.get("/provider/charges", &[]).await;
        reply.expect_json(StatusCode::OK)["count"]
            .as_i64()
            .expect("an integer count")
    }

    /// The number of webhook events applied.
    async fn webhooks_processed(&self) -> i64 {
        let reply = self.get("/webhooks/provider", &[]).await;
        reply.expect_json(StatusCode::OK)["processed"]
            .as_i64()
            .expect("an integer count")
    }

    /// `GET /orders/{order_id}` for a tenant (`None`: no `Authorization`).
    async fn order(&self, tenant: Option<&str>, order_id: i64) -> Value {
        let auth = tenant.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| ("authorization", a))
            .into_iter()
            .collect();
        let reply = self.get(&format!("/orders/{order_id}"), &headers).await;
        reply.expect_json(StatusCode::OK)
    }
}

/// Asserts a first answer of `POST /payments`: `201`, JSON, not a replay, the right fields.
fn expect_new_payment(reply: &Reply, order_id: i64, amount_cents: i64) -> Value {
    let payment = reply.expect_json(StatusCode::CREATED);
    assert!(
        !reply.replayed(),
        "a first answer is not a replay: {reply:?}"
    );
    assert!(payment["payment_id"].is_string(), "{payment}");
    assert!(payment["charge_id"].is_string(), "{payment}");
    assert_eq!(payment["order_id"], order_id, "{payment}");
    assert_eq!(payment["amount_cents"], amount_cents, "{payment}");
    payment
}

/// Asserts that `replay` is `first` again: status, content type, body byte for byte, and
/// `Idempotent-Replayed: true`.
fn expect_replay_of(replay: &Reply, first: &Reply) {
    assert_eq!(replay.status, first.status, "{replay:?}");
    assert!(replay.replayed(), "not marked as a replay: {replay:?}");
    assert_eq!(replay.content_type(), first.content_type());
    assert_eq!(
        replay.body,
        first.body,
        "the replay differs: {} vs {}",
        replay.text(),
        first.text()
    );
}

fn order_json(order_id: i64, total: i64, payments: i64, address: Option<&str>) -> Value {
    json!({
        "order_id": order_id,
        "total_cents": total,
        "payments": payments,
        "shipping_address": address,
    })
}

// ---------------------------------------------------------------------------------------------
// Payments
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_retried_payment_is_charged_once_and_replayed_byte_for_byte() {
    let server = Server::start(&[]);
    let api = server.api();
    let headers = [
        ("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("authorization", "Bearer acme"),
    ];

    let first = api.pay(&headers, 42, 1999).await;
    let payment = expect_new_payment(&first, 42, 1999);
    assert!(first.header("idempotent-replayed").is_none());

    for _ in 0..2 {
        let again = api.pay(&headers, 42, 1999).await;
        expect_replay_of(&again, &first);
    }
    assert_eq!(api.charges().await, 1, "the provider charged once");
    assert_eq!(
        api.order(Some("acme"), 42).await,
        order_json(42, 1999, 1, None),
        "the order was charged once"
    );

    // A new key is a new payment, with new ids.
    let other = api
        .pay(&[("idempotency-key", "another"), headers[1]], 42, 1)
        .await;
    let other = expect_new_payment(&other, 42, 1);
    assert_ne!(other["payment_id"], payment["payment_id"]);
    assert_ne!(other["charge_id"], payment["charge_id"]);
    assert_eq!(api.charges().await, 2);
    assert_eq!(
        api.order(Some("acme"), 42).await,
        order_json(42, 2000, 2, None)
    );
}

#[tokio::test]
async fn a_quoted_key_is_the_same_key_as_a_bare_one() {
    let server = Server::start(&[]);
    let api = server.api();

    let quoted = api.pay(&[("idempotency-key", "\"abc\"")], 1, 500).await;
    expect_new_payment(&quoted, 1, 500);
    let bare = api.pay(&[("idempotency-key", "abc")], 1, 500).await;
    expect_replay_of(&bare, &quoted);
    assert_eq!(api.charges().await, 1);
}

#[tokio::test]
async fn requests_without_a_valid_key_or_body_are_refused() {
    let server = Server::start(&[]);
    let api = server.api();

    let missing = api.pay(&[], 1, 500).await;
    let kind = missing.expect_problem(StatusCode::BAD_REQUEST);
    assert!(kind.ends_with("missing-key"), "{kind}");

    let too_long = "k".repeat(256);
    let reply = api.pay(&[("idempotency-key", &too_long)], 1, 500).await;
    let kind = reply.expect_problem(StatusCode::BAD_REQUEST);
    assert!(kind.ends_with("invalid-key"), "{kind}");

    let bad_json = api
        .send(
            Method::POST,
            "/payments",
            &[("idempotency-key", "bad-json")],
            "{not json",
        )
        .await;
    assert!(bad_json.status.is_client_error(), "{bad_json:?}");

    let wrong_shape = api
        .post(
            "/payments",
            &[("idempotency-key", "wrong-shape")],
            &json!({ "order_id": "one", "amount_cents": 5 }),
        )
        .await;
    assert!(wrong_shape.status.is_client_error(), "{wrong_shape:?}");

    for amount in [0, -5] {
        let key = format!("amount{amount}");
        let reply = api.pay(&[("idempotency-key", &key)], 1, amount).await;
        reply.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    }

    assert_eq!(api.charges().await, 0, "nothing was charged");
}

#[tokio::test]
async fn a_key_of_255_characters_works_and_its_derived_key_too() {
    let server = Server::start(&[]);
    let api = server.api();
    let key = "k".repeat(255);

    let first = api.pay(&[("idempotency-key", &key)], 7, 300).await;
    expect_new_payment(&first, 7, 300);
    // The same key, quoted (257 bytes on the wire), is the same key.
    let quoted = format!("\"{key}\"");
    let again = api.pay(&[("idempotency-key", &quoted)], 7, 300).await;
    expect_replay_of(&again, &first);
    assert_eq!(api.charges().await, 1);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422_and_the_stored_answer_stays() {
    let server = Server::start(&[]);
    let api = server.api();
    let headers = [("idempotency-key", "reused")];

    let first = api.pay(&headers, 3, 1000).await;
    expect_new_payment(&first, 3, 1000);

    let other_amount = api.pay(&headers, 3, 2000).await;
    let kind = other_amount.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(kind.ends_with("key-reused"), "{kind}");
    let other_order = api.pay(&headers, 4, 1000).await;
    other_order.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);

    let original = api.pay(&headers, 3, 1000).await;
    expect_replay_of(&original, &first);
    assert_eq!(api.charges().await, 1);
    assert_eq!(api.order(None, 3).await, order_json(3, 1000, 1, None));
    assert_eq!(api.order(None, 4).await, order_json(4, 0, 0, None));
}

/// JSON bodies are fingerprinted semantically: a retry that rebuilt its JSON (members
/// reordered, other whitespace) is a replay; another amount is still `422`.
#[tokio::test]
async fn a_retry_with_reordered_json_is_a_replay_and_another_amount_is_422() {
    let server = Server::start(&[]);
    let api = server.api();
    let headers = [
        ("idempotency-key", "json-1"),
        ("authorization", "Bearer acme"),
    ];

    let first = api
        .send(
            Method::POST,
            "/payments",
            &headers,
            r#"{"order_id":5,"amount_cents":700}"#,
        )
        .await;
    expect_new_payment(&first, 5, 700);
    let reordered = api
        .send(
            Method::POST,
            "/payments",
            &headers,
            "{\n  \"amount_cents\" : 700 ,\n  \"order_id\": 5\n}",
        )
        .await;
    expect_replay_of(&reordered, &first);
    let other = api
        .send(
            Method::POST,
            "/payments",
            &headers,
            r#"{"amount_cents":701,"order_id":5}"#,
        )
        .await;
    other.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(api.charges().await, 1, "the provider charged once");

    let patch = [
        ("idempotency-key", "json-2"),
        ("authorization", "Bearer acme"),
    ];
    let address = api
        .send(
            Method::PATCH,
            "/orders/5",
            &patch,
            r#"{"shipping_address":"1 Main St"}"#,
        )
        .await;
    address.expect_json(StatusCode::OK);
    let again = api
        .send(
            Method::PATCH,
            "/orders/5",
            &patch,
            "{ \"shipping_address\" :\t\"1 Main St\" }",
        )
        .await;
    expect_replay_of(&again, &address);
    let moved = api
        .send(
            Method::PATCH,
            "/orders/5",
            &patch,
            r#"{"shipping_address":"2 Side St"}"#,
        )
        .await;
    moved.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    let elsewhere = api
        .send(
            Method::PATCH,
            "/orders/6",
            &patch,
            r#"{"shipping_address":"1 Main St"}"#,
        )
        .await;
    elsewhere.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test]
async fn keys_are_scoped_per_tenant() {
    let server = Server::start(&[]);
    let api = server.api();
    let key = ("idempotency-key", "shared-key");

    let acme = api
        .pay(&[key, ("authorization", "Bearer acme")], 1, 1000)
        .await;
    let acme_payment = expect_new_payment(&acme, 1, 1000);
    let globex = api
        .pay(&[key, ("authorization", "Bearer globex")], 1, 1000)
        .await;
    let globex_payment = expect_new_payment(&globex, 1, 1000);
    let anonymous = api.pay(&[key], 1, 1000).await;
    let anonymous_payment = expect_new_payment(&anonymous, 1, 1000);

    assert_ne!(acme_payment["payment_id"], globex_payment["payment_id"]);
    assert_ne!(acme_payment["charge_id"], globex_payment["charge_id"]);
    assert_ne!(acme_payment["payment_id"], anonymous_payment["payment_id"]);
    // The provider scopes the derived key per tenant too: three real charges.
    assert_eq!(api.charges().await, 3);

    // Each tenant replays its own answer.
    let acme_again = api
        .pay(&[key, ("authorization", "Bearer acme")], 1, 1000)
        .await;
    expect_replay_of(&acme_again, &acme);
    let globex_again = api
        .pay(&[key, ("authorization", "Bearer globex")], 1, 1000)
        .await;
    expect_replay_of(&globex_again, &globex);
    assert_eq!(api.charges().await, 3);

    for tenant in [Some("acme"), Some("globex"), None] {
        assert_eq!(
            api.order(tenant, 1).await,
            order_json(1, 1000, 1, None),
            "{tenant:?}"
        );
    }
    assert_eq!(
        api.order(Some("initech"), 1).await,
        order_json(1, 0, 0, None)
    );
}

#[tokio::test]
async fn concurrent_duplicates_are_charged_once() {
    let server = Server::start(&[("CHARGE_DELAY_MS", "500")]);
    let api = server.api();

    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let api = api.clone();
        requests.spawn(async move {
            api.pay(
                &[
                    ("idempotency-key", "double-click"),
                    ("authorization", "Bearer acme"),
                ],
                9,
                4200,
            )
            .await
        });
    }
    let replies = requests.join_all().await;

    let executed: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(executed.len(), 1, "exactly one request ran: {replies:#?}");
    let first = executed[0];
    expect_new_payment(first, 9, 4200);
    for reply in &replies {
        if std::ptr::eq(reply, first) {
            continue;
        }
        if reply.status == StatusCode::CONFLICT {
            let kind = reply.expect_problem(StatusCode::CONFLICT);
            assert!(kind.ends_with("request-in-progress"), "{kind}");
            let retry_after: u64 = reply
                .header("retry-after")
                .unwrap_or_else(|| panic!("409 without {RETRY_AFTER}: {reply:?}"))
                .parse()
                .expect("Retry-After in seconds");
            assert!(retry_after >= 1, "{reply:?}");
        } else {
            expect_replay_of(reply, first);
        }
    }
    assert_eq!(api.charges().await, 1, "the provider charged once");
    assert_eq!(
        api.order(Some("acme"), 9).await,
        order_json(9, 4200, 1, None)
    );
    // Once the first finished, a retry is a replay.
    let retry = api
        .pay(
            &[
                ("idempotency-key", "double-click"),
                ("authorization", "Bearer acme"),
            ],
            9,
            4200,
        )
        .await;
    expect_replay_of(&retry, first);
}

/// `IDEMPOTENCY_WAIT_MS`: duplicates sent while the first payment is still being charged
/// wait for it and get its exact answer, replayed; the provider charges once.
async fn duplicates_wait_for_the_first_answer(env: &[(&str, &str)]) {
    let mut env = env.to_vec();
    env.extend([("CHARGE_DELAY_MS", "800"), ("IDEMPOTENCY_WAIT_MS", "20000")]);
    let server = Server::start(&env);
    let api = server.api();
    let headers = [
        ("idempotency-key", "impatient-client"),
        ("authorization", "Bearer acme"),
    ];
    let first = {
        let api = api.clone();
        tokio::spawn(async move { api.pay(&headers, 12, 990).await })
    };
    // The duplicates arrive while the provider sleeps inside the first charge.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let api = api.clone();
        duplicates.spawn(async move { api.pay(&headers, 12, 990).await });
    }
    let first = first.await.unwrap();
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "{first:?}; the example's log:\n{}",
        server.stderr()
    );
    expect_new_payment(&first, 12, 990);
    assert!(!first.replayed());
    for reply in duplicates.join_all().await {
        // Never a 409: each waited, and got the first's answer byte for byte.
        expect_replay_of(&reply, &first);
    }
    assert_eq!(api.charges().await, 1, "the provider charged once");
    assert_eq!(
        api.order(Some("acme"), 12).await,
        order_json(12, 990, 1, None)
    );
}

#[tokio::test]
async fn waiting_duplicates_get_the_first_answer() {
    duplicates_wait_for_the_first_answer(&[]).await;
}

#[tokio::test]
async fn postgres_waiting_duplicates_get_the_first_answer() {
    with_fresh_database(|url| async move {
        duplicates_wait_for_the_first_answer(&[("DATABASE_URL", &url)]).await;
    })
    .await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_nothing_is_stored() {
    let server = Server::start(&[("MAX_BODY_BYTES", "1024")]);
    let api = server.api();
    let headers = [("idempotency-key", "big")];

    let big = json!({ "order_id": 5, "amount_cents": 100, "note": "x".repeat(2048) });
    let reply = api.post("/payments", &headers, &big).await;
    let kind = reply.expect_problem(StatusCode::PAYLOAD_TOO_LARGE);
    assert!(kind.ends_with("body-too-large"), "{kind}");
    assert_eq!(api.charges().await, 0);

    // Nothing was stored for the key: a request that fits runs.
    let small = api.pay(&headers, 5, 100).await;
    expect_new_payment(&small, 5, 100);
    assert_eq!(api.charges().await, 1);
}

#[tokio::test]
async fn keys_expire_after_the_ttl() {
    let server = Server::start(&[("IDEMPOTENCY_TTL_SECS", "1")]);
    let api = server.api();
    let headers = [("idempotency-key", "short-lived")];

    let first = api.pay(&headers, 6, 700).await;
    let first_payment = expect_new_payment(&first, 6, 700);
    let again = api.pay(&headers, 6, 700).await;
    expect_replay_of(&again, &first);

    tokio::time::sleep(Duration::from_millis(2500)).await;

    let later = api.pay(&headers, 6, 700).await;
    let later_payment = expect_new_payment(&later, 6, 700);
    assert_ne!(later_payment["charge_id"], first_payment["charge_id"]);
    assert_ne!(later_payment["payment_id"], first_payment["payment_id"]);
    assert_eq!(api.charges().await, 2, "after the TTL the key is new");
    assert_eq!(api.order(None, 6).await, order_json(6, 1400, 2, None));
}

// ---------------------------------------------------------------------------------------------
// Orders, pass-through, webhooks
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn patching_an_order_is_idempotent() {
    let server = Server::start(&[]);
    let api = server.api();
    let acme = ("authorization", "Bearer acme");

    let address = json!({ "shipping_address": "1 Main St" });
    let first = api
        .patch(
            "/orders/11",
            &[("idempotency-key", "addr-1"), acme],
            &address,
        )
        .await;
    assert_eq!(
        first.expect_json(StatusCode::OK),
        order_json(11, 0, 0, Some("1 Main St"))
    );
    assert!(!first.replayed());
    let again = api
        .patch(
            "/orders/11",
            &[("idempotency-key", "addr-1"), acme],
            &address,
        )
        .await;
    expect_replay_of(&again, &first);

    let moved = json!({ "shipping_address": "2 Side St" });
    let reused = api
        .patch("/orders/11", &[("idempotency-key", "addr-1"), acme], &moved)
        .await;
    reused.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    let no_key = api.patch("/orders/11", &[acme], &moved).await;
    no_key.expect_problem(StatusCode::BAD_REQUEST);
    assert_eq!(
        api.order(Some("acme"), 11).await,
        order_json(11, 0, 0, Some("1 Main St"))
    );

    let second = api
        .patch("/orders/11", &[("idempotency-key", "addr-2"), acme], &moved)
        .await;
    assert_eq!(
        second.expect_json(StatusCode::OK),
        order_json(11, 0, 0, Some("2 Side St"))
    );
    // The order is the tenant's: another tenant's order 11 is untouched.
    assert_eq!(api.order(None, 11).await, order_json(11, 0, 0, None));

    // Payments and the address end up in the same order.
    let paid = api
        .pay(&[("idempotency-key", "pay-11"), acme], 11, 250)
        .await;
    expect_new_payment(&paid, 11, 250);
    assert_eq!(
        api.order(Some("acme"), 11).await,
        order_json(11, 250, 1, Some("2 Side St"))
    );
}

#[tokio::test]
async fn gets_pass_through_and_unknown_paths_are_404() {
    let server = Server::start(&[]);
    let api = server.api();
    let too_long = "k".repeat(300);

    for key in ["a-key", too_long.as_str()] {
        for _ in 0..2 {
            let order = api.get("/orders/5", &[("idempotency-key", key)]).await;
            assert_eq!(order.expect_json(StatusCode::OK), order_json(5, 0, 0, None));
            assert!(!order.replayed());
            let charges = api
                .get("/provider/charges", &[("idempotency-key", key)])
                .await;
            assert_eq!(charges.expect_json(StatusCode::OK), json!({ "count": 0 }));
            assert!(!charges.replayed());
        }
        let webhooks = api.get("/webhooks/provider", &[("webhook-id", key)]).await;
        assert_eq!(
            webhooks.expect_json(StatusCode::OK),
            json!({ "processed": 0 })
        );
    }

    let unknown = api
        .post("/nope", &[("idempotency-key", "k")], &json!({}))
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{unknown:?}");
    let unknown = api.post("/nope", &[], &json!({})).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{unknown:?}");
    let unknown = api.get("/payments/1", &[]).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{unknown:?}");
}

#[tokio::test]
async fn a_redelivered_webhook_is_applied_once() {
    let server = Server::start(&[]);
    let api = server.api();
    let event = json!({ "type": "charge.succeeded", "data": { "charge_id": "ch_1" } });

    let mut replies = Vec::new();
    for _ in 0..3 {
        let reply = api
            .post("/webhooks/provider", &[("webhook-id", "msg_1")], &event)
            .await;
        assert_eq!(
            reply.expect_json(StatusCode::OK),
            json!({ "received": true })
        );
        replies.push(reply);
    }
    assert!(!replies[0].replayed());
    expect_replay_of(&replies[1], &replies[0]);
    expect_replay_of(&replies[2], &replies[0]);
    assert_eq!(api.webhooks_processed().await, 1);
    // The event redelivered as the provider serialised it again (other member order, other
    // whitespace): the same event, `2xx`, not applied again.
    let again = api
        .send(
            Method::POST,
            "/webhooks/provider",
            &[("webhook-id", "msg_1")],
            "{ \"data\": {\"charge_id\": \"ch_1\"},\n  \"type\": \"charge.succeeded\" }".to_owned(),
        )
        .await;
    expect_replay_of(&again, &replies[0]);
    assert_eq!(api.webhooks_processed().await, 1);

    let other = api
        .post(
            "/webhooks/provider",
            &[("webhook-id", "msg_2")],
            &json!([1, 2]),
        )
        .await;
    other.expect_json(StatusCode::OK);
    assert_eq!(api.webhooks_processed().await, 2);

    // The receiver's key is the `webhook-id`: an `Idempotency-Key` does not stand in for it.
    let no_id = api
        .post(
            "/webhooks/provider",
            &[("idempotency-key", "msg_3")],
            &event,
        )
        .await;
    let kind = no_id.expect_problem(StatusCode::BAD_REQUEST);
    assert!(kind.ends_with("missing-key"), "{kind}");
    assert_eq!(api.webhooks_processed().await, 2);
}

// ---------------------------------------------------------------------------------------------
// IDEMPOTENCY=off, signals, configuration
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn without_the_layer_the_same_routes_work_without_keys() {
    routes_without_the_layer(&[]).await;
}

/// `IDEMPOTENCY=off` (and `env`): every route works without keys, and every request is new.
async fn routes_without_the_layer(env: &[(&str, &str)]) {
    let mut env = env.to_vec();
    env.extend([("IDEMPOTENCY", "off"), ("MAX_BODY_BYTES", "1024")]);
    let server = Server::start(&env);
    let api = server.api();
    let acme = ("authorization", "Bearer acme");

    let first = api.pay(&[acme], 8, 100).await;
    let first = expect_new_payment(&first, 8, 100);
    let second = api.pay(&[acme], 8, 100).await;
    let second = expect_new_payment(&second, 8, 100);
    assert_ne!(first["payment_id"], second["payment_id"]);
    assert_ne!(first["charge_id"], second["charge_id"]);
    assert_eq!(api.charges().await, 2, "no layer: every request charges");
    assert_eq!(
        api.order(Some("acme"), 8).await,
        order_json(8, 200, 2, None)
    );

    let patched = api
        .patch("/orders/8", &[acme], &json!({ "shipping_address": "Here" }))
        .await;
    assert_eq!(
        patched.expect_json(StatusCode::OK),
        order_json(8, 200, 2, Some("Here"))
    );

    let webhook = api
        .post("/webhooks/provider", &[], &json!({ "type": "ping" }))
        .await;
    assert_eq!(
        webhook.expect_json(StatusCode::OK),
        json!({ "received": true })
    );
    assert_eq!(api.webhooks_processed().await, 1);

    let provider = api
        .post("/provider/charges", &[], &json!({ "amount_cents": 5 }))
        .await;
    let charge = provider.expect_json(StatusCode::CREATED);
    assert!(charge["charge_id"].is_string(), "{charge}");
    assert_eq!(charge["amount_cents"], 5);
    assert_eq!(api.charges().await, 3);

    let big = json!({ "order_id": 8, "amount_cents": 1, "note": "x".repeat(2048) });
    let reply = api.post("/payments", &[acme], &big).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE, "{reply:?}");
    assert_eq!(api.charges().await, 3);
}

#[tokio::test]
async fn the_provider_is_protected_on_its_own() {
    let server = Server::start(&[]);
    let api = server.api();
    let headers = [
        ("idempotency-key", "charge-1"),
        ("authorization", "Bearer acme"),
    ];
    let body = json!({ "amount_cents": 900 });

    let first = api.post("/provider/charges", &headers, &body).await;
    let charge = first.expect_json(StatusCode::CREATED);
    assert!(charge["charge_id"].is_string(), "{charge}");
    assert_eq!(charge["amount_cents"], 900);
    let again = api.post("/provider/charges", &headers, &body).await;
    expect_replay_of(&again, &first);
    assert_eq!(api.charges().await, 1);

    let no_key = api
        .post(
            "/provider/charges",
            &[("authorization", "Bearer acme")],
            &body,
        )
        .await;
    no_key.expect_problem(StatusCode::BAD_REQUEST);
    assert_eq!(api.charges().await, 1);
}

#[tokio::test]
async fn sigterm_stops_the_example_cleanly() {
    let mut server = Server::start(&[]);
    let api = server.api();
    let reply = api.pay(&[("idempotency-key", "before-stop")], 1, 10).await;
    expect_new_payment(&reply, 1, 10);

    let status = server.signal_and_wait("TERM");
    assert!(
        status.success(),
        "exit status {status}; stderr:\n{}",
        server.stderr()
    );
    assert_eq!(
        server.remaining_stdout(),
        Vec::<String>::new(),
        "stdout holds only the `listening on` line"
    );
}

#[tokio::test]
async fn sigint_stops_the_example_cleanly() {
    let mut server = Server::start(&[]);
    assert_eq!(server.api().charges().await, 0);
    let status = server.signal_and_wait("INT");
    assert!(
        status.success(),
        "exit status {status}; stderr:\n{}",
        server.stderr()
    );
}

#[test]
fn it_listens_where_bind_says() {
    // Find a free port, release it, and ask the example for it. Another process may take the
    // port in between, so try a few.
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let bind = format!("127.0.0.1:{port}");
        match Server::try_start(&[("BIND", &bind)]) {
            Ok(server) => {
                assert_eq!(server.addr.to_string(), bind);
                return;
            }
            Err(e) if e.contains("cannot listen") => continue,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("the example could not bind any of 5 free ports");
}

#[test]
fn invalid_configuration_is_reported_and_exits_non_zero() {
    let cases: &[(&str, &str)] = &[
        ("IDEMPOTENCY_TTL_SECS", "abc"),
        ("IDEMPOTENCY_TTL_SECS", "-1"),
        ("IDEMPOTENCY_LEASE_MS", "1.5"),
        ("CHARGE_DELAY_MS", "soon"),
        ("IDEMPOTENCY_WAIT_MS", "-5"),
        ("MAX_BODY_BYTES", "1MB"),
        ("IDEMPOTENCY", "maybe"),
        ("BIND", "not an address"),
        ("PROVIDER_URL", "ftp://127.0.0.1:1"),
        ("PROVIDER_URL", "not a url"),
    ];
    for &(var, value) in cases {
        let stderr = expect_config_error(&[(var, value)]);
        assert!(
            stderr.contains(var),
            "the error for {var}={value:?} should name the variable:\n{stderr}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Postgres
// ---------------------------------------------------------------------------------------------

/// `url` with its database name replaced by `name` (the query string is kept).
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

#[test]
fn with_database_replaces_only_the_database_name() {
    assert_eq!(
        with_database("postgres://postgres@127.0.0.1:5432/postgres", "e2e_x"),
        "postgres://postgres@127.0.0.1:5432/e2e_x"
    );
    assert_eq!(
        with_database("postgres://u:p@db/app?sslmode=disable", "e2e_x"),
        "postgres://u:p@db/e2e_x?sslmode=disable"
    );
    assert_eq!(
        with_database("postgres://localhost", "e2e_x"),
        "postgres://localhost/e2e_x"
    );
}

/// A database name no other run uses.
fn fresh_database_name() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("e2e_{}_{nanos:x}", std::process::id())
}

/// Runs `scenario` with the URL of a database of its own, created for it and dropped after it
/// (also when it panics).
async fn with_fresh_database<F, Fut>(scenario: F)
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let admin_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&admin_url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Postgres is unreachable at {admin_url}: {e}\n\
                 This test needs Postgres: run ./scripts/test.sh, or set DATABASE_URL to a \
                 server where the test may create databases."
            )
        });
    let name = fresh_database_name();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {name} at {admin_url}: {e}"));

    // Run the scenario as a task, so that the database is dropped even when it panics.
    // (In pooler mode, `TI_PGBOUNCER_URL`, the example reaches it through the pooler.)
    let url = if support::pooler_url().is_some() {
        support::program_database_url(&admin, &name).await
    } else {
        support::with_isolation(with_database(&admin_url, &name))
    };
    let outcome = tokio::spawn(scenario(url)).await;

    let dropped = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await;
    admin.close().await;
    match outcome {
        Ok(()) => {}
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("the scenario did not finish: {e}"),
    }
    dropped.unwrap_or_else(|e| panic!("DROP DATABASE {name}: {e}"));
}

/// A pool to look into the example's database from the test (straight to the server, also in
/// pooler mode).
async fn inspect(url: &str) -> PgPool {
    let url = &support::direct_database_url(url);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// The rows of `table`.
async fn count(db: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(db)
        .await
        .unwrap_or_else(|e| panic!("count {table}: {e}"))
}

/// The transaction that wrote the one row `sql` selects (its `xmin`).
async fn xmin(db: &PgPool, sql: &'static str, binds: &[&str]) -> String {
    let mut query = sqlx::query_scalar::<_, String>(sql);
    for bind in binds {
        query = query.bind(*bind);
    }
    query
        .fetch_one(db)
        .await
        .unwrap_or_else(|e| panic!("{sql} with {binds:?}: {e}"))
}

const KEY_XMIN: &str =
    "SELECT xmin::text FROM tower_idempotency_keys WHERE scope = $1 AND key = $2";

/// Asserts that the row `row_sql` selects was written by the transaction that stored the
/// answer for (`scope`, `key`): the row and the key committed together.
async fn assert_written_with_key(
    db: &PgPool,
    scope: &str,
    key: &str,
    row_sql: &'static str,
    binds: &[&str],
) -> String {
    // Stores keep the digest of a scope, not its text.
    let digest = tower_idempotency::scope_digest(scope);
    let key_tx = xmin(db, KEY_XMIN, &[&digest, key]).await;
    let row_tx = xmin(db, row_sql, binds).await;
    assert_eq!(
        row_tx, key_tx,
        "`{row_sql}` with {binds:?} was not written by the transaction of the key {scope:?}/{key:?}"
    );
    row_tx
}

/// Asserts that `payment`, made by `tenant` with `key`, committed with that key, and that its
/// charge committed with the provider's key `<key>:charge`, in the provider's own transaction.
async fn assert_payment_committed_with_its_keys(
    db: &PgPool,
    tenant: &str,
    key: &str,
    payment: &Value,
) {
    let payment_tx = assert_written_with_key(
        db,
        &format!("tenant:{tenant}"),
        key,
        "SELECT xmin::text FROM example_payments WHERE tenant = $1 AND idempotency_key = $2",
        &[tenant, key],
    )
    .await;
    let charge_id = payment["charge_id"].as_str().unwrap();
    let charge_tx = assert_written_with_key(
        db,
        &format!("provider:{tenant}"),
        &format!("{key}:charge"),
        "SELECT xmin::text FROM example_provider_charges WHERE 'ch_' || id = $1",
        &[charge_id],
    )
    .await;
    assert_ne!(payment_tx, charge_tx, "the provider commits on its own");
}

#[tokio::test]
async fn postgres_keeps_keys_and_data_across_a_crash() {
    with_fresh_database(crash_and_restart).await;
}

/// Pays, crashes the example with SIGKILL, restarts it on the same database, and checks that
/// keys, payments, charges, orders and webhook events all survived.
async fn crash_and_restart(url: String) {
    let acme = ("authorization", "Bearer acme");
    let key = ("idempotency-key", "pg-payment-1");
    let event = json!({ "type": "charge.succeeded" });

    let mut server = Server::start(&[("DATABASE_URL", &url)]);
    let api = server.api();
    let first = api.pay(&[key, acme], 21, 3100).await;
    let payment = expect_new_payment(&first, 21, 3100);
    let again = api.pay(&[key, acme], 21, 3100).await;
    expect_replay_of(&again, &first);
    let reused = api.pay(&[key, acme], 21, 1).await;
    reused.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(api.charges().await, 1);
    let patched = api
        .patch(
            "/orders/21",
            &[("idempotency-key", "pg-address"), acme],
            &json!({ "shipping_address": "1 Main St" }),
        )
        .await;
    assert_eq!(
        patched.expect_json(StatusCode::OK),
        order_json(21, 3100, 1, Some("1 Main St"))
    );
    let webhook = api
        .post("/webhooks/provider", &[("webhook-id", "msg_pg")], &event)
        .await;
    webhook.expect_json(StatusCode::OK);
    assert_eq!(api.webhooks_processed().await, 1);

    let status = server.crash();
    assert!(!status.success(), "SIGKILL: {status}");
    drop(server);

    // The same database, a new process: everything is still there.
    let mut server = Server::start(&[("DATABASE_URL", &url), ("CHARGE_DELAY_MS", "300")]);
    let api = server.api();
    let replay = api.pay(&[key, acme], 21, 3100).await;
    expect_replay_of(&replay, &first);
    assert_eq!(api.charges().await, 1, "no second charge after the restart");
    assert_eq!(
        api.order(Some("acme"), 21).await,
        order_json(21, 3100, 1, Some("1 Main St"))
    );
    let redelivered = api
        .post("/webhooks/provider", &[("webhook-id", "msg_pg")], &event)
        .await;
    expect_replay_of(&redelivered, &webhook);
    assert_eq!(api.webhooks_processed().await, 1);

    // New payments continue the sequences, and concurrent duplicates are still charged once.
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let api = api.clone();
        requests.spawn(async move {
            api.pay(&[("idempotency-key", "pg-payment-2"), acme], 21, 900)
                .await
        });
    }
    let replies = requests.join_all().await;
    let executed: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(executed.len(), 1, "{replies:#?}");
    let second = expect_new_payment(executed[0], 21, 900);
    for reply in &replies {
        assert!(
            reply.status == StatusCode::CONFLICT || reply.status == StatusCode::CREATED,
            "{reply:?}"
        );
    }
    assert_ne!(second["payment_id"], payment["payment_id"]);
    assert_ne!(second["charge_id"], payment["charge_id"]);
    assert_eq!(api.charges().await, 2);
    assert_eq!(
        api.order(Some("acme"), 21).await,
        order_json(21, 4000, 2, Some("1 Main St"))
    );
    let status = server.signal_and_wait("TERM");
    assert!(status.success(), "{status}; stderr:\n{}", server.stderr());

    // The data is in the example's own tables, each row committed with its key.
    let pool = inspect(&url).await;
    assert_payment_committed_with_its_keys(&pool, "acme", "pg-payment-1", &payment).await;
    assert_payment_committed_with_its_keys(&pool, "acme", "pg-payment-2", &second).await;
    assert_written_with_key(
        &pool,
        "tenant:acme",
        "pg-address",
        "SELECT xmin::text FROM example_orders WHERE tenant = $1 AND order_id = $2::bigint",
        &["acme", "21"],
    )
    .await;
    assert_written_with_key(
        &pool,
        "webhooks:provider",
        "msg_pg",
        "SELECT xmin::text FROM example_webhook_events WHERE event_id = $1",
        &["msg_pg"],
    )
    .await;
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM example_payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payments, 2);
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM example_provider_charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(charges, 2);
    pool.close().await;
}

#[tokio::test]
async fn postgres_without_the_layer_each_request_commits_on_its_own() {
    with_fresh_database(|url| async move {
        routes_without_the_layer(&[("DATABASE_URL", &url)]).await;
        // Committed, and without keys: another connection sees the rows.
        let db = inspect(&url).await;
        let keyless: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM example_payments WHERE idempotency_key IS NULL",
        )
        .fetch_one(&db)
        .await
        .unwrap();
        assert_eq!(keyless, 2);
        assert_eq!(count(&db, "example_provider_charges").await, 3);
        assert_eq!(count(&db, "example_orders").await, 1);
        assert_eq!(count(&db, "example_webhook_events").await, 1);
        db.close().await;
    })
    .await;
}

#[tokio::test]
async fn postgres_a_payment_killed_mid_charge_resumes_after_its_lease() {
    with_fresh_database(killed_mid_charge).await;
}

/// SIGKILLs the example while the provider sleeps inside the charge, restarts it on the same
/// database and retries. The payment's first phase had committed (its key claimed, the
/// payment pending); the retry waits for the lease, resumes after that phase (no second
/// payment row), calls the provider again with the same derived key, and the order is
/// charged once.
async fn killed_mid_charge(url: String) {
    const KEY: &str = "crash-mid-charge";
    let headers = [("idempotency-key", KEY), ("authorization", "Bearer acme")];
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("CHARGE_DELAY_MS", "1500"),
        ("IDEMPOTENCY_LEASE_MS", "2000"),
    ];
    let db = inspect(&url).await;

    let mut server = Server::start(&env);
    let api = server.api();
    let first = tokio::spawn(async move { api.try_pay(&headers, 31, 2500).await });
    // Two keys claimed (the payment's and the charge's, which the provider holds while it
    // sleeps), and the payment pending.
    wait_for_rows(&db, "the payment reaches the provider", IN_PROVIDER, 2).await;
    let status = server.crash();
    assert!(!status.success(), "SIGKILL: {status}");
    let lost = first.await.unwrap();
    assert!(lost.is_err(), "the killed attempt got an answer: {lost:?}");
    drop(server);
    assert_eq!(count(&db, "example_provider_charges").await, 0);
    assert_eq!(
        count(&db, "example_payments").await,
        1,
        "the pending payment"
    );

    let mut server = Server::start(&env);
    let api = server.api();
    let retry = pay_until_not_in_flight(&api, &headers, 31, 2500).await;
    let payment = expect_new_payment(&retry, 31, 2500);
    assert_eq!(api.charges().await, 1, "charged once");
    assert_eq!(
        count(&db, "example_payments").await,
        1,
        "no second payment row"
    );
    assert_eq!(
        api.order(Some("acme"), 31).await,
        order_json(31, 2500, 1, None)
    );
    let again = api.pay(&headers, 31, 2500).await;
    expect_replay_of(&again, &retry);
    assert_eq!(api.charges().await, 1);

    assert_payment_committed_with_its_keys(&db, "acme", KEY, &payment).await;
    let status = server.signal_and_wait("TERM");
    assert!(status.success(), "{status}; stderr:\n{}", server.stderr());
    db.close().await;
}

/// Rows that show a payment waiting at the provider: a pending payment, and the claims of
/// its key and of the charge's.
const IN_PROVIDER: &str = "SELECT (SELECT count(*) FROM tower_idempotency_keys \
      WHERE lease_token IS NOT NULL) \
    + (SELECT count(*) FROM example_payments WHERE status = 'pending') - 1";

/// Waits until `sql` (one `bigint`) says at least `at_least`.
async fn wait_for_rows(db: &PgPool, what: &str, sql: &'static str, at_least: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n: i64 = sqlx::query_scalar(sql)
            .fetch_one(db)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        if n >= at_least {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still {n}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `POST /payments` until the answer is neither `409` (a key still held by a dead process's
/// lease) nor `503` with `Retry-After`, after the server is reachable: what a client does.
/// The killed process's charge key is claimed a moment after its payment key, so its lease
/// outlives the payment's by that moment; a retry in between finds the provider still
/// holding the charge and is told to retry later.
async fn pay_until_not_in_flight(
    api: &Api,
    headers: &[(&str, &str)],
    order_id: i64,
    amount_cents: i64,
) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = pay_when_reachable(api, headers, order_id, amount_cents).await;
        let later = reply.status == StatusCode::CONFLICT
            || (reply.status == StatusCode::SERVICE_UNAVAILABLE
                && reply.header("retry-after").is_some());
        if !later {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "still {}: {}",
            reply.status,
            reply.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn postgres_no_transaction_is_open_while_the_provider_works() {
    with_fresh_database(|url| async move {
        let env = [("DATABASE_URL", url.as_str()), ("CHARGE_DELAY_MS", "1500")];
        let db = inspect(&url).await;
        let server = Server::start(&env);
        let api = server.api();
        let headers = [
            ("idempotency-key", "no-tx"),
            ("authorization", "Bearer acme"),
        ];
        let paid = tokio::spawn(async move { api.try_pay(&headers, 51, 700).await });
        wait_for_rows(&db, "the payment reaches the provider", IN_PROVIDER, 2).await;
        // Sample the example's backends through most of the provider's delay.
        let database: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(&db)
            .await
            .unwrap();
        let mut samples = 0;
        let until = Instant::now() + Duration::from_millis(1000);
        while Instant::now() < until {
            let idle_in_tx: Vec<String> = sqlx::query_scalar(
                "SELECT state || ': ' || left(query, 120) FROM pg_stat_activity \
                  WHERE datname = $1 AND pid <> pg_backend_pid() \
                    AND state LIKE 'idle in transaction%'",
            )
            .bind(&database)
            .fetch_all(&db)
            .await
            .unwrap();
            assert!(
                idle_in_tx.is_empty(),
                "a backend of the example is idle in a transaction while the provider works: \
                 {idle_in_tx:?}"
            );
            samples += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(samples > 10);
        let paid = paid.await.unwrap().unwrap();
        let payment = expect_new_payment(&paid, 51, 700);
        let api = server.api();
        assert_eq!(api.charges().await, 1);
        assert_eq!(
            api.order(Some("acme"), 51).await,
            order_json(51, 700, 1, None)
        );
        assert_payment_committed_with_its_keys(&db, "acme", "no-tx", &payment).await;
        db.close().await;
    })
    .await;
}

/// Behind PgBouncer in transaction pooling mode with 10 server connections, 40 distinct
/// payments at once, each waiting a second at the provider: every one is answered `201`
/// within a few seconds (none holds a server connection while the provider works, so none
/// waits a second for one), and each order is charged once.
#[tokio::test]
async fn postgres_forty_slow_payments_share_ten_pooled_server_connections() {
    with_fresh_database(|url| async move {
        let pooler = support::pgbouncer::PgBouncer::start(10);
        let database = url
            .split('?')
            .next()
            .and_then(|base| base.rsplit('/').next())
            .unwrap()
            .to_owned();
        let through = pooler.url_for(&database);
        let env = [
            ("DATABASE_URL", through.as_str()),
            ("CHARGE_DELAY_MS", "1000"),
        ];
        let server = Server::start(&env);
        let started = Instant::now();
        let mut payments = Vec::new();
        for i in 0..40 {
            let api = server.api();
            payments.push(tokio::spawn(async move {
                let key = format!("busy-{i}");
                let reply = api
                    .try_pay(
                        &[("idempotency-key", &key), ("authorization", "Bearer acme")],
                        700 + i,
                        100,
                    )
                    .await;
                (reply, started.elapsed())
            }));
        }
        let mut slowest = Duration::ZERO;
        for (i, payment) in payments.into_iter().enumerate() {
            let (reply, took) = payment.await.unwrap();
            let reply = reply.unwrap_or_else(|e| panic!("payment {i}: {e}"));
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "payment {i}: {}",
                reply.text()
            );
            slowest = slowest.max(took);
        }
        eprintln!("40 payments with a 1 s provider call: the slowest answered after {slowest:?}");
        assert!(
            slowest < Duration::from_secs(5),
            "the slowest of 40 payments took {slowest:?}: payments waited for server connections"
        );
        let api = server.api();
        assert_eq!(api.charges().await, 40);
        for i in 0..40 {
            assert_eq!(
                api.order(Some("acme"), 700 + i).await,
                order_json(700 + i, 100, 1, None)
            );
        }
        drop(server);
        drop(pooler);
    })
    .await;
}

/// SIGKILLs the example at random moments of payments (before, between and after their
/// phases), restarts it and retries each payment until it is answered: every payment is
/// charged exactly once, has one payment row, and its answer is the one a run without the
/// crash gives (its own payment row and its own charge).
#[tokio::test]
async fn postgres_payments_killed_at_random_points_are_charged_once() {
    with_fresh_database(|url| async move {
        let env = [
            ("DATABASE_URL", url.as_str()),
            ("CHARGE_DELAY_MS", "150"),
            ("IDEMPOTENCY_LEASE_MS", "800"),
        ];
        let db = inspect(&url).await;
        let mut seed = u64::from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .subsec_nanos(),
        ) | 1;
        let mut random = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        let rounds = 8;
        for round in 0..rounds {
            let key = format!("kill-{round}");
            let order = 600 + round;
            let mut server = Server::start(&env);
            let api = server.api();
            let sent_key = key.clone();
            let attempt = tokio::spawn(async move {
                api.try_pay(
                    &[
                        ("idempotency-key", &sent_key),
                        ("authorization", "Bearer acme"),
                    ],
                    order,
                    1000 + order,
                )
                .await
            });
            // The payment's phases take ~150 ms (the provider's delay) plus a few commits.
            let after = Duration::from_millis(random(260));
            tokio::time::sleep(after).await;
            server.crash();
            let _ = attempt.await.unwrap();
            drop(server);

            let server = Server::start(&env);
            let api = server.api();
            let headers = [
                ("idempotency-key", key.as_str()),
                ("authorization", "Bearer acme"),
            ];
            let done = pay_until_not_in_flight(&api, &headers, order, 1000 + order).await;
            // Killed after its answer was stored, the payment's retry is a replay.
            let payment = if done.replayed() {
                done.expect_json(StatusCode::CREATED)
            } else {
                expect_new_payment(&done, order, 1000 + order)
            };
            let rows: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM example_payments WHERE idempotency_key = $1",
            )
            .bind(&key)
            .fetch_one(&db)
            .await
            .unwrap();
            assert_eq!(
                rows, 1,
                "round {round} (killed after {after:?}): one payment row"
            );
            assert_eq!(
                api.order(Some("acme"), order).await,
                order_json(order, 1000 + order, 1, None),
                "round {round} (killed after {after:?}): charged once"
            );
            // The answer names the payment's own row and the charge made for its key.
            let (payment_id, charge_id): (String, String) = sqlx::query_as(
                "SELECT 'pay_' || id, charge_id FROM example_payments WHERE idempotency_key = $1",
            )
            .bind(&key)
            .fetch_one(&db)
            .await
            .unwrap();
            assert_eq!(payment["payment_id"], payment_id.as_str());
            assert_eq!(payment["charge_id"], charge_id.as_str());
            assert_payment_committed_with_its_keys(&db, "acme", &key, &payment).await;
            expect_replay_of(&api.pay(&headers, order, 1000 + order).await, &done);
        }
        assert_eq!(count(&db, "example_provider_charges").await, rounds);
        db.close().await;
    })
    .await;
}

/// `POST /payments` to a server that has just started: a few quick retries while the
/// connection fails.
async fn pay_when_reachable(
    api: &Api,
    headers: &[(&str, &str)],
    order_id: i64,
    amount_cents: i64,
) -> Reply {
    let mut failures = 0;
    loop {
        match api.try_pay(headers, order_id, amount_cents).await {
            Ok(reply) => return reply,
            Err(e) if failures < 10 => {
                failures += 1;
                eprintln!("POST /payments failed ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("POST /payments failed {failures} times; last: {e}"),
        }
    }
}

#[tokio::test]
async fn a_charge_made_before_a_crash_is_not_made_again() {
    charged_before_the_crash(&[]).await;
}

#[tokio::test]
async fn postgres_a_charge_made_before_a_crash_is_not_made_again() {
    with_fresh_database(|url| async move {
        let payment = charged_before_the_crash(&[("DATABASE_URL", &url)]).await;
        let db = inspect(&url).await;
        assert_payment_committed_with_its_keys(&db, "acme", CHARGED_KEY, &payment).await;
        db.close().await;
    })
    .await;
}

/// The key of [`charged_before_the_crash`].
const CHARGED_KEY: &str = "crash-after-charge";

/// A crash right after the provider answered, before the payment committed, is hard to time
/// from outside; what it leaves behind is easy to make. The provider committed the charge
/// under the derived key `<key>:charge`, for the tenant, and no payment exists. The client's
/// retry runs the payment again: the provider must answer with that charge, not make another.
/// Returns the payment.
async fn charged_before_the_crash(env: &[(&str, &str)]) -> Value {
    let acme = ("authorization", "Bearer acme");
    let server = Server::start(env);
    let api = server.api();

    let charge_key = format!("{CHARGED_KEY}:charge");
    let charged = api
        .post(
            "/provider/charges",
            &[("idempotency-key", &charge_key), acme],
            &json!({ "amount_cents": 1200 }),
        )
        .await;
    let charge = charged.expect_json(StatusCode::CREATED);
    assert_eq!(api.charges().await, 1);
    assert_eq!(
        api.order(Some("acme"), 41).await,
        order_json(41, 0, 0, None)
    );

    let retry = api
        .pay(&[("idempotency-key", CHARGED_KEY), acme], 41, 1200)
        .await;
    let payment = expect_new_payment(&retry, 41, 1200);
    assert_eq!(
        payment["charge_id"], charge["charge_id"],
        "the provider answered with the charge it made before"
    );
    assert_eq!(api.charges().await, 1, "charged once");
    assert_eq!(
        api.order(Some("acme"), 41).await,
        order_json(41, 1200, 1, None)
    );
    let again = api
        .pay(&[("idempotency-key", CHARGED_KEY), acme], 41, 1200)
        .await;
    expect_replay_of(&again, &retry);
    assert_eq!(api.charges().await, 1);
    payment
}

// ---------------------------------------------------------------------------------------------
// Bounds on input: amounts, order ids, tenants
// ---------------------------------------------------------------------------------------------

/// The largest amount one payment (or charge) may have: 10 million in currency units.
const MAX_AMOUNT_CENTS: i64 = 1_000_000_000;

/// `POST /payments` with a raw JSON body (for numbers an `i64` cannot hold).
async fn pay_raw(api: &Api, key: &str, body: &str) -> Reply {
    api.send(
        Method::POST,
        "/payments",
        &[("idempotency-key", key), ("authorization", "Bearer acme")],
        body.to_owned(),
    )
    .await
}

#[tokio::test]
async fn amounts_outside_1_to_1_000_000_000_cents_are_422() {
    amounts_out_of_range(&[]).await;
}

#[tokio::test]
async fn postgres_amounts_outside_1_to_1_000_000_000_cents_are_422() {
    with_fresh_database(|url| async move {
        amounts_out_of_range(&[("DATABASE_URL", &url)]).await;
    })
    .await;
}

/// Amounts that are not a whole number of cents from 1 to [`MAX_AMOUNT_CENTS`] are refused
/// with `422` and a problem document, at the payments service and at the provider, and charge
/// nothing. The bounds themselves are accepted.
async fn amounts_out_of_range(env: &[(&str, &str)]) {
    let server = Server::start(env);
    let api = server.api();
    let acme = ("authorization", "Bearer acme");

    for amount in [0, -5, MAX_AMOUNT_CENTS + 1, i64::MAX, i64::MIN] {
        let key = format!("amount{amount}");
        let reply = api.pay(&[("idempotency-key", &key), acme], 1, amount).await;
        reply.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("amount_cents"), "{detail}");
        // A 4xx answer is stored like any other: the retry replays it.
        let again = api.pay(&[("idempotency-key", &key), acme], 1, amount).await;
        expect_replay_of(&again, &reply);

        let charge = api
            .post(
                "/provider/charges",
                &[("idempotency-key", &key), acme],
                &json!({ "amount_cents": amount }),
            )
            .await;
        charge.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    }
    // Numbers no i64 holds, and fractions of a cent.
    for (i, amount) in ["99999999999999999999", "-99999999999999999999", "12.5"]
        .iter()
        .enumerate()
    {
        let body = format!(r#"{{"order_id": 1, "amount_cents": {amount}}}"#);
        let reply = pay_raw(&api, &format!("raw-amount-{i}"), &body).await;
        reply.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    }
    assert_eq!(api.charges().await, 0, "nothing was charged");
    assert_eq!(api.order(Some("acme"), 1).await, order_json(1, 0, 0, None));

    for amount in [1, MAX_AMOUNT_CENTS] {
        let reply = api
            .pay(
                &[("idempotency-key", &format!("ok{amount}")), acme],
                1,
                amount,
            )
            .await;
        expect_new_payment(&reply, 1, amount);
    }
    assert_eq!(api.charges().await, 2);
    assert_eq!(
        api.order(Some("acme"), 1).await,
        order_json(1, MAX_AMOUNT_CENTS + 1, 2, None)
    );
}

#[tokio::test]
async fn the_order_total_cannot_overflow() {
    order_total_cannot_overflow(&[]).await;
}

/// In Postgres the total is also exact for rows no longer accepted (written before amounts
/// were bounded): their sum exceeds an i64, and `GET /orders/{id}` still answers it.
#[tokio::test]
async fn postgres_the_order_total_cannot_overflow() {
    with_fresh_database(|url| async move {
        order_total_cannot_overflow(&[("DATABASE_URL", &url)]).await;

        let server = Server::start(&[("DATABASE_URL", &url)]);
        let db = inspect(&url).await;
        for _ in 0..2 {
            sqlx::query(
                "INSERT INTO example_payments (tenant, order_id, amount_cents, charge_id)
                 VALUES ('legacy', 77, $1, 'ch_legacy')",
            )
            .bind(i64::MAX)
            .execute(&db)
            .await
            .unwrap();
        }
        db.close().await;
        let order = server.api().order(Some("legacy"), 77).await;
        let total = u64::try_from(i64::MAX).unwrap() * 2;
        assert_eq!(
            order,
            json!({
                "order_id": 77,
                "total_cents": total,
                "payments": 2,
                "shipping_address": null,
            })
        );
    })
    .await;
}

/// Two payments of `i64::MAX` used to overflow the order's total (a `500` forever in
/// Postgres, a silently capped total in memory). They are refused; the total stays exact.
async fn order_total_cannot_overflow(env: &[(&str, &str)]) {
    let server = Server::start(env);
    let api = server.api();
    let acme = ("authorization", "Bearer acme");
    for i in 0..2 {
        let key = format!("huge-{i}");
        let reply = api
            .pay(&[("idempotency-key", &key), acme], 9, i64::MAX)
            .await;
        reply.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    }
    for i in 0..3 {
        let key = format!("max-{i}");
        let reply = api
            .pay(&[("idempotency-key", &key), acme], 9, MAX_AMOUNT_CENTS)
            .await;
        expect_new_payment(&reply, 9, MAX_AMOUNT_CENTS);
    }
    assert_eq!(
        api.order(Some("acme"), 9).await,
        order_json(9, 3 * MAX_AMOUNT_CENTS, 3, None)
    );
    assert_eq!(api.charges().await, 3);
}

#[tokio::test]
async fn absurd_order_ids_are_refused_and_never_a_500() {
    absurd_order_ids(&[]).await;
}

#[tokio::test]
async fn postgres_absurd_order_ids_are_refused_and_never_a_500() {
    with_fresh_database(|url| async move {
        absurd_order_ids(&[("DATABASE_URL", &url)]).await;
    })
    .await;
}

/// Any i64 is an order id (the contract says int): negative ones and the extremes work. A
/// number no i64 holds, or a fraction, is `422` in a body and `404` in a path, with a problem
/// document.
async fn absurd_order_ids(env: &[(&str, &str)]) {
    let server = Server::start(env);
    let api = server.api();
    let acme = ("authorization", "Bearer acme");

    for order_id in [-7, 0, i64::MIN, i64::MAX] {
        let key = format!("order{order_id}");
        let reply = api
            .pay(&[("idempotency-key", &key), acme], order_id, 5)
            .await;
        expect_new_payment(&reply, order_id, 5);
        let patched = api
            .patch(
                &format!("/orders/{order_id}"),
                &[("idempotency-key", &format!("patch{order_id}")), acme],
                &json!({ "shipping_address": "Here" }),
            )
            .await;
        assert_eq!(
            patched.expect_json(StatusCode::OK),
            order_json(order_id, 5, 1, Some("Here"))
        );
        assert_eq!(
            api.order(Some("acme"), order_id).await,
            order_json(order_id, 5, 1, Some("Here"))
        );
    }
    assert_eq!(api.charges().await, 4);

    for (i, order_id) in ["99999999999999999999", "-99999999999999999999", "1.5"]
        .iter()
        .enumerate()
    {
        let body = format!(r#"{{"order_id": {order_id}, "amount_cents": 5}}"#);
        let reply = pay_raw(&api, &format!("raw-order-{i}"), &body).await;
        reply.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("order_id"), "{detail}");
    }
    assert_eq!(api.charges().await, 4, "nothing more was charged");

    for (i, path) in [
        "/orders/99999999999999999999",
        "/orders/-99999999999999999999",
        "/orders/abc",
        "/orders/1.5",
        "/orders/%FF",
    ]
    .iter()
    .enumerate()
    {
        let got = api.get(path, &[acme]).await;
        got.expect_problem(StatusCode::NOT_FOUND);
        let patched = api
            .patch(
                path,
                &[("idempotency-key", &format!("bad-path-{i}")), acme],
                &json!({ "shipping_address": "Here" }),
            )
            .await;
        patched.expect_problem(StatusCode::NOT_FOUND);
    }
}

/// A string of `len` characters of the Bearer token alphabet that does not compress (so a
/// Postgres index sees its full size).
fn incompressible_token(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/";
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let index = usize::try_from(state >> 33).unwrap() % ALPHABET.len();
            char::from(ALPHABET[index])
        })
        .collect()
}

#[tokio::test]
async fn an_over_long_or_malformed_tenant_is_401_before_the_layer() {
    bad_tenants(&[]).await;
}

#[tokio::test]
async fn postgres_an_over_long_or_malformed_tenant_is_401_before_the_layer() {
    with_fresh_database(|url| async move {
        bad_tenants(&[("DATABASE_URL", &url)]).await;
        // The refused requests claimed no key: only the two accepted payments left theirs
        // (each with its provider's key).
        let db = inspect(&url).await;
        assert_eq!(count(&db, "tower_idempotency_keys").await, 4);
        db.close().await;
    })
    .await;
}

/// The toy token names the tenant: at most 128 characters of the RFC 6750 token alphabet.
/// Anything else is `401` with a problem document and `WWW-Authenticate`, on every route of
/// the payments service and of the provider, before the idempotency layer sees the request.
async fn bad_tenants(env: &[(&str, &str)]) {
    let server = Server::start(env);
    let api = server.api();
    let too_long = incompressible_token(3000);
    let just_over = incompressible_token(129);
    let longest = incompressible_token(128);

    let bad = [
        format!("Bearer {too_long}"),
        format!("Bearer {just_over}"),
        "Bearer acme corp".to_owned(),
        "Bearer ac,me".to_owned(),
        "Bearer \"acme\"".to_owned(),
        "Bearer ac=me".to_owned(),
        "Bearer ".to_owned(),
        "Basic YWNtZTo=".to_owned(),
    ];
    for (i, authorization) in bad.iter().enumerate() {
        let headers = [
            ("idempotency-key", "tenant-key"),
            ("authorization", authorization.as_str()),
        ];
        let replies = [
            api.pay(&headers, 1, 100).await,
            api.post(
                "/provider/charges",
                &headers,
                &json!({ "amount_cents": 100 }),
            )
            .await,
            api.patch(
                "/orders/1",
                &headers,
                &json!({ "shipping_address": "Here" }),
            )
            .await,
            api.get("/orders/1", &headers).await,
        ];
        for reply in replies {
            reply.expect_problem(StatusCode::UNAUTHORIZED);
            let challenge = reply.header("www-authenticate").unwrap_or_default();
            assert!(challenge.starts_with("Bearer"), "#{i}: {reply:?}");
            assert!(!reply.replayed());
        }
    }
    assert_eq!(api.charges().await, 0, "nothing was charged");

    // The longest tenant works, and so does the token alphabet (with trailing `=`).
    for tenant in [longest.as_str(), "a-Z_0.9~+/=="] {
        let authorization = format!("Bearer {tenant}");
        let headers = [
            ("idempotency-key", "tenant-key"),
            ("authorization", authorization.as_str()),
        ];
        let reply = api.pay(&headers, 1, 100).await;
        expect_new_payment(&reply, 1, 100);
        let again = api.pay(&headers, 1, 100).await;
        expect_replay_of(&again, &reply);
        assert_eq!(
            api.order(Some(tenant), 1).await,
            order_json(1, 100, 1, None)
        );
    }
    assert_eq!(api.charges().await, 2);
}

// ---------------------------------------------------------------------------------------------
// PROVIDER_URL: the provider in another process, over HTTP, through the client layer
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn lost_provider_answers_charge_once_per_payment() {
    lost_provider_answers(&[]).await;
}

#[tokio::test]
async fn postgres_lost_provider_answers_charge_once_per_payment() {
    // Both processes on one database: the provider's charges and the payments are in their
    // own tables, and their keys in their own scopes (`provider:…`, `tenant:…`).
    with_fresh_database(|url| async move {
        lost_provider_answers(&[("DATABASE_URL", &url)]).await;
    })
    .await;
}

/// Two example processes: the provider, and the payments service with `PROVIDER_URL`
/// pointing at the provider through a proxy that loses answers after the provider made the
/// charge and answered. Every payment is `201`, each charged exactly once (the provider's
/// own count), and a retry of a payment replays it.
async fn lost_provider_answers(env: &[(&str, &str)]) {
    const SEQUENTIAL: i64 = 5;
    const CONCURRENT: i64 = 8;
    let acme = ("authorization", "Bearer acme");
    let provider = Server::start(env);
    let proxy = support::proxy::Proxy::start(provider.addr).await;
    let provider_url = format!("http://{}", proxy.addr());
    let mut payments_env = env.to_vec();
    payments_env.push(("PROVIDER_URL", &provider_url));
    let payments = Server::start(&payments_env);
    let (api, provider_api) = (payments.api(), provider.api());

    // One at a time: the first two answers of each charge are lost.
    let mut first_answers = Vec::new();
    for i in 1..=SEQUENTIAL {
        let lost = proxy.answers_lost();
        proxy.lose_answers(2);
        let key = format!("lost-{i}");
        let reply = api.pay(&[("idempotency-key", &key), acme], 7, 100).await;
        expect_new_payment(&reply, 7, 100);
        assert_eq!(
            proxy.answers_lost(),
            lost + 2,
            "both answers of {key} were lost"
        );
        assert_eq!(provider_api.charges().await, i, "{key} was charged once");
        first_answers.push((key, reply));
    }

    // Together: `CONCURRENT` payments, and as many answers lost among them. A payment whose
    // provider call gives up (all its attempts lost) is `503`: the client retries it with
    // its key, as a client does.
    proxy.lose_answers(usize::try_from(CONCURRENT).unwrap());
    let lost_before = proxy.answers_lost();
    let unavailable = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (1..=CONCURRENT)
        .map(|i| {
            let api = api.clone();
            let unavailable = unavailable.clone();
            tokio::spawn(async move {
                let key = format!("together-{i}");
                loop {
                    let reply = api.pay(&[("idempotency-key", &key), acme], 8, 10).await;
                    if reply.status != StatusCode::SERVICE_UNAVAILABLE {
                        return (key, reply);
                    }
                    unavailable.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        })
        .collect();
    for task in tasks {
        let (key, reply) = task.await.unwrap();
        let payment = reply.expect_json(StatusCode::CREATED);
        assert_eq!(payment["amount_cents"], 10, "{key}: {payment}");
        first_answers.push((key, reply));
    }
    assert_eq!(
        proxy.answers_lost() - lost_before,
        usize::try_from(CONCURRENT).unwrap(),
        "every answer the proxy was told to lose was lost"
    );
    eprintln!(
        "{} payments, {} provider answers lost, {} payments answered 503 and retried by the \
         test's client",
        SEQUENTIAL + CONCURRENT,
        proxy.answers_lost(),
        unavailable.load(std::sync::atomic::Ordering::SeqCst)
    );

    // The provider made one charge per payment. In memory, the payments process has charges
    // of its own (none: nothing was charged in process); in Postgres the two processes
    // count the same table.
    assert_eq!(provider_api.charges().await, SEQUENTIAL + CONCURRENT);
    if !env.iter().any(|(var, _)| *var == "DATABASE_URL") {
        assert_eq!(api.charges().await, 0, "no charge was made in process");
    }
    assert_eq!(
        api.order(Some("acme"), 7).await,
        order_json(7, 100 * SEQUENTIAL, SEQUENTIAL, None)
    );
    assert_eq!(
        api.order(Some("acme"), 8).await,
        order_json(8, 10 * CONCURRENT, CONCURRENT, None)
    );
    // Charge ids are distinct: no two payments share a charge.
    let mut charge_ids: Vec<String> = first_answers
        .iter()
        .map(|(_, reply)| reply.json()["charge_id"].as_str().unwrap().to_owned())
        .collect();
    charge_ids.sort();
    charge_ids.dedup();
    assert_eq!(charge_ids.len(), first_answers.len(), "{charge_ids:?}");

    // A retry of a payment is its replay; nothing is charged again.
    proxy.lose_answers(0);
    for (key, first) in &first_answers {
        let again = api.pay(&[("idempotency-key", key), acme], 0, 0).await;
        // Another body under the same key is 422 at the payments layer: the replay check
        // below uses the same body as the first request.
        again.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
        let (order, amount) = if key.starts_with("lost-") {
            (7, 100)
        } else {
            (8, 10)
        };
        let again = api
            .pay(&[("idempotency-key", key), acme], order, amount)
            .await;
        expect_replay_of(&again, first);
    }
    assert_eq!(provider_api.charges().await, SEQUENTIAL + CONCURRENT);

    // The provider refuses a charge (the derived key was used before with another amount):
    // its 422 is an answer, not retried; the payment is 502, and nothing is charged.
    let used = provider_api
        .post(
            "/provider/charges",
            &[("idempotency-key", "reused:charge"), acme],
            &json!({ "amount_cents": 5 }),
        )
        .await;
    used.expect_json(StatusCode::CREATED);
    let count = provider_api.charges().await;
    let refused = api.pay(&[("idempotency-key", "reused"), acme], 9, 7).await;
    refused.expect_problem(StatusCode::BAD_GATEWAY);
    assert_eq!(provider_api.charges().await, count);
}

/// What a fake provider (in the test process) was sent: the key and `Authorization` of each
/// request, in order.
#[derive(Clone, Default)]
struct FakeProvider {
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl FakeProvider {
    /// Serves `POST /provider/charges` on a free port: keys that start with `refuse-422` are
    /// answered `422`, `refuse-400` `400`, `slow-down` always `429`; `busy` is answered `409` (`Retry-After: 1`), `429`,
    /// `503`, then `201`; any other key `201` at once.
    async fn start() -> (FakeProvider, SocketAddr) {
        let fake = FakeProvider::default();
        let seen = fake.seen.clone();
        let app = axum::Router::new().route(
            "/provider/charges",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let seen = seen.clone();
                async move { fake_charge(&seen, &headers, &body) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (fake, addr)
    }

    fn keys(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }
}

fn fake_charge(
    seen: &Mutex<Vec<(String, String)>>,
    headers: &HeaderMap,
    body: &Bytes,
) -> (StatusCode, HeaderMap, String) {
    let text = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    };
    let key = text("idempotency-key");
    let attempt = {
        let mut seen = seen.lock().unwrap();
        seen.push((key.clone(), text("authorization")));
        seen.iter().filter(|(k, _)| *k == key).count()
    };
    let amount = serde_json::from_slice::<Value>(body).unwrap()["amount_cents"].clone();
    let mut answer_headers = HeaderMap::new();
    let status = if key.starts_with("refuse-422") {
        StatusCode::UNPROCESSABLE_ENTITY
    } else if key.starts_with("refuse-400") {
        StatusCode::BAD_REQUEST
    } else if key.starts_with("slow-down") {
        StatusCode::TOO_MANY_REQUESTS
    } else if key.starts_with("busy") && attempt <= 3 {
        if attempt == 1 {
            answer_headers.insert(RETRY_AFTER, "1".parse().unwrap());
        }
        [
            StatusCode::CONFLICT,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::SERVICE_UNAVAILABLE,
        ][attempt - 1]
    } else {
        answer_headers.insert(CONTENT_TYPE, JSON.parse().unwrap());
        let charge = json!({ "charge_id": format!("ch_fake_{attempt}"), "amount_cents": amount });
        return (StatusCode::CREATED, answer_headers, charge.to_string());
    };
    (status, answer_headers, String::new())
}

/// `PROVIDER_URL` pointing at a fake provider that answers by script: the payments process
/// sends the derived key and the tenant's `Authorization`, retries `409`, `429` and `503` with
/// the same key, and never a `422` or a `400` (the payment is then `502`, as in process).
#[tokio::test]
async fn a_provider_4xx_is_not_retried_and_409_429_503_are() {
    let (fake, addr) = FakeProvider::start().await;
    let provider_url = format!("http://{addr}");
    let payments = Server::start(&[("PROVIDER_URL", &provider_url)]);
    let api = payments.api();
    let acme = ("authorization", "Bearer acme");

    let busy = api
        .pay(&[("idempotency-key", "busy-1"), acme], 3, 250)
        .await;
    let payment = expect_new_payment(&busy, 3, 250);
    assert_eq!(
        payment["charge_id"], "ch_fake_4",
        "the fourth attempt was charged"
    );
    assert_eq!(
        fake.keys(),
        vec!["busy-1:charge"; 4],
        "the same key on every attempt"
    );
    assert!(
        fake.seen
            .lock()
            .unwrap()
            .iter()
            .all(|(_, auth)| auth == "Bearer acme"),
        "the tenant's Authorization is forwarded"
    );

    for key in ["refuse-422", "refuse-400"] {
        let reply = api.pay(&[("idempotency-key", key), acme], 3, 250).await;
        reply.expect_problem(StatusCode::BAD_GATEWAY);
        let charge_key = format!("{key}:charge");
        let sent = fake.keys().iter().filter(|k| **k == charge_key).count();
        assert_eq!(sent, 1, "{key}: the provider's 4xx was sent again");
    }

    // A provider that keeps saying "slow down": five attempts (the layer's bound), then the
    // payment is 503 (retry later), not stored.
    let reply = api
        .pay(&[("idempotency-key", "slow-down"), acme], 3, 250)
        .await;
    reply.expect_problem(StatusCode::SERVICE_UNAVAILABLE);
    let sent = fake
        .keys()
        .iter()
        .filter(|k| *k == "slow-down:charge")
        .count();
    assert_eq!(sent, 5, "the attempts are bounded");

    // A key at the 255-character limit: the provider gets the hashed derived key.
    let long = "k".repeat(255);
    let reply = api.pay(&[("idempotency-key", &long), acme], 3, 1).await;
    expect_new_payment(&reply, 3, 1);
    let sent = fake.keys().last().unwrap().clone();
    assert!(
        sent.starts_with("~sha256-") && sent.ends_with(":charge"),
        "{sent}"
    );
    assert!(sent.len() <= 255);
}

// ---------------------------------------------------------------------------------------------
// REDIS_URL (feature redis): the keys in Redis, the payments in each process's memory.

/// A key no other run meets in the shared Redis (the example uses the default prefix).
#[cfg(feature = "redis")]
fn redis_key(name: &str) -> String {
    format!("{name}-{}", support::unique())
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_two_processes_replay_each_others_answers() {
    let url = support::redis_support::redis_url();
    let one = Server::start(&[("REDIS_URL", &url)]);
    let two = Server::start(&[("REDIS_URL", &url)]);
    let key = redis_key("shared");
    let headers = [
        ("idempotency-key", key.as_str()),
        ("authorization", "Bearer acme"),
    ];

    let first = one.api().pay(&headers, 42, 1999).await;
    expect_new_payment(&first, 42, 1999);
    // The other process never saw this payment, yet replays its answer byte for byte.
    let again = two.api().pay(&headers, 42, 1999).await;
    expect_replay_of(&again, &first);
    assert_eq!(
        two.api().charges().await,
        0,
        "the second process charged nothing"
    );
    assert_eq!(one.api().charges().await, 1);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_a_duplicate_in_flight_is_409_and_another_body_is_422() {
    let url = support::redis_support::redis_url();
    let one = Server::start(&[("REDIS_URL", &url), ("CHARGE_DELAY_MS", "1500")]);
    let two = Server::start(&[("REDIS_URL", &url)]);
    let key = redis_key("in-flight");
    let headers = [("idempotency-key", key.as_str())];
    let slow = {
        let api = one.api();
        let headers = [("idempotency-key", key.clone())];
        tokio::spawn(async move {
            let h = [("idempotency-key", headers[0].1.as_str())];
            api.pay(&h, 7, 500).await
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let busy = two.api().pay(&headers, 7, 500).await;
    let kind = busy.expect_problem(StatusCode::CONFLICT);
    assert!(kind.ends_with("request-in-progress"), "{kind}");
    let first = slow.await.unwrap();
    expect_new_payment(&first, 7, 500);
    let other = two.api().pay(&headers, 7, 501).await;
    let kind = other.expect_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert!(kind.ends_with("key-reused"), "{kind}");
    expect_replay_of(&two.api().pay(&headers, 7, 500).await, &first);
}

/// A Redis that does not answer: the example starts, and keyed requests are `503` (with
/// `Retry-After`), never run without their key.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_down_is_503() {
    // Nothing listens on a port just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://127.0.0.1:{port}");
    let server = Server::start(&[
        ("REDIS_URL", &url),
        ("IDEMPOTENCY_STORE_TIMEOUT_MS", "2000"),
    ]);
    let api = server.api();
    let key = redis_key("down");
    let reply = api.pay(&[("idempotency-key", key.as_str())], 1, 100).await;
    reply.expect_problem(StatusCode::SERVICE_UNAVAILABLE);
    assert!(reply.header("retry-after").is_some(), "{reply:?}");
    assert_eq!(api.charges().await, 0, "nothing ran");
}
