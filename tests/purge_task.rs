//! The periodic purge task.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::time::Duration;

use http::Request;
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, IdempotencyKey, MemoryStore, Store, fingerprint::fingerprint,
    spawn_purge_task,
};

#[tokio::test(start_paused = true)]
async fn purge_task_deletes_expired_keys_periodically() {
    let store = MemoryStore::new();
    let parts = Request::post("/p").body(()).unwrap().into_parts().0;
    for i in 0..5 {
        let key = IdempotencyKey::parse(&format!("k{i}")).unwrap();
        let claim = ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: fingerprint(&parts, &[], b""),
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(10 + i),
        };
        assert!(matches!(
            store.claim(claim).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }
    let task = spawn_purge_task(store.clone(), Duration::from_secs(5), 2).unwrap();
    tokio::time::sleep(Duration::from_secs(12)).await;
    // Ticks at 0, 5 and 10 s: the one at 10 s deleted the key that expired at 10 s only.
    assert_eq!(store.len(), 4);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(store.len(), 0);
    task.abort();
}

/// Outside a Tokio runtime the purge task is refused at the call, not started as a task that
/// could not run.
#[test]
fn outside_a_runtime_the_purge_task_is_refused() {
    let err = spawn_purge_task(MemoryStore::new(), Duration::from_secs(1), 10).unwrap_err();
    assert_eq!(err, tower_idempotency::ConfigError::NoRuntime);
}
