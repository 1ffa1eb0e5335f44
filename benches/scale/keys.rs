//! What every request of the benchmark carries: UUID-shaped keys (those of the bulk-loaded
//! records too), the one fingerprint, and the stored answer of a first request.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use sha2::{Digest, Sha256};
use tower_idempotency::{Fingerprint, IdempotencyKey, StoredResponse};

/// A UUID-shaped key (what clients usually send): the first 16 bytes of SHA-256(`seed`),
/// as Postgres writes them with `left(encode(sha256(…), 'hex'), 32)::uuid::text`.
pub(crate) fn uuid_key(seed: &str) -> String {
    let d = Sha256::digest(seed.as_bytes());
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The key of bulk-loaded record `i`.
pub(crate) fn bulk_key(i: u64) -> IdempotencyKey {
    IdempotencyKey::parse(&uuid_key(&format!("bulk-{i}"))).unwrap()
}

/// Every request of the benchmark has this fingerprint (the bulk-loaded records too).
pub(crate) fn the_fingerprint() -> Fingerprint {
    Fingerprint::from_bytes(Sha256::digest(b"tower-idempotency scale bench").into())
}

/// The stored answer of a first request: `201`, a content type, a small JSON body.
pub(crate) fn the_answer() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from_static(br#"{"id":4711,"status":"created","received":1024}"#),
    )
}
