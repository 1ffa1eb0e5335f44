//! The layer in real stacks: axum's `Router::layer` and `route_layer`, the extractor, and a
//! plain hyper server over loopback.
#![cfg(feature = "axum")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};

fn post_req(uri: &str, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(uri);
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from("{}")).unwrap()
}

async fn text(res: http::Response<Body>) -> String {
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

fn counting_router(calls: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/charges",
        post(move |key: IdempotencyKey| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let charge_key = key.derive("charge").unwrap();
                (
                    StatusCode::CREATED,
                    format!("charge #{n} with {charge_key}"),
                )
            }
        }),
    )
}

#[tokio::test]
async fn router_layer_and_extractor() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = counting_router(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
    let first = app
        .clone()
        .oneshot(post_req("/charges", Some("k")))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(text(first).await, "charge #1 with k:charge");
    let again = app
        .clone()
        .oneshot(post_req("/charges", Some("k")))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(text(again).await, "charge #1 with k:charge");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Router::layer covers unknown paths too: a POST without a key is rejected first.
    let unknown = app.oneshot(post_req("/nope", None)).await.unwrap();
    assert_eq!(unknown.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn route_layer_leaves_unknown_paths_alone() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = counting_router(calls.clone()).route_layer(IdempotencyLayer::new(MemoryStore::new()));
    let unknown = app.clone().oneshot(post_req("/nope", None)).await.unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let missing = app
        .clone()
        .oneshot(post_req("/charges", None))
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(
        app.clone()
            .oneshot(post_req("/charges", Some("k")))
            .await
            .unwrap()
            .status(),
        StatusCode::CREATED
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn extractor_without_the_layer_is_a_500_and_optional_is_none() {
    let app = Router::new()
        .route("/need", post(|_k: IdempotencyKey| async { "unreachable" }))
        .route(
            "/maybe",
            post(|k: Option<IdempotencyKey>| async move { format!("{k:?}") }),
        );
    let need = app
        .clone()
        .oneshot(post_req("/need", Some("k")))
        .await
        .unwrap();
    assert_eq!(need.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let maybe = app.oneshot(post_req("/maybe", Some("k"))).await.unwrap();
    assert_eq!(text(maybe).await, "None");
}

#[tokio::test]
async fn plain_hyper_server_over_loopback() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use tower::Layer;

    let calls = Arc::new(AtomicUsize::new(0));
    let svc = {
        let calls = calls.clone();
        IdempotencyLayer::new(MemoryStore::new()).layer(tower::service_fn(
            move |_req: Request<tower_idempotency::body::RequestBody<hyper::body::Incoming>>| {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                        format!("call #{n}"),
                    ))))
                }
            },
        ))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = hyper_util::service::TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });

    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let send = |key: &str| {
        let req = Request::post(format!("http://{addr}/x"))
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from("body")))
            .unwrap();
        client.request(req)
    };
    let first = send("k").await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let again = send("k").await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let body = again.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "call #1");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    server.abort();
}
