//! The duplicate-injection kit (`testing::duplicates`) on real code: the inbox's `Consumer`
//! on Postgres and the layer in front of a handler pass it; a consumer without an inbox and a
//! layer that fingerprints raw bytes are caught by it.
#![cfg(all(feature = "testing", feature = "postgres", feature = "json"))]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use sqlx::PgConnection;
use support::PgSchema;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::inbox::{Consumer, Inbox, Message};
use tower_idempotency::testing::duplicates::{self, Answer, Attempt};
use tower_idempotency::{IdempotencyLayer, JsonFingerprint, MemoryStore};

async fn consumer() -> (PgSchema, Consumer) {
    let schema = PgSchema::new().await;
    let inbox = Inbox::new(schema.pool(16).await);
    inbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE ledger (message_id text NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();
    (schema, Consumer::new(inbox, "kit").unwrap())
}

async fn ledger(consumer: &Consumer, id: &str) -> usize {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE message_id = $1")
        .bind(id)
        .fetch_one(consumer.inbox().pool())
        .await
        .unwrap();
    usize::try_from(n).unwrap()
}

#[tokio::test]
async fn the_consumer_passes_every_message_check() {
    let (schema, consumer) = consumer().await;
    for (check, id) in [("twice", "m1"), ("lost-ack", "m2"), ("concurrently", "m3")] {
        let deliver = async |attempt: Attempt| {
            let message = Message::new(Some(id)).redelivered(attempt.redelivered);
            let _ = consumer
                .deliver(
                    &message,
                    async || Ok::<_, sqlx::Error>(()),
                    async |tx: &mut PgConnection, ()| {
                        sqlx::query("INSERT INTO ledger VALUES ($1)")
                            .bind(id)
                            .execute(tx)
                            .await
                            .map(drop)
                    },
                )
                .await;
        };
        let probe = async || ledger(&consumer, id).await;
        let checked = match check {
            "twice" => duplicates::message_twice(&deliver, &probe).await,
            "lost-ack" => duplicates::message_after_a_lost_ack(&deliver, &probe).await,
            _ => duplicates::message_concurrently(10, &deliver, &probe).await,
        };
        checked.unwrap_or_else(|e| panic!("{check}: {e}"));
    }
    consumer.inbox().pool().close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_consumer_without_the_inbox_is_caught() {
    let applied = AtomicUsize::new(0);
    let deliver = async |_: Attempt| {
        applied.fetch_add(1, Ordering::SeqCst);
    };
    let probe = async || applied.load(Ordering::SeqCst);
    let failure = duplicates::message_twice(&deliver, &probe)
        .await
        .unwrap_err();
    assert_eq!(failure.check, "message_twice");
    assert!(failure.detail.contains("2 times"), "{failure}");
}

/// A handler behind the layer: it signals that it started, waits `delay`, then makes its
/// effect (counted) and answers `201` with the count.
fn service(
    layer: IdempotencyLayer<MemoryStore>,
    effects: Arc<AtomicUsize>,
    started: Arc<tokio::sync::Notify>,
    delay: Duration,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<impl http_body::Body<Data = Bytes, Error = impl std::fmt::Debug>>,
    Error = impl std::fmt::Debug,
    Future = impl Send,
> + Clone {
    let handler = tower::service_fn(move |_req: Request<_>| {
        let effects = effects.clone();
        let started = started.clone();
        async move {
            started.notify_one();
            tokio::time::sleep(delay).await;
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, Infallible>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Full::new(Bytes::from(format!("{{\"effect\":{n}}}"))))
                    .unwrap(),
            )
        }
    });
    layer.layer(handler)
}

async fn send_with<S, B>(svc: &S, key: &str, body: Bytes) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let request = Request::post("/charges")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let response = svc.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer { status, body }
}

#[tokio::test]
async fn the_layer_passes_every_request_check() {
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).with_json_fingerprint(JsonFingerprint::new());
    let effects = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = service(
        layer,
        effects.clone(),
        started.clone(),
        Duration::from_millis(50),
    );
    let body = Bytes::from_static(br#"{"amount": 5, "currency": "EUR"}"#);
    let reordered = Bytes::from_static(br#"{ "currency":"EUR","amount":5 }"#);

    let base = effects.load(Ordering::SeqCst);
    let send = async |b: Bytes| send_with(&svc, "k-twice", b).await;
    let probe = async || effects.load(Ordering::SeqCst) - base;
    duplicates::request_twice(&send, body.clone(), &probe)
        .await
        .unwrap();

    let base = effects.load(Ordering::SeqCst);
    let send = async |b: Bytes| send_with(&svc, "k-concurrent", b).await;
    let probe = async || effects.load(Ordering::SeqCst) - base;
    duplicates::request_concurrently(10, &send, body.clone(), &probe)
        .await
        .unwrap();

    let base = effects.load(Ordering::SeqCst);
    let send = async |b: Bytes| send_with(&svc, "k-reordered", b).await;
    let probe = async || effects.load(Ordering::SeqCst) - base;
    duplicates::request_with_reordered_json(&send, body.clone(), reordered, &probe)
        .await
        .unwrap();

    let base = effects.load(Ordering::SeqCst);
    let send = async |b: Bytes| send_with(&svc, "k-dropped", b).await;
    let probe = async || effects.load(Ordering::SeqCst) - base;
    duplicates::request_with_first_answer_dropped(&send, body, started.notified(), &probe, 50)
        .await
        .unwrap();
}

/// A first request that never answers, with a `started` signal that never comes (a handler
/// that does not give it), fails the check at its bound instead of hanging.
#[tokio::test(start_paused = true)]
async fn a_first_request_never_answered_nor_seen_running_fails_instead_of_hanging() {
    let send = async |_: Bytes| std::future::pending::<Answer>().await;
    let probe = async || 0;
    let check = duplicates::request_with_first_answer_dropped(
        &send,
        Bytes::from_static(b"{}"),
        std::future::pending::<()>(),
        &probe,
        1,
    );
    let failure = tokio::time::timeout(Duration::from_secs(3600), check)
        .await
        .expect("the check hung")
        .unwrap_err();
    assert_eq!(failure.check, "request_with_first_answer_dropped");
    assert!(
        failure.detail.contains("neither answered nor seen running"),
        "{failure}"
    );
}

#[tokio::test]
async fn a_layer_that_fingerprints_raw_bytes_is_caught_by_the_reordered_json_check() {
    let effects = Arc::new(AtomicUsize::new(0));
    let svc = service(
        IdempotencyLayer::new(MemoryStore::new()),
        effects.clone(),
        Arc::new(tokio::sync::Notify::new()),
        Duration::ZERO,
    );
    let send = async |b: Bytes| send_with(&svc, "k", b).await;
    let probe = async || effects.load(Ordering::SeqCst);
    let failure = duplicates::request_with_reordered_json(
        &send,
        Bytes::from_static(br#"{"a":1,"b":2}"#),
        Bytes::from_static(br#"{"b":2,"a":1}"#),
        &probe,
    )
    .await
    .unwrap_err();
    assert!(failure.detail.contains("422"), "{failure}");
}
