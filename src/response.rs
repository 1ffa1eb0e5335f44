//! The stored response and its encoding.

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

use crate::error::StoreError;

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response remembered with its key, replayed for repeats.
///
/// It keeps the status, the headers (less those [`is_replayable_header`] drops), the body and
/// the trailers (gRPC's `grpc-status` travels in them). When the handler's body was larger
/// than the layer's storage limit, the record keeps
/// the status and headers only ([`body`](StoredResponse::body) is `None`); a repeat is then
/// answered `409` with a problem document that names the original status, and the handler is
/// not run again.
///
/// Cloning is cheap (a reference count): stores may keep a clone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse(Arc<Inner>);

#[derive(Clone, Debug, PartialEq, Eq)]
struct Inner {
    status: StatusCode,
    headers: HeaderMap,
    body: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

/// Between the headers and the trailers in [`StoredResponse::encode_headers`]' output: a name
/// length of zero, which no header has (a header name is never empty).
const TRAILERS_FOLLOW: [u8; 2] = [0, 0];

impl StoredResponse {
    /// A complete response.
    pub fn new(status: StatusCode, headers: HeaderMap, body: Bytes) -> Self {
        Self(Arc::new(Inner {
            status,
            headers,
            body: Some(body),
            trailers: None,
        }))
    }

    /// A response whose body was too large to store.
    pub fn without_body(status: StatusCode, headers: HeaderMap) -> Self {
        Self(Arc::new(Inner {
            status,
            headers,
            body: None,
            trailers: None,
        }))
    }

    /// This response with `trailers` after its body (none when the map is empty).
    pub fn with_trailers(self, trailers: HeaderMap) -> Self {
        let mut inner = Arc::try_unwrap(self.0).unwrap_or_else(|shared| (*shared).clone());
        inner.trailers = (!trailers.is_empty()).then_some(trailers);
        Self(Arc::new(inner))
    }

    /// The trailers sent after the body, if there were any.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.0.trailers.as_ref()
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The stored headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.0.headers
    }

    /// The body, or `None` when it was too large to store.
    pub fn body(&self) -> Option<&Bytes> {
        self.0.body.as_ref()
    }

    /// Splits the response into its status, headers and body (copying the headers only when
    /// a store still holds this response).
    pub fn into_parts(self) -> (StatusCode, HeaderMap, Option<Bytes>) {
        let inner = Arc::try_unwrap(self.0).unwrap_or_else(|shared| (*shared).clone());
        (inner.status, inner.headers, inner.body)
    }

    /// The headers alone (copied only when a store still holds this response).
    pub(crate) fn into_headers(mut self) -> HeaderMap {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => std::mem::take(&mut inner.headers),
            None => self.0.headers.clone(),
        }
    }

    /// Encodes the headers, and the trailers if any, for storage: for each header, a
    /// big-endian `u16` name length, the name, a `u32` value length and the value; then, when
    /// there are trailers, a `u16` zero (no header name is empty) and the trailers the same
    /// way. An encoding without trailers is the headers alone, as before trailers were kept.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_headers_len());
        self.encode_headers_into(&mut out);
        out
    }

    /// The length of [`encode_headers`](StoredResponse::encode_headers)' output.
    pub(crate) fn encoded_headers_len(&self) -> usize {
        let len = |map: &HeaderMap| -> usize {
            map.iter()
                .map(|(n, v)| 6 + n.as_str().len() + v.len())
                .sum()
        };
        len(&self.0.headers) + self.0.trailers.as_ref().map_or(0, |t| 2 + len(t))
    }

    /// Appends what [`encode_headers`](StoredResponse::encode_headers) returns to `out`, so a
    /// store can write the headers into its own buffer without a second allocation.
    pub(crate) fn encode_headers_into(&self, out: &mut Vec<u8>) {
        encode_map(&self.0.headers, out);
        if let Some(trailers) = &self.0.trailers {
            out.put_slice(&TRAILERS_FOLLOW);
            encode_map(trailers, out);
        }
    }

    /// Decodes the headers written by [`encode_headers`](StoredResponse::encode_headers),
    /// without the trailers.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] when the bytes are not a valid encoding.
    pub fn decode_headers(bytes: &[u8]) -> Result<HeaderMap, StoreError> {
        Self::decode_head(bytes).map(|(headers, _)| headers)
    }

    /// Decodes what [`encode_headers`](StoredResponse::encode_headers) wrote: the headers,
    /// and the trailers when there were any.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] when the bytes are not a valid encoding.
    pub fn decode_head(bytes: &[u8]) -> Result<(HeaderMap, Option<HeaderMap>), StoreError> {
        let mut bytes = bytes;
        let headers = decode_map(&mut bytes)?;
        if !bytes.has_remaining() {
            return Ok((headers, None));
        }
        // `decode_map` stops only at the end or at the marker, which it leaves.
        bytes.advance(TRAILERS_FOLLOW.len());
        let trailers = decode_map(&mut bytes)?;
        if bytes.has_remaining() {
            return Err(StoreError::Corrupt("a second set of trailers".into()));
        }
        Ok((headers, Some(trailers)))
    }

    /// A stored answer as a store reads it back: its status, what
    /// [`encode_headers`](StoredResponse::encode_headers) wrote, and its body (`None` when it
    /// was too large to store).
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] when the head is not a valid encoding.
    pub fn decode(
        status: StatusCode,
        head: &[u8],
        body: Option<Bytes>,
    ) -> Result<Self, StoreError> {
        let (headers, trailers) = Self::decode_head(head)?;
        Ok(Self(Arc::new(Inner {
            status,
            headers,
            body,
            trailers: trailers.filter(|t| !t.is_empty()),
        })))
    }
}

