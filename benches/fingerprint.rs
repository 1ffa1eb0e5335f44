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

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench_fingerprint
}
criterion_main!(benches);
