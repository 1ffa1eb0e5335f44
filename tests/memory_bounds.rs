//! The memory store's limits, its policy when full, and expiry without a purge task.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, IdempotencyLayer, LeaseToken,
    MemoryStore, Store, StoreError, StoredResponse, WhenFull, body::RequestBody,
};

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k).unwrap()
}

fn claim_of(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: "",
        key,
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    }
}

fn answer(body: &'static str) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from_static(body.as_bytes()),
    )
}

async fn acquire(store: &MemoryStore, k: &IdempotencyKey) -> LeaseToken {
    match store.claim(claim_of(k)).await.unwrap() {
        ClaimOutcome::Acquired { token, .. } => token,
        other => panic!("{k}: expected Acquired, got {other:?}"),
    }
}

/// Claims and completes `k` with `body`, for `ttl`.
async fn store_answer(store: &MemoryStore, k: &str, body: &'static str, ttl: Duration) {
    let k = key(k);
    let token = acquire(store, &k).await;
    assert!(
        store
            .complete("", &k, token, &answer(body), ttl)
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn a_full_store_answers_new_keys_503_and_still_replays_and_409s() {
    let store = MemoryStore::new().with_max_entries(2);
    let calls = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Notify::new());
    let svc = {
        let (calls, gate) = (calls.clone(), gate.clone());
        IdempotencyLayer::new(store.clone()).layer(tower::service_fn(
            move |req: Request<RequestBody<Full<Bytes>>>| {
                let (calls, gate) = (calls.clone(), gate.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    if body == "wait" {
                        gate.notified().await;
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(body)))
                }
            },
        ))
    };
    let send = |k: &str, body: &'static str| {
        let req = Request::post("/pay")
            .header("idempotency-key", k)
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        let svc = svc.clone();
        async move {
            let res = svc.oneshot(req).await.unwrap();
            let (parts, body) = res.into_parts();
            (parts, body.collect().await.unwrap().to_bytes())
        }
    };
    // One stored answer, one running request: the store is full.
    assert_eq!(send("done", "a").await.0.status, StatusCode::OK);
    let running = tokio::spawn(send("running", "wait"));
    while calls.load(Ordering::SeqCst) < 2 {
        tokio::task::yield_now().await;
    }
    assert_eq!(store.len(), 2);

    let (full, body) = send("new", "b").await;
    assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE, "{body:?}");
    assert!(full.headers.contains_key(header::RETRY_AFTER));
    assert!(
        String::from_utf8_lossy(&body).contains("store-unavailable"),
        "{body:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the handler did not run");

    let (replay, body) = send("done", "a").await;
    assert_eq!((replay.status, &body[..]), (StatusCode::OK, &b"a"[..]));
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(send("running", "wait").await.0.status, StatusCode::CONFLICT);

    // The running request still stores its answer, and is replayed.
    gate.notify_one();
    assert_eq!(running.await.unwrap().0.status, StatusCode::OK);
    let (replay, _) = send("running", "wait").await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(matches!(
        store.claim(claim_of(&key("new"))).await,
        Err(StoreError::Full)
    ));
}

