//! Outcome counters through the `metrics` facade (feature `metrics`).
#![cfg(feature = "metrics")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[derive(Default, Clone)]
struct Counts(Arc<Mutex<HashMap<String, Arc<Cell>>>>);

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
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
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
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(support::handler(calls.clone()));
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
}
