//! How many statements each path of the Postgres store sends, counted on the wire.
//!
//! The store's pool connects through a small TCP proxy on `127.0.0.1:0` that forwards to
//! Postgres and counts the frontend messages by type. The store sends each of its statements
//! as one simple Query (`Q`) message (so that a pooler in transaction mode can carry it),
//! its `statement_timeout` and `lock_timeout` set with `SET LOCAL` in front of it in the same
//! message: the number of `Q` messages is the number of round trips, and Parse (`P`) and
//! Execute (`E`) messages stay at zero. The proxy records the text of every `Q` message.
//! sqlx's own queries (the handler's, in the transactional test) use the extended protocol:
//! Bind + Execute + Sync. The pool has one connection and the counts are taken between two
//! points after it is warmed, so sqlx's own connection set-up is not counted.
//!
//! Plain mode is checked with each [`ClaimStrategy`]; transactional mode against the same
//! handler run without the layer in a transaction of its own.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use support::{Answer, Calls, PgSchema, database_url, handler, read, req};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::{Layer, ServiceExt};
use tower_idempotency::{ClaimStrategy, IdempotencyLayer, IdempotentTx, PostgresStore};

/// Frontend messages seen by the proxy, per message type byte, and the text of every simple
/// Query message (sqlx sends `BEGIN`, `COMMIT` and `ROLLBACK` that way), in order.
struct Counters {
    by_type: [AtomicUsize; 256],
    queries: std::sync::Mutex<Vec<String>>,
    /// ErrorResponse messages from the server: each is an ERROR the server also writes to
    /// its log (with the statement, by default).
    errors: AtomicUsize,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            by_type: std::array::from_fn(|_| AtomicUsize::new(0)),
            queries: std::sync::Mutex::default(),
            errors: AtomicUsize::new(0),
        }
    }
}

/// Splits the server-to-client byte stream into typed messages (the proxy's connections use
/// no TLS, so the server never answers an encryption request with a bare byte) and counts
/// its ErrorResponse (`E`) messages.
#[derive(Default)]
struct BackendParser {
    header: Vec<u8>,
    skip: usize,
}

impl BackendParser {
    fn feed(&mut self, mut data: &[u8], counters: &Counters) {
        while !data.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                self.skip -= n;
                data = &data[n..];
                continue;
            }
            let n = (5 - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.header.len() < 5 {
                continue;
            }
            let h = &self.header;
            let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
            if h[0] == b'E' {
                counters.errors.fetch_add(1, Ordering::SeqCst);
            }
            self.skip = usize::try_from(len).unwrap() - 4;
            self.header.clear();
        }
    }
}

/// A snapshot of [`Counters`], or the difference of two.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Counts([usize; 256]);

impl Counts {
    fn of(&self, message: u8) -> usize {
        self.0[usize::from(message)]
    }
    /// Execute: one per statement in the extended protocol.
    fn execute(&self) -> usize {
        self.of(b'E')
    }
    /// Parse: a statement prepared (zero when the connection's cache has it).
    fn parse(&self) -> usize {
        self.of(b'P')
    }
    /// Simple Query.
    fn query(&self) -> usize {
        self.of(b'Q')
    }

    fn since(&self, earlier: &Counts) -> Counts {
        let mut d = [0; 256];
        for (i, slot) in d.iter_mut().enumerate() {
            *slot = self.0[i] - earlier.0[i];
        }
        Counts(d)
    }
}

impl fmt::Debug for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (i, n) in self.0.iter().enumerate() {
            if *n > 0 {
                let ty = u8::try_from(i).map(char::from).unwrap_or('?');
                m.entry(&ty, n);
            }
        }
        m.finish()
    }
}

/// Splits the client-to-server byte stream into messages: first the untyped start-up
/// packets (`int32 length, int32 code, ...`; an SSL or GSS encryption request is followed by
/// another), then typed messages (`byte type, int32 length, ...`).
#[derive(Default)]
struct FrontendParser {
    started: bool,
    header: Vec<u8>,
    skip: usize,
    /// The body of the simple Query message being read, if one is.
    query: Option<Vec<u8>>,
}

