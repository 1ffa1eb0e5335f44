//! The behaviour suite: written once, run against every store (`memory::*`, `postgres::*`,
//! and with the `redis` feature `redis::*` and `redis_cluster::*`).
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::Full;
use support::{Answer, Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, ClaimStrategy, IdempotencyKey, IdempotencyLayer, MemoryStore,
    PostgresStore, Store, StoredResponse, fingerprint::fingerprint,
};

/// A store under test, and how to reach it from a second "app instance".
trait Fixture: Sized {
    type Store: Store;
    fn new() -> impl Future<Output = Self>;
    fn store(&self) -> Self::Store;
    /// The same records, reached as another app instance would (a second pool).
    fn second_instance(&self) -> impl Future<Output = Self::Store>;
    /// Lets `d` of the store's time pass: the memory store's clock is Tokio's, paused in its
    /// timed tests, so the wait ends at once; the Postgres fixtures move the database's clock
    /// hook, which stands still otherwise; Redis keeps the server's own clock, so its fixture
    /// waits for real.
    fn pass(&self, d: Duration) -> impl Future<Output = ()> {
        tokio::time::sleep(d)
    }
    fn cleanup(self) -> impl Future<Output = ()>;
}

struct Memory(MemoryStore);

impl Fixture for Memory {
    type Store = MemoryStore;
    async fn new() -> Self {
        Memory(MemoryStore::new())
    }
    fn store(&self) -> MemoryStore {
        self.0.clone()
    }
    async fn second_instance(&self) -> MemoryStore {
        self.0.clone()
    }
    async fn cleanup(self) {}
}

struct Postgres {
    schema: PgSchema,
    store: PostgresStore,
    strategy: ClaimStrategy,
}

impl Postgres {
    async fn with(strategy: ClaimStrategy) -> Self {
        let schema = PgSchema::new().await;
        let store = schema.store().await.with_claim_strategy(strategy);
        schema.controlled_clock().await;
        Postgres {
            schema,
            store,
            strategy,
        }
    }

    /// The claim function (`ClaimStrategy::Combined`) with prepared statements, on a direct
    /// connection (never through a pooler: see `PostgresStore::with_prepared_statements`). Its
    /// second instance uses the default simple protocol: the two must keep every guarantee
    /// together.
    async fn prepared() -> Self {
        let schema = PgSchema::new().await;
        let store = PostgresStore::new(schema.direct_pool(16).await)
            .with_prepared_statements(true)
            .with_claim_strategy(ClaimStrategy::Combined);
        store.migrate().await.unwrap();
        schema.controlled_clock().await;
        Postgres {
            schema,
            store,
            strategy: ClaimStrategy::Combined,
        }
    }
}

impl Fixture for Postgres {
    type Store = PostgresStore;
    async fn new() -> Self {
        Postgres::with(ClaimStrategy::default()).await
    }
    fn store(&self) -> PostgresStore {
        self.store.clone()
    }
    async fn second_instance(&self) -> PostgresStore {
        let store = PostgresStore::new(self.schema.pool(16).await);
        // The other instance uses another claim strategy: together they must keep every
        // guarantee.
        let other = match self.strategy {
            ClaimStrategy::Adaptive => ClaimStrategy::Combined,
            ClaimStrategy::Combined => ClaimStrategy::ReadFirst,
            ClaimStrategy::ReadFirst => ClaimStrategy::InsertFirst,
            _ => ClaimStrategy::Adaptive,
        };
        let store = store.with_claim_strategy(other);
        // A second instance runs migrate() at start too; it must be a no-op.
        store.migrate().await.unwrap();
        store
    }
    async fn pass(&self, d: Duration) {
        self.schema.advance_clock(d).await;
    }
    async fn cleanup(self) {
        self.store.pool().close().await;
        self.schema.drop_schema().await;
    }
}

/// A Redis store (feature `redis`) with a key prefix of its own: on the single server, or on
/// the cluster. The second instance is another connection with the same prefix.
#[cfg(feature = "redis")]
struct Redis {
    prefix: String,
    cluster: bool,
    store: tower_idempotency::RedisStore,
}

#[cfg(feature = "redis")]
impl Redis {
    async fn on(cluster: bool) -> Self {
        let prefix = support::redis_support::prefix();
        let store = if cluster {
            support::redis_support::cluster_store(&prefix).await
        } else {
            support::redis_support::connected_store(&prefix).await
        };
        Redis {
            prefix,
            cluster,
            store,
        }
    }
}

#[cfg(feature = "redis")]
impl Fixture for Redis {
    type Store = tower_idempotency::RedisStore;
    async fn new() -> Self {
        Redis::on(false).await
    }
    fn store(&self) -> Self::Store {
        self.store.clone()
    }
    async fn second_instance(&self) -> Self::Store {
        if self.cluster {
            support::redis_support::cluster_store(&self.prefix).await
        } else {
            // Connected lazily, as an app instance starting up would be.
            support::redis_support::store(&self.prefix)
        }
    }
    async fn cleanup(self) {}
}

/// The layer as the tests configure it by default: keys scoped by `x-tenant`.
fn layer<St: Store>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store).with_scope(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    })
}

type Svc = dyn Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
    + Send
    + Sync;

