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

/// A claim the store does not answer within the layer's store timeout is answered `503`
/// at that bound (not whenever the store gets round to it), and the handler does not run.
/// The claim may still have been made (here it was: the store answers late): a retry then
/// finds the key in flight, and after its lease runs out the handler runs — once.
#[tokio::test(start_paused = true)]
async fn a_claim_slower_than_the_store_timeout_is_503_at_the_bound_and_runs_once_later() {
    let calls = Calls::default();
    let store = support::Faulty::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_store_timeout(Duration::from_secs(2))
        .with_lease(Duration::from_secs(10))
        .layer(support::handler(calls.clone()));
    let send = || svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"));

    store.claim_delay_ms.store(60_000, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let first = read(send().await.unwrap()).await;
    first.assert_problem(503, "store-unavailable");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_millis(2100),
        "answered after {waited:?}, not at the 2 s bound"
    );
    let retry_after: u64 = first.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(calls.total(), 0, "the handler must not run without a claim");

    store.claim_delay_ms.store(0, Ordering::SeqCst);
    let during = read(send().await.unwrap()).await;
    during.assert_problem(409, "request-in-progress");
    tokio::time::sleep(Duration::from_secs(11)).await;
    let after = read(send().await.unwrap()).await;
    assert_eq!(after.status, 201, "{}", after.text());
    let replay = read(send().await.unwrap()).await;
    assert!(replay.replayed());
    assert_eq!(calls.get("/pay"), 1, "the handler ran exactly once");
}

/// Storing the answer takes longer than the store timeout: the client gets the handler's
/// answer at the bound, nothing half-stored is left (the store call was dropped whole), and
/// the key waits for its lease: a retry meanwhile gets `409`, never a second run.
#[tokio::test(start_paused = true)]
async fn a_completion_slower_than_the_store_timeout_still_answers_at_the_bound() {
    let calls = Calls::default();
    let store = support::Faulty::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_store_timeout(Duration::from_secs(2))
        .with_lease(Duration::from_secs(30))
        .layer(support::handler(calls.clone()));
    let send = || svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"));

    store.complete_delay_ms.store(60_000, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let first = read(send().await.unwrap()).await;
    assert_eq!(first.status, 201, "the handler's answer: {}", first.text());
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(2100),
        "the answer waited {waited:?} for the store"
    );
    store.complete_delay_ms.store(0, Ordering::SeqCst);
    let retry = read(send().await.unwrap()).await;
    retry.assert_problem(409, "request-in-progress");
    assert_eq!(calls.get("/pay"), 1);
}
