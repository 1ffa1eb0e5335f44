//! Helpers shared by the fault tests (connection loss, stalls, failover): pools whose
//! connections the test can find in `pg_stat_activity` by name, a handler that waits at a gate
//! so the test can strike while it runs, and polling of the server's state.

use std::convert::Infallible;
use std::net::{SocketAddr, ToSocketAddrs as _};
use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use tower_idempotency::IdempotentTx;

use tower::Layer as _;
use tower_idempotency::{IdempotencyLayer, PostgresStore};

use super::proxy::Proxy;
use super::{BoxBody, Calls, PgSchema, TestBody, database_url, unique};

/// The address of the server behind `url` (to put a proxy in front of it).
pub fn server_addr(url: &str) -> SocketAddr {
    let opts = PgConnectOptions::from_str(url).unwrap();
    (opts.get_host(), opts.get_port())
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap()
}

/// A pool on `url` (with `addr` instead of the URL's host and port, when given: a proxy),
/// working in `schema`, whose connections show as `app` in `pg_stat_activity`.
pub async fn named_pool(
    url: &str,
    addr: Option<SocketAddr>,
    schema: &str,
    app: &str,
    max_connections: u32,
) -> PgPool {
    let mut opts = PgConnectOptions::from_str(url)
        .unwrap()
        .application_name(app)
        .options([("search_path", schema)]);
    if let Some(addr) = addr {
        opts = opts.host(&addr.ip().to_string()).port(addr.port());
    }
    if let Some(level) = super::isolation() {
        opts = opts.options([("default_transaction_isolation", level)]);
    }
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .unwrap()
}

/// How many backends named `app` match `condition` (SQL over `pg_stat_activity`'s columns).
pub async fn backends(admin: &PgPool, app: &str, condition: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND ({condition})"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(app)
        .fetch_one(admin)
        .await
        .unwrap()
}

/// Waits until some backend named `app` matches `condition`; fails after `within`.
pub async fn wait_for_backend(admin: &PgPool, app: &str, condition: &str, within: Duration) {
    let started = tokio::time::Instant::now();
    while backends(admin, app, condition).await == 0 {
        assert!(
            started.elapsed() < within,
            "no backend of {app} matched `{condition}` within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until no backend is named `app` any more (terminated backends take a moment).
pub async fn wait_for_no_backend(admin: &PgPool, app: &str, within: Duration) {
    let started = tokio::time::Instant::now();
    while backends(admin, app, "true").await > 0 {
        assert!(
            started.elapsed() < within,
            "backends of {app} still alive after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `pg_terminate_backend` of every backend named `app` matching `condition`; returns how
/// many were terminated.
pub async fn terminate(admin: &PgPool, app: &str, condition: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND ({condition})) AS t"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(app)
        .fetch_one(admin)
        .await
        .unwrap()
}

/// Polls `check` until it holds; fails with `what` after `within`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = tokio::time::Instant::now();
    while !check().await {
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A gate the handler waits at (requests whose query holds `gate`): the test learns when a
/// handler reached it, strikes, then opens it.
pub struct Gate {
    open: watch::Sender<bool>,
    reached: watch::Sender<usize>,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            open: watch::channel(false).0,
            reached: watch::channel(0).0,
        })
    }

    /// Waits until `n` handlers in all reached the gate.
    pub async fn reached(&self, n: usize) {
        let mut reached = self.reached.subscribe();
        tokio::time::timeout(Duration::from_secs(30), reached.wait_for(|r| *r >= n))
            .await
            .expect("the handler did not reach the gate within 30 s")
            .unwrap();
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    async fn pass(&self) {
        self.reached.send_modify(|r| *r += 1);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|o| *o).await;
    }
}

fn query_num(query: &str, name: &str) -> usize {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn answer(status: StatusCode, body: String) -> Response<BoxBody> {
    let mut res = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|e: Infallible| match e {})
            .boxed_unsync(),
    );
    *res.status_mut() = status;
    res.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// A plain-mode handler: counts its runs per path, waits at `gate` when the query says
/// `gate`, sleeps `ms=N`, and answers `201` with `path #run`, padded to `pad=N` bytes.
pub fn plain_handler(
    calls: Calls,
    gate: Arc<Gate>,
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
        let gate = gate.clone();
        async move {
            let path = req.uri().path().to_owned();
            let query = req.uri().query().unwrap_or("").to_owned();
            let n = calls.hit(&path);
            if query.split('&').any(|kv| kv == "gate") {
                gate.pass().await;
            }
            let ms = query_num(&query, "ms");
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms as u64)).await;
            }
            let mut body = format!("{path} #{n}");
            let pad = query_num(&query, "pad");
            while body.len() < pad {
                body.push_str(" padding");
            }
            Ok(answer(StatusCode::CREATED, body))
        }
    })
}

