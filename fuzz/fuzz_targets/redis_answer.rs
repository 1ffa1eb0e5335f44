//! `cargo +nightly fuzz run redis_answer`: see [`tower_idempotency_fuzz::redis_answer`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::redis_answer(data));