const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

impl FrontendParser {
    fn feed(&mut self, mut data: &[u8], counters: &Counters) {
        while !data.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                if let Some(q) = &mut self.query {
                    q.extend_from_slice(&data[..n]);
                }
                self.skip -= n;
                data = &data[n..];
                if self.skip == 0 {
                    self.finish_query(counters);
                }
                continue;
            }
            let header_len = if self.started { 5 } else { 8 };
            let n = (header_len - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.header.len() < header_len {
                continue;
            }
            let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
            if self.started {
                let len = usize::try_from(be(&self.header[1..5])).unwrap();
                counters.by_type[usize::from(self.header[0])].fetch_add(1, Ordering::SeqCst);
                self.skip = len - 4;
                if self.header[0] == b'Q' {
                    self.query = Some(Vec::with_capacity(self.skip));
                    if self.skip == 0 {
                        self.finish_query(counters);
                    }
                }
            } else {
                let len = usize::try_from(be(&self.header[0..4])).unwrap();
                let code = be(&self.header[4..8]);
                self.skip = len - 8;
                self.started = code != SSL_REQUEST && code != GSSENC_REQUEST;
            }
            self.header.clear();
        }
    }

    /// Records the text of the simple Query just read (its body is a NUL-terminated string).
    fn finish_query(&mut self, counters: &Counters) {
        if let Some(q) = self.query.take() {
            let text = String::from_utf8_lossy(&q)
                .trim_end_matches('\0')
                .to_owned();
            counters.queries.lock().unwrap().push(text);
        }
    }
}

/// A TCP proxy to Postgres that counts the frontend messages of every connection through it.
struct Proxy {
    addr: SocketAddr,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: (String, u16)) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = TcpStream::connect((upstream.0.as_str(), upstream.1))
                    .await
                    .unwrap();
                tokio::spawn(forward(client, server, c.clone()));
            }
        });
        Proxy {
            addr,
            counters,
            task,
        }
    }

    fn counts(&self) -> Counts {
        Counts(std::array::from_fn(|i| {
            self.counters.by_type[i].load(Ordering::SeqCst)
        }))
    }

    /// How many errors the server answered so far.
    fn errors(&self) -> usize {
        self.counters.errors.load(Ordering::SeqCst)
    }

    /// The texts of the simple Query messages seen so far, in order.
    fn queries(&self) -> Vec<String> {
        self.counters.queries.lock().unwrap().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(client: TcpStream, server: TcpStream, counters: Arc<Counters>) {
    client.set_nodelay(true).unwrap();
    server.set_nodelay(true).unwrap();
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let down_counters = counters.clone();
    let up = async move {
        let mut parser = FrontendParser::default();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            // Counted before it is forwarded, so a count is complete once the answer is back.
            parser.feed(&buf[..n], &counters);
            server_write.write_all(&buf[..n]).await?;
        }
    };
    let down = async move {
        let mut parser = BackendParser::default();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return client_write.shutdown().await;
            }
            parser.feed(&buf[..n], &down_counters);
            client_write.write_all(&buf[..n]).await?;
        }
    };
    let _ = tokio::join!(up, down);
}

/// A pool of one connection to the test's schema, through `proxy`, without TLS (so the
/// proxy can read the messages).
async fn pool_through(proxy: &Proxy, schema: &PgSchema) -> PgPool {
    pool_of(proxy, schema, 1).await
}

/// [`pool_through`] with `connections` connections, all open from the start.
async fn pool_of(proxy: &Proxy, schema: &PgSchema, connections: u32) -> PgPool {
    let opts = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .host("127.0.0.1")
        .port(proxy.addr.port())
        .ssl_mode(PgSslMode::Disable)
        .options([("search_path", schema.name.as_str())]);
    PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .unwrap()
}

fn upstream() -> (String, u16) {
    let opts = PgConnectOptions::from_str(&database_url()).unwrap();
    let host = opts.get_host().to_owned();
    assert!(
        !host.starts_with('/'),
        "DATABASE_URL names a Unix socket ({host}); this test needs a TCP address"
    );
    (host, opts.get_port())
}