/// The handler behind `layer`, as a function from request to read answer.
fn build<St: Store>(layer: IdempotencyLayer<St>, calls: &Calls) -> std::sync::Arc<Svc> {
    let svc = layer.layer(support::handler(calls.clone()));
    std::sync::Arc::new(move |r| {
        let svc = svc.clone();
        Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
    })
}

fn with_header(
    mut r: Request<Full<Bytes>>,
    name: &'static str,
    value: &str,
) -> Request<Full<Bytes>> {
    r.headers_mut()
        .append(HeaderName::from_static(name), value.parse().unwrap());
    r
}

// ---------------------------------------------------------------------------------------------
// The behaviours.

async fn first_request_runs_and_repeat_replays_byte_for_byte<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let first = app(req("POST", "/pay?x=1", Some("k1"), "{\"amount\":5}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.text(), "POST /pay call #1 body={\"amount\":5}");
    // The live answer keeps all the handler's headers.
    assert_eq!(first.headers["set-cookie"], "session=secret");

    for _ in 0..3 {
        let again = app(req("POST", "/pay?x=1", Some("k1"), "{\"amount\":5}")).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, first.body, "replayed byte for byte");
        assert!(again.replayed());
        assert_eq!(again.headers["content-type"], "text/plain; charset=utf-8");
        assert_eq!(again.headers["x-custom"], "kept");
        assert!(
            !again.headers.contains_key("set-cookie"),
            "cookies are not replayed"
        );
        assert!(!again.headers.contains_key("date"), "date is not replayed");
    }
    assert_eq!(calls.get("/pay"), 1, "handler ran once");
}

async fn the_live_answer_keeps_every_header_it_stores<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    for n in 0..3 {
        let res = app(req("POST", "/headers", Some("k"), "b")).await;
        assert_eq!(res.status, StatusCode::CREATED);
        assert_eq!(res.replayed(), n > 0);
        assert_eq!(res.text(), "call #1");
        assert_eq!(res.headers["content-type"], "application/json");
        assert_eq!(res.headers["x-call"], "1");
        let many: Vec<_> = res.headers.get_all("x-many").iter().collect();
        assert_eq!(many, ["one", "two"]);
    }
    assert_eq!(calls.get("/headers"), 1);
}

async fn set_cookie_is_replayed_when_configured<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()).with_replayed_set_cookie(true), &calls);
    app(req("POST", "/pay", Some("k"), "")).await;
    let again = app(req("POST", "/pay", Some("k"), "")).await;
    assert!(again.replayed());
    assert_eq!(again.headers["set-cookie"], "session=secret");
}

async fn quoted_and_bare_keys_are_the_same_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let first = app(req("POST", "/pay", Some("abc"), "b")).await;
    let quoted = app(req("POST", "/pay", Some("\"abc\""), "b")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(quoted.replayed());
    assert_eq!(quoted.body, first.body);
    assert_eq!(calls.get("/pay"), 1);
}

async fn missing_key_is_400_and_optional_key_passes_through<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let strict = build(layer(fx.store()), &calls);
    for method in ["POST", "PATCH"] {
        strict(req(method, "/pay", None, "b"))
            .await
            .assert_problem(400, "missing-key");
    }
    assert_eq!(calls.total(), 0, "handler not run");

    let lax = build(layer(fx.store()).with_key_required(false), &calls);
    let a = lax(req("POST", "/pay", None, "b")).await;
    let b = lax(req("POST", "/pay", None, "b")).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!b.replayed());
    assert_eq!(calls.get("/pay"), 2, "without a key nothing is protected");
}

async fn malformed_keys_are_400<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let too_long = "k".repeat(256);
    for bad in ["", "\"\"", "a b", "\"unterminated", "\"a\";p=1", &too_long] {
        app(req("POST", "/pay", Some(bad), "b"))
            .await
            .assert_problem(400, "invalid-key");
    }
    let non_ascii = {
        let mut r = req("POST", "/pay", None, "b");
        r.headers_mut().insert(
            "idempotency-key",
            http::HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
        );
        r
    };
    app(non_ascii).await.assert_problem(400, "invalid-key");
    let twice = with_header(req("POST", "/pay", Some("a"), "b"), "idempotency-key", "b");
    app(twice).await.assert_problem(400, "multiple-keys");
    assert_eq!(calls.total(), 0);

    let longest = "k".repeat(255);
    assert_eq!(
        app(req("POST", "/pay", Some(&longest), "b")).await.status,
        201
    );
}

async fn different_payload_is_422_and_keeps_the_stored_answer<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let first = app(req("POST", "/pay?q=1", Some("k"), "one")).await;
    assert_eq!(first.status, 201);
    for other in [
        req("POST", "/pay?q=1", Some("k"), "two"),
        req("POST", "/other?q=1", Some("k"), "one"),
        req("POST", "/pay?q=2", Some("k"), "one"),
        req("PATCH", "/pay?q=1", Some("k"), "one"),
    ] {
        app(other).await.assert_problem(422, "key-reused");
    }
    let again = app(req("POST", "/pay?q=1", Some("k"), "one")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "stored answer unchanged");
    assert_eq!(calls.total(), 1);
}

