//! The protocol at its edges, through the layer on the memory store: what the problem documents
//! name, how a body of many small frames is kept, response trailers, and `Retry-After` while
//! the first request runs.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::{Layer, ServiceExt, service_fn};
use tower_idempotency::body::RequestBody;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// A body made of the frames given, in order.
struct Frames(VecDeque<Frame<Bytes>>);

impl Frames {
    fn data(chunks: impl IntoIterator<Item = Bytes>) -> Self {
        Frames(chunks.into_iter().map(Frame::data).collect())
    }

    fn with_trailers(mut self, trailers: HeaderMap) -> Self {
        self.0.push_back(Frame::trailers(trailers));
        self
    }
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// A response read in full, trailers included.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Answer {
    fn problem(&self) -> serde_json::Value {
        assert_eq!(self.headers["content-type"], "application/problem+json");
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn read<B: Body<Data = Bytes>>(res: Response<B>) -> Answer
where
    B::Error: std::fmt::Debug,
{
    let (parts, body) = res.into_parts();
    let collected = body.collect().await.unwrap();
    Answer {
        status: parts.status,
        headers: parts.headers,
        trailers: collected.trailers().cloned(),
        body: collected.to_bytes(),
    }
}

fn post(headers: &[(&str, &str)], body: Frames) -> Request<Frames> {
    let mut req = Request::post("/pay");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(body).unwrap()
}

/// Sends one request through `layer` in front of a handler that answers `201` with the
/// request body's text.
async fn send(layer: &IdempotencyLayer<MemoryStore>, req: Request<Frames>) -> Answer {
    let handler = service_fn(|req: Request<RequestBody<Frames>>| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let mut res = Response::new(Frames::data([body]));
        *res.status_mut() = StatusCode::CREATED;
        Ok::<_, Infallible>(res)
    });
    read(layer.layer(handler).oneshot(req).await.unwrap()).await
}

// --- The problem documents name where the key is read from -------------------------------

#[tokio::test]
async fn a_missing_key_names_the_default_header() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let answer = send(&layer, post(&[], Frames::data([]))).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    let problem = answer.problem();
    assert!(problem["type"].as_str().unwrap().ends_with("#missing-key"));
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("Idempotency-Key"), "{detail}");
}

#[tokio::test]
async fn a_webhook_layer_names_its_header_when_the_key_is_missing_bad_or_repeated() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_header(HeaderName::from_static("webhook-id"));
    let cases = [
        (vec![], "missing-key"),
        (vec![("webhook-id", "a b")], "invalid-key"),
        (
            vec![("webhook-id", "msg_1"), ("webhook-id", "msg_2")],
            "multiple-keys",
        ),
    ];
    for (headers, code) in cases {
        let answer = send(&layer, post(&headers, Frames::data([]))).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{code}");
        let problem = answer.problem();
        assert!(
            problem["type"].as_str().unwrap().ends_with(code),
            "{problem}"
        );
        let text = format!("{} {}", problem["title"], problem["detail"]);
        assert!(text.contains("webhook-id"), "{code}: {text}");
        assert!(!text.contains("Idempotency-Key"), "{code}: {text}");
    }
}

#[tokio::test]
async fn a_key_function_is_named_as_the_source_of_the_key() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_from(|parts| {
        let id = parts.headers.get("x-delivery")?.to_str().ok()?;
        Some(format!("delivery {id}"))
    });
    let missing = send(&layer, post(&[], Frames::data([]))).await;
    let invalid = send(&layer, post(&[("x-delivery", "1")], Frames::data([]))).await;
    for (answer, code) in [(missing, "missing-key"), (invalid, "invalid-key")] {
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{code}");
        let problem = answer.problem();
        assert!(
            problem["type"].as_str().unwrap().ends_with(code),
            "{problem}"
        );
        let text = format!("{} {}", problem["title"], problem["detail"]);
        assert!(!text.contains("Idempotency-Key"), "{code}: {text}");
        assert!(text.contains("derives from the request"), "{code}: {text}");
    }
    // Quoted, the same text is a key.
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_from(|parts| {
        let id = parts.headers.get("x-delivery")?.to_str().ok()?;
        Some(format!("\"delivery {id}\""))
    });
    let ok = send(&layer, post(&[("x-delivery", "1")], Frames::data([]))).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

// --- Keys with spaces, end to end -----------------------------------------------------------

#[tokio::test]
async fn a_quoted_key_with_spaces_is_a_key_and_its_retry_is_replayed() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let body = || Frames::data([Bytes::from_static(b"x")]);
    let first = send(&layer, post(&[("idempotency-key", "\"a b\"")], body())).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&layer, post(&[("idempotency-key", "\"a b\"")], body())).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    // The bare form stays strict.
    let bare = send(&layer, post(&[("idempotency-key", "a b")], body())).await;
    assert_eq!(bare.status, StatusCode::BAD_REQUEST);
}

// --- A body of many small frames --------------------------------------------------------------

