//! GUARANTEES.md stays true to the tests: every row of its tables names at least one test,
//! and every test it names exists (a renamed or deleted test fails this check).
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::path::Path;

/// The test references of a line: backticked `path/to/file.rs::name` (the name may carry
/// module segments, `file.rs::module::name`; the function is the last segment).
fn references(line: &str) -> Vec<(&str, &str)> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|quoted| {
            let (file, path) = quoted.split_once(".rs::")?;
            let file = &quoted[..file.len() + 3];
            let name = path.rsplit("::").next()?;
            let valid = (file.starts_with("tests/") || file.starts_with("src/"))
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            valid.then_some((file, name))
        })
        .collect()
}

#[test]
fn every_row_names_a_test_and_every_named_test_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("GUARANTEES.md")).unwrap();
    let mut named = 0;
    let mut missing = Vec::new();
    let mut rows_without = Vec::new();
    for line in doc.lines() {
        let refs = references(line);
        let is_row =
            line.starts_with('|') && !line.starts_with("|---") && !line.starts_with("| situation");
        if is_row && refs.is_empty() {
            rows_without.push(line.to_owned());
        }
        for (file, name) in refs {
            named += 1;
            let text = std::fs::read_to_string(root.join(file))
                .unwrap_or_else(|e| panic!("GUARANTEES.md names {file}: {e}"));
            if !text.contains(&format!("fn {name}(")) && !text.contains(&format!("fn {name}<")) {
                missing.push(format!("{file}::{name}"));
            }
        }
    }
    assert!(named >= 40, "GUARANTEES.md names only {named} tests");
    assert!(
        missing.is_empty(),
        "tests named in GUARANTEES.md but not found: {missing:#?}"
    );
    assert!(
        rows_without.is_empty(),
        "rows of GUARANTEES.md that name no test: {rows_without:#?}"
    );
}

#[test]
fn references_are_read_from_backticks() {
    assert_eq!(
        references("| a | `tests/behaviour.rs::first` and `src/key.rs::tests::second` |"),
        [("tests/behaviour.rs", "first"), ("src/key.rs", "second")]
    );
    assert!(references("| a | `Retry-After: 1` |").is_empty());
}
