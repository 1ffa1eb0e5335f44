//! The memory store as it fills, behind the layer: new keys and replays with 1 M and 10 M
//! live records against a nearly empty store, and the slowest requests while its maps grow.
//!
//! Sends `N` requests with new keys (default 10,000,000; `--records N`) through
//! `IdempotencyLayer::new(MemoryStore)` in front of a create handler, one at a time on one
//! thread (`oneshot`, the answer read in full), each a `POST` with a 36-character key and a
//! small JSON body, and times every request (the request is built before the clock starts).
//! With 10,000 records held, with 1,000,000 and with `N` it measures:
//!
//! - new keys: the next 100,000 requests (their rate, against the rate at the first
//!   checkpoint, where the store is nearly empty);
//! - replays: 100,000 requests repeating keys already answered, drawn at random from all the
//!   store holds (each answered from the store).
//!
//! Then the latency of every request sent while filling: p50, p99, p99.9, the longest, how
//! many took over 1 ms and over 10 ms, and the store's size when the five longest happened;
//! and the resident memory the process grew by, per record. Last, new keys on a store full at
//! 1,000,000 records that evicts one for each ([`WhenFull::EvictCompleted`]), against the same
//! store just before it was full. About 6 GiB of memory and two minutes for 10 M records.
//! Run with `cargo bench --bench memory_scale`; without `--bench` (`cargo test
//! --all-targets`) it makes a smoke run to 20,000 records.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore, WhenFull};

/// How much a run sends: the measurement's sizes with `--bench` (as `cargo bench` runs it);
/// without it (`cargo test --all-targets`), a smoke run of a fraction of a second that checks
/// every answer.
struct Sizes {
    /// Records the store is filled to (`--records`).
    records: usize,
    /// Requests per measured window.
    window: usize,
    /// The cap of the evicting store.
    evict_cap: usize,
}

/// The `n`th key: 36 characters, as a UUID.
fn key(n: usize) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn request(key: &str, body: &Bytes) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::POST)
        .uri("/payments")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap()
}

/// The layer as it fills its store, with the latency of every request sent.
struct Fill<S> {
    svc: S,
    body: Bytes,
    /// Keys `0..len` have been answered.
    len: usize,
    /// Nanoseconds of each request sent by [`Fill::add`], in order.
    took: Vec<u32>,
    /// (nanoseconds, records held) of the five slowest.
    slowest: Vec<(u32, usize)>,
}

impl<S, B> Fill<S>
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    /// Sends one request and reads its answer; returns its status and how long it took.
    async fn send(&self, key: &str) -> (StatusCode, Duration) {
        let req = request(key, &self.body);
        let start = Instant::now();
        let res = self.svc.clone().oneshot(req).await.unwrap();
        let status = res.status();
        res.into_body().collect().await.unwrap();
        (status, start.elapsed())
    }

    /// Sends the next `n` new keys; returns the seconds they took.
    async fn add(&mut self, n: usize) -> f64 {
        let mut spent = Duration::ZERO;
        for _ in 0..n {
            let (status, took) = self.send(&key(self.len)).await;
            assert_eq!(status, StatusCode::CREATED, "key {}", self.len);
            let ns = u32::try_from(took.as_nanos()).unwrap_or(u32::MAX);
            self.took.push(ns);
            if self.slowest.len() < 5 || ns > self.slowest[4].0 {
                self.slowest.push((ns, self.len));
                self.slowest.sort_by_key(|&(ns, _)| std::cmp::Reverse(ns));
                self.slowest.truncate(5);
            }
            spent += took;
            self.len += 1;
        }
        spent.as_secs_f64()
    }

    /// Repeats `n` keys drawn at random from those answered; returns the seconds they took.
    async fn replay(&self, n: usize, seed: &mut u64) -> f64 {
        let mut spent = Duration::ZERO;
        for _ in 0..n {
            // xorshift64: the draw costs nothing beside the request.
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let n = usize::try_from(*seed % self.len as u64).unwrap();
            let (status, took) = self.send(&key(n)).await;
            assert_eq!(status, StatusCode::CREATED, "replay of key {n}");
            spent += took;
        }
        spent.as_secs_f64()
    }
}

