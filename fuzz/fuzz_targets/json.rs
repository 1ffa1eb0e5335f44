//! `cargo +nightly fuzz run json`: see [`tower_idempotency_fuzz::json`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::json(data));
