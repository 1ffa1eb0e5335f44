//! Shared test support: a fresh Postgres schema per test, and a counting handler.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::PostgresStore;
use tower_idempotency::body::RequestBody;

pub mod cluster;
pub mod faults;
pub mod pgbouncer;
pub mod proxy;
#[cfg(feature = "redis")]
pub mod redis_support;
pub mod wire;

/// The server the Postgres tests use: `DATABASE_URL`, or the local service. Admin work
/// (creating and dropping schemas, roles and databases) and the tests' own inspections always
/// go straight to it, also in pooler mode.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Pooler mode: `TI_PGBOUNCER_URL`, a PgBouncer in transaction pooling mode in front of the
/// server of [`database_url`] (`scripts/test.sh` starts one and runs the Postgres behaviour
/// suite and the example's end-to-end tests through it). When set, the pools of
/// [`PgSchema::pool`] and [`PgSchema::store`] and the URL of [`PgDatabase`] go through it.
///
/// PgBouncer 1.18 does not forward the `options` startup parameter, so in this mode a
/// schema's `search_path` and the default isolation level of [`isolation`] are not set per
/// connection: each [`PgSchema`] gets a login role of its own with both set on the role, and
/// connects through the pooler as that role (PgBouncer keeps a pool per database and user);
/// a [`PgDatabase`] gets the isolation level set on the database.
pub fn pooler_url() -> Option<String> {
    std::env::var("TI_PGBOUNCER_URL")
        .ok()
        .filter(|url| !url.is_empty())
}

/// `url` with its database name replaced by `name` (the query string, if any, kept).
pub fn with_database_name(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let head = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{head}/{name}?{query}"),
        None => format!("{head}/{name}"),
    }
}

/// Connects to the server of [`database_url`] directly, for admin work.
async fn connect_admin(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to PostgreSQL at {url}: {e}\n\
                 The Postgres tests need a server. Run ./scripts/test.sh (it starts or \
                 installs a local PostgreSQL), or set DATABASE_URL to a server you own."
            )
        })
}