/// The `per_mille`th thousandth of `sorted` nanoseconds, in µs.
fn percentile(sorted: &[u32], per_mille: usize) -> f64 {
    let i = (sorted.len() - 1) * per_mille / 1000;
    f64::from(sorted[i]) / 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; a filter that excludes this bench skips it.
    if args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .any(|a| a.parse::<usize>().is_err() && !"memory_scale".contains(a.as_str()))
    {
        return;
    }
    let measuring = args.iter().any(|a| a == "--bench");
    let mut sizes = if measuring {
        Sizes {
            records: 10_000_000,
            window: 100_000,
            evict_cap: 1_000_000,
        }
    } else {
        println!(
            "test mode (no --bench): a smoke run; `cargo bench --bench memory_scale` measures"
        );
        Sizes {
            records: 20_000,
            window: 2_000,
            evict_cap: 10_000,
        }
    };
    if let Some(n) = args
        .iter()
        .position(|a| a == "--records")
        .and_then(|i| args.get(i + 1))
    {
        sizes.records = n.parse().expect("--records N");
    }
    let Sizes {
        records,
        window,
        evict_cap,
    } = sizes;
    let mut checkpoints: Vec<usize> = [10_000, 1_000_000, records]
        .into_iter()
        .filter(|&c| c <= records)
        .collect();
    checkpoints.dedup();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = common::unbounded_memory_store();
        let fill_body = Bytes::from_static(br#"{"order_id":4711,"amount_cents":1999,"currency":"EUR"}"#);
        let mut fill = Fill {
            svc: IdempotencyLayer::new(store.clone()).layer(common::create_handler()),
            body: fill_body.clone(),
            len: 0,
            took: Vec::with_capacity(records + checkpoints.len() * window),
            slowest: Vec::new(),
        };
        let rss_before = common::rss();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rows = Vec::new();
        let started = Instant::now();
        for &at in &checkpoints {
            fill.add(at.saturating_sub(fill.len)).await;
            let held = fill.len;
            let replays = window as f64 / fill.replay(window, &mut seed).await;
            let new = window as f64 / fill.add(window).await;
            rows.push((held, new, replays));
        }
        let filled = started.elapsed();
        let grown = common::rss().saturating_sub(rss_before);
        let (_, new0, replay0) = rows[0];
        println!(
            "memory_scale: {} records in {filled:.1?}; RSS grew {:.0} B per record \
             (the latency log included), the store counts {:.0}",
            store.len(),
            grown as f64 / store.len() as f64,
            store.bytes() as f64 / store.len() as f64,
        );
        println!("| records held | new keys /s | ratio | replays /s | ratio |");
        println!("|---:|---:|---:|---:|---:|");
        for (held, new, replays) in &rows {
            println!(
                "| {held} | {new:.0} | {:.3} | {replays:.0} | {:.3} |",
                new / new0,
                replays / replay0
            );
        }
        let mut sorted = fill.took.clone();
        sorted.sort_unstable();
        let over = |us: u32| sorted.iter().filter(|&&ns| ns > us * 1000).count();
        println!(
            "new-key requests while filling: {}; p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs, \
             max {:.2} ms; over 1 ms: {}, over 10 ms: {}",
            sorted.len(),
            percentile(&sorted, 500),
            percentile(&sorted, 990),
            percentile(&sorted, 999),
            f64::from(*sorted.last().unwrap()) / 1e6,
            over(1_000),
            over(10_000),
        );
        let slowest: Vec<String> = fill
            .slowest
            .iter()
            .map(|(ns, held)| format!("{:.2} ms at {held}", f64::from(*ns) / 1e6))
            .collect();
        println!("slowest: {}", slowest.join(", "));
        drop(fill);

        // A store full at `evict_cap` records that evicts: every new key evicts the completed
        // record nearest its expiry, over all shards.
        let evicting = MemoryStore::new()
            .with_max_entries(evict_cap)
            .with_when_full(WhenFull::EvictCompleted);
        let mut fill = Fill {
            svc: IdempotencyLayer::new(evicting.clone()).layer(common::create_handler()),
            body: fill_body,
            len: 0,
            took: Vec::with_capacity(evict_cap + window),
            slowest: Vec::new(),
        };
        fill.add(evict_cap - window).await;
        let not_full = window as f64 / fill.add(window).await;
        let evicting_rate = window as f64 / fill.add(window).await;
        assert_eq!(evicting.len(), evict_cap);
        println!(
            "new keys on a store full at {evict_cap} records, evicting one each: {evicting_rate:.0}/s, \
             {:.3} of the {not_full:.0}/s just before it was full",
            evicting_rate / not_full
        );
    });
}
