//! Micro-benchmarks of the layer in process, with [`MemoryStore`] and no network: what the
//! layer adds to one request with a 1 KiB JSON body.
//!
//! | benchmark | what runs |
//! |---|---|
//! | `no_layer/POST` | the handler alone (the baseline) |
//! | `no_layer/GET` | the handler alone, on a `GET` |
//! | `layer/GET passthrough` | the layer on a `GET`: not covered, passed through |
//! | `layer/POST new key` | the layer on a `POST` with a new key: claim, handler, complete |
//! | `layer/POST replay` | the layer on a `POST` with a completed key: one replay |
//!
//! Every request is built the same way (with an `Idempotency-Key` header) and every response
//! body is read in full, so the figures differ only by what the layer does. Run with
//! `cargo bench --bench layer`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{Method, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn request(method: &Method, key: &str, body: &Bytes) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap()
}

/// Sends `req` through `svc` and reads the whole response, so lazy bodies are paid for.
async fn send<S, B>(svc: &S, req: Request<Full<Bytes>>) -> Bytes
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    assert!(res.status().is_success(), "status {}", res.status());
    res.into_body().collect().await.unwrap().to_bytes()
}

/// Keys that no other benchmark (or sample) used.
fn fresh_key(n: &mut u64) -> String {
    *n += 1;
    format!("bench-key-{n}")
}

fn bench_layer(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = common::json_body(common::BODY_LEN);
    let mut group = c.benchmark_group("layer_1KiB");
    group.throughput(Throughput::Bytes(u64::try_from(common::BODY_LEN).unwrap()));

    // Each sample gets a new store (dropped outside the timed part), so a long run of new
    // keys does not grow one map without bound.
    let fresh_layered =
        || IdempotencyLayer::new(MemoryStore::new()).layer(common::create_handler());

    for method in [Method::POST, Method::GET] {
        let body = body.clone();
        group.bench_function(format!("no_layer/{method}"), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (body, method) = (body.clone(), method.clone());
                async move {
                    let svc = common::create_handler::<Full<Bytes>>();
                    let mut n = 0;
                    let start = Instant::now();
                    for _ in 0..iters {
                        let req = request(&method, &fresh_key(&mut n), &body);
                        black_box(send(&svc, req).await);
                    }
                    start.elapsed()
                }
            });
        });
    }

    group.bench_function("layer/GET passthrough", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let body = body.clone();
            async move {
                let svc = fresh_layered();
                let mut n = 0;
                let start = Instant::now();
                for _ in 0..iters {
                    let req = request(&Method::GET, &fresh_key(&mut n), &body);
                    black_box(send(&svc, req).await);
                }
                start.elapsed()
            }
        });
    });

    group.bench_function("layer/POST new key", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let body = body.clone();
            async move {
                let svc = fresh_layered();
                let mut n = 0;
                let start = Instant::now();
                for _ in 0..iters {
                    let req = request(&Method::POST, &fresh_key(&mut n), &body);
                    black_box(send(&svc, req).await);
                }
                start.elapsed()
            }
        });
    });

    group.bench_function("layer/POST replay", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let body = body.clone();
            async move {
                let svc = fresh_layered();
                // Complete the key once; every timed request is then a replay.
                send(&svc, request(&Method::POST, "bench-key-1", &body)).await;
                let again = svc
                    .clone()
                    .oneshot(request(&Method::POST, "bench-key-1", &body))
                    .await
                    .unwrap();
                assert_eq!(again.headers()["idempotent-replayed"], "true");
                let start = Instant::now();
                for _ in 0..iters {
                    // The same formatting work as the other benchmarks, the same key each time.
                    let mut n = 0;
                    let req = request(&Method::POST, &fresh_key(&mut n), &body);
                    black_box(send(&svc, req).await);
                }
                start.elapsed()
            }
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench_layer
}
criterion_main!(benches);