/// Sends one request through `svc` and returns its answer and the messages it cost.
async fn send<S, B>(svc: &S, proxy: &Proxy, path: &str, key: &str, body: &str) -> (Answer, Counts)
where
    S: tower::Service<http::Request<Full<Bytes>>, Response = http::Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: fmt::Debug,
{
    let before = proxy.counts();
    let res = svc
        .clone()
        .oneshot(req("POST", path, Some(key), body))
        .await
        .unwrap();
    let answer = read(res).await;
    (answer, proxy.counts().since(&before))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_counts_statements_on_the_wire() {
    let schema = PgSchema::new().await;
    let proxy = Proxy::start(upstream()).await;
    let pool = pool_through(&proxy, &schema).await;
    let started = proxy.counts();

    // A prepared statement, twice: prepared once, executed twice.
    for _ in 0..2 {
        sqlx::query("SELECT $1::int4")
            .bind(1)
            .execute(&pool)
            .await
            .unwrap();
    }
    let prepared = proxy.counts().since(&started);
    assert_eq!(prepared.execute(), 2, "{prepared:?}");
    assert_eq!(prepared.parse(), 1, "{prepared:?}");

    // A simple query: one Query message, no Execute.
    let before = proxy.counts();
    sqlx::raw_sql("SELECT 1").execute(&pool).await.unwrap();
    let simple = proxy.counts().since(&before);
    assert_eq!((simple.query(), simple.execute()), (1, 0), "{simple:?}");
    assert_eq!(proxy.queries().last().map(String::as_str), Some("SELECT 1"));

    pool.close().await;
    schema.drop_schema().await;
}

/// The default store on a first request and on a replay: every message runs statements
/// prepared by name (no call of a PL/pgSQL function, whose call is planned anew and whose
/// settings are saved and restored on every call), written with the store's schema in them
/// (no `search_path` setting in the message). A first request is the insert and the
/// completion; once most claims find their key, a replay is the read alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_sends_statements_prepared_by_name_and_follows_the_workload() {
    let schema = PgSchema::new().await;
    let admin = schema.pool(2).await;
    PostgresStore::new(admin.clone()).migrate().await.unwrap();
    let proxy = Proxy::start(upstream()).await;
    let pool = pool_through(&proxy, &schema).await;
    let svc =
        IdempotencyLayer::new(PostgresStore::new(pool.clone())).layer(handler(Calls::default()));
    // Every path runs once, so its statements are prepared on the connection.
    for (path, key) in [("/ok", "warm"), ("/ok", "warm"), ("/fail", "warm-fail")] {
        send(&svc, &proxy, path, key, "w").await;
    }
    let prepared_only = |q: &str| {
        let statements: Vec<&str> = q.split("; ").collect();
        statements
            .iter()
            .all(|s| s.starts_with("SET LOCAL ") || s.starts_with("EXECUTE "))
            && !q.contains("search_path")
            && !q.contains("PREPARE")
    };

    // First requests: the insert, then the completion.
    for i in 0..20 {
        let (first, cost) = send(&svc, &proxy, "/ok", &format!("new-{i}"), "body").await;
        assert_eq!(first.status, 201, "{}", first.text());
        assert_eq!(cost.query(), 2, "a first request: {cost:?}");
        for q in proxy.queries().iter().rev().take(2) {
            assert!(prepared_only(q), "{q}");
        }
    }

    // Replays: after a few, each is the read alone.
    let mut replay = None;
    for _ in 0..40 {
        let (again, cost) = send(&svc, &proxy, "/ok", "new-0", "body").await;
        assert_eq!(again.status, 201);
        assert!(again.replayed());
        replay = Some(cost.query());
    }
    assert_eq!(replay, Some(1), "a replay after replays");
    let last = proxy.queries().last().cloned().unwrap_or_default();
    assert!(prepared_only(&last), "{last}");
    assert_eq!((proxy.counts().parse(), proxy.counts().execute()), (0, 0));

    // First requests again: after a few, each is back to the insert and the completion.
    let mut first = None;
    for i in 0..40 {
        let (answer, cost) = send(&svc, &proxy, "/ok", &format!("again-{i}"), "body").await;
        assert_eq!(answer.status, 201);
        first = Some(cost.query());
    }
    assert_eq!(first, Some(2), "a first request after first requests");

    admin.close().await;
    pool.close().await;
    schema.drop_schema().await;
}

