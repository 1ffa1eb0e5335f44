//! The public store conformance suite (`tower_idempotency::testing`, feature `testing`) run
//! against this crate's stores, through exactly the API a store author calls.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use support::PgSchema;
use tower_idempotency::{MemoryStore, PostgresStore, testing};

/// Every check the suite has: a store that passes them all passes each of them.
const ALL: [&str; 12] = [
    "claim_complete_replay",
    "in_flight_and_mismatch",
    "scopes_are_independent",
    "answer_without_body",
    "release_frees_the_key",
    "racing_claims_acquire_once",
    "takeover_fences_the_old_token",
    "renewal_keeps_the_key",
    "completed_record_expires_after_its_ttl",
    "tokens_are_never_reused",
    "purge_removes_expired_records",
    "watch_wakes_on_complete_and_release",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_conforms() {
    let store = MemoryStore::new();
    let passed = testing::check_all(store.clone(), store).await.unwrap();
    assert_eq!(passed, ALL);
}

/// Two instances: two pools on one schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_conforms() {
    let schema = PgSchema::new().await;
    let first = schema.store().await.with_notifications(true);
    let second = PostgresStore::new(schema.pool(8).await).with_notifications(true);
    let passed = testing::check_all(first, second).await.unwrap();
    assert_eq!(passed, ALL);
    schema.drop_schema().await;
}

/// With prepared statements (on a direct connection), against a default instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_with_prepared_statements_conforms() {
    let schema = PgSchema::new().await;
    let first = PostgresStore::new(schema.direct_pool(8).await)
        .with_prepared_statements(true)
        .with_notifications(true);
    first.migrate().await.unwrap();
    let second = schema.store().await.with_notifications(true);
    let passed = testing::check_all(first, second).await.unwrap();
    assert_eq!(passed, ALL);
    schema.drop_schema().await;
}

/// Two instances: two connections to one Redis, one prefix; wake-ups on.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_conforms() {
    use support::redis_support as r;
    let prefix = r::prefix();
    let first = r::connected_store(&prefix)
        .await
        .with_notifications(r::client());
    let second = r::store(&prefix).with_notifications(r::client());
    let passed = testing::check_all(first, second).await.unwrap();
    assert_eq!(passed, ALL);
}

/// Without wake-ups (waiters poll), as by default.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_without_notifications_conforms() {
    use support::redis_support as r;
    let prefix = r::prefix();
    let store = r::connected_store(&prefix).await;
    let passed = testing::check_all(store.clone(), store).await.unwrap();
    assert_eq!(passed, ALL);
}

/// Two instances on a Redis Cluster (three masters, three replicas); wake-ups on.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_cluster_store_conforms() {
    use support::redis_support as r;
    let prefix = r::prefix();
    let first = r::cluster_store(&prefix)
        .await
        .with_notifications(r::cluster_client());
    let second = r::cluster_store(&prefix)
        .await
        .with_notifications(r::cluster_client());
    let passed = testing::check_all(first, second).await.unwrap();
    assert_eq!(passed, ALL);
}

/// A store that breaks the contract is caught, and the failure names the check.
#[tokio::test]
async fn a_store_that_forgets_answers_fails_the_suite() {
    let store = support::Faulty::default();
    // `Faulty` with no fault is a conforming store ...
    testing::claim_complete_replay(&store).await.unwrap();
    // ... and one whose completions are lost is not.
    support::Faulty::set(&store.writes_fail, true);
    let failure = testing::claim_complete_replay(&store).await.unwrap_err();
    assert_eq!(failure.check, "claim_complete_replay");
    assert!(failure.to_string().contains("completing"), "{failure}");
}
