//! `cargo +nightly fuzz run headers`: see [`tower_idempotency_fuzz::headers`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::headers(data));