async fn fingerprint_headers_are_part_of_the_request<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store()).with_fingerprint_headers([http::header::CONTENT_TYPE]),
        &calls,
    );
    let json = |ct: &str| with_header(req("POST", "/pay", Some("k"), "{}"), "content-type", ct);
    assert_eq!(app(json("application/json")).await.status, 201);
    app(json("text/plain"))
        .await
        .assert_problem(422, "key-reused");
    assert!(app(json("application/json")).await.replayed());
}

async fn concurrent_repeat_is_409_with_retry_after<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let first = tokio::spawn(app(req("POST", "/slow?ms=800", Some("k"), "b")));
    wait_for(|| calls.get("/slow") == 1).await;
    let second = app(req("POST", "/slow?ms=800", Some("k"), "b")).await;
    second.assert_problem(409, "request-in-progress");
    let retry: u64 = second.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry), "retry-after {retry}");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(
        app(req("POST", "/slow?ms=800", Some("k"), "b"))
            .await
            .replayed()
    );
    assert_eq!(calls.get("/slow"), 1);
}

async fn server_errors_release_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app_ = build(layer(fx.store()), &calls);
    for n in 1..=2 {
        let a = app_(req("POST", "/fail", Some("k"), "")).await;
        assert_eq!(a.status, 500);
        assert!(!a.replayed());
        assert_eq!(calls.get("/fail"), n, "a retry runs the handler again");
    }

    let storing = build(layer(fx.store()).with_store_server_errors(true), &calls);
    assert_eq!(
        storing(req("POST", "/fail", Some("k2"), "")).await.status,
        500
    );
    let again = storing(req("POST", "/fail", Some("k2"), "")).await;
    assert_eq!(again.status, 500);
    assert!(again.replayed());
    assert_eq!(calls.get("/fail"), 3);
}

async fn client_errors_are_stored<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let first = app(req("POST", "/bad", Some("k"), "")).await;
    assert_eq!(first.status, 400);
    let again = app(req("POST", "/bad", Some("k"), "")).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::BAD_REQUEST, true)
    );
    assert_eq!(again.body, first.body);
    assert_eq!(calls.get("/bad"), 1);
}

/// `429` and `408` say "not now", not "no": they are not stored, the key is released, and
/// the retry runs the handler, whose answer is then stored and replayed.
async fn rate_limited_and_timed_out_answers_are_not_stored<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    for (path, status) in [("/limited", 429), ("/timeout", 408)] {
        let key = &path[1..];
        let first = app(req("POST", path, Some(key), "b")).await;
        assert_eq!(first.status, status, "{path}");
        assert!(!first.replayed(), "{path}");
        let retry = app(req("POST", path, Some(key), "b")).await;
        assert_eq!(retry.status, 201, "{path}: {}", retry.text());
        assert!(!retry.replayed(), "{path}: the retry ran the handler");
        let again = app(req("POST", path, Some(key), "b")).await;
        assert!(again.replayed(), "{path}");
        assert_eq!(again.body, retry.body, "{path}");
        assert_eq!(calls.get(path), 2, "{path}");
    }
}

/// `with_store_when` decides which answers are stored: here successes only, so a `400` is
/// not stored and its retry runs the handler again; a success is stored.
async fn with_store_when_decides_which_answers_are_stored<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store())
            .with_store_when(|status: StatusCode, _: &http::HeaderMap| status.is_success()),
        &calls,
    );
    let first = app(req("POST", "/bad", Some("k"), "")).await;
    assert_eq!(first.status, 400);
    let retry = app(req("POST", "/bad", Some("k"), "")).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::BAD_REQUEST, false)
    );
    assert_eq!(calls.get("/bad"), 2);
    let ok = app(req("POST", "/pay", Some("k2"), "")).await;
    assert_eq!(ok.status, 201);
    let again = app(req("POST", "/pay", Some("k2"), "")).await;
    assert!(again.replayed());
    assert_eq!(calls.get("/pay"), 1);
}

async fn handler_panic_releases_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let svc = layer(fx.store()).layer(support::handler(calls.clone()));
    let panicked = tokio::spawn(svc.clone().oneshot(req("POST", "/panic", Some("k"), ""))).await;
    assert!(panicked.unwrap_err().is_panic());
    // The release runs in the background; the retry must get through long before the lease
    // (30 s) would have freed the key.
    let started = std::time::Instant::now();
    loop {
        let r = tokio::spawn(svc.clone().oneshot(req("POST", "/panic", Some("k"), ""))).await;
        if calls.get("/panic") == 2 {
            assert!(r.unwrap_err().is_panic());
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "key stayed locked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn service_error_releases_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let svc = layer(fx.store()).layer(support::handler(calls.clone()));
    for n in 1..=2 {
        let err = svc
            .clone()
            .oneshot(req("POST", "/error", Some("k"), ""))
            .await;
        assert_eq!(err.unwrap_err().to_string(), "service error");
        assert_eq!(calls.get("/error"), n);
    }
}

/// With `with_cancel_on_disconnect(true)`; by default the handler runs to its end instead
/// (tests/cancellation.rs).
async fn dropped_request_releases_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()).with_cancel_on_disconnect(true), &calls);
    let first = tokio::spawn(app(req("POST", "/slow?ms=1500", Some("k"), "b")));
    wait_for(|| calls.get("/slow") == 1).await;
    first.abort(); // the client went away
    let _ = first.await;
    let started = std::time::Instant::now();
    loop {
        let r = app(req("POST", "/slow?ms=1500", Some("k"), "b")).await;
        if r.status == StatusCode::CREATED {
            break;
        }
        r.assert_problem(409, "request-in-progress");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "key stayed locked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(calls.get("/slow"), 2);
}