/// The statements each plain-mode path costs with one [`ClaimStrategy`].
struct Expected {
    first: usize,
    replay: usize,
    reused: usize,
    failed: usize,
    /// Whether a replay runs the claim function's insert, which draws a lease token from the
    /// sequence even when it conflicts (the bare insert's token is random).
    replay_draws_a_token: Option<bool>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_one_statement_and_a_first_request_two() {
    // Claim (a function that reads, and inserts only for an absent key), complete. A replay
    // is that read alone: the insert, which runs inside the statement and so is not seen on
    // the wire, does not run (no lease token is drawn).
    plain_mode_counts(
        ClaimStrategy::Combined,
        Expected {
            first: 2,
            replay: 1,
            reused: 1,
            failed: 2,
            replay_draws_a_token: Some(false),
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_first_replays_with_one_select() {
    // Read, insert, complete; a replay or a reused key is the read alone; a 5xx releases.
    plain_mode_counts(
        ClaimStrategy::ReadFirst,
        Expected {
            first: 3,
            replay: 1,
            reused: 1,
            failed: 3,
            replay_draws_a_token: None,
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_first_claims_with_one_insert() {
    // Insert, complete; a replay or a reused key is the conflicting insert, then the read.
    plain_mode_counts(
        ClaimStrategy::InsertFirst,
        Expected {
            first: 2,
            replay: 2,
            reused: 2,
            failed: 2,
            replay_draws_a_token: None,
        },
    )
    .await;
}

async fn plain_mode_counts(strategy: ClaimStrategy, expected: Expected) {
    let schema = PgSchema::new().await;
    let admin = schema.pool(2).await;
    PostgresStore::new(admin.clone()).migrate().await.unwrap();
    // The last lease token drawn, read beside the proxy (not counted).
    let last_token = || async {
        sqlx::query_scalar::<_, i64>("SELECT last_value FROM tower_idempotency_lease_token_seq")
            .fetch_one(&admin)
            .await
            .unwrap()
    };

    let proxy = Proxy::start(upstream()).await;
    let pool = pool_through(&proxy, &schema).await;
    let calls = Calls::default();
    let store = PostgresStore::new(pool.clone()).with_claim_strategy(strategy);
    let svc = IdempotencyLayer::new(store).layer(handler(calls.clone()));

    // Warm the connection: every path below runs once, so its statements are prepared.
    for (path, key, body) in [
        ("/ok", "warm", "w"),
        ("/ok", "warm", "w"),
        ("/ok", "warm", "other"),
        ("/fail", "warm-fail", "w"),
    ] {
        svc.clone()
            .oneshot(req("POST", path, Some(key), body))
            .await
            .unwrap();
    }

    // A first request.
    let (first, cost) = send(&svc, &proxy, "/ok", "k1", "body").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(
        cost.query(),
        expected.first,
        "{strategy:?}, a first request: {cost:?}"
    );
    assert_eq!((cost.parse(), cost.execute()), (0, 0), "{cost:?}");
    // Every message carries the store's bounds. A call of one of the store's functions is
    // sent as text; a statement written out in SQL runs prepared (the warm-up prepared it on
    // the connection: no `PREPARE` again), its schema written in (no `search_path` setting).
    for q in proxy.queries().iter().rev().take(expected.first) {
        let call = q.starts_with(
            "SET LOCAL transaction_isolation = 'read committed'; \
             SET LOCAL statement_timeout = 5000; SELECT ",
        );
        let prepared = q.starts_with(
            "SET LOCAL transaction_isolation = 'read committed'; \
             SET LOCAL statement_timeout = 5000; ",
        ) && q
            .split("; ")
            .all(|s| s.starts_with("SET LOCAL ") || s.starts_with("EXECUTE tower_idempotency_"))
            && !q.contains("search_path");
        assert!(call || prepared, "{q}");
        assert!(!q.contains("PREPARE"), "{q}");
    }

    // A replay, which finds the completed record.
    let token_before = last_token().await;
    let (again, cost) = send(&svc, &proxy, "/ok", "k1", "body").await;
    if let Some(inserts) = expected.replay_draws_a_token {
        assert_eq!(
            last_token().await != token_before,
            inserts,
            "{strategy:?}: does a replay run the claim function's insert?"
        );
    }
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(
        cost.query(),
        expected.replay,
        "{strategy:?}, a replay: {cost:?}"
    );
    assert_eq!((cost.parse(), cost.execute()), (0, 0), "{cost:?}");

    // The key with another body: answered 422.
    let (reused, cost) = send(&svc, &proxy, "/ok", "k1", "another body").await;
    assert_eq!(reused.status, 422);
    assert_eq!(
        cost.query(),
        expected.reused,
        "{strategy:?}, a reused key: {cost:?}"
    );

    // A 5xx: the claim, then the release.
    let (failed, cost) = send(&svc, &proxy, "/fail", "k2", "body").await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        cost.query(),
        expected.failed,
        "{strategy:?}, a 5xx: {cost:?}"
    );

    // The handler ran for the first request only (and the warm-up's).
    assert_eq!(calls.get("/ok"), 2);

    admin.close().await;
    pool.close().await;
    schema.drop_schema().await;
}

/// The payments table the transactional test's handler writes to.
const PAYMENTS_DDL: &str = "
CREATE TABLE payments (
    id           bigserial   PRIMARY KEY,
    amount_cents bigint      NOT NULL
)";

/// A handler that inserts one payment row and answers `201` with its id. Behind the
/// transactional layer it writes through the request's [`IdempotentTx`]; without the layer
/// it opens a transaction of its own on `pool` (BEGIN, the insert, COMMIT).
fn pay_handler<B>(
    pool: PgPool,
) -> impl tower::Service<
    http::Request<B>,
    Response = http::Response<Full<Bytes>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static
where
    B: Send + 'static,
{
    tower::service_fn(move |req: http::Request<B>| {
        let pool = pool.clone();
        async move {
            const INSERT: &str = "INSERT INTO payments (amount_cents) VALUES ($1) RETURNING id";
            let id: i64 = match req.extensions().get::<IdempotentTx>() {
                Some(tx) => {
                    let mut conn = tx.conn().await.unwrap();
                    sqlx::query_scalar(INSERT)
                        .bind(500_i64)
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap()
                }
                None => {
                    let mut tx = pool.begin().await.unwrap();
                    let id = sqlx::query_scalar(INSERT)
                        .bind(500_i64)
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    id
                }
            };
            let mut res = http::Response::new(Full::new(Bytes::from(format!("payment {id}"))));
            *res.status_mut() = http::StatusCode::CREATED;
            Ok(res)
        }
    })
}

/// Sends one request like [`send`], waits until `pool` has its connection back (sqlx flushes
/// what it queued on a connection, such as a rollback, as it returns it to the pool), and
/// also returns the simple Query messages the request cost.
async fn send_logged<S, B>(
    svc: &S,
    proxy: &Proxy,
    pool: &PgPool,
    key: &str,
    body: &str,
) -> (Answer, Counts, Vec<String>)
where
    S: tower::Service<http::Request<Full<Bytes>>, Response = http::Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: fmt::Debug,
{
    let logged = proxy.queries().len();
    let before = proxy.counts();
    let (answer, _) = send(svc, proxy, "/pay", key, body).await;
    settle(pool).await;
    let queries = proxy.queries().split_off(logged);
    (answer, proxy.counts().since(&before), queries)
}

/// Waits until every connection of `pool` is idle in it again.
async fn settle(pool: &PgPool) {
    for _ in 0..2000 {
        if pool.num_idle() == pool.size() as usize {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the pool did not get its connection back within 2 s");
}

/// The statements of a simple Query message (the crate's batches separate them by `"; "`),
/// each shortened to its first word, to the function it calls, or to `INSERT <table>`.
fn statements(queries: &[String]) -> Vec<String> {
    queries
        .iter()
        .flat_map(|q| q.split("; "))
        .map(|stmt| {
            let stmt = stmt.trim();
            if let Some(bound) = stmt.strip_prefix("SET LOCAL ") {
                format!("SET {}", bound.split(' ').next().unwrap_or(bound))
            } else if let Some(call) = stmt.strip_prefix("SELECT ") {
                match call.strip_prefix('\'') {
                    // `SELECT 'step' AS step, …`: the transactional batches name their steps.
                    Some(named) => named.split('\'').next().unwrap_or(named).to_owned(),
                    None => call.split('(').next().unwrap_or(call).to_owned(),
                }
            } else if let Some(insert) = stmt.strip_prefix("INSERT INTO ") {
                format!("INSERT {}", insert.split(' ').next().unwrap_or(insert))
            } else {
                stmt.to_owned()
            }
        })
        .collect()
}

/// Transactional mode, on the wire. What sqlx sends (observed): `BEGIN`, `COMMIT` and
/// `ROLLBACK` are simple Query (`Q`) messages; every other statement is Bind + Execute (+ a
/// Close of its portal) + Sync. The handler alone in its own transaction costs `BEGIN`,
/// 1 Execute, `COMMIT`: three round trips. Behind the layer the claim is one simple Query
/// message (the look in a read-only transaction of its own, then the request's `BEGIN`, the
/// claim and a savepoint) and the completion another (the completion and `COMMIT`), so the
/// same handler costs the same three round trips, with one commit. (Sync messages are not
/// asserted: besides one per statement, sqlx sends a varying number of them to check pooled
/// connections.) A replay costs the claim's message alone: the look returns the record; the
/// transaction the message opened is rolled back after the answer. None of it makes the
/// server raise an error (which it would log with the statement, key and all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_adds_two_statements_and_no_commit() {
    let schema = PgSchema::new().await;
    let admin = schema.pool(2).await;
    PostgresStore::new(admin.clone()).migrate().await.unwrap();
    sqlx::query(PAYMENTS_DDL).execute(&admin).await.unwrap();
    admin.close().await;

    let proxy = Proxy::start(upstream()).await;
    let pool = pool_through(&proxy, &schema).await;
    let store = PostgresStore::new(pool.clone());
    let plain = pay_handler::<Full<Bytes>>(pool.clone());
    let layered = IdempotencyLayer::new(store.transactional()).layer(pay_handler(pool.clone()));

    // Warm the connection: both paths once, and a replay, so every statement is prepared.
    send(&plain, &proxy, "/pay", "warm-plain", "w").await;
    send(&layered, &proxy, "/pay", "warm", "w").await;
    send(&layered, &proxy, "/pay", "warm", "w").await;
    settle(&pool).await;
    let errors = proxy.errors();

    // The handler alone, in a transaction of its own.
    let (alone, alone_cost, alone_q) = send_logged(&plain, &proxy, &pool, "unused", "body").await;
    assert_eq!(alone.status, 201, "{}", alone.text());
    assert_eq!(alone_cost.execute(), 1, "the handler alone: {alone_cost:?}");
    assert_eq!(alone_q, ["BEGIN", "COMMIT"], "the handler alone");
    assert_eq!(alone_cost.parse(), 0, "{alone_cost:?}");

    // The same handler behind the transactional layer, a new key.
    let (first, cost, first_q) = send_logged(&layered, &proxy, &pool, "k1", "body").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(first_q.len(), 2, "{first_q:?}");
    assert_eq!(
        statements(&first_q),
        [
            "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
            "SET statement_timeout",
            "SET lock_timeout",
            "look",
            "COMMIT",
            "BEGIN",
            "set_config",
            "SET statement_timeout",
            "SET lock_timeout",
            "claim",
            "set_config",
            "SAVEPOINT tower_idempotency_handler",
            "SET statement_timeout",
            "SET lock_timeout",
            "tower_idempotency_complete_tx",
            "COMMIT",
        ],
        "{first_q:?}"
    );
    // The handler's transaction: the handler's own statement, one commit.
    assert_eq!(cost.execute(), alone_cost.execute(), "{cost:?}");
    // Round trips the request waits for: the claim's message, the handler's Execute and the
    // completion's message, as many as the handler alone (BEGIN, Execute, COMMIT).
    assert_eq!(
        first_q.len() + cost.execute(),
        alone_q.len() + alone_cost.execute()
    );
    assert_eq!(cost.parse(), 0, "{cost:?}");

    // A replay: the claim's message only, which finds the record; the handler does not run.
    // The transaction the message opened is rolled back after the answer.
    let (again, replay_cost, replay_q) = send_logged(&layered, &proxy, &pool, "k1", "body").await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(
        statements(&replay_q),
        [
            "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
            "SET statement_timeout",
            "SET lock_timeout",
            "look",
            "COMMIT",
            "BEGIN",
            "set_config",
            "SET statement_timeout",
            "SET lock_timeout",
            "claim",
            "set_config",
            "SAVEPOINT tower_idempotency_handler",
            "ROLLBACK"
        ],
        "transactional replay"
    );
    assert_eq!(
        replay_cost.execute(),
        0,
        "transactional replay: {replay_cost:?}"
    );

    // The same key with another body: 422, and no statement failed either.
    let (reused, _, _) = send_logged(&layered, &proxy, &pool, "k1", "other").await;
    assert_eq!(reused.status, 422);
    assert_eq!(
        proxy.errors(),
        errors,
        "a new key, a replay and a mismatch raise no error on the server"
    );
    // The count sees an error when there is one.
    assert!(sqlx::query("SELECT 1/0").execute(&pool).await.is_err());
    assert_eq!(proxy.errors(), errors + 1);

    // Three payments in all: the warm-up's two and the two measured first requests; the
    // replays inserted nothing.
    let admin = schema.pool(1).await;
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(payments, 4);
    admin.close().await;

    pool.close().await;
    schema.drop_schema().await;
}

/// A statement prepared by name is tried on one connection: refused there as not prepared
/// yet (`26000`), it is prepared and run on that same connection. Sent again through the
/// pool, the second try could meet another connection that has it already (`42P05`), and
/// bounce so up to four times before it went unprepared. So on a pool of four connections
/// with requests at once, each connection refuses each statement at most once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_not_prepared_on_a_connection_is_prepared_there_without_bouncing() {
    let schema = PgSchema::new().await;
    let setup = schema.pool(2).await;
    PostgresStore::new(setup.clone()).migrate().await.unwrap();
    let proxy = Proxy::start(upstream()).await;
    const CONNECTIONS: u32 = 4;
    let pool = pool_of(&proxy, &schema, CONNECTIONS).await;
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(PostgresStore::new(pool.clone())).layer(handler(calls.clone()));
    let errors = proxy.errors();
    for wave in 0..10 {
        let sent: Vec<_> = (0..8)
            .map(|i| {
                let svc = svc.clone();
                tokio::spawn(async move {
                    let key = format!("k-{wave}-{}", i % 6);
                    read(
                        svc.oneshot(req("POST", "/pay", Some(&key), "{}"))
                            .await
                            .unwrap(),
                    )
                    .await
                })
            })
            .collect();
        for answer in sent {
            let answer = answer.await.unwrap();
            assert!(
                answer.status.is_success() || answer.status == 409,
                "{} {}",
                answer.status,
                answer.text()
            );
        }
    }
    // The statements a first request, a replay and a duplicate in flight send prepared.
    let statements = 5;
    let refused = proxy.errors() - errors;
    assert!(
        refused <= CONNECTIONS as usize * statements,
        "{refused} statements refused on {CONNECTIONS} connections"
    );
    pool.close().await;
    setup.close().await;
    schema.drop_schema().await;
}
