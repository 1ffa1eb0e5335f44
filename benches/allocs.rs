//! Heap allocations per request, counted by a global allocator: what the layer adds to one
//! request on the memory store, beside the handler's own allocations.
//!
//! | scenario | what runs | compared with |
//! |---|---|---|
//! | `GET passthrough` | the layer on a `GET`: not covered, passed through | the handler alone, `GET` |
//! | `POST no key` | a `POST` without a key, keys optional (`with_key_required(false)`) | the handler alone, `POST` |
//! | `POST new key` | claim, handler, completion | the handler alone, `POST` |
//! | `POST replay` | one replay of a completed key (the handler does not run) | the handler alone, `POST` |
//! | `… routed` | the same, each request already carrying an extension (as behind axum's `Router`, which inserts `MatchedPath`): the layer's own extensions then cost no map | the handler alone, `POST`, routed |
//!
//! Requests are built before counting starts; what is counted is sending each through the
//! service and reading its whole answer, on a current-thread runtime (so every allocation
//! counted is the request's). An allocation is a call to `alloc`, `alloc_zeroed` or
//! `realloc`. Run with `cargo bench --bench allocs`; the figures are exact counts, the same
//! on a busy machine. It fails when the layer passes a request through with an allocation
//! more than the handler's own, or adds more than 12 to a keyed one.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The one unsafe code of the repository: a global allocator that counts, forwarding to
// `System`.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The system allocator, counting calls and bytes.
struct Counting;

static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Requests per scenario: the counts are exact, so few are needed; enough to average out
/// the store's occasional growth (a map resizing).
const REQUESTS: usize = 2_000;

/// What a router leaves in a request's extensions (axum inserts `MatchedPath`).
#[derive(Clone)]
struct Routed;

fn routed(mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    req.extensions_mut().insert(Routed);
    req
}

fn request(method: &Method, key: Option<&str>, body: &Bytes) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(method)
        .uri("/orders")
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(Full::new(body.clone())).unwrap()
}

/// Allocations (calls, bytes) per request for sending each of `requests` through `svc` and
/// reading its whole answer.
async fn count<S, B>(svc: &S, requests: Vec<Request<Full<Bytes>>>) -> (f64, f64)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let n = requests.len() as f64;
    let mut svcs: Vec<S> = (0..requests.len()).map(|_| svc.clone()).collect();
    let mut answers = Vec::with_capacity(requests.len());
    let (calls, bytes) = (CALLS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
    for (req, svc) in requests.into_iter().zip(svcs.iter_mut()) {
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        assert!(res.status().is_success(), "status {}", res.status());
        answers.push(res.into_body().collect().await.unwrap().to_bytes());
    }
    let calls = CALLS.load(Ordering::Relaxed) - calls;
    let bytes = BYTES.load(Ordering::Relaxed) - bytes;
    drop(answers);
    (calls as f64 / n, bytes as f64 / n)
}

fn keys(prefix: &str) -> Vec<String> {
    (0..REQUESTS).map(|i| format!("{prefix}-{i:08}")).collect()
}

async fn run() {
    let body = common::json_body(common::BODY_LEN);
    let post = || (0..REQUESTS).map(|_| request(&Method::POST, None, &body));
    let get = || (0..REQUESTS).map(|_| request(&Method::GET, None, &body));
    let keyed = |keys: &[String]| {
        keys.iter()
            .map(|k| request(&Method::POST, Some(k), &body))
            .collect::<Vec<_>>()
    };

    let bare = common::create_handler::<Full<Bytes>>();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let layered = layer.clone().layer(common::create_handler());
    let optional = layer
        .clone()
        .with_key_required(false)
        .layer(common::create_handler());

    // Warm every path (lazy statics), and every shard of the store with its first record
    // (its map and its first chunk), so that what is counted is a request's own.
    let warm = keys("warm");
    count(&layered, keyed(&warm)).await;
    count(&layered, keyed(&warm)).await;
    count(&bare, post().collect()).await;
    count(&optional, post().collect()).await;

    let base_post = count(&bare, post().collect()).await;
    let base_get = count(&bare, get().collect()).await;
    let passthrough = count(&layered, get().collect()).await;
    let no_key = count(&optional, post().collect()).await;
    let new_keys = keys("new");
    let new_key = count(&layered, keyed(&new_keys)).await;
    let replay = count(&layered, keyed(&new_keys)).await;
    let base_routed = count(&bare, post().map(routed).collect()).await;
    let routed_keys = keys("routed");
    let routed_new = count(
        &layered,
        keyed(&routed_keys).into_iter().map(routed).collect(),
    )
    .await;
    let routed_replay = count(
        &layered,
        keyed(&routed_keys).into_iter().map(routed).collect(),
    )
    .await;

    println!(
        "| scenario | allocations per request | bytes per request | extra allocations | extra bytes |"
    );
    println!("|---|---:|---:|---:|---:|");
    let row = |name: &str, (calls, bytes): (f64, f64), (base_calls, base_bytes): (f64, f64)| {
        println!(
            "| {name} | {calls:.1} | {bytes:.0} | {:+.1} | {:+.0} |",
            calls - base_calls,
            bytes - base_bytes
        );
    };
    row("handler alone, GET", base_get, base_get);
    row("handler alone, POST", base_post, base_post);
    row("layer, GET passthrough", passthrough, base_get);
    row("layer, POST no key (optional)", no_key, base_post);
    row("layer, POST new key", new_key, base_post);
    row("layer, POST replay", replay, base_post);
    row("handler alone, POST routed", base_routed, base_routed);
    row("layer, POST new key routed", routed_new, base_routed);
    row("layer, POST replay routed", routed_replay, base_routed);

    // The bounds: a request the layer passes through allocates nothing more, a
    // keyed one at most 12 more. Checked on every run, `cargo test` included.
    let bounds = [
        ("GET passthrough", passthrough, base_get, 0.0),
        ("POST no key", no_key, base_post, 0.0),
        ("POST new key", new_key, base_post, MAX_EXTRA_KEYED),
        ("POST replay", replay, base_post, MAX_EXTRA_KEYED),
        (
            "POST new key routed",
            routed_new,
            base_routed,
            MAX_EXTRA_KEYED,
        ),
        (
            "POST replay routed",
            routed_replay,
            base_routed,
            MAX_EXTRA_KEYED,
        ),
    ];
    let over: Vec<String> = bounds
        .iter()
        .filter(|(_, (calls, _), (base, _), max)| calls - base > max + 1e-9)
        .map(|(name, (calls, _), (base, _), max)| {
            format!(
                "{name}: {:+.1} allocations (at most {max:+.0})",
                calls - base
            )
        })
        .collect();
    assert!(over.is_empty(), "over the bound: {}", over.join("; "));
}

/// The most allocations a keyed request may add to the handler's own, on the memory store.
const MAX_EXTRA_KEYED: f64 = 12.0;

fn main() {
    // `cargo test --benches` runs benches with `--test`-like flags; this one has nothing to
    // check in that case beyond building.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}