async fn oversized_request_body_is_413_and_stores_nothing<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()).with_max_request_body(16), &calls);
    let big = "x".repeat(17);
    app(req("POST", "/pay", Some("k"), &big))
        .await
        .assert_problem(413, "body-too-large");
    // Without Content-Length the limit holds while streaming.
    let streamed = {
        let chunks: Vec<Result<http_body::Frame<Bytes>, std::convert::Infallible>> = (0..3)
            .map(|_| Ok(http_body::Frame::data(Bytes::from("x".repeat(10)))))
            .collect();
        Request::post("/pay")
            .header("idempotency-key", "k")
            .body(http_body_util::StreamBody::new(tokio_stream_iter(chunks)))
            .unwrap()
    };
    let svc = layer(fx.store())
        .with_max_request_body(16)
        .layer(tower::service_fn(|_r: Request<_>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
        }));
    read(svc.oneshot(streamed).await.unwrap())
        .await
        .assert_problem(413, "body-too-large");
    assert_eq!(calls.total(), 0);
    // Nothing was stored: the key is free for a request within the limit.
    let ok = app(req("POST", "/pay", Some("k"), "small")).await;
    assert_eq!(ok.status, 201);
}

fn tokio_stream_iter<T: Unpin>(items: Vec<T>) -> impl futures_core::Stream<Item = T> + Unpin {
    struct S<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for S<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    S(items.into_iter())
}

async fn uncovered_methods_pass_through<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    for method in ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"] {
        for _ in 0..2 {
            let a = app(req(method, "/thing", Some("k"), "")).await;
            assert_eq!(a.status, 201, "{method}");
            assert!(!a.replayed());
        }
    }
    assert_eq!(calls.get("/thing"), 10);
    // No key needed either.
    assert_eq!(app(req("GET", "/thing", None, "")).await.status, 201);

    let put_too = build(
        layer(fx.store()).with_methods([Method::PUT]).unwrap(),
        &calls,
    );
    put_too(req("PUT", "/put", Some("k"), "")).await;
    assert!(put_too(req("PUT", "/put", Some("k"), "")).await.replayed());
    assert_eq!(calls.get("/put"), 1);
}

async fn keys_are_scoped<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    let as_tenant =
        |t: &str, body: &str| with_header(req("POST", "/pay", Some("k"), body), "x-tenant", t);
    let a = app(as_tenant("a", "for a")).await;
    // Same key, other tenant, other body: independent (no 422, no replay of a's answer).
    let b = app(as_tenant("b", "for b")).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!b.replayed());
    assert_ne!(a.body, b.body);
    let a2 = app(as_tenant("a", "for a")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    assert_eq!(calls.get("/pay"), 2);
}

async fn expired_keys_count_as_new<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store())
            .with_ttl(Duration::from_millis(600))
            .unwrap(),
        &calls,
    );
    assert_eq!(app(req("POST", "/pay", Some("k"), "1")).await.status, 201);
    assert!(app(req("POST", "/pay", Some("k"), "1")).await.replayed());
    fx.pass(Duration::from_millis(900)).await;
    // Even with another payload: the old record no longer exists.
    let fresh = app(req("POST", "/pay", Some("k"), "2")).await;
    assert_eq!(fresh.status, 201);
    assert!(!fresh.replayed());
    assert_eq!(calls.get("/pay"), 2);
}

fn claim_of<'a>(key: &'a IdempotencyKey, body: &[u8], lease: Duration) -> ClaimRequest<'a> {
    let parts = Request::post("/pay").body(()).unwrap().into_parts().0;
    ClaimRequest {
        scope: "",
        key,
        fingerprint: fingerprint(&parts, &[], body),
        lease,
        ttl: Duration::from_secs(60),
    }
}

async fn lease_runs_out_after_a_crash_and_the_key_is_taken_over<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let store = fx.store();
    let app = build(layer(store.clone()), &calls);
    let key = IdempotencyKey::parse("k").unwrap();
    // An instance claims the key and dies before completing it.
    let crashed = store
        .claim(claim_of(&key, b"b", Duration::from_millis(500)))
        .await
        .unwrap();
    let ClaimOutcome::Acquired {
        token: stale,
        takeover: false,
    } = crashed
    else {
        panic!("{crashed:?}")
    };
    app(req("POST", "/pay", Some("k"), "b"))
        .await
        .assert_problem(409, "request-in-progress");
    // A different payload is a mismatch even though the owner died.
    app(req("POST", "/pay", Some("k"), "other"))
        .await
        .assert_problem(422, "key-reused");
    fx.pass(Duration::from_millis(700)).await;
    let retry = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(calls.get("/pay"), 1);

    // The dead owner's token is fenced off: it can neither overwrite nor release.
    let forged = StoredResponse::new(StatusCode::OK, http::HeaderMap::new(), Bytes::from("stale"));
    let ttl = Duration::from_secs(60);
    assert!(!store.complete("", &key, stale, &forged, ttl).await.unwrap());
    assert!(!store.release("", &key, stale).await.unwrap());
    assert!(!store.renew("", &key, stale, ttl).await.unwrap());
    let again = app(req("POST", "/pay", Some("k"), "b")).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
}

