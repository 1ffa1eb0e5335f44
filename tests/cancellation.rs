//! A request dropped after its handler finished must not let a retry run the handler again.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, IdempotencyKey, IdempotencyLayer, LeaseToken, MemoryStore, Store,
    StoreError, StoredResponse,
};

/// A memory store whose `complete` is slow, to drop the request while the answer is stored.
#[derive(Clone, Default)]
struct SlowComplete(MemoryStore);

impl Store for SlowComplete {
    async fn claim(&self, r: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.0.claim(r).await
    }
    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.0.complete(scope, key, token, response, ttl).await
    }
    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        self.0.release(scope, key, token).await
    }
    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.0.renew(scope, key, token, lease).await
    }
    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        self.0.purge_expired(batch_size).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_request_while_the_answer_is_stored_keeps_the_answer() {
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(SlowComplete::default()).layer(support::handler(calls.clone()));
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    while calls.get("/pay") == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The handler ran; the answer is being stored. The client goes away.
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The key must not have been released: a retry is a 409, then a replay, never a rerun.
    let started = std::time::Instant::now();
    loop {
        let a = read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await;
        if a.replayed() {
            assert_eq!(a.status, 201);
            break;
        }
        a.assert_problem(409, "request-in-progress");
        assert!(started.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(calls.get("/pay"), 1, "the handler ran once");
}