/// Runs one admin statement (simple query protocol).
async fn admin_exec(admin: &PgPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
        .execute(admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A schema of its own for one test, dropped by [`PgSchema::drop_schema`].
pub struct PgSchema {
    pub name: String,
    admin: PgPool,
    /// Pooler mode: the login role the pools connect as (its `search_path` is this schema).
    role: Option<String>,
}

impl PgSchema {
    /// Creates a fresh schema (and, in pooler mode, its role). Fails the test, saying what to
    /// do, when Postgres is not there.
    pub async fn new() -> PgSchema {
        let admin = connect_admin(&database_url()).await;
        let name = format!("ti_{}", unique());
        admin_exec(&admin, format!("CREATE SCHEMA {name}")).await;
        let role = if pooler_url().is_some() {
            // Same name as the schema: roles and schemas are separate namespaces.
            admin_exec(&admin, format!("CREATE ROLE {name} LOGIN SUPERUSER")).await;
            admin_exec(
                &admin,
                format!("ALTER ROLE {name} SET search_path = {name}"),
            )
            .await;
            if let Some(level) = isolation() {
                admin_exec(
                    &admin,
                    format!("ALTER ROLE {name} SET default_transaction_isolation = '{level}'"),
                )
                .await;
            }
            Some(name.clone())
        } else {
            None
        };
        PgSchema { name, admin, role }
    }

    /// A pool whose connections work in this schema, at the default isolation level that
    /// [`isolation`] names; through the pooler in pooler mode.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(self.connect_options())
            .await
            .unwrap()
    }

    /// The options [`pool`](Self::pool) connects with.
    pub fn connect_options(&self) -> PgConnectOptions {
        match (&self.role, pooler_url()) {
            (Some(role), Some(pooler)) => {
                PgConnectOptions::from_str(&pooler).unwrap().username(role)
            }
            _ => {
                let mut opts = PgConnectOptions::from_str(&database_url())
                    .unwrap()
                    .options([("search_path", self.name.as_str())]);
                if let Some(level) = isolation() {
                    opts = opts.options([("default_transaction_isolation", level)]);
                }
                opts
            }
        }
    }

    /// A pool straight to the server (never through the pooler), in this schema, at the
    /// default isolation level that [`isolation`] names: for a test's own inspections, and for
    /// what only works on a direct connection (prepared statements).
    pub async fn direct_pool(&self, max_connections: u32) -> PgPool {
        let mut opts = PgConnectOptions::from_str(&database_url())
            .unwrap()
            .options([("search_path", self.name.as_str())]);
        if let Some(level) = isolation() {
            opts = opts.options([("default_transaction_isolation", level)]);
        }
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await
            .unwrap()
    }

    /// A migrated store in this schema.
    pub async fn store(&self) -> PostgresStore {
        let store = PostgresStore::new(self.pool(16).await);
        store.migrate().await.unwrap();
        store
    }

    /// Puts the schema's records on a clock that only the test moves: the store's clock hook,
    /// `tower_idempotency_now()`, reads a one-row table that starts at the server's time and
    /// goes ahead only by [`advance_clock`](Self::advance_clock). Call it after `migrate()`.
    /// Leases and TTLs then run out only where the test says, whatever the machine's load.
    pub async fn controlled_clock(&self) {
        self.controlled_clock_from("pg_catalog.now()").await;
    }

    /// [`controlled_clock`](Self::controlled_clock), starting at `start` (an SQL expression).
    pub async fn controlled_clock_from(&self, start: &str) {
        let s = &self.name;
        admin_exec(
            &self.admin,
            format!(
                "CREATE TABLE {s}.ti_clock (t timestamptz NOT NULL);
                 INSERT INTO {s}.ti_clock VALUES ({start});
                 CREATE OR REPLACE FUNCTION {s}.tower_idempotency_now() RETURNS timestamptz
                     LANGUAGE sql STABLE PARALLEL SAFE AS $$ SELECT t FROM {s}.ti_clock $$"
            ),
        )
        .await;
    }

    /// Moves the clock of [`controlled_clock`](Self::controlled_clock) `by` ahead, at once.
    pub async fn advance_clock(&self, by: Duration) {
        let micros = i64::try_from(by.as_micros()).unwrap();
        admin_exec(
            &self.admin,
            format!(
                "UPDATE {}.ti_clock SET t = t + interval '{micros} microseconds'",
                self.name
            ),
        )
        .await;
    }

    pub async fn drop_schema(mut self) {
        match self.role.take() {
            None => {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA {} CASCADE",
                    self.name
                )))
                .execute(&self.admin)
                .await;
            }
            Some(role) => {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop_role_and_schema(&role, &self.name)))
                    .execute(&self.admin)
                    .await;
            }
        }
    }
}

/// Drops a pooler-mode schema and its role. The pooler may keep server connections of the
/// role open: they are ended first (PgBouncer drops a server connection it finds closed), so
/// that nothing holds a lock on the schema, the role can go, and the server's connection
/// slots come back.
fn drop_role_and_schema(role: &str, schema: &str) -> String {
    format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';
         DROP SCHEMA IF EXISTS {schema} CASCADE;
         DROP ROLE IF EXISTS {role}"
    )
}

impl Drop for PgSchema {
    /// A test that failed before [`PgSchema::drop_schema`] leaves its schema behind (in both
    /// modes), but not, in pooler mode, its role: a superuser without a password.
    fn drop(&mut self) {
        let Some(role) = self.role.take() else {
            return;
        };
        let sql = drop_role_and_schema(&role, &self.name);
        // Another thread with a runtime of its own: this one may be inside a runtime.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let Ok(admin) = sqlx::PgPool::connect(&database_url()).await else {
                    return;
                };
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&admin)
                    .await;
                admin.close().await;
            });
        })
        .join();
    }
}