async fn stale_owner_cannot_complete_after_takeover<F: Fixture>(fx: &F) {
    let store = fx.store();
    let key = IdempotencyKey::parse("k").unwrap();
    let lease = Duration::from_millis(300);
    let ClaimOutcome::Acquired { token: a, .. } =
        store.claim(claim_of(&key, b"b", lease)).await.unwrap()
    else {
        panic!()
    };
    fx.pass(Duration::from_millis(450)).await;
    let ClaimOutcome::Acquired { token: b, takeover } =
        store.claim(claim_of(&key, b"b", lease)).await.unwrap()
    else {
        panic!()
    };
    assert!(takeover);
    assert_ne!(a, b);
    let resp = |s: &'static str| {
        StoredResponse::new(StatusCode::OK, http::HeaderMap::new(), Bytes::from(s))
    };
    let ttl = Duration::from_secs(60);
    assert!(
        !store
            .complete("", &key, a, &resp("from a"), ttl)
            .await
            .unwrap()
    );
    assert!(
        store
            .complete("", &key, b, &resp("from b"), ttl)
            .await
            .unwrap()
    );
    assert!(
        !store
            .complete("", &key, a, &resp("from a"), ttl)
            .await
            .unwrap()
    );
    let replay = store.claim(claim_of(&key, b"b", lease)).await.unwrap();
    assert_eq!(replay, ClaimOutcome::Completed(resp("from b")));
    // Released keys are claimed with new tokens: a token is never reused.
    let k2 = IdempotencyKey::parse("k2").unwrap();
    let ClaimOutcome::Acquired { token: c, .. } =
        store.claim(claim_of(&k2, b"b", lease)).await.unwrap()
    else {
        panic!()
    };
    assert!(store.release("", &k2, c).await.unwrap());
    let ClaimOutcome::Acquired { token: d, .. } =
        store.claim(claim_of(&k2, b"b", lease)).await.unwrap()
    else {
        panic!()
    };
    assert_ne!(c, d);
    assert!(
        !store
            .complete("", &k2, c, &resp("stale"), ttl)
            .await
            .unwrap()
    );
}

async fn lease_renewal_keeps_a_slow_handler_from_being_taken_over<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    // Renewed every 200 ms of Tokio's time.
    let app = build(
        layer(fx.store()).with_lease(Duration::from_millis(600)),
        &calls,
    );
    let first = tokio::spawn(app(req("POST", "/hold", Some("k"), "b")));
    wait_for(|| calls.get("/hold") == 1).await;
    // Well past the lease, the handler still held: the renewals must have kept the key. Each
    // step gives the renewals 400 ms of Tokio's time, then moves the store's clock 250 ms
    // more: the lease outlives one step without a renewal, not two.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        fx.pass(Duration::from_millis(250)).await;
        app(req("POST", "/hold", Some("k"), "b"))
            .await
            .assert_problem(409, "request-in-progress");
    }
    calls.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(calls.get("/hold"), 1);
}

async fn slow_handler_outliving_the_ttl_runs_once_and_is_replayed<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    // The TTL is shorter than the handler takes (the lease is the default 30 s): the record
    // must not expire while the handler runs, and its answer must be stored.
    let app = build(
        layer(fx.store())
            .with_ttl(Duration::from_millis(500))
            .unwrap(),
        &calls,
    );
    let first = tokio::spawn(app(req("POST", "/hold", Some("k"), "b")));
    wait_for(|| calls.get("/hold") == 1).await;
    // Past the TTL (at about 650 and 1300 ms), the handler still held.
    for _ in 0..2 {
        fx.pass(Duration::from_millis(650)).await;
        app(req("POST", "/hold", Some("k"), "b"))
            .await
            .assert_problem(409, "request-in-progress");
    }
    calls.release();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    // The answer is stored before it is returned; it lives the TTL from then.
    let retry = app(req("POST", "/hold", Some("k"), "b")).await;
    assert!(retry.replayed(), "{} {}", retry.status, retry.text());
    assert_eq!(retry.body, first.body);
    assert_eq!(calls.get("/hold"), 1, "handler ran once");
}

async fn ttl_shorter_than_the_lease_keeps_a_running_key<F: Fixture>(fx: &F) {
    let store = fx.store();
    let key = IdempotencyKey::parse("k").unwrap();
    let mut claim = claim_of(&key, b"b", Duration::from_millis(900));
    claim.ttl = Duration::from_millis(100);
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
        panic!()
    };
    fx.pass(Duration::from_millis(400)).await;
    // Past the TTL, within the lease: the key is still held, for any payload.
    assert!(matches!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(
        store
            .claim(claim_of(&key, b"other", claim.lease))
            .await
            .unwrap(),
        ClaimOutcome::Mismatch
    );
    // A renewal keeps it past the claim's lease (and 300 ms short of the renewed one).
    assert!(
        store
            .renew("", &key, token, Duration::from_millis(900))
            .await
            .unwrap()
    );
    fx.pass(Duration::from_millis(600)).await;
    assert!(matches!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    let answer = StoredResponse::new(StatusCode::OK, http::HeaderMap::new(), Bytes::from("done"));
    let ttl = Duration::from_secs(60);
    assert!(store.complete("", &key, token, &answer, ttl).await.unwrap());
    assert_eq!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::Completed(answer)
    );
}

