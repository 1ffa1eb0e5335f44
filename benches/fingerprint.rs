//! The crate's request fingerprint against plain SHA-256 over the same body bytes, for a
//! 1 KiB and a 1 MiB body. The fingerprint also hashes the method, path and query and the
//! lengths of each part; over a large body it should cost what SHA-256 of the body costs.
//!
//! Run with `cargo bench --bench fingerprint`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sha2::{Digest, Sha256};
use tower_idempotency::fingerprint::fingerprint;

fn bench_fingerprint(c: &mut Criterion) {
    let (parts, ()) = http::Request::post("/orders?source=bench")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let mut group = c.benchmark_group("fingerprint");
    for (label, len) in [("1KiB", 1024), ("1MiB", 1024 * 1024)] {
        let body = common::json_body(len);
        group.throughput(Throughput::Bytes(u64::try_from(body.len()).unwrap()));
        group.bench_with_input(BenchmarkId::new("sha2", label), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(&body[..])));
        });
        group.bench_with_input(BenchmarkId::new("fingerprint", label), &body, |b, body| {
            b.iter(|| fingerprint(black_box(&parts), &[], black_box(&body[..])));
        });
    }
    group.finish();
}

/// A JSON body of about `len` bytes: a payment with line items, as a client builds it.
#[cfg(feature = "json")]
fn structured_json(len: usize) -> Vec<u8> {
    let mut s = String::from(
        r#"{"order_id":4711,"amount_cents":1999,"currency":"EUR","metadata":{"request_id":"3f2a","source":"web"},"items":["#,
    );
    let mut i = 0;
    while s.len() + 80 < len {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!(
            r#"{{"sku":"SKU-{i:05}","quantity":{},"price_cents":{},"name":"item n\u00b0{i}"}}"#,
            i % 7 + 1,
            100 + i * 3
        ));
        i += 1;
    }
    s.push_str("]}");
    s.into_bytes()
}

/// The raw fingerprint against the JSON fingerprint (canonical form, one excluded field)
/// of a small payment body and a ~4 KiB one.
#[cfg(feature = "json")]
fn bench_json(c: &mut Criterion) {
    use tower_idempotency::JsonFingerprint;
    let (parts, ()) = http::Request::post("/payments")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let json = JsonFingerprint::new()
        .exclude("/metadata/request_id")
        .unwrap();
    let mut group = c.benchmark_group("json");
    let small = br#"{"order_id":4711,"amount_cents":1999,"currency":"EUR"}"#.to_vec();
    for (label, body) in [("payment", small), ("4KiB", structured_json(4096))] {
        group.throughput(Throughput::Bytes(u64::try_from(body.len()).unwrap()));
        group.bench_with_input(BenchmarkId::new("raw", label), &body, |b, body| {
            b.iter(|| fingerprint(black_box(&parts), &[], black_box(&body[..])));
        });
        group.bench_with_input(BenchmarkId::new("json", label), &body, |b, body| {
            b.iter(|| json.fingerprint(black_box(&parts), &[], black_box(&body[..])));
        });
    }
    group.finish();
}

#[cfg(not(feature = "json"))]
fn bench_json(_: &mut Criterion) {}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench_fingerprint, bench_json
}
criterion_main!(benches);
