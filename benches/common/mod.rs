//! What the benchmarks share: the request body and the handler's answer.
#![allow(dead_code)] // each benchmark uses part of it

use bytes::Bytes;

/// The size of the request body every benchmark sends (1 KiB).
pub(crate) const BODY_LEN: usize = 1024;

/// A JSON document of exactly `len` bytes (at least 32): an order with a padded note.
pub(crate) fn json_body(len: usize) -> Bytes {
    let head = r#"{"order_id":4711,"amount_cents":1999,"currency":"EUR","note":""#;
    let tail = r#""}"#;
    let pad = len.saturating_sub(head.len() + tail.len());
    let mut s = String::with_capacity(len);
    s.push_str(head);
    s.extend(std::iter::repeat_n('x', pad));
    s.push_str(tail);
    Bytes::from(s)
}

/// The handler's answer to a request whose body had `len` bytes: small JSON, as a create
/// endpoint would answer.
pub(crate) fn created_json(len: usize) -> Bytes {
    Bytes::from(format!(
        r#"{{"id":4711,"status":"created","received":{len}}}"#
    ))
}