async fn renewals_keep_a_key_whose_ttl_is_shorter_than_the_lease<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    // Renewed every 200 ms of Tokio's time. The TTL is shorter than the lease; it runs out
    // only where the test moves the store's clock (on Redis, the server's own clock: 400 ms
    // for the replay below to arrive).
    let app = build(
        layer(fx.store())
            .with_lease(Duration::from_millis(600))
            .with_ttl(Duration::from_millis(400))
            .unwrap(),
        &calls,
    );
    let first = tokio::spawn(app(req("POST", "/hold", Some("k"), "b")));
    wait_for(|| calls.get("/hold") == 1).await;
    // Past the TTL and the first lease, the handler still held; each step as in
    // `lease_renewal_keeps_a_slow_handler_from_being_taken_over`.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        fx.pass(Duration::from_millis(250)).await;
        app(req("POST", "/hold", Some("k"), "b"))
            .await
            .assert_problem(409, "request-in-progress");
    }
    calls.release();
    assert_eq!(first.await.unwrap().status, 201);
    assert!(app(req("POST", "/hold", Some("k"), "b")).await.replayed());
    assert_eq!(calls.get("/hold"), 1);
}

async fn completed_record_lives_the_ttl_from_its_completion<F: Fixture>(fx: &F) {
    let store = fx.store();
    let key = IdempotencyKey::parse("k").unwrap();
    let mut claim = claim_of(&key, b"b", Duration::from_secs(5));
    claim.ttl = Duration::from_millis(600);
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
        panic!()
    };
    fx.pass(Duration::from_millis(500)).await;
    let answer = StoredResponse::new(StatusCode::OK, http::HeaderMap::new(), Bytes::from("done"));
    assert!(
        store
            .complete("", &key, token, &answer, claim.ttl)
            .await
            .unwrap()
    );
    // 800 ms after the claim (past its TTL), 300 ms after the completion: still there.
    fx.pass(Duration::from_millis(300)).await;
    assert_eq!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::Completed(answer)
    );
    // 800 ms after the completion: gone (and not kept for the claim's 5 s lease either).
    fx.pass(Duration::from_millis(500)).await;
    assert!(matches!(
        store
            .claim(claim_of(&key, b"other", claim.lease))
            .await
            .unwrap(),
        ClaimOutcome::Acquired {
            takeover: false,
            ..
        }
    ));
}

async fn owner_completes_a_lapsed_claim_that_nobody_took_over<F: Fixture>(fx: &F) {
    let store = fx.store();
    let key = IdempotencyKey::parse("k").unwrap();
    let mut claim = claim_of(&key, b"b", Duration::from_millis(200));
    claim.ttl = Duration::from_millis(100);
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
        panic!()
    };
    // The owner stalls past its lease and the record's expiry; nobody claims the key
    // meanwhile, so its token still holds the record: it can renew and complete.
    fx.pass(Duration::from_millis(400)).await;
    assert!(store.renew("", &key, token, claim.lease).await.unwrap());
    fx.pass(Duration::from_millis(400)).await;
    let answer = StoredResponse::new(StatusCode::OK, http::HeaderMap::new(), Bytes::from("late"));
    let ttl = Duration::from_secs(60);
    assert!(store.complete("", &key, token, &answer, ttl).await.unwrap());
    assert_eq!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::Completed(answer)
    );
}

async fn fifty_concurrent_requests_run_the_handler_once<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let one = build(layer(fx.store()), &calls);
    let two = build(layer(fx.second_instance().await), &calls);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let app = if i % 2 == 0 { one.clone() } else { two.clone() };
        tasks.push(tokio::spawn(app(req(
            "POST",
            "/slow?ms=300",
            Some("race"),
            "b",
        ))));
    }
    let mut created = 0;
    for t in tasks {
        let a = t.await.unwrap();
        match a.status.as_u16() {
            201 if a.replayed() => {}
            201 => created += 1,
            409 => a.assert_problem(409, "request-in-progress"),
            other => panic!("unexpected {other}: {}", a.text()),
        }
    }
    assert_eq!(created, 1);
    assert_eq!(calls.get("/slow"), 1, "handler ran exactly once");
}

async fn oversized_response_reaches_the_client_and_is_never_rerun<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()).with_max_response_body(4096), &calls);
    let first = app(req("POST", "/big?n=10000", Some("k"), "")).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.headers["content-type"], "text/plain");
    assert_eq!(first.body.len(), 10000, "the client gets the whole answer");
    assert_eq!(&first.body[..1024], &[b'a'; 1024][..]);
    assert_eq!(&first.body[9216..], &vec![b'j'; 784][..]);
    let again = app(req("POST", "/big?n=10000", Some("k"), "")).await;
    again.assert_problem(409, "response-not-stored");
    assert_eq!(again.json()["original_status"], 200);
    assert_eq!(calls.get("/big"), 1);
    // Exactly at the limit is stored.
    let at = app(req("POST", "/big?n=4096", Some("k2"), "")).await;
    let at_again = app(req("POST", "/big?n=4096", Some("k2"), "")).await;
    assert!(at_again.replayed());
    assert_eq!(at_again.body, at.body);
}

