//! The request fingerprint: SHA-256 over what makes two requests "the same request".

use std::fmt;

use std::sync::Arc;

use bytes::Bytes;
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
        write!(f, "Fingerprint({})", crate::hex::encode(&self.0))
    }
}

/// The version tag of the raw fingerprint: change it if the input layout ever changes.
const RAW_TAG: &[u8] = b"tower-idempotency/v1\0";
/// The tag of a fingerprint over the canonical form of a JSON body. It differs from
/// [`RAW_TAG`] within their common length, so no raw input is ever a JSON input.
#[cfg(feature = "json")]
const JSON_TAG: &[u8] = b"tower-idempotency/json-v1\0";
/// The tag of the digest of a user's fingerprint ([`IdempotencyLayer::with_fingerprint_fn`]).
///
/// [`IdempotencyLayer::with_fingerprint_fn`]: crate::IdempotencyLayer::with_fingerprint_fn
const FN_TAG: &[u8] = b"tower-idempotency/fn-v1\0";

/// A user's fingerprint function ([`IdempotencyLayer::with_fingerprint_fn`]).
///
/// [`IdempotencyLayer::with_fingerprint_fn`]: crate::IdempotencyLayer::with_fingerprint_fn
pub(crate) type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync;

/// How a layer fingerprints its requests.
#[derive(Clone, Default)]
pub(crate) enum Method {
    /// The raw bytes of the body, hashed as they arrive (the default).
    #[default]
    Raw,
    /// The canonical form of JSON bodies.
    #[cfg(feature = "json")]
    Json(Arc<JsonFingerprint>),
    /// The user's function, over the whole body.
    Fn(Arc<FingerprintFn>),
}

impl fmt::Debug for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Raw => f.write_str("Raw"),
            #[cfg(feature = "json")]
            Self::Json(json) => f.debug_tuple("Json").field(json).finish(),
            Self::Fn(_) => f.write_str("Fn(<fn>)"),
        }
    }
}

/// Fingerprints a request: the head first, then the body chunk by chunk as it arrives, so
/// the body is never copied for hashing — or, for a fingerprint that needs the whole body (a
/// JSON body, a user's function), the body once it is all there.
pub(crate) struct Fingerprinter(State);

enum State {
    Raw {
        hasher: Sha256,
        body_len: u64,
    },
    #[cfg(feature = "json")]
    Json(Arc<JsonFingerprint>),
    Fn(Arc<FingerprintFn>),
}

impl Fingerprinter {
    /// Starts a fingerprint of a request with the head `parts`, `headers` being the layer's
    /// fingerprint headers.
    pub(crate) fn new(parts: &Parts, headers: &[HeaderName], method: &Method) -> Self {
        match method {
            Method::Raw => Self::raw(parts, headers, &[]),
            #[cfg(feature = "json")]
            Method::Json(json) if json.applies_to(parts) => Self(State::Json(json.clone())),
            #[cfg(feature = "json")]
            Method::Json(json) => Self::raw(parts, headers, &json.excluded_headers),
            Method::Fn(f) => Self(State::Fn(f.clone())),
        }
    }

    fn raw(parts: &Parts, headers: &[HeaderName], excluded: &[HeaderName]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(RAW_TAG);
        head(&mut hasher, parts, headers, excluded);
        Self(State::Raw {
            hasher,
            body_len: 0,
        })
    }

    /// Adds a chunk of the body (kept by the caller; only the raw fingerprint reads it here).
    pub(crate) fn update(&mut self, chunk: &[u8]) {
        if let State::Raw { hasher, body_len } = &mut self.0 {
            hasher.update(chunk);
            *body_len += chunk.len() as u64;
        }
    }

