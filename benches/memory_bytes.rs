//! What one record costs the memory store: the growth of the process's resident set (RSS, from
//! `/proc/self/statm`, so Linux only) per completed record, for a small JSON answer.
//!
//! Claims and completes `N` keys (default 1,000,000, or 20,000 in the smoke run without
//! `--bench`; `MEMORY_BYTES_N=…` to change it), each a 36-character key (a UUID's length)
//! whose answer is `201`, a `content-type: application/json` header and a 60-byte JSON body,
//! built afresh for each record as the layer does. Prints the RSS growth per record, and the store's own estimate of its bytes
//! ([`MemoryStore::bytes`]). Run with `cargo bench --bench memory_bytes`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, MemoryStore, Store, StoredResponse,
};

/// The resident set, in bytes (Linux; 0 elsewhere).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn main() {
    // `cargo bench` passes `--bench`; a filter that excludes this bench skips it.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args
        .iter()
        .any(|a| !a.starts_with('-') && !"memory_bytes".contains(a.as_str()))
    {
        return;
    }
    // Without `--bench` (`cargo test --all-targets`), a smoke run of 20,000 records.
    let measuring = args.iter().any(|a| a == "--bench");
    let n: usize = std::env::var("MEMORY_BYTES_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if measuring { 1_000_000 } else { 20_000 });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        // No limit: the figure is what the records cost, not what the defaults admit.
        let store = MemoryStore::new()
            .with_max_entries(usize::MAX)
            .with_max_bytes(usize::MAX);
        let body = br#"{"id":"pay_0000000000","amount":100,"currency":"EUR","ok":0}"#;
        assert_eq!(body.len(), 60);
        let before = rss();
        for i in 0..n {
            let key =
                IdempotencyKey::parse(&format!("{i:08x}-0000-4000-8000-000000000000")).unwrap();
            let claim = ClaimRequest {
                scope: "",
                key: &key,
                fingerprint: Fingerprint::from_bytes([7; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(24 * 3600),
            };
            let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
                panic!("key {i} was not new");
            };
            let mut headers = HeaderMap::new();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            let answer =
                StoredResponse::new(StatusCode::CREATED, headers, Bytes::copy_from_slice(body));
            assert!(
                store
                    .complete("", &key, token, &answer, Duration::from_secs(24 * 3600))
                    .await
                    .unwrap()
            );
        }
        let after = rss();
        assert_eq!(store.len(), n);
        let per_record = after.saturating_sub(before) as f64 / n as f64;
        println!(
            "memory_bytes: {n} records; RSS {:.1} MiB -> {:.1} MiB: {per_record:.0} B per record; \
             the store counts {:.0} B per record",
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            store.bytes() as f64 / n as f64,
        );
    });
}