/// Appends `map` in the encoding of [`StoredResponse::encode_headers`].
fn encode_map(map: &HeaderMap, out: &mut Vec<u8>) {
    for (name, value) in map {
        // Header names are far shorter than 64 KiB and values than 4 GiB in any HTTP
        // implementation (hyper caps a whole head at a few hundred KiB); saturate anyway.
        let n = name.as_str().as_bytes();
        out.put_u16(u16::try_from(n.len()).unwrap_or(u16::MAX));
        out.put_slice(n);
        out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
        out.put_slice(value.as_bytes());
    }
}

/// Reads headers in the encoding of [`StoredResponse::encode_headers`] up to the end of
/// `bytes` or up to the trailers' marker, which it leaves in `bytes`.
fn decode_map(bytes: &mut &[u8]) -> Result<HeaderMap, StoreError> {
    let corrupt = |what: &'static str| StoreError::Corrupt(what.into());
    let mut headers = HeaderMap::new();
    while bytes.has_remaining() {
        if bytes.starts_with(&TRAILERS_FOLLOW) {
            break;
        }
        if bytes.remaining() < 2 {
            return Err(corrupt("truncated header name length"));
        }
        let n = usize::from(bytes.get_u16());
        if bytes.remaining() < n + 4 {
            return Err(corrupt("truncated header name"));
        }
        let name = HeaderName::from_bytes(&bytes[..n])
            .map_err(|_| corrupt("invalid stored header name"))?;
        bytes.advance(n);
        let v = usize::try_from(bytes.get_u32()).map_err(|_| corrupt("header too long"))?;
        if bytes.remaining() < v {
            return Err(corrupt("truncated header value"));
        }
        let value = HeaderValue::from_bytes(&bytes[..v])
            .map_err(|_| corrupt("invalid stored header value"))?;
        bytes.advance(v);
        headers
            .try_append(name, value)
            .map_err(|_| corrupt("more stored headers than a header map holds"))?;
    }
    Ok(headers)
}

/// Whether a response header is stored and replayed, before the layer's
/// [`ReplayedHeaders`] policy is applied.
///
/// Dropped: the hop-by-hop headers (`Connection`, `Keep-Alive`, `Proxy-Connection`, `TE`,
/// `Trailer`, `Transfer-Encoding`, `Upgrade`, and any named in `Connection`), `Date` (the
/// replay is a new message; the server adds a fresh one), `Content-Length` (recomputed from the
/// stored body, so it can never disagree with it), and the credential-like headers:
/// `Authentication-Info` and `Proxy-Authentication-Info` always, `Set-Cookie` unless
/// `keep_set_cookie`. A credential replayed hands it to whoever holds the key — within the
/// same scope, but possibly after the session it belonged to was ended.
pub fn is_replayable_header(name: &HeaderName, keep_set_cookie: bool) -> bool {
    !(name == header::CONNECTION
        || name == "authentication-info"
        || name == "proxy-authentication-info"
        || name == "keep-alive"
        || name == "proxy-connection"
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::DATE
        || name == header::CONTENT_LENGTH
        || name == IDEMPOTENT_REPLAYED
        || (!keep_set_cookie && name == header::SET_COOKIE))
}