    /// Finishes the fingerprint. `body` is called for the whole body when the fingerprint
    /// needs it at once (not for the raw fingerprint, which has seen every chunk).
    pub(crate) fn finish(
        self,
        parts: &Parts,
        headers: &[HeaderName],
        body: impl FnOnce() -> Bytes,
    ) -> Fingerprint {
        #[cfg(not(feature = "json"))]
        let _ = headers;
        match self.0 {
            State::Raw {
                mut hasher,
                body_len,
            } => {
                // The body length goes last: the body is the only unprefixed field.
                hasher.update(body_len.to_be_bytes());
                Fingerprint(hasher.finalize().into())
            }
            #[cfg(feature = "json")]
            State::Json(json) => json.of_json_body(parts, headers, &body()),
            State::Fn(f) => {
                let theirs = f(parts, &body());
                let mut hasher = Sha256::new();
                hasher.update(FN_TAG);
                hasher.update(theirs.as_bytes());
                Fingerprint(hasher.finalize().into())
            }
        }
    }
}

/// Hashes the head of a request: method, path, query and the values of `headers` (but not
/// of those in `excluded`), each length-prefixed.
fn head(hasher: &mut Sha256, parts: &Parts, headers: &[HeaderName], excluded: &[HeaderName]) {
    field(hasher, parts.method.as_str().as_bytes());
    field(hasher, parts.uri.path().as_bytes());
    match parts.uri.query() {
        Some(q) => {
            hasher.update([1u8]);
            field(hasher, q.as_bytes());
        }
        None => hasher.update([0u8]),
    }
    for name in headers.iter().filter(|h| !excluded.contains(h)) {
        field(hasher, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        let count = values.iter().count() as u64;
        hasher.update(count.to_be_bytes());
        for v in values {
            field(hasher, v.as_bytes());
        }
    }
}

fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// A fingerprint over the **meaning** of a JSON body (feature `json`, on by default): the
/// same object with its members in another order, other whitespace, or other escapes and
/// number spellings of the same values (`4.50` and `4.5`) is the same request; any other
/// value is another request, answered `422`.
///
/// Set it with [`IdempotencyLayer::with_json_fingerprint`]. It covers what the raw
/// fingerprint covers (the method, the path, the query and the layer's
/// [fingerprint headers](crate::IdempotencyLayer::with_fingerprint_headers)), with the body
/// in its canonical form: RFC 8785 (JSON Canonicalization Scheme), except that numbers keep
/// their exact decimal value where an IEEE 754 double would round them, so `9007199254740993`
/// and `9007199254740992` stay two amounts (see below).
///
/// - **Which bodies.** A body is read as JSON when its `Content-Type` is `application/json`
///   or any `…/…+json` type (`application/merge-patch+json`), parameters allowed; with
///   [`with_any_content_type`](Self::with_any_content_type), whatever its `Content-Type`.
/// - **Fallback.** A body that is not valid JSON (invalid UTF-8, a syntax error, a lone
///   surrogate escape, a duplicate member name, more than 128 levels of nesting, an exponent
///   that does not fit in 64 bits, as written or once the number is put in `e` notation
///   behind its first significant digit), and every body of another `Content-Type`, is fingerprinted by its raw
///   bytes, exactly as without this setting (less the [excluded headers](Self::exclude_header)).
///   So such bodies must repeat byte for byte. A raw and a JSON fingerprint never collide:
///   each hashes its own tag first.
/// - **Excluded fields.** [`exclude`](Self::exclude) names a field by JSON Pointer (RFC 6901)
///   whose value does not count, such as a request id or a timestamp a client sets anew on
///   each attempt: the member is left out of the canonical form (an array element becomes
///   `null`, so the other elements keep their places).
/// - **Numbers.** RFC 8785 writes a number as the shortest decimal of the double nearest to
///   it, so two amounts a double cannot tell apart would be one request. Here a number is
///   written with its exact decimal value, in the RFC's layout: identical to RFC 8785 for
///   every number a conforming serialiser writes (`1e+30`, `4.5`, `0.002`, `1e-7`), and
///   different numbers never share a form.
///
/// Canonicalising needs the whole body at once: a JSON body is buffered as the layer always
/// buffers it, but hashed after it is read, not as it arrives, and a body that came in
/// several frames is joined into one (the handler sees one frame).
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::{IdempotencyLayer, JsonFingerprint, MemoryStore};
///
/// let fingerprint = JsonFingerprint::new()
///     .exclude("/metadata/request_id")?
///     .exclude_header(HeaderName::from_static("x-request-timestamp"));
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_fingerprint_headers([HeaderName::from_static("x-request-timestamp")])
///     .with_json_fingerprint(fingerprint);
///
/// // What the layer hashes of a body:
/// let fp = JsonFingerprint::new().exclude("/metadata/request_id")?;
/// let canonical = fp.canonicalize(br#"{ "b": 4.50, "a": [1e2], "metadata": {"request_id": 7} }"#);
/// assert_eq!(canonical.as_deref(), Some(&br#"{"a":[100],"b":4.5,"metadata":{}}"#[..]));
/// assert_eq!(fp.canonicalize(b"not json"), None);
/// # let _ = layer;
/// # Ok::<(), tower_idempotency::fingerprint::InvalidPointer>(())
/// ```
///
/// [`IdempotencyLayer::with_json_fingerprint`]: crate::IdempotencyLayer::with_json_fingerprint
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
#[derive(Clone, Debug, Default)]
pub struct JsonFingerprint {
    /// The excluded pointers, as given and as reference tokens.
    excluded: Vec<(String, Vec<String>)>,
    excluded_headers: Vec<HeaderName>,
    any_content_type: bool,
}

/// A JSON Pointer that is not one ([`JsonFingerprint::exclude`]): it must be empty or start
/// with `/`, and each `~` in it must be followed by `0` or `1` (RFC 6901).
#[cfg(feature = "json")]
#[cfg_attr(docsrs, doc(cfg(feature = "json")))]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid JSON Pointer {pointer:?}: it must be empty or start with `/`, and `~` must be followed by `0` or `1` (RFC 6901)"
)]
pub struct InvalidPointer {
    pointer: String,
}

