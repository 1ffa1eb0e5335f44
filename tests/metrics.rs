//! Outcome counters through the `metrics` facade (feature `metrics`).
#![cfg(feature = "metrics")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString,
    Unit,
};
use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, Store,
    StoreError, StoredResponse, WhenFull,
};

#[derive(Default, Clone)]
struct Counts(
    Arc<Mutex<HashMap<String, Arc<Cell>>>>,
    Arc<Mutex<HashMap<String, Arc<GaugeCell>>>>,
);

/// A gauge's value, as the bits of an `f64`.
#[derive(Default)]
struct GaugeCell(AtomicU64);

impl GaugeCell {
    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl GaugeFn for GaugeCell {
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

#[derive(Default)]
struct Cell(AtomicU64);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

impl Counts {
    /// A counter without labels.
    fn counter(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(&format!("{name}{{}}"))
            .map_or(0, |c| c.0.load(Ordering::SeqCst))
    }

    fn gauge(&self, name: &str) -> f64 {
        self.1
            .lock()
            .unwrap()
            .get(name)
            .map_or(0.0, |g| f64::from_bits(g.0.load(Ordering::SeqCst)))
    }

    fn get(&self, outcome: &str) -> u64 {
        let name = format!("tower_idempotency_requests_total{{outcome={outcome}}}");
        self.0
            .lock()
            .unwrap()
            .get(&name)
            .map_or(0, |c| c.0.load(Ordering::SeqCst))
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let cell = self.0.lock().unwrap().entry(name).or_default().clone();
        Counter::from_arc(cell)
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        assert_eq!(
            key.labels().count(),
            0,
            "{key:?}: memory gauges have no labels"
        );
        let name = key.name().to_owned();
        Gauge::from_arc(self.1.lock().unwrap().entry(name).or_default().clone())
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test]
async fn outcomes_are_counted() {
    let counts = Counts::default();
    metrics::set_global_recorder(counts.clone()).unwrap();
    let calls = Calls::default();
    let svc_store = MemoryStore::new();
    let svc = IdempotencyLayer::new(svc_store.clone()).layer(support::handler(calls.clone()));
    let send = |key: Option<&str>, body: &str| svc.clone().oneshot(req("POST", "/pay", key, body));
    read(send(Some("k"), "a").await.unwrap()).await;
    read(send(Some("k"), "a").await.unwrap()).await;
    read(send(Some("k"), "a").await.unwrap()).await;
    read(send(Some("k"), "b").await.unwrap()).await;
    read(send(None, "a").await.unwrap()).await;
    assert_eq!(counts.get("executed"), 1);
    assert_eq!(counts.get("replayed"), 2);
    assert_eq!(counts.get("mismatch"), 1);
    assert_eq!(counts.get("rejected"), 1);
    assert_eq!(calls.total(), 1);

    // The memory store's own: records and bytes held, claims refused, records evicted.
    assert_eq!(counts.gauge("tower_idempotency_memory_records"), 1.0);
    let store = MemoryStore::new().with_max_entries(1);
    let claim = |k: &'static str| ClaimRequest {
        scope: "",
        key: Box::leak(Box::new(IdempotencyKey::parse(k).unwrap())),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: std::time::Duration::from_secs(30),
        ttl: std::time::Duration::from_secs(60),
    };
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim("a")).await.unwrap() else {
        panic!("a new key");
    };
    let answer = StoredResponse::new(http::StatusCode::OK, Default::default(), "{}".into());
    let a = IdempotencyKey::parse("a").unwrap();
    let ttl = std::time::Duration::from_secs(60);
    assert!(store.complete("", &a, token, &answer, ttl).await.unwrap());
    assert!(matches!(
        store.claim(claim("b")).await,
        Err(StoreError::Full)
    ));
    assert_eq!(
        counts.counter("tower_idempotency_memory_rejections_total"),
        1
    );
    assert_eq!(counts.gauge("tower_idempotency_memory_records"), 2.0);
    let bytes = counts.gauge("tower_idempotency_memory_bytes");
    #[allow(clippy::cast_precision_loss)]
    let held = (store.bytes() + svc_store.bytes()) as f64;
    assert_eq!(bytes, held);
    let store = store.with_when_full(WhenFull::EvictCompleted);
    store.claim(claim("b")).await.unwrap();
    assert_eq!(
        counts.counter("tower_idempotency_memory_evictions_total"),
        1
    );
    assert_eq!(counts.gauge("tower_idempotency_memory_records"), 2.0);
    drop(store);
    assert_eq!(counts.gauge("tower_idempotency_memory_records"), 1.0);
}