/// Which response headers the layer stores and replays
/// ([`IdempotencyLayer::with_replayed_headers`](crate::IdempotencyLayer::with_replayed_headers)),
/// among those [`is_replayable_header`] keeps. `Content-Type` is always replayed; hop-by-hop
/// and credential-like headers never are (`Set-Cookie` only with
/// [`with_replayed_set_cookie`](crate::IdempotencyLayer::with_replayed_set_cookie)).
///
/// The default replays every other header ([`ReplayedHeaders::all_but`] of nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayedHeaders {
    allow: bool,
    names: Arc<[HeaderName]>,
}

impl ReplayedHeaders {
    /// A denylist: every header but those named.
    pub fn all_but(names: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            allow: false,
            names: names.into_iter().collect(),
        }
    }

    /// An allowlist: only the headers named (and `Content-Type`).
    pub fn only(names: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            allow: true,
            names: names.into_iter().collect(),
        }
    }

    /// Whether the policy keeps `name` (the fixed rules of [`is_replayable_header`] aside).
    fn keeps(&self, name: &HeaderName) -> bool {
        if self.allow {
            name == header::CONTENT_TYPE || self.names.contains(name)
        } else {
            !self.names.contains(name)
        }
    }

    /// The default: nothing more is dropped.
    fn keeps_all(&self) -> bool {
        !self.allow && self.names.is_empty()
    }
}

/// Whether every header of a live response is stored for replay, as most answers' are (they
/// carry no header that is dropped, and so no `Connection` header either).
pub(crate) fn keeps_every_header(
    headers: &HeaderMap,
    keep_set_cookie: bool,
    policy: &ReplayedHeaders,
) -> bool {
    policy.keeps_all()
        && headers
            .keys()
            .all(|name| is_replayable_header(name, keep_set_cookie))
}