/// The default isolation level the Postgres tests' connections run at: `TI_ISOLATION`
/// (`read committed`, `repeatable read` or `serializable`; the test script runs the Postgres
/// suites once at each), or the server's default when unset.
pub fn isolation() -> Option<&'static str> {
    static LEVEL: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let level = std::env::var("TI_ISOLATION").ok()?;
        match level.trim().to_ascii_lowercase().as_str() {
            "" => None,
            "read committed" => Some("read committed"),
            "repeatable read" => Some("repeatable read"),
            "serializable" => Some("serializable"),
            other => panic!(
                "TI_ISOLATION={other:?}: use 'read committed', 'repeatable read' or 'serializable'"
            ),
        }
    })
}

/// `url` with the default isolation level of [`isolation`] added to its connection options,
/// so that a program started on it runs at the level the test run asks for.
pub fn with_isolation(mut url: String) -> String {
    if let Some(level) = isolation() {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str("options=-c%20default_transaction_isolation%3D");
        // A space inside a `-c` value is escaped with a backslash.
        url.push_str(&level.replace(' ', "%5C%20"));
    }
    url
}

/// A name unique across test processes and threads.
pub fn unique() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{}_{}_{}",
        std::process::id(),
        nanos,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub type TestBody = RequestBody<Full<Bytes>>;
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// Counts how often the handler really ran, per path.
#[derive(Clone, Default)]
pub struct Calls(
    Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    Arc<tokio::sync::watch::Sender<bool>>,
);

impl Calls {
    /// Lets the first call of `/hold` answer, whether it is waiting yet or not.
    pub fn release(&self) {
        self.1.send_replace(true);
    }
    /// Waits until [`release`](Self::release).
    async fn held(&self) {
        let mut released = self.1.subscribe();
        let _ = released.wait_for(|r| *r).await;
    }
    pub fn get(&self, path: &str) -> usize {
        self.0.lock().unwrap().get(path).copied().unwrap_or(0)
    }
    pub fn total(&self) -> usize {
        self.0.lock().unwrap().values().sum()
    }
    fn hit(&self, path: &str) -> usize {
        let mut m = self.0.lock().unwrap();
        let n = m.entry(path.to_owned()).or_default();
        *n += 1;
        *n
    }
}

/// A body of one chunk and trailers.
pub struct WithTrailers {
    pub data: Option<Bytes>,
    pub trailers: Option<http::HeaderMap>,
}

impl http_body::Body for WithTrailers {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        let frame = match self.data.take() {
            Some(data) => Some(http_body::Frame::data(data)),
            None => self.trailers.take().map(http_body::Frame::trailers),
        };
        std::task::Poll::Ready(frame.map(Ok))
    }
}

