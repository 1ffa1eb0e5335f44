//! The outbound client layer (`tower_idempotency::client`) against real HTTP servers on
//! loopback, through hyper-util's client: which key it sends, what it retries (always with
//! that key), its bounds, its body handling, and — with the server layer on the other side
//! and a proxy that loses answers after the server committed — that the handler runs once
//! and the caller gets the replay.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

#[allow(dead_code, unreachable_pub)]
#[path = "support/proxy.rs"]
mod proxy;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing;
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use proxy::Proxy;
use tower::{Layer as _, ServiceExt as _};
use tower_idempotency::client::{
    ClientError, ConnectionErrors, IdempotentClient, IdempotentClientLayer, ReplayBody,
};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};

// ---------------------------------------------------------------------------------------------
// A scripted upstream server
// ---------------------------------------------------------------------------------------------

/// What the upstream does with one request.
#[derive(Clone, Debug)]
enum Step {
    /// Answers this status, with `Retry-After` if given.
    Status(u16, Option<&'static str>),
    /// Waits this long, then answers `201`.
    Slow(Duration),
}

/// A request as the upstream saw it.
#[derive(Clone, Debug)]
struct Seen {
    key: Option<String>,
    body: Bytes,
    at: Instant,
}

/// An HTTP server on loopback that answers requests by its script (then `201 created`), and
/// records each request it got.
#[derive(Clone, Default)]
struct Upstream {
    script: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    async fn start(script: impl IntoIterator<Item = Step>) -> (Upstream, SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (Self::serve(listener, script), addr)
    }

