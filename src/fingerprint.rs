//! The request fingerprint: SHA-256 over what makes two requests "the same request".

use std::fmt;

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

/// The SHA-256 fingerprint of a request.
///
/// It covers the method, the path, the query, the values of the headers named with
/// [`IdempotencyLayer::with_fingerprint_headers`](crate::IdempotencyLayer::with_fingerprint_headers)
/// and the body. Each part is length-prefixed, so no two different requests share the
/// input to the hash. A key sent again with a request of another fingerprint is answered
/// with `422 Unprocessable Content`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps 32 bytes of a SHA-256 digest (for stores that read it back).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes of the digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex(&self.0))
    }
}

/// Hashes a request incrementally: the head first, then the body chunk by chunk as it
/// arrives, so the body is never copied for hashing.
#[derive(Clone)]
pub(crate) struct Fingerprinter {
    hasher: Sha256,
    body_len: u64,
}

impl Fingerprinter {
    /// Starts a fingerprint with the request head.
    pub(crate) fn new(parts: &Parts, headers: &[HeaderName]) -> Self {
        let mut hasher = Sha256::new();
        // Version tag: change it if the input layout ever changes.
        hasher.update(b"tower-idempotency/v1\0");
        field(&mut hasher, parts.method.as_str().as_bytes());
        field(&mut hasher, parts.uri.path().as_bytes());
        match parts.uri.query() {
            Some(q) => {
                hasher.update([1u8]);
                field(&mut hasher, q.as_bytes());
            }
            None => hasher.update([0u8]),
        }
        for name in headers {
            field(&mut hasher, name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            let count = values.iter().count() as u64;
            hasher.update(count.to_be_bytes());
            for v in values {
                field(&mut hasher, v.as_bytes());
            }
        }
        Self {
            hasher,
            body_len: 0,
        }
    }

    /// Adds a chunk of the body.
    pub(crate) fn update(&mut self, chunk: &[u8]) {
        self.hasher.update(chunk);
        self.body_len += chunk.len() as u64;
    }

    /// Finishes the fingerprint.
    pub(crate) fn finish(mut self) -> Fingerprint {
        // The body length goes last: the body is the only unprefixed field.
        self.hasher.update(self.body_len.to_be_bytes());
        Fingerprint(self.hasher.finalize().into())
    }
}

fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// Computes the fingerprint of a complete request (head and whole body) in one call.
///
/// The layer computes the same value incrementally; this function is for stores, tests and
/// tools that need to predict it.
pub fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    let mut f = Fingerprinter::new(parts, headers);
    f.update(body);
    f.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(method: &str, uri: &str) -> Parts {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("x-tenant", "a")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn fingerprint_covers_each_part() {
        let base = fingerprint(&parts("POST", "/p?x=1"), &[], b"body");
        assert_eq!(base, fingerprint(&parts("POST", "/p?x=1"), &[], b"body"));
        assert_ne!(base, fingerprint(&parts("PATCH", "/p?x=1"), &[], b"body"));
        assert_ne!(base, fingerprint(&parts("POST", "/q?x=1"), &[], b"body"));
        assert_ne!(base, fingerprint(&parts("POST", "/p?x=2"), &[], b"body"));
        assert_ne!(base, fingerprint(&parts("POST", "/p"), &[], b"body"));
        assert_ne!(base, fingerprint(&parts("POST", "/p?x=1"), &[], b"bodY"));
        let tenant = HeaderName::from_static("x-tenant");
        assert_ne!(
            base,
            fingerprint(&parts("POST", "/p?x=1"), &[tenant], b"body")
        );
        // An empty query and no query differ.
        assert_ne!(
            fingerprint(&parts("POST", "/p?"), &[], b""),
            fingerprint(&parts("POST", "/p"), &[], b"")
        );
    }

    #[test]
    fn chunking_does_not_change_the_fingerprint() {
        let p = parts("POST", "/p");
        let mut f = Fingerprinter::new(&p, &[]);
        f.update(b"bo");
        f.update(b"dy");
        assert_eq!(f.finish(), fingerprint(&p, &[], b"body"));
    }

    #[test]
    fn hex_encodes() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
    }
}
