//! `cargo +nightly fuzz run postgres_answer`: see [`tower_idempotency_fuzz::postgres_answer`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::postgres_answer(data));