/// The test handler. What it does depends on the path:
///
/// - `/slow?ms=N`: sleeps N ms, then answers like `/ok`;
/// - `/hold`: its first call waits until the test calls [`Calls::release`]; then, and every
///   later call at once, answers like `/ok`;
/// - `/fail`: `500`; `/bad`: `400`; `/panic`: panics; `/error`: a service error;
/// - `/limited`, `/timeout`: `429`, `408` on their first call, then like anything else;
/// - `/big?n=N`: `200` with N bytes, streamed in 1 KiB chunks;
/// - `/key`: `200` with the key the layer inserted into the extensions;
/// - `/grpc`: a gRPC answer, one message and `grpc-status: 0` in the trailers;
/// - anything else: `201` echoing the method, body and call count, with
///   `content-type`, `x-custom`, `set-cookie` and `date` headers.
pub fn handler(
    calls: Calls,
) -> impl tower::Service<
    Request<TestBody>,
    Response = Response<BoxBody>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |req: Request<TestBody>| {
        let calls = calls.clone();
        async move {
            let path = req.uri().path().to_owned();
            let query = req.uri().query().unwrap_or("").to_owned();
            let n = calls.hit(&path);
            let num = |name: &str| -> u64 {
                query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let key = req
                .extensions()
                .get::<tower_idempotency::IdempotencyKey>()
                .map(|k| k.to_string());
            let method = req.method().clone();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let full = |status: StatusCode, text: String| {
                let mut res = Response::new(
                    Full::new(Bytes::from(text))
                        .map_err(|e: Infallible| match e {})
                        .boxed_unsync(),
                );
                *res.status_mut() = status;
                res
            };
            match path.as_str() {
                "/slow" => tokio::time::sleep(Duration::from_millis(num("ms"))).await,
                "/hold" if n == 1 => calls.held().await,
                "/fail" => return Ok(full(StatusCode::INTERNAL_SERVER_ERROR, "boom".into())),
                "/bad" => return Ok(full(StatusCode::BAD_REQUEST, format!("bad #{n}"))),
                "/limited" if n == 1 => {
                    return Ok(full(StatusCode::TOO_MANY_REQUESTS, "slow down".into()));
                }
                "/timeout" if n == 1 => {
                    return Ok(full(StatusCode::REQUEST_TIMEOUT, "too slow".into()));
                }
                "/panic" => panic!("handler panicked on purpose"),
                "/error" => return Err(std::io::Error::other("service error")),
                "/key" => return Ok(full(StatusCode::OK, key.unwrap_or_default())),
                "/grpc" => {
                    // A gRPC answer: one message, then the outcome in the trailers.
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    trailers.insert("grpc-message", HeaderValue::from(n));
                    let body = WithTrailers {
                        data: Some(Bytes::from(format!("message #{n}"))),
                        trailers: Some(trailers),
                    };
                    let mut res = Response::new(body.boxed_unsync());
                    res.headers_mut()
                        .insert("content-type", HeaderValue::from_static("application/grpc"));
                    return Ok(res);
                }
                "/headers" => {
                    // Only headers that are stored: the answer lends them all to the store.
                    let mut res = full(StatusCode::CREATED, format!("call #{n}"));
                    let h = res.headers_mut();
                    h.insert("content-type", HeaderValue::from_static("application/json"));
                    h.insert("x-call", HeaderValue::from(n));
                    h.append("x-many", HeaderValue::from_static("one"));
                    h.append("x-many", HeaderValue::from_static("two"));
                    return Ok(res);
                }
                "/big" => {
                    let total = usize::try_from(num("n")).unwrap();
                    let chunks: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = (0..total
                        .div_ceil(1024))
                        .map(|i| {
                            let len = (total - i * 1024).min(1024);
                            Ok(http_body::Frame::data(Bytes::from(
                                vec![b"abcdefghijklmnopqrstuvwxyz"[i % 26]; len],
                            )))
                        })
                        .collect();
                    let stream = futures_stream(chunks);
                    let mut res = Response::new(StreamBody::new(stream).boxed_unsync());
                    res.headers_mut()
                        .insert("content-type", HeaderValue::from_static("text/plain"));
                    return Ok(res);
                }
                _ => {}
            }
            let mut res = full(
                StatusCode::CREATED,
                format!(
                    "{method} {path} call #{n} body={}",
                    String::from_utf8_lossy(&body)
                ),
            );
            let h = res.headers_mut();
            h.insert(
                "content-type",
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            h.insert("x-custom", HeaderValue::from_static("kept"));
            h.insert("set-cookie", HeaderValue::from_static("session=secret"));
            h.insert(
                "date",
                HeaderValue::from_static("Mon, 30 Nov 2026 00:00:00 GMT"),
            );
            Ok(res)
        }
    })
}

/// A stream of frames that yields between chunks, so the body really streams.
fn futures_stream<T: Send + Unpin + 'static>(
    items: Vec<T>,
) -> impl futures_core::Stream<Item = T> + Send + 'static {
    struct Iter<T>(std::collections::VecDeque<T>, bool);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            // Alternate between pending and ready to exercise partial reads.
            self.1 = !self.1;
            if self.1 {
                cx.waker().wake_by_ref();
                return std::task::Poll::Pending;
            }
            std::task::Poll::Ready(self.0.pop_front())
        }
    }
    Iter(items.into(), false)
}