#[tokio::test(start_paused = true)]
async fn evict_completed_drops_the_oldest_answer_and_never_a_running_key() {
    let store = MemoryStore::new()
        .with_max_entries(4)
        .with_when_full(WhenFull::EvictCompleted);
    let ttl = Duration::from_secs(60);
    store_answer(&store, "oldest", "1", ttl).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    store_answer(&store, "older", "2", ttl).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    let running = acquire(&store, &key("running")).await;
    store_answer(&store, "newest", "3", ttl).await;
    assert_eq!(store.len(), 4);

    // A new key evicts the oldest answer; the others stay.
    acquire(&store, &key("new")).await;
    assert_eq!(store.len(), 4);
    for (k, body) in [("older", "2"), ("newest", "3")] {
        assert_eq!(
            store.claim(claim_of(&key(k))).await.unwrap(),
            ClaimOutcome::Completed(answer(body)),
            "{k}"
        );
    }
    assert!(matches!(
        store.claim(claim_of(&key("running"))).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    // `oldest` is gone: it is claimed afresh (evicting `older`, now the oldest answer).
    assert!(matches!(
        store.claim(claim_of(&key("oldest"))).await.unwrap(),
        ClaimOutcome::Acquired {
            takeover: false,
            ..
        }
    ));
    // `older` went so (a fresh claim again, evicting `newest`, the last answer).
    assert!(matches!(
        store.claim(claim_of(&key("older"))).await.unwrap(),
        ClaimOutcome::Acquired {
            takeover: false,
            ..
        }
    ));
    // Four keys run and none may be evicted: a new claim fails closed.
    assert!(matches!(
        store.claim(claim_of(&key("newest"))).await,
        Err(StoreError::Full)
    ));
    assert!(matches!(
        store.claim(claim_of(&key("one-more"))).await,
        Err(StoreError::Full)
    ));
    assert!(matches!(
        store.claim(claim_of(&key("running"))).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    assert!(store.release("", &key("running"), running).await.unwrap());
    acquire(&store, &key("one-more")).await;
}

#[tokio::test(start_paused = true)]
async fn eviction_takes_the_answers_nearest_expiry_across_all_shards() {
    // 1,000 answers spread over every shard, expiring one second apart in an order that is
    // not the order they were stored in; the first 21 expire and are purged. Each new key
    // must then evict the answer nearest its expiry of all those left, whichever shard
    // holds it.
    let n = 1000;
    let store = MemoryStore::new()
        .with_max_entries(n)
        .with_when_full(WhenFull::EvictCompleted);
    let ttl_of = |i: usize| Duration::from_secs(10 + (i as u64 * 7919) % 1000);
    for i in 0..n {
        store_answer(&store, &format!("k{i}"), "{}", ttl_of(i)).await;
    }
    tokio::time::advance(Duration::from_millis(30_500)).await;
    assert_eq!(store.purge_expired(1000).await.unwrap(), 21);
    let mut left: Vec<usize> = (0..n).filter(|&i| ttl_of(i).as_secs() > 30).collect();
    left.sort_by_key(|&i| ttl_of(i));
    // Full again with running keys, then 100 new keys, each evicting one answer.
    for i in 0..(n - left.len()) {
        acquire(&store, &key(&format!("fill{i}"))).await;
    }
    for i in 0..100 {
        acquire(&store, &key(&format!("new{i}"))).await;
    }
    assert_eq!(store.len(), n);
    // Every answer but the 100 nearest their expiry is still there (the store holds n
    // records: the 121 running keys and these 879).
    for &i in &left[100..] {
        let outcome = store.claim(claim_of(&key(&format!("k{i}")))).await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Completed(_)),
            "k{i} (ttl {:?}): {outcome:?}",
            ttl_of(i)
        );
    }
    assert_eq!(121 + left.len() - 100, n);
}

#[tokio::test]
async fn a_store_full_of_running_keys_fails_closed_under_either_policy() {
    for policy in [WhenFull::Reject, WhenFull::EvictCompleted] {
        let store = MemoryStore::new()
            .with_max_entries(3)
            .with_when_full(policy);
        for k in ["a", "b", "c"] {
            acquire(&store, &key(k)).await;
        }
        assert!(
            matches!(
                store.claim(claim_of(&key("d"))).await,
                Err(StoreError::Full)
            ),
            "{policy:?}"
        );
        for k in ["a", "b", "c"] {
            assert!(matches!(
                store.claim(claim_of(&key(k))).await.unwrap(),
                ClaimOutcome::InFlight { .. }
            ));
        }
        assert_eq!(store.len(), 3);
    }
}

#[tokio::test]
async fn the_byte_limit_counts_keys_and_answers() {
    let body = "x".repeat(1000).leak();
    // Room for two records without answers (about 190 bytes each), not three, nor one with a
    // 1000-byte answer.
    let store = MemoryStore::new().with_max_bytes(500);
    let t = acquire(&store, &key("a")).await;
    let in_progress = store.bytes();
    assert!((170..250).contains(&in_progress), "{in_progress}");
    acquire(&store, &key("b")).await;
    // A new key fits by count, but not by bytes.
    assert!(matches!(
        store.claim(claim_of(&key("c"))).await,
        Err(StoreError::Full)
    ));
    // A running request's answer is stored even past the limit.
    assert!(
        store
            .complete("", &key("a"), t, &answer(body), Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert!(store.bytes() > 1000 + in_progress, "{}", store.bytes());
    assert_eq!(
        store.claim(claim_of(&key("a"))).await.unwrap(),
        ClaimOutcome::Completed(answer(body))
    );

    // Evicting frees the answer's bytes too.
    let store = store.with_when_full(WhenFull::EvictCompleted);
    acquire(&store, &key("c")).await;
    assert_eq!(store.len(), 2);
    assert!(store.bytes() <= 500, "{}", store.bytes());
}

#[tokio::test(start_paused = true)]
async fn expired_answers_vanish_without_a_purge() {
    let store = MemoryStore::new().with_max_entries(100);
    for i in 0..100 {
        store_answer(&store, &format!("old{i}"), "{}", Duration::from_secs(1)).await;
    }
    tokio::time::advance(Duration::from_secs(2)).await;
    // No purge task, no purge call: new keys take the expired answers' place.
    for i in 0..100 {
        acquire(&store, &key(&format!("new{i}"))).await;
    }
    assert_eq!(store.len(), 100);
    // The old keys are gone; claiming them would need room the store no longer has.
    assert!(matches!(
        store.claim(claim_of(&key("old0"))).await,
        Err(StoreError::Full)
    ));
}

/// A store with room for nothing (`with_max_entries(0)`, or a byte limit below one record)
/// fails closed under either policy: every new key is refused, none runs unprotected.
#[tokio::test]
async fn a_store_with_room_for_nothing_refuses_every_new_key() {
    for policy in [WhenFull::Reject, WhenFull::EvictCompleted] {
        for store in [
            MemoryStore::new().with_max_entries(0),
            MemoryStore::new().with_max_bytes(0),
        ] {
            let store = store.with_when_full(policy);
            for k in ["a", "b"] {
                assert!(
                    matches!(store.claim(claim_of(&key(k))).await, Err(StoreError::Full)),
                    "{policy:?}"
                );
            }
            assert!(store.is_empty());
        }
    }
}