/// `with_max_response_body(0)` means what the docs say: no body is kept. An answer with an
/// empty body is replayed; any other is delivered once and its retry gets `409`
/// `response-not-stored`, never a second run.
async fn a_response_body_limit_of_zero_keeps_status_and_headers_only<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()).with_max_response_body(0), &calls);
    let first = app(req("POST", "/big?n=10", Some("k"), "")).await;
    assert_eq!((first.status, first.body.len()), (StatusCode::OK, 10));
    let again = app(req("POST", "/big?n=10", Some("k"), "")).await;
    again.assert_problem(409, "response-not-stored");
    assert_eq!(calls.get("/big"), 1);
    let empty = app(req("POST", "/big?n=0", Some("k2"), "")).await;
    assert_eq!(empty.status, 200);
    let empty_again = app(req("POST", "/big?n=0", Some("k2"), "")).await;
    assert!(empty_again.replayed(), "{}", empty_again.text());
}

/// Settings that would switch the protection off are refused where they are given.
async fn settings_that_would_turn_the_layer_off_are_refused<F: Fixture>(fx: &F) {
    use tower_idempotency::ConfigError;
    assert_eq!(
        layer(fx.store()).with_ttl(Duration::ZERO).err(),
        Some(ConfigError::ZeroTtl)
    );
    assert_eq!(
        layer(fx.store()).with_methods([]).err(),
        Some(ConfigError::NoMethods)
    );
    let store = fx.store();
    assert_eq!(
        tower_idempotency::spawn_purge_task(store.clone(), Duration::ZERO, 10).unwrap_err(),
        ConfigError::ZeroPurgePeriod
    );
    assert_eq!(
        tower_idempotency::spawn_purge_task(store, Duration::from_secs(1), 0).unwrap_err(),
        ConfigError::ZeroPurgeBatch
    );
}

/// A gRPC answer's trailers (its `grpc-status`) are stored with it and replayed after the
/// body, by every store.
async fn trailers_are_stored_and_replayed<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let svc = layer(fx.store()).layer(support::handler(calls.clone()));
    let send = || async {
        let res = svc
            .clone()
            .oneshot(req("POST", "/grpc", Some("k"), ""))
            .await
            .unwrap();
        let (parts, body) = res.into_parts();
        let collected = http_body_util::BodyExt::collect(body).await.unwrap();
        (
            parts.headers,
            collected.trailers().cloned(),
            collected.to_bytes(),
        )
    };
    let (_, first_trailers, first_body) = send().await;
    let (headers, trailers, body) = send().await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(body, first_body);
    let trailers = trailers.expect("the replay has the trailers");
    assert_eq!(Some(&trailers), first_trailers.as_ref());
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(calls.get("/grpc"), 1);
}

async fn handler_sees_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(layer(fx.store()), &calls);
    assert_eq!(
        app(req("POST", "/key", Some("\"q\\\"k\""), ""))
            .await
            .text(),
        "q\"k"
    );
}

async fn custom_header_names_the_key<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store()).with_header(HeaderName::from_static("webhook-id")),
        &calls,
    );
    let hook = || with_header(req("POST", "/hook", None, "{}"), "webhook-id", "msg_1");
    assert_eq!(app(hook()).await.status, 201);
    assert!(app(hook()).await.replayed());
    app(req("POST", "/hook", Some("x"), "{}"))
        .await
        .assert_problem(400, "missing-key");
    assert_eq!(calls.get("/hook"), 1);
}

async fn key_from_a_function<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store()).with_key_from(|parts| {
            let event = parts.headers.get("x-github-event")?.to_str().ok()?;
            let id = parts.headers.get("x-github-delivery")?.to_str().ok()?;
            Some(format!("{event}:{id}"))
        }),
        &calls,
    );
    let hook = |event: &str, id: &str| {
        let r = with_header(req("POST", "/hook", None, "{}"), "x-github-event", event);
        with_header(r, "x-github-delivery", id)
    };
    assert_eq!(app(hook("push", "d-1")).await.status, 201);
    let again = app(hook("push", "d-1")).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(app(hook("ping", "d-1")).await.status, 201, "another key");
    app(with_header(
        req("POST", "/hook", None, "{}"),
        "x-github-event",
        "push",
    ))
    .await
    .assert_problem(400, "missing-key");
    app(hook("push", "has space"))
        .await
        .assert_problem(400, "invalid-key");
    assert_eq!(calls.get("/hook"), 2);
}

async fn rejections_can_be_rendered_differently<F: Fixture>(fx: &F) {
    let calls = Calls::default();
    let app = build(
        layer(fx.store()).with_rejection_handler(|r| {
            let mut res = http::Response::new(Bytes::from(format!("nope: {}", r.code())));
            *res.status_mut() = r.status();
            res
        }),
        &calls,
    );
    let missing = app(req("POST", "/pay", None, "")).await;
    assert_eq!(
        (missing.status, missing.text()),
        (StatusCode::BAD_REQUEST, "nope: missing-key".into())
    );
    app(req("POST", "/pay", Some("k"), "a")).await;
    let reused = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(
        (reused.status.as_u16(), reused.text()),
        (422, "nope: key-reused".into())
    );
}