/// Builds a request.
pub fn req(method: &str, uri: &str, key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

/// A response read in full.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    /// Asserts a problem+json answer with this status and problem code.
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "body: {}", self.text());
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let v = self.json();
        assert_eq!(v["status"], status);
        let ty = v["type"].as_str().unwrap();
        assert!(ty.ends_with(&format!("#{code}")), "type {ty} is not {code}");
        assert!(v["title"].is_string() && v["detail"].is_string());
    }
}

pub async fn read<B>(res: Response<B>) -> Answer
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = res.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A database of its own, for tests that run a program with a `DATABASE_URL`.
pub struct PgDatabase {
    pub name: String,
    /// The URL the program gets: through the pooler in pooler mode.
    pub url: String,
    /// Straight to the server, for the test's own inspections.
    pub direct_url: String,
    admin: PgPool,
}

impl PgDatabase {
    pub async fn new() -> PgDatabase {
        let admin = connect_admin(&database_url()).await;
        let name = format!("tidb_{}", unique());
        admin_exec(&admin, format!("CREATE DATABASE {name}")).await;
        let direct_url = with_database_name(&database_url(), &name);
        let url = program_database_url(&admin, &name).await;
        PgDatabase {
            name,
            url,
            direct_url,
            admin,
        }
    }

    pub async fn drop_database(self) {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&self.admin)
        .await;
    }
}

/// The `DATABASE_URL` to give a program under test for the fresh database `name` (on the
/// server of [`database_url`], where `admin` is connected), at the isolation level of
/// [`isolation`]: straight to the server with the level in the connection options, or in
/// pooler mode through the pooler, with the level set on the database (the pooler does not
/// forward connection options).
pub async fn program_database_url(admin: &PgPool, name: &str) -> String {
    match pooler_url() {
        Some(pooler) => {
            if let Some(level) = isolation() {
                admin_exec(
                    admin,
                    format!("ALTER DATABASE {name} SET default_transaction_isolation = '{level}'"),
                )
                .await;
            }
            with_database_name(&pooler, name)
        }
        None => with_isolation(with_database_name(&database_url(), name)),
    }
}

/// `url` (a URL of [`program_database_url`]) straight to the server: for a test's own
/// inspections, which use sqlx's cached prepared statements and so must not go through a
/// transaction-mode pooler.
pub fn direct_database_url(url: &str) -> String {
    if pooler_url().is_none() {
        return url.to_owned();
    }
    let base = url.split_once('?').map_or(url, |(base, _)| base);
    let name = base.rsplit_once('/').map_or("", |(_, name)| name);
    with_database_name(&database_url(), name)
}

/// The path of an example's binary, `target/<profile>/examples/<name>`, built once per test
/// process with this test's profile and features (a no-op when `cargo test` built it
/// already; `cargo test --all-targets` builds examples as tests only, so this matters).
pub fn example_path(name: &str) -> std::path::PathBuf {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static BUILT: OnceLock<Mutex<HashMap<String, std::path::PathBuf>>> = OnceLock::new();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>-<hash> -> target/<profile>
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    build_example(name, profile_dir);
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "the example binary {} is missing; build it with `cargo build --example {name}`",
        path.display()
    );
    built.insert(name.to_owned(), path.clone());
    path
}

/// `cargo build --example <name>` into the same target directory, with the profile and the
/// features of this test.
fn build_example(name: &str, profile_dir: &std::path::Path) {
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo
        .args(["build", "--example", name, "--quiet"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => {}
        Some("release") => {
            cargo.arg("--release");
        }
        Some(profile) => {
            cargo.args(["--profile", profile]);
        }
    }
    if let Some(target_dir) = profile_dir.parent() {
        cargo.env("CARGO_TARGET_DIR", target_dir);
    }
    // Exactly the features this test was built with (`default` included), so that the
    // library the example links is the one the test build made, and `scripts/test.sh`'s
    // `cargo build --all-features --examples` leaves nothing to build here.
    let mut features = vec!["postgres"];
    for (on, feature) in [
        (cfg!(feature = "default"), "default"),
        (cfg!(feature = "json"), "json"),
        (cfg!(feature = "axum"), "axum"),
        (cfg!(feature = "testing"), "testing"),
        (cfg!(feature = "metrics"), "metrics"),
        (cfg!(feature = "redis"), "redis"),
        (cfg!(feature = "fuzzing"), "fuzzing"),
    ] {
        if on {
            features.push(feature);
        }
    }
    cargo
        .arg("--no-default-features")
        .arg("--features")
        .arg(features.join(","));
    match cargo.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "`cargo build --example {name}` failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        // No cargo at run time (tests run from an archive): use the binary as it is.
        Err(e) => eprintln!("cannot run cargo ({e}); using the example binary as built"),
    }
}