#[cfg(feature = "json")]
impl InvalidPointer {
    /// The pointer as it was given.
    pub fn pointer(&self) -> &str {
        &self.pointer
    }
}

#[cfg(feature = "json")]
impl JsonFingerprint {
    /// A JSON fingerprint that excludes nothing and reads bodies whose `Content-Type` is JSON.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leaves the value at `pointer` (RFC 6901: `/metadata/request_id`, `/items/0/ts`; `~1`
    /// is `/` and `~0` is `~` in a name) out of the fingerprint. A member of an object is left
    /// out; an array element counts as `null`; the empty pointer `""` leaves out the whole
    /// body (any JSON body is then the same request, a non-JSON one is still compared by its
    /// bytes). A pointer that matches nothing in a body changes nothing.
    ///
    /// # Errors
    ///
    /// [`InvalidPointer`] when `pointer` is not a JSON Pointer.
    pub fn exclude(mut self, pointer: &str) -> Result<Self, InvalidPointer> {
        let tokens = crate::json::parse_pointer(pointer).ok_or_else(|| InvalidPointer {
            pointer: pointer.to_owned(),
        })?;
        self.excluded.push((pointer.to_owned(), tokens));
        Ok(self)
    }

    /// Leaves the request header `name` out of the fingerprint, though the layer names it in
    /// [`with_fingerprint_headers`](crate::IdempotencyLayer::with_fingerprint_headers): a
    /// signature or timestamp header that a sender sets anew on each delivery. (Headers the
    /// layer does not name are never part of the fingerprint.) Applies to raw-fallback bodies
    /// too.
    pub fn exclude_header(mut self, name: HeaderName) -> Self {
        if !self.excluded_headers.contains(&name) {
            self.excluded_headers.push(name);
        }
        self
    }

    /// Reads every body as JSON, whatever its `Content-Type` (or none), for handlers that
    /// parse JSON without looking at it. A body that is not JSON still falls back to its raw
    /// bytes.
    pub fn with_any_content_type(mut self) -> Self {
        self.any_content_type = true;
        self
    }

