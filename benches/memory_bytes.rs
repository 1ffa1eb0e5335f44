//! What one record costs the memory store: the growth of the process's resident set (RSS, from
//! `/proc/self/statm`, so Linux only) per completed record, for a small JSON answer.
//!
//! Claims and completes `N` keys (default 1,000,000, or 20,000 in the smoke run without
//! `--bench`; `MEMORY_BYTES_N=…` to change it) with `common::fill_memory_store`: 36-character
//! keys whose answer is `201`, a `content-type: application/json` header and a 60-byte JSON
//! body, built afresh for each record as the layer does. Prints the RSS growth per record,
//! and the store's own estimate of its bytes (`MemoryStore::bytes`). Run with
//! `cargo bench --bench memory_bytes`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::rss;

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
        let store = common::unbounded_memory_store();
        let before = rss();
        common::fill_memory_store(&store, n).await;
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