/// The table the transactional handler writes: one row per run that committed.
pub const PAYMENTS_TABLE: &str =
    "CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL, path text NOT NULL)";

/// A transactional-mode handler: counts its runs per path, inserts a `payments` row with the
/// request's key through the request's transaction, then waits at `gate` (query `gate`),
/// sleeps `ms=N`, and answers `201` with `payment <id>`, padded to `pad=N` bytes (or the
/// status `status=N`, with no padding). A failed statement is a `503` (the
/// database is unreachable), never a `500`.
pub fn tx_handler(
    calls: Calls,
    gate: Arc<Gate>,
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
        let gate = gate.clone();
        async move {
            let path = req.uri().path().to_owned();
            let query = req.uri().query().unwrap_or("").to_owned();
            calls.hit(&path);
            let key = req
                .extensions()
                .get::<tower_idempotency::IdempotencyKey>()
                .unwrap()
                .to_string();
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            let inserted: Result<i64, sqlx::Error> = {
                let mut conn = tx.conn().await.unwrap();
                sqlx::query_scalar("INSERT INTO payments (key, path) VALUES ($1, $2) RETURNING id")
                    .bind(&key)
                    .bind(&path)
                    .fetch_one(&mut *conn)
                    .await
            };
            let id = match inserted {
                Ok(id) => id,
                Err(e) => {
                    return Ok(answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("database: {e}"),
                    ));
                }
            };
            if query.split('&').any(|kv| kv == "gate") {
                gate.pass().await;
            }
            let ms = query_num(&query, "ms");
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms as u64)).await;
            }
            let status = query_num(&query, "status");
            if status > 0 {
                let status = StatusCode::from_u16(u16::try_from(status).unwrap()).unwrap();
                return Ok(answer(status, format!("payment {id} answered {status}")));
            }
            let mut body = format!("payment {id}");
            let pad = query_num(&query, "pad");
            while body.len() < pad {
                body.push_str(" padding");
            }
            Ok(answer(StatusCode::CREATED, body))
        }
    })
}

/// A counter of events the tests tally (503s, replays, …).
#[derive(Default)]
pub struct Tally(AtomicUsize);

impl Tally {
    pub fn add(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A service behind the layer, as a function from a request to its answer read in full.
pub type App = Arc<
    dyn Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = super::Answer> + Send>>
        + Send
        + Sync,
>;

/// Wraps a layered service into an [`App`].
pub fn app<S, B>(svc: S) -> App
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    use tower::ServiceExt as _;
    Arc::new(move |r| {
        let svc = svc.clone();
        Box::pin(async move { super::read(svc.oneshot(r).await.unwrap()).await })
    })
}

/// Sends `r` through `app`, failing the test if no answer comes within `within` (a hang);
/// returns the answer and how long it took.
pub async fn timed(
    app: &App,
    r: Request<Full<Bytes>>,
    within: Duration,
) -> (super::Answer, Duration) {
    let started = std::time::Instant::now();
    let answer = tokio::time::timeout(within, app(r))
        .await
        .unwrap_or_else(|_| panic!("no answer within {within:?}: the request hangs"));
    (answer, started.elapsed())
}

/// The two modes of the layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    Plain,
    Transactional,
}