/// A memory store with faults to switch on: slow answers, failing writes, renewals refused or
/// disowned. Clones share the switches.
#[derive(Clone, Default)]
pub struct Faulty {
    pub inner: tower_idempotency::MemoryStore,
    /// The claim is made, then answered this many milliseconds late.
    pub claim_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// `complete` waits this many milliseconds before storing.
    pub complete_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// `complete` and `release` fail (the store is down for writes).
    pub writes_fail: Arc<std::sync::atomic::AtomicBool>,
    /// `renew` fails (the store cannot be reached).
    pub renew_fails: Arc<std::sync::atomic::AtomicBool>,
    /// `renew` answers that the claim no longer holds the key.
    pub renew_disowned: Arc<std::sync::atomic::AtomicBool>,
}

impl Faulty {
    /// Switches a fault on or off.
    pub fn set(switch: &std::sync::atomic::AtomicBool, on: bool) {
        switch.store(on, Ordering::SeqCst);
    }

    fn down(switch: &std::sync::atomic::AtomicBool) -> Result<(), tower_idempotency::StoreError> {
        if switch.load(Ordering::SeqCst) {
            Err(tower_idempotency::StoreError::backend("the store is down"))
        } else {
            Ok(())
        }
    }

    async fn delay(ms: &std::sync::atomic::AtomicU64) {
        let ms = ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

impl tower_idempotency::Store for Faulty {
    async fn claim(
        &self,
        r: tower_idempotency::ClaimRequest<'_>,
    ) -> Result<tower_idempotency::ClaimOutcome, tower_idempotency::StoreError> {
        let outcome = self.inner.claim(r).await;
        Self::delay(&self.claim_delay_ms).await;
        outcome
    }
    async fn complete(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
        response: &tower_idempotency::StoredResponse,
        ttl: Duration,
    ) -> Result<bool, tower_idempotency::StoreError> {
        Self::delay(&self.complete_delay_ms).await;
        Self::down(&self.writes_fail)?;
        self.inner.complete(scope, key, token, response, ttl).await
    }
    async fn release(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
    ) -> Result<bool, tower_idempotency::StoreError> {
        Self::down(&self.writes_fail)?;
        self.inner.release(scope, key, token).await
    }
    async fn renew(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
        lease: Duration,
    ) -> Result<bool, tower_idempotency::StoreError> {
        Self::down(&self.renew_fails)?;
        if self.renew_disowned.load(Ordering::SeqCst) {
            return Ok(false);
        }
        self.inner.renew(scope, key, token, lease).await
    }
    async fn purge_expired(&self, batch_size: usize) -> Result<u64, tower_idempotency::StoreError> {
        self.inner.purge_expired(batch_size).await
    }
}

/// Sends `send()` until it is not `409` (the first request, or its release, still in
/// progress) and returns that answer; fails when it stays `409` for `within`.
pub async fn until_not_in_flight<F, Fut>(within: Duration, mut send: F) -> Answer
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Answer>,
{
    let started = tokio::time::Instant::now();
    loop {
        let a = send().await;
        if a.status != StatusCode::CONFLICT {
            return a;
        }
        a.assert_problem(409, "request-in-progress");
        assert!(
            started.elapsed() < within,
            "the key stayed in flight for {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
