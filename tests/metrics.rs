//! What the layer reports through the `metrics` facade (feature `metrics`): outcome counters,
//! the in-flight gauge, store-call latencies, store errors and timeouts, lost leases — and
//! never a key or a scope as a label.
#![cfg(feature = "metrics")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, Store,
    StoreError, StoredResponse, WhenFull,
};

/// Every metric by `name{label=value,…}`: counters and histogram sample counts as integers,
/// gauges as their value (the bits of an `f64`).
#[derive(Default, Clone)]
struct Seen(Arc<Mutex<HashMap<String, Arc<Cell>>>>);

#[derive(Default)]
struct Cell(AtomicU64, AtomicU64);

impl Cell {
    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .1
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }
    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }
    fn set(&self, value: f64) {
        self.update(|_| value);
    }
}

impl HistogramFn for Cell {
    fn record(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl Seen {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        self.0.lock().unwrap().entry(name).or_default().clone()
    }
    fn count(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |c| c.0.load(Ordering::SeqCst))
    }
    fn gauge(&self, name: &str) -> f64 {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(0.0, |c| f64::from_bits(c.1.load(Ordering::SeqCst)))
    }
    fn outcome(&self, outcome: &str) -> u64 {
        self.count(&format!(
            "tower_idempotency_requests_total{{outcome={outcome}}}"
        ))
    }
    fn names(&self) -> Vec<String> {
        self.0.lock().unwrap().keys().cloned().collect()
    }
}

impl Recorder for Seen {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}

/// One test: the recorder is global to the process, and the counts below are exact.
#[tokio::test(start_paused = true)]
async fn outcomes_gauges_latencies_and_store_failures_are_reported() {
    let seen = Seen::default();
    metrics::set_global_recorder(seen.clone()).unwrap();

    // Outcomes.
    let calls = Calls::default();
    let svc_store = MemoryStore::new();
    let svc = IdempotencyLayer::new(svc_store.clone()).layer(support::handler(calls.clone()));
    let send = |key: Option<&str>, body: &str| svc.clone().oneshot(req("POST", "/pay", key, body));
    read(send(Some("kq1"), "a").await.unwrap()).await;
    read(send(Some("kq1"), "a").await.unwrap()).await;
    read(send(Some("kq1"), "a").await.unwrap()).await;
    read(send(Some("kq1"), "b").await.unwrap()).await;
    read(send(None, "a").await.unwrap()).await;
    assert_eq!(seen.outcome("executed"), 1);
    assert_eq!(seen.outcome("replayed"), 2);
    assert_eq!(seen.outcome("mismatch"), 1);
    assert_eq!(seen.outcome("rejected"), 1);
    assert_eq!(calls.total(), 1);
    // Store calls: four claims and one completion, each timed.
    assert_eq!(
        seen.count("tower_idempotency_store_call_seconds{operation=claim}"),
        4
    );
    assert_eq!(
        seen.count("tower_idempotency_store_call_seconds{operation=complete}"),
        1
    );

    // The memory store's own: records and bytes held, claims refused, records evicted.
    assert_eq!(seen.gauge("tower_idempotency_memory_records{}"), 1.0);
    let store = MemoryStore::new().with_max_entries(1);
    let claim = |k: &'static str| ClaimRequest {
        scope: "",
        key: Box::leak(Box::new(IdempotencyKey::parse(k).unwrap())),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim("a")).await.unwrap() else {
        panic!("a new key");
    };
    let answer = StoredResponse::new(http::StatusCode::OK, Default::default(), "{}".into());
    let a = IdempotencyKey::parse("a").unwrap();
    let ttl = Duration::from_secs(60);
    assert!(store.complete("", &a, token, &answer, ttl).await.unwrap());
    assert!(matches!(
        store.claim(claim("b")).await,
        Err(StoreError::Full)
    ));
    assert_eq!(seen.count("tower_idempotency_memory_rejections_total{}"), 1);
    assert_eq!(seen.gauge("tower_idempotency_memory_records{}"), 2.0);
    #[allow(clippy::cast_precision_loss)]
    let held = (store.bytes() + svc_store.bytes()) as f64;
    assert_eq!(seen.gauge("tower_idempotency_memory_bytes{}"), held);
    let store = store.with_when_full(WhenFull::EvictCompleted);
    store.claim(claim("b")).await.unwrap();
    assert_eq!(seen.count("tower_idempotency_memory_evictions_total{}"), 1);
    assert_eq!(seen.gauge("tower_idempotency_memory_records{}"), 2.0);
    drop(store);
    assert_eq!(seen.gauge("tower_idempotency_memory_records{}"), 1.0);

    // The in-flight gauge: up while a handler runs, back down when it answered.
    let slow = svc
        .clone()
        .oneshot(req("POST", "/slow?ms=1000", Some("kq2"), ""));
    let slow = tokio::spawn(slow);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(seen.gauge("tower_idempotency_in_flight{}"), 1.0);
    read(slow.await.unwrap().unwrap()).await;
    assert_eq!(seen.gauge("tower_idempotency_in_flight{}"), 0.0);

    // A store that does not answer within the store timeout: a 503, counted as a store
    // error of kind `timeout` and as the outcome `store_error`.
    let store = support::Faulty::default();
    store.claim_delay_ms.store(60_000, Ordering::SeqCst);
    let svc = IdempotencyLayer::new(store.clone())
        .with_store_timeout(Duration::from_secs(1))
        .layer(support::handler(calls.clone()));
    let answer = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("kq3"), ""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, 503);
    assert_eq!(
        seen.count("tower_idempotency_store_errors_total{operation=claim,kind=timeout}"),
        1
    );
    assert_eq!(seen.outcome("store_error"), 1);

    // A lease lost while the handler runs: the store disowns the claim at its renewal.
    store.claim_delay_ms.store(0, Ordering::SeqCst);
    store.renew_disowned.store(true, Ordering::SeqCst);
    let svc = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .layer(support::handler(calls.clone()));
    read(
        svc.oneshot(req("POST", "/slow?ms=500", Some("kq4"), ""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(seen.count("tower_idempotency_leases_lost_total{}"), 1);

    // No key and no scope ever becomes a label.
    for name in seen.names() {
        assert!(!name.contains("kq"), "a key in the metric {name}");
    }
}