    /// The canonical form of `body` with the excluded fields left out: what this fingerprint
    /// hashes of a JSON body. `None` when `body` is not valid JSON (the layer then hashes its
    /// raw bytes).
    pub fn canonicalize(&self, body: &[u8]) -> Option<Vec<u8>> {
        let mut value = crate::json::parse(body)?;
        for (_, tokens) in &self.excluded {
            crate::json::exclude(&mut value, tokens);
        }
        let mut out = Vec::with_capacity(body.len());
        crate::json::write(&value, &mut out)?;
        Some(out)
    }

    /// The fingerprint of a complete request, as the layer computes it with this setting
    /// (`headers`: the layer's fingerprint headers). For tools and tests that predict it.
    pub fn fingerprint(&self, parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
        if self.applies_to(parts) {
            self.of_json_body(parts, headers, body)
        } else {
            raw(parts, headers, &self.excluded_headers, body)
        }
    }

    /// Whether the body of a request with this head is read as JSON.
    fn applies_to(&self, parts: &Parts) -> bool {
        if self.any_content_type {
            return true;
        }
        let mut values = parts.headers.get_all(http::header::CONTENT_TYPE).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => value.to_str().is_ok_and(is_json_media_type),
            _ => false,
        }
    }

    /// The fingerprint of a request whose body may be JSON: its canonical form, or its raw
    /// bytes when it is not JSON.
    fn of_json_body(&self, parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
        let Some(canonical) = self.canonicalize(body) else {
            return raw(parts, headers, &self.excluded_headers, body);
        };
        let mut hasher = Sha256::new();
        hasher.update(JSON_TAG);
        head(&mut hasher, parts, headers, &self.excluded_headers);
        field(&mut hasher, &canonical);
        Fingerprint(hasher.finalize().into())
    }
}

/// Whether a `Content-Type` is JSON: `application/json`, or a `+json` subtype of any type,
/// with any parameters, in any case.
#[cfg(feature = "json")]
fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    let token = |s: &str| !s.is_empty() && !s.contains(char::is_whitespace);
    if !token(kind) || !token(subtype) {
        return false;
    }
    (kind.eq_ignore_ascii_case("application") && subtype.eq_ignore_ascii_case("json"))
        || (subtype.len() > 5
            && subtype
                .get(subtype.len() - 5..)
                .is_some_and(|end| end.eq_ignore_ascii_case("+json")))
}

/// Computes the fingerprint of a complete request (head and whole body) in one call.
///
/// The layer computes the same value incrementally; this function is for stores, tests and
/// tools that need to predict it.
pub fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    raw(parts, headers, &[], body)
}

/// The raw fingerprint of a complete request, leaving out the `excluded` headers.
fn raw(parts: &Parts, headers: &[HeaderName], excluded: &[HeaderName], body: &[u8]) -> Fingerprint {
    let mut f = Fingerprinter::raw(parts, headers, excluded);
    f.update(body);
    f.finish(parts, headers, Bytes::new)
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
        let mut f = Fingerprinter::new(&p, &[], &Method::Raw);
        f.update(b"bo");
        f.update(b"dy");
        assert_eq!(f.finish(&p, &[], Bytes::new), fingerprint(&p, &[], b"body"));
    }

    /// The raw fingerprint's layout is fixed (stored fingerprints must stay valid): this
    /// digest was computed independently (Python's hashlib) from the documented layout.
    #[test]
    fn raw_fingerprint_layout_is_unchanged() {
        let tenant = HeaderName::from_static("x-tenant");
        let fp = fingerprint(&parts("POST", "/p?x=1"), &[tenant], b"body");
        assert_eq!(
            crate::hex::encode(fp.as_bytes()),
            "35862694a7798c601dc265cc39cfcaf78fdbf400e691122dbf2983df754509cd"
        );
    }

    #[test]
    fn hex_encodes() {}
}