/// Copies the headers of a live response that are stored for replay.
pub(crate) fn replayable_headers(
    headers: &HeaderMap,
    keep_set_cookie: bool,
    policy: &ReplayedHeaders,
) -> HeaderMap {
    let kept =
        |name: &HeaderName| is_replayable_header(name, keep_set_cookie) && policy.keeps(name);
    // Copied whole, the map is not rehashed entry by entry.
    if keeps_every_header(headers, keep_set_cookie, policy) {
        return headers.clone();
    }
    // Headers named by `Connection` are hop-by-hop too.
    let connection_named: Vec<&[u8]> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !kept(name) {
            continue;
        }
        if connection_named
            .iter()
            .any(|t| t.eq_ignore_ascii_case(name.as_str().as_bytes()))
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.append("x-multi", HeaderValue::from_static("1"));
        h.append("x-multi", HeaderValue::from_static("2"));
        h.insert("x-bin", HeaderValue::from_bytes(b"\xff\x80ok").unwrap());
        let r = StoredResponse::new(StatusCode::CREATED, h.clone(), Bytes::from_static(b"{}"));
        let decoded = StoredResponse::decode_headers(&r.encode_headers()).unwrap();
        assert_eq!(decoded, h);
        assert_eq!(
            decoded.get_all("x-multi").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
    }

    #[test]
    fn trailers_round_trip_after_the_headers_and_old_encodings_read_without_them() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        let mut t = HeaderMap::new();
        t.insert("grpc-status", HeaderValue::from_static("0"));
        t.append("x-multi", HeaderValue::from_static("1"));
        t.append("x-multi", HeaderValue::from_static("2"));
        let plain = StoredResponse::new(StatusCode::OK, h.clone(), Bytes::from_static(b"m"));
        let with = plain.clone().with_trailers(t.clone());
        let enc = with.encode_headers();
        assert_eq!(enc.len(), with.encoded_headers_len());
        // Without trailers, the encoding is the headers alone, as it always was.
        assert!(enc.starts_with(&plain.encode_headers()));
        assert_eq!(plain.encode_headers().len(), plain.encoded_headers_len());
        let decoded =
            StoredResponse::decode(StatusCode::OK, &enc, Some(Bytes::from_static(b"m"))).unwrap();
        assert_eq!(decoded, with);
        assert_eq!(decoded.trailers(), Some(&t));
        assert_eq!(StoredResponse::decode_headers(&enc).unwrap(), h);
        let old = StoredResponse::decode(StatusCode::OK, &plain.encode_headers(), None).unwrap();
        assert_eq!(old.trailers(), None);
        // Empty trailers are no trailers.
        assert_eq!(plain.clone().with_trailers(HeaderMap::new()), plain);
        // A second marker, or a truncated trailer, is corrupt, never a panic.
        let mut twice = enc.clone();
        twice.extend_from_slice(&TRAILERS_FOLLOW);
        assert!(StoredResponse::decode_head(&twice).is_err());
        for cut in 0..enc.len() {
            let _ = StoredResponse::decode_head(&enc[..cut]);
        }
    }

    #[test]
    fn corrupt_headers_are_errors_not_panics() {
        let mut h = HeaderMap::new();
        h.insert("x-a", HeaderValue::from_static("value"));
        let enc = StoredResponse::new(StatusCode::OK, h, Bytes::new()).encode_headers();
        for cut in 0..enc.len() {
            assert!(StoredResponse::decode_headers(&enc[..cut]).is_err() || cut == 0);
        }
        assert!(StoredResponse::decode_headers(&[0, 1, b' ', 0, 0, 0, 0]).is_err());
    }

    /// A `HeaderMap` holds at most 24,576 names (`http`'s limit; appending past it panics).
    /// An encoding with more, which no stored response can produce but a store's record can
    /// hold, is corrupt.
    #[test]
    fn more_names_than_a_header_map_holds_are_corrupt_not_a_panic() {
        let mut encoded = Vec::new();
        for i in 0..30_000 {
            let name = format!("x-{i}");
            encoded.put_u16(u16::try_from(name.len()).unwrap());
            encoded.put_slice(name.as_bytes());
            encoded.put_u32(1);
            encoded.put_u8(b'v');
        }
        assert!(matches!(
            StoredResponse::decode_headers(&encoded),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn filters_hop_by_hop_date_and_cookies() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert(header::DATE, HeaderValue::from_static("now"));
        h.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.insert(header::LOCATION, HeaderValue::from_static("/p/1"));
        let kept = replayable_headers(&h, false, &ReplayedHeaders::default());
        assert_eq!(kept.len(), 2);
        assert!(kept.contains_key(header::CONTENT_TYPE) && kept.contains_key(header::LOCATION));
        assert!(
            replayable_headers(&h, true, &ReplayedHeaders::default())
                .contains_key(header::SET_COOKIE)
        );
    }

    #[test]
    fn keeps_every_header_of_an_answer_without_dropped_ones() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.append("x-multi", HeaderValue::from_static("1"));
        h.append("x-multi", HeaderValue::from_static("2"));
        assert_eq!(
            replayable_headers(&h, false, &ReplayedHeaders::default()),
            h
        );
        h.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        assert_eq!(replayable_headers(&h, true, &ReplayedHeaders::default()), h);
        assert_eq!(
            replayable_headers(&h, false, &ReplayedHeaders::default()).len(),
            3
        );
    }

    #[test]
    fn credential_like_headers_are_never_replayed() {
        let mut h = HeaderMap::new();
        h.insert(
            "authentication-info",
            HeaderValue::from_static("nextnonce=x"),
        );
        h.insert("proxy-authentication-info", HeaderValue::from_static("y"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let kept = replayable_headers(&h, true, &ReplayedHeaders::default());
        assert_eq!(kept.keys().collect::<Vec<_>>(), [header::CONTENT_TYPE]);
    }

    #[test]
    fn allow_and_deny_lists() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.insert(header::LOCATION, HeaderValue::from_static("/p/1"));
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        h.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        let deny = ReplayedHeaders::all_but([HeaderName::from_static("x-request-id")]);
        let kept = replayable_headers(&h, false, &deny);
        assert!(kept.contains_key(header::LOCATION) && !kept.contains_key("x-request-id"));
        assert!(kept.contains_key(header::CONTENT_TYPE) && !kept.contains_key(header::SET_COOKIE));
        let allow = ReplayedHeaders::only([header::LOCATION, header::SET_COOKIE]);
        let kept = replayable_headers(&h, false, &allow);
        // Content-Type always; Set-Cookie only with its own switch.
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.contains_key(header::LOCATION) && kept.contains_key(header::CONTENT_TYPE));
        assert!(replayable_headers(&h, true, &allow).contains_key(header::SET_COOKIE));
    }
}
