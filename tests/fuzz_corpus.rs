//! The fuzz targets of `fuzz/`, run on stable in the test suite: each over its committed
//! corpus (`fuzz/corpus/<target>/`) and over a bounded number of generated inputs, so every
//! machine that runs the tests checks the invariants the fuzzers check for hours. The checks
//! themselves are in `fuzz/src/lib.rs`, shared with `cargo fuzz`; the README says how to run
//! the long fuzzing.
//!
//! The store targets use the real servers: Postgres at `DATABASE_URL` and Redis at
//! `REDIS_URL`, as the other tests do.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

#[path = "../fuzz/src/lib.rs"]
mod checks;

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::Path;

use proptest::prelude::*;

/// Runs `check` on every file of the target's corpus; a failure names the file.
fn replay(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    for file in files {
        let data = std::fs::read(&file).unwrap();
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| check(&data))) {
            eprintln!("fuzz target {target} fails on {}", file.display());
            resume_unwind(panic);
        }
    }
}

/// Every target has a corpus, and every corpus a target.
#[test]
fn every_target_has_a_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut corpora: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    corpora.sort();
    let mut targets: Vec<String> = checks::TARGETS.iter().map(|&t| t.to_owned()).collect();
    targets.sort();
    assert_eq!(corpora, targets);
}

/// Bytes of every kind, with the bytes a target's format cares about more likely.
fn bytes(special: &'static [u8], max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..max),
        proptest::collection::vec(proptest::sample::select(special), 0..max),
    ]
}

/// Keys: random bytes, and bare and quoted keys near the grammar's edges.
fn keys() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        bytes(b" \t\"\\!~az09:\x7f\x80\xff", 300),
        "[ -~]{0,260}".prop_map(String::into_bytes),
        "[ \t]{0,2}\"([ !#-\\[\\]-~]|\\\\[\"\\\\]){0,258}\"[ \t]{0,2}".prop_map(String::into_bytes),
    ]
}

/// A JSON number's text, exponents up to 20 digits.
fn number() -> impl Strategy<Value = String> {
    "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,24})?([eE][+-]?[0-9]{1,20})?"
}

/// Valid JSON texts (members may repeat, numbers and strings of every shape, whitespace),
/// and random bytes made of JSON's characters.
fn json() -> impl Strategy<Value = Vec<u8>> {
    let string = "\"([ !#-\\[\\]-~é€😂]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4}){0,12}\"";
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        number(),
        string,
    ];
    let ws = "[ \t\r\n]{0,2}";
    let value = leaf.prop_recursive(6, 64, 8, move |inner| {
        prop_oneof![
            proptest::collection::vec((ws, inner.clone()), 0..8).prop_map(|items| {
                let items: Vec<String> = items.into_iter().map(|(w, v)| w + &v).collect();
                format!("[{}]", items.join(","))
            }),
            proptest::collection::vec(("\"[a-cé😂]{0,2}\"", ws, inner), 0..8).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(name, w, v)| format!("{name}{w}:{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    });
    prop_oneof![
        3 => value.prop_map(String::into_bytes),
        1 => bytes(b"{}[]\",:\\u0123456789abcdefABCDEF.eE+- \t\n\rtruefalsnl\xc3\xa9\xff\x00", 200),
    ]
}

/// Texts of every kind (any Unicode, and the bytes that matter to SQL and to the client
/// encodings that can hide a quote or a backslash in a character), and any bytes.
fn sql_values() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        any::<String>().prop_map(String::into_bytes),
        bytes(b"'\\\"$1$2$3E\x00\x5c\x81\x95\xe3\x80\x9e-\n", 300),
        proptest::collection::vec(any::<u8>(), 0..300),
    ]
}

#[test]
fn the_key_parser_holds_on_its_corpus() {
    replay("key", checks::key);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    #[test]
    fn the_key_parser_holds_on_generated_inputs(data in keys()) {
        checks::key(&data);
    }
}

#[test]
fn the_json_canonicaliser_holds_on_its_corpus() {
    replay("json", checks::json);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    #[test]
    fn the_json_canonicaliser_holds_on_generated_inputs(data in json()) {
        checks::json(&data);
    }
}

#[test]
fn the_header_codec_holds_on_its_corpus() {
    replay("headers", checks::headers);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]
    #[test]
    fn the_header_codec_holds_on_generated_inputs(data in bytes(b"\x00\x01\x02\x05\xffabc:-\t\x7f", 400)) {
        checks::headers(&data);
    }
}

#[test]
fn the_memory_answer_codec_holds_on_its_corpus() {
    replay("memory_answer", checks::memory_answer);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn the_memory_answer_codec_holds_on_generated_inputs(data in bytes(b"\x00\x01\x02\x10\x20\xffabc", 400)) {
        checks::memory_answer(&data);
    }
}

#[cfg(feature = "redis")]
#[test]
fn the_redis_answer_codec_holds_on_its_corpus() {
    replay("redis_answer", checks::redis_answer);
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_redis_answer_codec_holds_on_generated_inputs(data in bytes(b"\x00\x01\x02\x10\xff0123456789-+ ", 400)) {
        checks::redis_answer(&data);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn the_postgres_answer_codec_holds_on_its_corpus() {
    replay("postgres_answer", checks::postgres_answer);
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_postgres_answer_codec_holds_on_generated_inputs(data in bytes(b"\x00\x01\x02\x03\xe7\x10\xff", 400)) {
        checks::postgres_answer(&data);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn the_sql_literal_writer_round_trips_its_corpus_through_postgres() {
    replay("sql_literals", checks::sql_literals);
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_sql_literal_writer_round_trips_generated_text_and_bytes_through_postgres(data in sql_values()) {
        checks::sql_literals(&data);
    }
}
