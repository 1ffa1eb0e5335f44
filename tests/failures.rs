//! Plain mode when the store fails after the handler ran: the client gets the handler's real
//! answer (never a 500 or 503 for work that was done), and the key is left to its lease, so a
//! retry cannot run the handler again while the store is failing.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::IdempotencyLayer;

/// The store fails as the answer is stored: the client gets the handler's `201`; a retry
/// within the lease gets `409` (the handler does not run again); after the lease, with the
/// store back, the retry runs the handler again — the window plain mode documents, which a
/// derived key closes for work that leaves the process.
#[tokio::test(start_paused = true)]
async fn a_failed_completion_still_answers_and_leaves_the_key_to_its_lease() {
    let calls = Calls::default();
    let store = support::Faulty::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_secs(30))
        .layer(support::handler(calls.clone()));
    let send = || svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"));

    store.writes_fail.store(true, Ordering::SeqCst);
    let first = read(send().await.unwrap()).await;
    assert_eq!(
        first.status,
        201,
        "the handler's real answer: {}",
        first.text()
    );
    assert!(!first.replayed());
    assert_eq!(calls.get("/pay"), 1);

    store.writes_fail.store(false, Ordering::SeqCst);
    let during = read(send().await.unwrap()).await;
    during.assert_problem(409, "request-in-progress");
    assert_eq!(calls.get("/pay"), 1, "not run again within the lease");

    tokio::time::advance(Duration::from_secs(31)).await;
    let after = read(send().await.unwrap()).await;
    assert_eq!(after.status, 201);
    assert_eq!(
        calls.get("/pay"),
        2,
        "after the lease the key is taken over"
    );
    let replay = read(send().await.unwrap()).await;
    assert!(replay.replayed());
    assert_eq!(calls.get("/pay"), 2);
}

/// The store fails as a `5xx` answer releases the key: the client gets the `5xx`; the key
/// stays claimed until its lease runs out (a retry meanwhile is `409`), then runs again.
#[tokio::test(start_paused = true)]
async fn a_failed_release_still_answers_and_the_lease_frees_the_key() {
    let calls = Calls::default();
    let store = support::Faulty::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_secs(30))
        .layer(support::handler(calls.clone()));
    let send = || svc.clone().oneshot(req("POST", "/fail", Some("k"), "b"));

    store.writes_fail.store(true, Ordering::SeqCst);
    let first = read(send().await.unwrap()).await;
    assert_eq!(first.status, 500, "the handler's real answer");
    store.writes_fail.store(false, Ordering::SeqCst);
    read(send().await.unwrap())
        .await
        .assert_problem(409, "request-in-progress");
    assert_eq!(calls.get("/fail"), 1);

    tokio::time::advance(Duration::from_secs(31)).await;
    let after = read(send().await.unwrap()).await;
    assert_eq!(after.status, 500);
    assert_eq!(calls.get("/fail"), 2);
}
