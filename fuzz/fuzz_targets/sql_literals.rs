//! `cargo +nightly fuzz run sql_literals`: see [`tower_idempotency_fuzz::sql_literals`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tower_idempotency_fuzz::sql_literals(data));
