//! Which response headers are replayed: the default (credential-like ones never), an
//! allowlist, a denylist; and a CORS layer that lets browsers read `Idempotent-Replayed`.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::convert::Infallible;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt, service_fn};
use tower_http::cors::CorsLayer;
use tower_idempotency::body::RequestBody;
use tower_idempotency::{IDEMPOTENT_REPLAYED, IdempotencyLayer, MemoryStore, ReplayedHeaders};

/// A handler that answers `201` with a content type, a location, a request id, and the
/// credential-like headers.
async fn handler(
    _req: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut res = Response::new(Full::new(Bytes::from_static(b"{\"id\":1}")));
    *res.status_mut() = StatusCode::CREATED;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::LOCATION, HeaderValue::from_static("/payments/1"));
    h.insert("x-request-id", HeaderValue::from_static("first"));
    h.insert(
        "authentication-info",
        HeaderValue::from_static("nextnonce=\"n\""),
    );
    h.insert(
        "proxy-authentication-info",
        HeaderValue::from_static("nextnonce=\"p\""),
    );
    h.insert(header::SET_COOKIE, HeaderValue::from_static("session=s"));
    Ok(res)
}

fn req() -> Request<Full<Bytes>> {
    Request::post("/pay")
        .header("idempotency-key", "k")
        .header(header::ORIGIN, "https://shop.example")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// The replay of the layer's answer, after the first request.
async fn replay(layer: IdempotencyLayer<MemoryStore>) -> Response<Bytes> {
    let svc = layer.layer(service_fn(handler));
    let first = svc.clone().oneshot(req()).await.unwrap();
    assert!(
        first.headers().contains_key("authentication-info"),
        "the first answer is whole"
    );
    let again = svc.oneshot(req()).await.unwrap();
    let (parts, body) = again.into_parts();
    Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
}

#[tokio::test]
async fn credential_like_headers_are_never_replayed_by_default() {
    let again = replay(IdempotencyLayer::new(MemoryStore::new())).await;
    assert_eq!(again.headers()[&IDEMPOTENT_REPLAYED], "true");
    for gone in [
        "authentication-info",
        "proxy-authentication-info",
        "set-cookie",
    ] {
        assert!(!again.headers().contains_key(gone), "{gone} was replayed");
    }
    for kept in ["content-type", "location", "x-request-id"] {
        assert!(
            again.headers().contains_key(kept),
            "{kept} was not replayed"
        );
    }
}

#[tokio::test]
async fn an_allowlist_replays_only_its_headers_and_the_content_type() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_replayed_headers(ReplayedHeaders::only([header::LOCATION]));
    let again = replay(layer).await;
    let mut names: Vec<_> = again.headers().keys().map(HeaderName::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["content-type", "idempotent-replayed", "location"]);
    assert_eq!(again.body(), "{\"id\":1}");
}

#[tokio::test]
async fn a_denylist_drops_its_headers() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_replayed_headers(
        ReplayedHeaders::all_but([HeaderName::from_static("x-request-id")]),
    );
    let again = replay(layer).await;
    assert!(!again.headers().contains_key("x-request-id"));
    assert!(again.headers().contains_key(header::LOCATION));
    assert!(!again.headers().contains_key("authentication-info"));
}

/// Browsers show a cross-origin script only the response headers that CORS exposes: a CORS
/// layer outside the idempotency layer, exposing `Idempotent-Replayed`, lets a web client see
/// that its retry was a replay (README, "Layer ordering").
#[tokio::test]
async fn cors_exposes_idempotent_replayed_to_browsers() {
    let cors = CorsLayer::new()
        .allow_origin(HeaderValue::from_static("https://shop.example"))
        .allow_methods([http::Method::POST])
        .allow_headers([
            HeaderName::from_static("idempotency-key"),
            header::CONTENT_TYPE,
        ])
        .expose_headers([IDEMPOTENT_REPLAYED]);
    let app = Router::new()
        .route("/pay", post(|| async { (StatusCode::CREATED, "paid") }))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(cors);
    let first = app.clone().oneshot(req()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = app.clone().oneshot(req()).await.unwrap();
    assert_eq!(again.headers()[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(
        again.headers()[header::ACCESS_CONTROL_EXPOSE_HEADERS],
        "idempotent-replayed"
    );
    assert_eq!(
        again.headers()[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://shop.example"
    );
    // The preflight of a keyed POST is answered by the CORS layer: it never reaches the
    // idempotency layer (OPTIONS is not covered anyway).
    let preflight = Request::options("/pay")
        .header(header::ORIGIN, "https://shop.example")
        .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
        .header(header::ACCESS_CONTROL_REQUEST_HEADERS, "idempotency-key")
        .body(axum::body::Body::empty())
        .unwrap();
    let pre = app.oneshot(preflight).await.unwrap();
    assert!(pre.status().is_success());
    let allowed = pre.headers()[header::ACCESS_CONTROL_ALLOW_HEADERS]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(allowed.contains("idempotency-key"), "{allowed}");
}