async fn purge_deletes_expired_records_in_batches<F: Fixture>(fx: &F) {
    let store = fx.store();
    let short = Duration::from_millis(200);
    for i in 0..7 {
        let key = IdempotencyKey::parse(&format!("old{i}")).unwrap();
        // An in-progress record lives as long as its lease at least: both are short here.
        let mut c = claim_of(&key, b"", Duration::from_millis(100));
        c.ttl = short;
        assert!(matches!(
            store.claim(c).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }
    let keep = IdempotencyKey::parse("fresh").unwrap();
    store
        .claim(claim_of(&keep, b"", Duration::from_secs(5)))
        .await
        .unwrap();
    fx.pass(Duration::from_millis(400)).await;
    assert_eq!(store.purge_expired(3).await.unwrap(), 7);
    assert_eq!(store.purge_expired(3).await.unwrap(), 0);
    assert!(matches!(
        store
            .claim(claim_of(&keep, b"", Duration::from_secs(5)))
            .await
            .unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
}

async fn wait_for(mut cond: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !cond() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "condition not reached"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The suite, once per store.

/// One test per behaviour for one fixture, each under the runtime `$runtime` names.
macro_rules! cases {
    ($runtime:meta, $fixture:expr; $($name:ident),* $(,)?) => {
        $(
            #[$runtime]
            async fn $name() {
                use super::Fixture;
                let fx = $fixture;
                super::$name(&fx).await;
                fx.cleanup().await;
            }
        )*
    };
}

/// Each behaviour once per store. The memory store runs its `timed` behaviours on Tokio's
/// paused clock (its own clock): their leases, TTLs and sleeps pass at once and exactly. The
/// others run on two worker threads, so that racing requests really race.
macro_rules! suite {
    (untimed: [$($name:ident),* $(,)?], timed: [$($timed:ident),* $(,)?] $(,)?) => {
        mod memory {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Memory::new().await; $($name),*);
            cases!(tokio::test(start_paused = true), super::Memory::new().await; $($timed),*);
        }
        mod postgres {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Postgres::new().await; $($name,)* $($timed),*);
        }
        mod postgres_read_first {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Postgres::with(super::ClaimStrategy::ReadFirst).await;
                $($name,)* $($timed),*);
        }
        mod postgres_prepared {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Postgres::prepared().await; $($name,)* $($timed),*);
        }
        #[cfg(feature = "redis")]
        mod redis {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Redis::on(false).await; $($name,)* $($timed),*);
        }
        #[cfg(feature = "redis")]
        mod redis_cluster {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Redis::on(true).await; $($name,)* $($timed),*);
        }
        mod postgres_insert_first {
            cases!(tokio::test(flavor = "multi_thread", worker_threads = 2),
                super::Postgres::with(super::ClaimStrategy::InsertFirst).await;
                $($name,)* $($timed),*);
        }
    };
}

suite!(
    untimed: [
        first_request_runs_and_repeat_replays_byte_for_byte,
        the_live_answer_keeps_every_header_it_stores,
        set_cookie_is_replayed_when_configured,
        quoted_and_bare_keys_are_the_same_key,
        missing_key_is_400_and_optional_key_passes_through,
        malformed_keys_are_400,
        different_payload_is_422_and_keeps_the_stored_answer,
        fingerprint_headers_are_part_of_the_request,
        concurrent_repeat_is_409_with_retry_after,
        server_errors_release_the_key,
        client_errors_are_stored,
        trailers_are_stored_and_replayed,
        a_response_body_limit_of_zero_keeps_status_and_headers_only,
        settings_that_would_turn_the_layer_off_are_refused,
        rate_limited_and_timed_out_answers_are_not_stored,
        with_store_when_decides_which_answers_are_stored,
        handler_panic_releases_the_key,
        service_error_releases_the_key,
        dropped_request_releases_the_key,
        oversized_request_body_is_413_and_stores_nothing,
        uncovered_methods_pass_through,
        keys_are_scoped,
        fifty_concurrent_requests_run_the_handler_once,
        oversized_response_reaches_the_client_and_is_never_rerun,
        handler_sees_the_key,
        custom_header_names_the_key,
        key_from_a_function,
        rejections_can_be_rendered_differently,
    ],
    timed: [
        expired_keys_count_as_new,
        lease_runs_out_after_a_crash_and_the_key_is_taken_over,
        stale_owner_cannot_complete_after_takeover,
        lease_renewal_keeps_a_slow_handler_from_being_taken_over,
        slow_handler_outliving_the_ttl_runs_once_and_is_replayed,
        ttl_shorter_than_the_lease_keeps_a_running_key,
        renewals_keep_a_key_whose_ttl_is_shorter_than_the_lease,
        completed_record_lives_the_ttl_from_its_completion,
        owner_completes_a_lapsed_claim_that_nobody_took_over,
        purge_deletes_expired_records_in_batches,
    ],
);
