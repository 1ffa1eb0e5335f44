//! `cargo +nightly fuzz run memory_answer`: see [`tower_idempotency_fuzz::memory_answer`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::memory_answer(data));
