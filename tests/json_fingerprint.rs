//! JSON fingerprints through the real layer (memory store): a retry whose JSON is the same
//! object is a replay, another value is `422`; excluded fields and headers do not count;
//! bodies that are not JSON are compared by their bytes; a fingerprint function is used.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_idempotency::body::RequestBody;
use tower_idempotency::{Fingerprint, IdempotencyLayer, JsonFingerprint, MemoryStore};

/// A service behind `layer` whose handler counts its runs and answers `201` with the run's
/// number.
fn app(
    layer: IdempotencyLayer<MemoryStore>,
) -> (
    impl Service<
        Request<Full<Bytes>>,
        Response = Response<impl http_body::Body<Data = Bytes, Error = impl std::fmt::Debug>>,
        Error = Infallible,
    > + Clone,
    Arc<AtomicUsize>,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let svc = layer.with_shared_scope().layer(service_fn(
        move |req: Request<RequestBody<Full<Bytes>>>| {
            let counter = counter.clone();
            async move {
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let mut res =
                    Response::new(Full::new(Bytes::from(format!("run {n}: {}", body.len()))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        },
    ));
    (svc, runs)
}

fn post(
    key: &str,
    content_type: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> Request<Full<Bytes>> {
    let mut req = Request::post("/payments").header("idempotency-key", key);
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

async fn send<S, B>(svc: &S, req: Request<Full<Bytes>>) -> (StatusCode, bool, Bytes)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

const JSON: Option<&str> = Some("application/json");

#[tokio::test]
async fn reordered_members_and_whitespace_are_a_replay_and_another_value_is_422() {
    let (svc, runs) = app(
        IdempotencyLayer::new(MemoryStore::new()).with_json_fingerprint(JsonFingerprint::new())
    );
    let first = send(
        &svc,
        post(
            "k",
            JSON,
            &[],
            r#"{"order_id":1,"amount":{"cents":500,"currency":"EUR"}}"#,
        ),
    )
    .await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
    let again = send(
        &svc,
        post(
            "k",
            Some("application/json; charset=utf-8"),
            &[],
            "{ \"amount\" : {\"currency\":\"EUR\", \"cents\": 5.00e2},\n\t\"order_id\" : 1 }",
        ),
    )
    .await;
    assert_eq!((again.0, again.1), (StatusCode::CREATED, true));
    assert_eq!(
        again.2, first.2,
        "the replay is the first answer byte for byte"
    );
    let other = send(
        &svc,
        post(
            "k",
            JSON,
            &[],
            r#"{"order_id":1,"amount":{"cents":501,"currency":"EUR"}}"#,
        ),
    )
    .await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    // Amounts a double cannot tell apart are still two amounts.
    send(
        &svc,
        post("big", JSON, &[], r#"{"cents":9007199254740992}"#),
    )
    .await;
    let big = send(
        &svc,
        post("big", JSON, &[], r#"{"cents":9007199254740993}"#),
    )
    .await;
    assert_eq!(big.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn excluded_fields_and_headers_do_not_count() {
    let json = JsonFingerprint::new()
        .exclude("/metadata/request_id")
        .unwrap()
        .exclude_header(HeaderName::from_static("webhook-timestamp"));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_fingerprint_headers([
            HeaderName::from_static("webhook-timestamp"),
            HeaderName::from_static("x-api-version"),
        ])
        .with_json_fingerprint(json);
    let (svc, runs) = app(layer);
    let first = send(
        &svc,
        post(
            "w",
            Some("application/vnd.event+json"),
            &[("webhook-timestamp", "1"), ("x-api-version", "2")],
            r#"{"event":"paid","metadata":{"request_id":"a","source":"x"}}"#,
        ),
    )
    .await;
    assert!(!first.1);
    let retry = send(
        &svc,
        post(
            "w",
            Some("application/vnd.event+json"),
            &[("webhook-timestamp", "2"), ("x-api-version", "2")],
            r#"{"metadata":{"source":"x","request_id":"b"},"event":"paid"}"#,
        ),
    )
    .await;
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, true));
    // A header named and not excluded still counts; a field not excluded still counts.
    let version = send(
        &svc,
        post(
            "w",
            Some("application/vnd.event+json"),
            &[("webhook-timestamp", "2"), ("x-api-version", "3")],
            r#"{"event":"paid","metadata":{"request_id":"a","source":"x"}}"#,
        ),
    )
    .await;
    assert_eq!(version.0, StatusCode::UNPROCESSABLE_ENTITY);
    let source = send(
        &svc,
        post(
            "w",
            Some("application/vnd.event+json"),
            &[("webhook-timestamp", "1"), ("x-api-version", "2")],
            r#"{"event":"paid","metadata":{"request_id":"a","source":"y"}}"#,
        ),
    )
    .await;
    assert_eq!(source.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn invalid_json_and_other_content_types_fall_back_to_the_raw_bytes() {
    let (svc, runs) = app(
        IdempotencyLayer::new(MemoryStore::new()).with_json_fingerprint(JsonFingerprint::new())
    );
    // Invalid JSON (a duplicate member): identical bytes replay, other bytes are 422.
    send(&svc, post("bad", JSON, &[], r#"{"a":1,"a":2}"#)).await;
    assert!(
        send(&svc, post("bad", JSON, &[], r#"{"a":1,"a":2}"#))
            .await
            .1
    );
    assert_eq!(
        send(&svc, post("bad", JSON, &[], r#"{"a":1, "a":2}"#))
            .await
            .0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // Not a JSON content type: compared by bytes, even when the body is JSON.
    send(
        &svc,
        post("text", Some("text/plain"), &[], r#"{"a":1,"b":2}"#),
    )
    .await;
    assert!(
        send(
            &svc,
            post("text", Some("text/plain"), &[], r#"{"a":1,"b":2}"#)
        )
        .await
        .1
    );
    assert_eq!(
        send(
            &svc,
            post("text", Some("text/plain"), &[], r#"{"b":2,"a":1}"#)
        )
        .await
        .0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // The fallback is the raw fingerprint itself, so keys stored before stay valid.
    let (parts, ()) = Request::post("/p")
        .header("content-type", "text/plain")
        .body(())
        .unwrap()
        .into_parts();
    assert_eq!(
        JsonFingerprint::new().fingerprint(&parts, &[], b"{}"),
        tower_idempotency::fingerprint::fingerprint(&parts, &[], b"{}")
    );
}

#[tokio::test]
async fn any_content_type_reads_every_body_as_json() {
    let (svc, runs) = app(IdempotencyLayer::new(MemoryStore::new())
        .with_json_fingerprint(JsonFingerprint::new().with_any_content_type()));
    send(&svc, post("k", None, &[], r#"{"a":1,"b":2}"#)).await;
    assert!(
        send(
            &svc,
            post(
                "k",
                Some("application/x-www-form-urlencoded"),
                &[],
                r#"{ "b":2, "a":1 }"#
            )
        )
        .await
        .1
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_fingerprint_function_is_used() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint_fn(|_parts, body| {
        // Only the body's length counts.
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&(body.len() as u64).to_be_bytes());
        Fingerprint::from_bytes(bytes)
    });
    let (svc, runs) = app(layer);
    send(&svc, post("f", None, &[], "abc")).await;
    assert!(send(&svc, post("f", None, &[], "xyz")).await.1);
    assert_eq!(
        send(&svc, post("f", None, &[], "abcd")).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn an_invalid_pointer_is_an_error() {
    let err = JsonFingerprint::new().exclude("metadata").unwrap_err();
    assert_eq!(err.pointer(), "metadata");
    assert!(JsonFingerprint::new().exclude("/a~2").is_err());
    assert!(JsonFingerprint::new().exclude("/a~1b/0").is_ok());
}