    fn serve(listener: tokio::net::TcpListener, script: impl IntoIterator<Item = Step>) -> Self {
        let upstream = Upstream {
            script: Arc::new(Mutex::new(script.into_iter().collect())),
            seen: Arc::default(),
        };
        let app = Router::new()
            .fallback(scripted)
            .with_state(upstream.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        upstream
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.seen().into_iter().map(|s| s.key).collect()
    }
}

async fn scripted(State(upstream): State<Upstream>, request: Request) -> Response {
    let key = request
        .headers()
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = request.into_body().collect().await.unwrap().to_bytes();
    upstream.seen.lock().unwrap().push(Seen {
        key,
        body,
        at: Instant::now(),
    });
    let step = upstream.script.lock().unwrap().pop_front();
    match step {
        Some(Step::Status(code, retry_after)) => {
            let mut response = StatusCode::from_u16(code).unwrap().into_response();
            if let Some(after) = retry_after {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static(after));
            }
            response
        }
        Some(Step::Slow(delay)) => {
            tokio::time::sleep(delay).await;
            (StatusCode::CREATED, "created").into_response()
        }
        None => (StatusCode::CREATED, "created").into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// The client under test
// ---------------------------------------------------------------------------------------------

type Http = Client<HttpConnector, ReplayBody>;

fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The layer with short waits (the tests count attempts; they do not time them).
fn layer() -> IdempotentClientLayer {
    IdempotentClientLayer::new("charge")
        .unwrap()
        .with_backoff(Duration::from_millis(5), Duration::from_millis(20))
}

fn client(layer: IdempotentClientLayer) -> IdempotentClient<Http> {
    layer.layer(http())
}

fn post(addr: SocketAddr, body: &'static str) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}/charges"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

type CallResult =
    Result<http::Response<hyper::body::Incoming>, ClientError<hyper_util::client::legacy::Error>>;

async fn call<B>(client: &IdempotentClient<Http>, request: http::Request<B>) -> CallResult
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<tower_idempotency::BoxError>,
{
    tokio::time::timeout(Duration::from_secs(60), client.clone().oneshot(request))
        .await
        .expect("the call took over a minute")
}

async fn text(response: http::Response<hyper::body::Incoming>) -> String {
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

fn is_random_key(key: &str) -> bool {
    key.len() == 32
        && key
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

// ---------------------------------------------------------------------------------------------
// Which key
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_fresh_random_key_is_sent_and_the_same_key_on_every_retry() {
    let (upstream, addr) = Upstream::start([
        Step::Status(503, None),
        Step::Status(429, None),
        Step::Status(502, None),
        Step::Status(504, None),
    ])
    .await;
    let client = client(layer());

    let response = call(&client, post(addr, r#"{"amount_cents":1999}"#))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = upstream.keys();
    assert_eq!(
        keys.len(),
        5,
        "four retryable answers, then the answer: {keys:?}"
    );
    let key = keys[0].clone().expect("a key on the first attempt");
    assert!(is_random_key(&key), "128 random bits as hex: {key}");
    assert!(keys.iter().all(|k| k.as_deref() == Some(&*key)), "{keys:?}");

    // Another logical call: another key.
    let response = call(&client, post(addr, r#"{"amount_cents":1999}"#))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let other = upstream.keys()[5].clone().unwrap();
    assert!(is_random_key(&other));
    assert_ne!(other, key);
}

#[tokio::test]
async fn a_key_in_the_extensions_is_derived_and_a_callers_header_is_kept() {
    let (upstream, addr) = Upstream::start([Step::Status(503, None)]).await;
    let client = client(layer());

    let mut request = post(addr, "{}");
    request
        .extensions_mut()
        .insert(IdempotencyKey::parse("order-7").unwrap());
    assert_eq!(call(&client, request).await.unwrap().status(), 201);
    assert_eq!(
        upstream.keys(),
        [
            Some("order-7:charge".to_owned()),
            Some("order-7:charge".to_owned())
        ]
    );

    // A key at the 255-character limit: the hashed form, the same as the server side derives.
    let long = IdempotencyKey::parse(&"k".repeat(255)).unwrap();
    let mut request = post(addr, "{}");
    request.extensions_mut().insert(long.clone());
    assert_eq!(call(&client, request).await.unwrap().status(), 201);
    let sent = upstream.keys()[2].clone().unwrap();
    assert_eq!(sent, long.derive("charge").unwrap().as_str());
    assert!(sent.starts_with("~sha256-"), "{sent}");

    // A key the caller set is sent as it is, also when the extensions hold one.
    let mut request = post(addr, "{}");
    request
        .headers_mut()
        .insert("idempotency-key", HeaderValue::from_static("callers-own"));
    request
        .extensions_mut()
        .insert(IdempotencyKey::parse("order-7").unwrap());
    assert_eq!(call(&client, request).await.unwrap().status(), 201);
    assert_eq!(upstream.keys()[3].as_deref(), Some("callers-own"));
}

#[test]
fn an_invalid_purpose_is_refused_when_the_layer_is_made() {
    for purpose in ["", "a:b", "with space", &"p".repeat(65)] {
        assert_eq!(
            IdempotentClientLayer::new(purpose).unwrap_err(),
            tower_idempotency::KeyError::InvalidPurpose,
            "{purpose:?}"
        );
    }
    assert!(IdempotentClientLayer::new(&"p".repeat(64)).is_ok());
}

// ---------------------------------------------------------------------------------------------
// What is retried
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_409_is_retried_no_sooner_than_its_retry_after() {
    let (upstream, addr) = Upstream::start([Step::Status(409, Some("1"))]).await;
    let client = client(layer());
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);
    let waited = seen[1].at - seen[0].at;
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
}

#[tokio::test]
async fn a_503_and_a_429_honour_retry_after_too() {
    let (upstream, addr) =
        Upstream::start([Step::Status(503, Some("1")), Step::Status(429, Some("1"))]).await;
    let client = client(layer());
    assert_eq!(call(&client, post(addr, "{}")).await.unwrap().status(), 201);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    for pair in seen.windows(2) {
        assert!(pair[1].at - pair[0].at >= Duration::from_secs(1));
    }
}

#[tokio::test]
async fn other_4xx_and_500_are_answers_not_retried() {
    for code in [400, 401, 404, 422, 500] {
        let (upstream, addr) = Upstream::start([Step::Status(code, None)]).await;
        let client = client(layer());
        let response = call(&client, post(addr, "{}")).await.unwrap();
        assert_eq!(response.status().as_u16(), code);
        assert_eq!(upstream.seen().len(), 1, "{code} was sent again");
    }
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_server_is_up() {
    // A free port with nothing listening on it (yet).
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let upstream: Arc<Mutex<Option<Upstream>>> = Arc::default();
    let started = upstream.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        *started.lock().unwrap() = Some(Upstream::serve(listener, []));
    });
    let client = client(
        layer()
            .with_max_attempts(100)
            .with_backoff(Duration::from_millis(20), Duration::from_millis(50)),
    );
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let upstream = upstream.lock().unwrap().clone().unwrap();
    assert_eq!(
        upstream.seen().len(),
        1,
        "refused attempts never reached it"
    );
}

#[tokio::test]
async fn a_connection_closed_before_the_answer_is_retried_with_the_same_key() {
    let (upstream, addr) = Upstream::start([]).await;
    let proxy = Proxy::start(addr).await;
    proxy.lose_answers(2);
    let client = client(layer());
    let response = call(&client, post(proxy.addr(), "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(proxy.answers_lost(), 2);
    let keys = upstream.keys();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(
        keys.iter().all(|k| k.is_some() && *k == keys[0]),
        "{keys:?}"
    );
}

#[tokio::test]
async fn an_attempt_past_its_timeout_is_retried_with_the_same_key() {
    let (upstream, addr) = Upstream::start([Step::Slow(Duration::from_secs(5))]).await;
    let client = client(layer().with_attempt_timeout(Duration::from_secs(1)));
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = upstream.keys();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0], keys[1]);
}

/// A tower service standing in for a server: `answer(n)` makes the `n`th answer (0-based);
/// each request's arrival (in Tokio's time, paused in these tests) is recorded.
fn scripted_service(
    answer: impl Fn(usize) -> http::Response<Body> + Clone + Send + Sync + 'static,
) -> (Scripted, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let svc = tower::service_fn(move |_: http::Request<ReplayBody>| {
        let n = {
            let mut seen = seen.lock().unwrap();
            seen.push(tokio::time::Instant::now());
            seen.len() - 1
        };
        let response = answer(n);
        async move { Ok::<_, Infallible>(response) }
    });
    (tower::util::BoxCloneService::new(svc), arrivals)
}

type Scripted =
    tower::util::BoxCloneService<http::Request<ReplayBody>, http::Response<Body>, Infallible>;

/// When each request arrived, in Tokio's time.
type Arrivals = Arc<Mutex<Vec<tokio::time::Instant>>>;

fn answer(status: u16, retry_after: Option<&str>) -> http::Response<Body> {
    let mut response = http::Response::builder().status(status);
    if let Some(after) = retry_after {
        response = response.header(header::RETRY_AFTER, after);
    }
    response.body(Body::empty()).unwrap()
}

fn keyed(key: &str) -> http::Request<Full<Bytes>> {
    http::Request::post("/charges")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// `at` as an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), written here by hand so that the
/// test does not share the parser's code.
fn imf_fixdate(at: std::time::SystemTime) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let secs = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let weekday = DAYS[usize::try_from(days % 7).unwrap()];
    // Days since 1970-01-01 to a civil date (H. Hinnant's `civil_from_days`).
    let z = i64::try_from(days).unwrap() + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{weekday}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        MONTHS[usize::try_from(month - 1).unwrap()],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[test]
fn the_tests_date_formatter_writes_imf_fixdates() {
    let at = std::time::UNIX_EPOCH + Duration::from_secs(784_111_777);
    assert_eq!(imf_fixdate(at), "Sun, 06 Nov 1994 08:49:37 GMT");
    let at = std::time::UNIX_EPOCH + Duration::from_secs(951_782_400);
    assert_eq!(imf_fixdate(at), "Tue, 29 Feb 2000 00:00:00 GMT");
}

/// A `409` that does not say "later" is final: a handler's own conflict, for one. It is the
/// call's answer, sent once.
#[tokio::test(start_paused = true)]
async fn a_409_without_retry_after_is_the_answer_and_not_sent_again() {
    let (svc, arrivals) = scripted_service(|n| match n {
        0 => answer(409, None),
        _ => answer(201, None),
    });
    let response = layer().layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(
        arrivals.lock().unwrap().len(),
        1,
        "a final 409 was sent again"
    );
}

/// The server layer in process, in front of a handler that counts its runs and answers a body
/// larger than the layer stores: a repeat of the key is the layer's `409 response-not-stored`
/// — final, the handler will not run again — and the client returns it after one attempt.
#[tokio::test(start_paused = true)]
async fn the_server_layers_response_not_stored_409_is_not_retried() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let server = Router::new()
        .route(
            "/charges",
            routing::post(move || {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "a charge too large to store")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_shared_scope()
                .with_max_response_body(4),
        );
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let inner = tower::service_fn(move |request: http::Request<ReplayBody>| {
        counter.fetch_add(1, Ordering::SeqCst);
        server.clone().oneshot(request)
    });
    let client = layer().layer(inner);

    let first = client.clone().oneshot(keyed("big")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let repeat = client.clone().oneshot(keyed("big")).await.unwrap();
    assert_eq!(repeat.status(), StatusCode::CONFLICT);
    assert!(repeat.headers().get(header::RETRY_AFTER).is_none());
    let problem = repeat.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&problem).contains("response-not-stored"),
        "{problem:?}"
    );
    assert_eq!(
        sent.load(Ordering::SeqCst),
        2,
        "the final 409 was sent again"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The server layer's `409 request-in-progress` carries `Retry-After`: the client waits for
/// it and sends the key again, and gets the first request's answer as a replay.
#[tokio::test(start_paused = true)]
async fn the_server_layers_in_progress_409_is_retried_until_the_replay() {
    let runs = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let (counted, released) = (runs.clone(), release.clone());
    let server = Router::new()
        .route(
            "/charges",
            routing::post(move || {
                let (runs, release) = (counted.clone(), released.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    release.notified().await;
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_shared_scope());
    let arrivals: Arrivals = Arc::default();
    let (seen, wake) = (arrivals.clone(), release.clone());
    let router = server.clone();
    let inner = tower::service_fn(move |request: http::Request<ReplayBody>| {
        let n = {
            let mut seen = seen.lock().unwrap();
            seen.push(tokio::time::Instant::now());
            seen.len()
        };
        let (router, wake) = (router.clone(), wake.clone());
        async move {
            let response = router.oneshot(request).await;
            // The first request finishes once the client was turned away once.
            if n == 1 {
                wake.notify_one();
            }
            response
        }
    });
    let first = tokio::spawn(
        server.oneshot(
            http::Request::post("/charges")
                .header("idempotency-key", "slow")
                .body(Body::from("{}"))
                .unwrap(),
        ),
    );
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }

    let response = layer().layer(inner).oneshot(keyed("slow")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals[1] - arrivals[0] >= Duration::from_secs(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `Retry-After` as an HTTP-date (RFC 9110 IMF-fixdate) is waited for like delta-seconds.
#[tokio::test(start_paused = true)]
async fn a_retry_after_http_date_is_waited_for() {
    // Three seconds ahead, written to the second: a wait of two to three seconds.
    let date = imf_fixdate(std::time::SystemTime::now() + Duration::from_secs(3));
    let (svc, arrivals) = scripted_service(move |n| match n {
        0 => answer(503, Some(&date)),
        _ => answer(201, None),
    });
    let response = layer().layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2);
    let waited = arrivals[1] - arrivals[0];
    assert!(
        waited >= Duration::from_secs(2) && waited <= Duration::from_secs(3),
        "retried after {waited:?}"
    );
}

/// An HTTP-date past the call's deadline is not waited for: the answer is returned at once.
#[tokio::test(start_paused = true)]
async fn a_retry_after_http_date_past_the_deadline_is_not_waited_for() {
    let date = imf_fixdate(std::time::SystemTime::now() + Duration::from_secs(3600));
    let (svc, arrivals) = scripted_service(move |n| match n {
        0 => answer(503, Some(&date)),
        _ => answer(201, None),
    });
    let started = tokio::time::Instant::now();
    let response = layer().layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(arrivals.lock().unwrap().len(), 1);
    assert_eq!(started.elapsed(), Duration::ZERO);
}

/// A request hyper-util's client refuses before sending (a URI without scheme and host)
/// fails the same way every time: one attempt, and its error.
#[tokio::test]
async fn an_invalid_uri_is_not_retried() {
    let request = http::Request::post("/charges")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    match call(&client(layer()), request).await {
        Err(e @ ClientError::Inner { .. }) => assert_eq!(e.attempts(), 1, "{e:?}"),
        other => panic!("expected the inner error: {other:?}"),
    }
}

type Tcp = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
type Connecting =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Tcp, std::io::Error>> + Send>>;

/// A connector for hyper-util's client that fails every connection with `kind`, as a TLS
/// connector reports a handshake it refused (`InvalidData` around the TLS library's error,
/// as tokio-rustls does), or as TCP reports a refused connection; it counts the tries.
fn failing_connector(
    kind: std::io::ErrorKind,
    connects: Arc<AtomicUsize>,
) -> impl tower::Service<http::Uri, Response = Tcp, Error = std::io::Error, Future = Connecting>
+ Clone
+ Send
+ Sync
+ 'static {
    tower::service_fn(move |_: http::Uri| {
        connects.fetch_add(1, Ordering::SeqCst);
        let fut: Connecting =
            Box::pin(
                async move { Err(std::io::Error::new(kind, format!("connect failed: {kind}"))) },
            );
        fut
    })
}

/// A TLS handshake that failed (a certificate the client does not trust) fails the same way
/// on every attempt: not retried. hyper-util reports it as a connect error, like a refused
/// connection — which is retried.
#[tokio::test]
async fn a_tls_failure_is_not_retried_and_a_refused_connection_is() {
    let connects = Arc::new(AtomicUsize::new(0));
    let tls = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(failing_connector(
        std::io::ErrorKind::InvalidData,
        connects.clone(),
    ));
    let client = layer().with_max_attempts(3).layer(tls);
    match client
        .oneshot(post("127.0.0.1:1".parse().unwrap(), "{}"))
        .await
    {
        Err(ClientError::Inner { source, attempts }) => {
            assert!(source.is_connect(), "{source:?}");
            assert_eq!(attempts, 1, "{source:?}");
        }
        other => panic!("expected the inner error: {other:?}"),
    }
    assert_eq!(connects.load(Ordering::SeqCst), 1);

    let connects = Arc::new(AtomicUsize::new(0));
    let refused = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(failing_connector(
        std::io::ErrorKind::ConnectionRefused,
        connects.clone(),
    ));
    let client = layer().with_max_attempts(3).layer(refused);
    match client
        .oneshot(post("127.0.0.1:1".parse().unwrap(), "{}"))
        .await
    {
        Err(ClientError::Inner { attempts: 3, .. }) => {}
        other => panic!("expected the inner error after 3 attempts: {other:?}"),
    }
    assert_eq!(connects.load(Ordering::SeqCst), 3);
}

/// The retried statuses are the layer's setting: here `500` is retried and `503` is not; an
/// empty set retries no answer, and lost connections are still retried.
#[tokio::test(start_paused = true)]
async fn the_retried_statuses_are_configurable() {
    let (svc, arrivals) = scripted_service(|n| match n {
        0 => answer(500, None),
        1 => answer(503, Some("1")),
        _ => answer(201, None),
    });
    let only_500 = layer()
        .with_retry_statuses([StatusCode::INTERNAL_SERVER_ERROR])
        .unwrap();
    let response = only_500.layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(arrivals.lock().unwrap().len(), 2, "500 retried, 503 not");

    let (svc, arrivals) = scripted_service(|n| match n {
        0 => answer(503, None),
        _ => answer(201, None),
    });
    let none = layer().with_retry_statuses([]).unwrap();
    let response = none.clone().layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(arrivals.lock().unwrap().len(), 1);

    let resets = Arc::new(AtomicUsize::new(0));
    let counted = resets.clone();
    let svc = tower::service_fn(move |_: http::Request<ReplayBody>| {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
            }
            Ok(answer(201, None))
        }
    });
    let response = none.layer(svc).oneshot(keyed("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(resets.load(Ordering::SeqCst), 2);
}

/// Statuses that do not say a request failed are refused when the layer is configured, with
/// the status named — never a panic, never a surprise at the first call.
#[test]
fn retry_statuses_other_than_4xx_and_5xx_are_refused_when_configured() {
    for code in [100, 200, 201, 204, 301, 302, 304, 600, 999] {
        let status = StatusCode::from_u16(code).unwrap();
        let refused = layer().with_retry_statuses([StatusCode::SERVICE_UNAVAILABLE, status]);
        let error = refused.unwrap_err();
        assert_eq!(error, tower_idempotency::ConfigError::NotRetryable(status));
        assert!(error.to_string().contains(&code.to_string()), "{error}");
    }
    assert!(layer().with_retry_statuses([]).is_ok());
    assert!(
        layer()
            .with_retry_statuses([StatusCode::BAD_REQUEST, StatusCode::from_u16(599).unwrap()])
            .is_ok()
    );
}

/// A classifier of the caller's decides which errors are retried: here every connect error
/// of hyper-util's client, the refused TLS handshake included (which the default does not
/// retry), and never an invalid URI.
#[tokio::test]
async fn an_error_classifier_decides_which_errors_are_retried() {
    let connects = Arc::new(AtomicUsize::new(0));
    let tls = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(failing_connector(
        std::io::ErrorKind::InvalidData,
        connects.clone(),
    ));
    let every_connect = layer()
        .with_max_attempts(3)
        .with_error_classifier(|e: &hyper_util::client::legacy::Error| e.is_connect());
    let client = every_connect.layer(tls);
    match client
        .clone()
        .oneshot(post("127.0.0.1:1".parse().unwrap(), "{}"))
        .await
    {
        Err(ClientError::Inner { attempts: 3, .. }) => {}
        other => panic!("expected the inner error after 3 attempts: {other:?}"),
    }
    assert_eq!(connects.load(Ordering::SeqCst), 3);
    let relative = http::Request::post("/charges")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    match client.oneshot(relative).await {
        Err(ClientError::Inner { attempts: 1, .. }) => {}
        other => panic!("expected the inner error after 1 attempt: {other:?}"),
    }

    // An inner service whose error is tower's `BoxError` (not a `std::error::Error`): the
    // default classifier's test, applied by a closure.
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let boxed = tower::service_fn(move |_: http::Request<ReplayBody>| {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            match n {
                0 => Err::<http::Response<Body>, tower_idempotency::BoxError>(
                    std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
                ),
                _ => Err("refused for good".into()),
            }
        }
    });
    let client = layer()
        .with_error_classifier(|e: &tower_idempotency::BoxError| ConnectionErrors::matches(&**e))
        .layer(boxed);
    match client.oneshot(keyed("k")).await {
        Err(ClientError::Inner {
            attempts: 2,
            source,
        }) => {
            assert_eq!(source.to_string(), "refused for good");
        }
        other => panic!("expected the second error after 2 attempts: {other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------------
// Bounds
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_attempts_are_bounded_and_the_last_answer_is_returned() {
    let (upstream, addr) = Upstream::start(vec![Step::Status(503, None); 10]).await;
    let client = client(layer().with_max_attempts(3));
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(upstream.seen().len(), 3);
}

#[tokio::test]
async fn a_retry_after_past_the_deadline_is_not_waited_for() {
    let (upstream, addr) = Upstream::start([Step::Status(503, Some("3600"))]).await;
    let client = client(layer().with_deadline(Duration::from_secs(30)));
    let started = Instant::now();
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(upstream.seen().len(), 1);
    // Returned without waiting for the hour, or for the deadline.
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn the_deadline_bounds_the_whole_call() {
    // Each answer says "come back in 2 s": within a 5 s deadline there is room for the first
    // attempt and two retries (at 2 s and 4 s; a second of slack for a busy machine), not
    // for a fourth attempt.
    let (upstream, addr) = Upstream::start(vec![Step::Status(429, Some("2")); 10]).await;
    let client = client(
        layer()
            .with_max_attempts(100)
            .with_deadline(Duration::from_secs(5)),
    );
    let response = call(&client, post(addr, "{}")).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(upstream.seen().len(), 3);
}

#[tokio::test]
async fn errors_and_timeouts_are_returned_once_the_attempts_are_spent() {
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let bounded = client(layer().with_max_attempts(3));
    match call(&bounded, post(addr, "{}")).await {
        Err(e @ ClientError::Inner { attempts: 3, .. }) => {
            assert_eq!(e.attempts(), 3);
            assert!(std::error::Error::source(&e).is_some(), "the cause is kept");
        }
        other => panic!("expected the inner error after 3 attempts: {other:?}"),
    }

    let (upstream, addr) = Upstream::start(vec![Step::Slow(Duration::from_secs(5)); 3]).await;
    let bounded = client(
        layer()
            .with_max_attempts(2)
            .with_attempt_timeout(Duration::from_millis(200)),
    );
    match call(&bounded, post(addr, "{}")).await {
        Err(ClientError::TimedOut { attempts: 2, after }) => {
            assert_eq!(after, Duration::from_millis(200));
        }
        other => panic!("expected a timeout after 2 attempts: {other:?}"),
    }
    assert_eq!(upstream.seen().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// The body
// ---------------------------------------------------------------------------------------------

/// A body of several frames, without a length.
fn streamed(
    chunks: &[&'static [u8]],
) -> StreamBody<
    impl futures_core::Stream<Item = Result<http_body::Frame<Bytes>, Infallible>> + Send + 'static,
> {
    let frames: Vec<Result<http_body::Frame<Bytes>, Infallible>> = chunks
        .iter()
        .map(|c| Ok(http_body::Frame::data(Bytes::from_static(c))))
        .collect();
    StreamBody::new(stream_of(frames))
}

/// A stream over `items` (futures-core only has the trait).
fn stream_of<T: Unpin + Send + 'static>(
    items: Vec<T>,
) -> impl futures_core::Stream<Item = T> + Send + 'static {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

#[tokio::test]
async fn the_body_is_sent_again_byte_for_byte() {
    let (upstream, addr) =
        Upstream::start([Step::Status(503, None), Step::Status(409, Some("0"))]).await;
    let client = client(layer());
    let chunks: [&'static [u8]; 3] = [b"{\"amount", b"_cents\": ", b"1999}\xff\x00"];
    let request = http::Request::post(format!("http://{addr}/charges"))
        .body(streamed(&chunks))
        .unwrap();
    assert_eq!(call(&client, request).await.unwrap().status(), 201);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    let expected: Vec<u8> = chunks.concat();
    for s in &seen {
        assert_eq!(&s.body[..], &expected[..]);
    }
}

#[tokio::test]
async fn a_body_over_the_limit_is_an_error_and_nothing_is_sent() {
    let (upstream, addr) = Upstream::start([]).await;
    let client = client(layer().with_max_request_body(10));

    // Known length (refused before it is read), and streamed (refused while read).
    match call(&client, post(addr, "12345678901")).await {
        Err(e @ ClientError::BodyTooLarge { limit: 10 }) => assert_eq!(e.attempts(), 0),
        other => panic!("expected BodyTooLarge: {other:?}"),
    }
    let request = http::Request::post(format!("http://{addr}/charges"))
        .body(streamed(&[b"123456", b"78901"]))
        .unwrap();
    assert!(matches!(
        call(&client, request).await,
        Err(ClientError::BodyTooLarge { limit: 10 })
    ));
    assert!(upstream.seen().is_empty());

    // At the limit: sent.
    assert_eq!(
        call(&client, post(addr, "1234567890"))
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(&upstream.seen()[0].body[..], b"1234567890");
}

// ---------------------------------------------------------------------------------------------
// With the server layer on the other side
// ---------------------------------------------------------------------------------------------

/// The server layer in front of a handler that counts its runs, over real HTTP, behind a
/// proxy that loses the first two answers (after the layer stored them). The client's
/// retries carry the same key: the handler runs once, and the caller gets the stored
/// answer, marked as a replay.
#[tokio::test]
async fn lost_answers_behind_the_server_layer_run_the_handler_once_and_replay() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/charges",
            routing::post(move |body: Bytes| {
                let runs = counted.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        StatusCode::CREATED,
                        format!("charge #{n} for {}", body.len()),
                    )
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_shared_scope());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let proxy = Proxy::start(addr).await;
    proxy.lose_answers(2);

    let client = client(layer());
    let mut request = post(proxy.addr(), r#"{"amount_cents":1999}"#);
    request
        .extensions_mut()
        .insert(IdempotencyKey::parse("pay-1").unwrap());
    let response = call(&client, request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        response
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "the answer the caller got is the stored one"
    );
    assert_eq!(text(response).await, "charge #1 for 21");
    assert_eq!(proxy.answers_lost(), 2);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");

    // Without the client layer's retries, a lost answer is an error for the caller.
    proxy.lose_answers(1);
    let bare = http();
    let request = http::Request::post(format!("http://{}/charges", proxy.addr()))
        .header("idempotency-key", "pay-2")
        .body(ReplayBody::default())
        .unwrap();
    assert!(bare.request(request).await.is_err());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "pay-2 ran, its answer was lost"
    );
}

#[tokio::test]
async fn a_body_that_fails_to_read_is_an_error_and_nothing_is_sent() {
    let (upstream, addr) = Upstream::start([]).await;
    let client = client(layer());
    let frames: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = vec![
        Ok(http_body::Frame::data(Bytes::from_static(b"abc"))),
        Err(std::io::Error::other("the disk is gone")),
    ];
    let request = http::Request::post(format!("http://{addr}/charges"))
        .body(StreamBody::new(stream_of(frames)))
        .unwrap();
    match call(&client, request).await {
        Err(e @ ClientError::Body(_)) => assert_eq!(e.attempts(), 0),
        other => panic!("expected a body error: {other:?}"),
    }
    assert!(upstream.seen().is_empty());
}

#[tokio::test]
async fn over_a_plain_service_the_key_is_derived_and_the_response_untouched() {
    // The layer over a plain tower service (no HTTP): the response comes back as made.
    let svc = tower::service_fn(|request: http::Request<ReplayBody>| async move {
        let key = request.headers()["idempotency-key"].clone();
        Ok::<_, Infallible>(
            http::Response::builder()
                .status(200)
                .header("echo-key", key)
                .body(Body::from(request.body().bytes().to_vec()))
                .unwrap(),
        )
    });
    let client = layer().layer(svc);
    let mut request = http::Request::post("/x")
        .body(Full::new(Bytes::from_static(b"hello")))
        .unwrap();
    request
        .extensions_mut()
        .insert(IdempotencyKey::parse("in").unwrap());
    let response = client.oneshot(request).await.unwrap();
    assert_eq!(response.headers()["echo-key"], "in:charge");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"hello");
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// Counters by `name{label=value,…}`.
#[cfg(feature = "metrics")]
#[derive(Default)]
struct Counters(Mutex<std::collections::HashMap<String, Arc<std::sync::atomic::AtomicU64>>>);

#[cfg(feature = "metrics")]
struct CounterCell(Arc<std::sync::atomic::AtomicU64>);

#[cfg(feature = "metrics")]
impl metrics::CounterFn for CounterCell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

#[cfg(feature = "metrics")]
impl Counters {
    fn get(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

#[cfg(feature = "metrics")]
impl metrics::Recorder for Counters {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let cell = self.0.lock().unwrap().entry(name).or_default().clone();
        metrics::Counter::from_arc(Arc::new(CounterCell(cell)))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Attempts, retries by reason and calls by outcome, labelled with the purpose and never
/// with a key. (A recorder local to this thread, and a runtime on this thread with paused
/// time: the waits between attempts pass at once.)
#[cfg(feature = "metrics")]
#[test]
fn attempts_retries_and_outcomes_are_counted_without_keys() {
    let counters = Counters::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&counters, || {
        runtime.block_on(async {
            // The inner service answers 503, then 409 in progress, then fails, then 200; 503
            // after that.
            let calls = Arc::new(AtomicUsize::new(0));
            let svc = tower::service_fn(move |_: http::Request<ReplayBody>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    let (status, retry_after) = match n {
                        0 => (503, None),
                        1 => (409, Some("0")),
                        2 => return Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
                        3 => (200, None),
                        _ => (503, None),
                    };
                    Ok(answer(status, retry_after))
                }
            });
            let client = layer().with_max_request_body(4).layer(svc.clone());
            let short = layer().with_max_attempts(2).layer(svc);
            let request = |body: &'static str| {
                let mut request = http::Request::post("/charges")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))
                    .unwrap();
                request
                    .extensions_mut()
                    .insert(IdempotencyKey::parse("secret-key").unwrap());
                request
            };
            let answered = client.clone().oneshot(request("{}")).await.unwrap();
            assert_eq!(answered.status(), 200);
            let too_large = client.clone().oneshot(request("12345")).await;
            assert!(matches!(too_large, Err(ClientError::BodyTooLarge { .. })));
            let exhausted = short.oneshot(request("{}")).await;
            assert_eq!(exhausted.unwrap().status(), 503);
            // An error that is not transient: one attempt, and the call fails.
            let refused = tower::service_fn(|_: http::Request<ReplayBody>| async {
                Err::<http::Response<Body>, _>(std::io::Error::from(
                    std::io::ErrorKind::InvalidData,
                ))
            });
            let failed = layer().layer(refused).oneshot(request("{}")).await;
            assert!(matches!(
                failed,
                Err(ClientError::Inner { attempts: 1, .. })
            ));
        });
    });
    let count = |name: &str| counters.get(name);
    assert_eq!(
        count("tower_idempotency_client_attempts_total{purpose=charge}"),
        7
    );
    for (reason, n) in [("503", 2), ("409", 1), ("error", 1)] {
        assert_eq!(
            count(&format!(
                "tower_idempotency_client_retries_total{{purpose=charge,reason={reason}}}"
            )),
            n,
            "{reason}"
        );
    }
    for outcome in ["answered", "not_sent", "exhausted", "failed"] {
        assert_eq!(
            count(&format!(
                "tower_idempotency_client_calls_total{{purpose=charge,outcome={outcome}}}"
            )),
            1,
            "{outcome}"
        );
    }
    for name in counters.0.lock().unwrap().keys() {
        assert!(!name.contains("secret"), "a key in the metric {name}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tracing
// ---------------------------------------------------------------------------------------------

/// `<span>.<field>=<value>` of every span (at creation and when recorded), and
/// `event.<field>=<value>` of every event.
#[derive(Clone, Default)]
struct Traced(Arc<Mutex<Vec<String>>>);

struct Visit<'a>(&'a str, &'a Traced);

impl tracing::field::Visit for Visit<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let entry = format!("{}.{}={value:?}", self.0, field.name());
        self.1.0.lock().unwrap().push(entry);
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        let entry = format!("{}.{}={value}", self.0, field.name());
        self.1.0.lock().unwrap().push(entry);
    }
}

thread_local! {
    /// The capture of the test running on this thread, if it asked for one.
    static CAPTURE: std::cell::RefCell<Option<Traced>> = const { std::cell::RefCell::new(None) };
}

/// The binary's one global subscriber writes to the capture of the thread that emitted. A
/// scoped `set_default` would race other tests' threads for the callsites' cached interest and
/// can miss a span; a global subscriber is asked about every callsite once, for every thread.
struct ToThisThread;

fn captured(record: impl FnOnce(&Traced)) {
    CAPTURE.with(|capture| {
        if let Some(traced) = &*capture.borrow() {
            record(traced);
        }
    });
}

impl<S> tracing_subscriber::Layer<S> for ToThisThread
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        captured(|traced| attrs.record(&mut Visit(attrs.metadata().name(), traced)));
    }
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            captured(|traced| values.record(&mut Visit(span.name(), traced)));
        }
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        captured(|traced| event.record(&mut Visit("event", traced)));
    }
}

/// Captures what this thread traces from now until the capture is dropped.
struct Capture(Traced);

impl Capture {
    fn start() -> Self {
        use tracing_subscriber::layer::SubscriberExt as _;
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            let subscriber = tracing_subscriber::registry()
                .with(ToThisThread)
                .with(tracing_subscriber::filter::LevelFilter::DEBUG);
            tracing::subscriber::set_global_default(subscriber)
                .expect("no other test of this binary sets a global subscriber");
        });
        let traced = Traced::default();
        CAPTURE.with(|capture| *capture.borrow_mut() = Some(traced.clone()));
        Capture(traced)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        CAPTURE.with(|capture| *capture.borrow_mut() = None);
    }
}

/// A span per call with its purpose, key and number of attempts; an event per retry with the
/// attempt's number and reason.
#[tokio::test(start_paused = true)]
async fn each_call_is_a_span_and_each_retry_an_event_with_its_number_and_reason() {
    let capture = Capture::start();

    let calls = Arc::new(AtomicUsize::new(0));
    let svc = tower::service_fn(move |_: http::Request<ReplayBody>| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        async move {
            let status = [429, 503, 201][n.min(2)];
            Ok::<_, Infallible>(
                http::Response::builder()
                    .status(status)
                    .body(Body::empty())
                    .unwrap(),
            )
        }
    });
    let mut request = http::Request::post("/charges")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    request
        .extensions_mut()
        .insert(IdempotencyKey::parse("order-9").unwrap());
    let response = layer().layer(svc).oneshot(request).await.unwrap();
    assert_eq!(response.status(), 201);

    let seen = capture.0.0.lock().unwrap().clone();
    for expected in [
        "idempotent_client.purpose=charge",
        "idempotent_client.key=order-9:charge",
        "idempotent_client.attempts=3",
    ] {
        assert!(
            seen.iter().any(|s| s == expected),
            "{expected} in {seen:#?}"
        );
    }
    let retries: Vec<&String> = seen
        .iter()
        .filter(|s| s.starts_with("event.reason="))
        .collect();
    assert_eq!(
        retries,
        ["event.reason=429", "event.reason=503"],
        "{seen:#?}"
    );
    for attempt in ["event.attempt=1", "event.attempt=2", "event.attempt=3"] {
        assert!(seen.iter().any(|s| s == attempt), "{attempt} in {seen:#?}");
    }
}