#[tokio::test]
async fn a_body_of_one_byte_frames_reaches_the_handler_whole_in_few_frames() {
    const LEN: usize = 200_000;
    let bytes: Bytes = (0..LEN).map(|i| u8::try_from(i % 251).unwrap()).collect();
    let calls = Arc::new(AtomicUsize::new(0));
    let frames_seen = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (calls, frames_seen) = (calls.clone(), frames_seen.clone());
        service_fn(move |req: Request<RequestBody<Frames>>| {
            let (calls, frames_seen) = (calls.clone(), frames_seen.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let mut body = req.into_body();
                let mut seen = Vec::new();
                while let Some(frame) = body.frame().await {
                    let data = frame.unwrap().into_data().unwrap();
                    frames_seen.fetch_add(1, Ordering::SeqCst);
                    seen.extend_from_slice(&data);
                }
                let mut res = Response::new(Frames::data([Bytes::from(seen)]));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
    let one_byte_frames = Frames::data((0..LEN).map(|i| bytes.slice(i..=i)));

    let first = read(
        svc.clone()
            .oneshot(post(&[("idempotency-key", "k")], one_byte_frames))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.body == bytes, "the handler saw other bytes");
    // The first frame as it came, then the copied small frames in buffers of up to 64 KiB.
    let frames = frames_seen.load(Ordering::SeqCst);
    assert!((2..=8).contains(&frames), "{frames} frames");

    // The fingerprint does not depend on how the body was framed: the same bytes in one frame
    // are a retry of the same request.
    let again = read(
        svc.oneshot(post(
            &[("idempotency-key", "k")],
            Frames::data([bytes.clone()]),
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert!(again.body == bytes);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// --- Response trailers --------------------------------------------------------------------------

/// Trailers are stored with the answer and replayed after its body, byte for byte: a gRPC
/// call's outcome (`grpc-status`) travels in them. (With or without a body.)
#[tokio::test]
async fn trailers_are_stored_and_replayed_after_the_body() {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("grpc-message", HeaderValue::from_static("ok"));
    for data in [&b"answer"[..], b""] {
        let calls = Arc::new(AtomicUsize::new(0));
        let handler = {
            let trailers = trailers.clone();
            let calls = calls.clone();
            service_fn(move |_: Request<RequestBody<Frames>>| {
                calls.fetch_add(1, Ordering::SeqCst);
                let body = Frames::data([Bytes::from_static(data)]).with_trailers(trailers.clone());
                let mut res = Response::new(body);
                res.headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
                async move { Ok::<_, Infallible>(res) }
            })
        };
        let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
        let req = || post(&[("idempotency-key", "k")], Frames::data([]));

        let first = read(svc.clone().oneshot(req()).await.unwrap()).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(first.body, data);
        assert_eq!(first.trailers.as_ref(), Some(&trailers), "{data:?}");

        let again = read(svc.oneshot(req()).await.unwrap()).await;
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(again.headers["content-type"], "application/grpc");
        assert_eq!(again.body, data);
        assert_eq!(again.trailers.as_ref(), Some(&trailers), "{data:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// A gRPC call is answered `200` whatever its outcome; the layer stores it or not on the
/// status its `grpc-status` stands for. `UNAVAILABLE` (in the trailers, or in the headers of
/// a trailers-only answer) and `RESOURCE_EXHAUSTED` are not stored, like a `503` and a `429`:
/// the retry runs the handler again. `NOT_FOUND` is stored, like a `404`.
#[tokio::test]
async fn grpc_answers_are_stored_or_not_on_their_grpc_status() {
    for (code, trailers_only, stored) in [
        ("14", false, false),
        ("14", true, false),
        ("8", false, false),
        ("1", false, false),
        ("5", false, true),
        ("0", false, true),
    ] {
        let calls = Arc::new(AtomicUsize::new(0));
        let handler = {
            let calls = calls.clone();
            service_fn(move |_: Request<RequestBody<Frames>>| {
                calls.fetch_add(1, Ordering::SeqCst);
                let mut outcome = HeaderMap::new();
                outcome.insert("grpc-status", HeaderValue::from_static(code));
                let mut res = if trailers_only {
                    let mut res = Response::new(Frames::data([]));
                    res.headers_mut().extend(outcome);
                    res
                } else {
                    Response::new(
                        Frames::data([Bytes::from_static(b"\0\0\0\0\0")]).with_trailers(outcome),
                    )
                };
                res.headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
                async move { Ok::<_, Infallible>(res) }
            })
        };
        let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
        let req = || post(&[("idempotency-key", "k")], Frames::data([]));
        let first = read(svc.clone().oneshot(req()).await.unwrap()).await;
        assert_eq!(first.status, StatusCode::OK);
        let again = read(svc.oneshot(req()).await.unwrap()).await;
        let label = format!("grpc-status {code}, trailers-only {trailers_only}");
        assert_eq!(
            again.headers.contains_key("idempotent-replayed"),
            stored,
            "{label}"
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            if stored { 1 } else { 2 },
            "{label}"
        );
    }
}

// --- Retry-After while the first request runs ------------------------------------------------

#[tokio::test]
async fn a_409_while_a_long_lease_runs_says_retry_after_one_second() {
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (entered, release) = (entered.clone(), release.clone());
        service_fn(move |_: Request<RequestBody<Frames>>| {
            let (entered, release) = (entered.clone(), release.clone());
            async move {
                entered.notify_one();
                release.notified().await;
                Ok::<_, Infallible>(Response::new(Frames::data([Bytes::from_static(b"done")])))
            }
        })
    };
    // The default lease, 30 s: the old hint was all of what was left of it.
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
    let req = || post(&[("idempotency-key", "k")], Frames::data([]));

    let first = tokio::spawn(svc.clone().oneshot(req()));
    entered.notified().await;
    let second = read(svc.clone().oneshot(req()).await.unwrap()).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    let problem = second.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("#request-in-progress")
    );
    assert_eq!(second.headers["retry-after"], "1");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("Retry after 1 s"), "{detail}");

    release.notify_one();
    let first = read(first.await.unwrap().unwrap()).await;
    assert_eq!(first.body, "done");
}
