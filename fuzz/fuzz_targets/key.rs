//! `cargo +nightly fuzz run key`: see [`tower_idempotency_fuzz::key`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::key(data));