/// A schema on the test server, the layer's pool (named, through a proxy), and a separate
/// admin pool for checks and for killing the layer's connections.
pub struct Fx {
    pub schema: PgSchema,
    pub admin: PgPool,
    /// The `application_name` of the layer's connections.
    pub name: String,
    pub store: PostgresStore,
    pub proxy: Proxy,
    pub calls: Calls,
    pub gate: Arc<Gate>,
    /// The layer's store timeout.
    pub store_timeout: Duration,
}

impl Fx {
    /// A fresh schema, the layer's pool of `max_connections` through a proxy, and layers
    /// whose store calls are bounded by `store_timeout`.
    pub async fn new(max_connections: u32, store_timeout: Duration) -> Fx {
        let schema = PgSchema::new().await;
        let admin = schema.pool(4).await;
        let proxy = Proxy::start(server_addr(&database_url())).await;
        let name = format!("ti_layer_{}", unique());
        let pool = named_pool(
            &database_url(),
            Some(proxy.addr()),
            &schema.name,
            &name,
            max_connections,
        )
        .await;
        // A lock timeout longer than the tests' locks: the test, not the store's bound, ends
        // a claim that waits on a lock.
        let store = PostgresStore::new(pool).with_lock_timeout(Duration::from_secs(10));
        store.migrate().await.unwrap();
        sqlx::raw_sql(PAYMENTS_TABLE).execute(&admin).await.unwrap();
        Fx {
            schema,
            admin,
            name,
            store,
            proxy,
            calls: Calls::default(),
            gate: Gate::new(),
            store_timeout,
        }
    }

    /// The layer in `mode` over the mode's handler (plain: [`plain_handler`], transactional:
    /// [`tx_handler`]), with the default lease.
    pub fn app(&self, mode: Mode) -> App {
        self.app_with_lease(mode, Duration::from_secs(30))
    }

    /// [`Fx::app`] with a plain-mode lease of `lease`.
    pub fn app_with_lease(&self, mode: Mode, lease: Duration) -> App {
        match mode {
            Mode::Plain => app(IdempotencyLayer::new(self.store.clone())
                .with_lease(lease)
                .with_store_timeout(self.store_timeout)
                .layer(plain_handler(self.calls.clone(), self.gate.clone()))),
            Mode::Transactional => app(IdempotencyLayer::new(self.store.transactional())
                .with_store_timeout(self.store_timeout)
                .layer(tx_handler(self.calls.clone(), self.gate.clone()))),
        }
    }

    /// Committed payment rows of `key`.
    pub async fn payments(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE key = $1")
            .bind(key)
            .fetch_one(&self.admin)
            .await
            .unwrap()
    }

    /// The committed record of `key`: `None`, or its status (`None` while in progress) and
    /// body.
    pub async fn record(&self, key: &str) -> Option<(Option<i16>, Option<Vec<u8>>)> {
        sqlx::query_as(
            "SELECT response_status, response_body FROM tower_idempotency_keys WHERE key = $1",
        )
        .bind(key)
        .fetch_optional(&self.admin)
        .await
        .unwrap()
    }

    /// Makes every commit that wrote to `table` (and matches `when`) sleep `secs` seconds
    /// first: a deferred constraint trigger, which runs inside `COMMIT`.
    pub async fn slow_commits(&self, table: &str, when: &str, secs: f64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN PERFORM pg_sleep({secs}); RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT OR UPDATE ON {table}
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ({when})
                 EXECUTE FUNCTION slow_commit();"
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }

    pub async fn cleanup(self) {
        self.store.pool().close().await;
        self.admin.close().await;
        drop(self.proxy);
        self.schema.drop_schema().await;
    }
}
