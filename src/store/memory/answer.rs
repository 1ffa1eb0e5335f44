//! A stored answer as the memory store keeps it: one allocation.

use bytes::{Buf, BufMut, Bytes};
use http::StatusCode;

use crate::error::StoreError;
use crate::response::StoredResponse;

/// An answer in one boxed buffer: the status (`u16`), whether it has a body (`u8`), the length
/// of the headers' encoding (`u32`), the headers as
/// [`StoredResponse::encode_headers`] writes them, and the body.
///
/// A [`StoredResponse`] of a small JSON answer holds four allocations, the largest a
/// `HeaderMap`'s table of six entries whatever the number of headers (about 900 bytes for a
/// 60-byte body); this holds one (about 110). A replay decodes it into a new
/// [`StoredResponse`], copying the body.
pub(super) struct Answer(Box<[u8]>);

/// The status, the body flag and the headers' length.
const HEAD: usize = 2 + 1 + 4;

impl Answer {
    pub(super) fn encode(answer: &StoredResponse) -> Self {
        let headers = answer.encoded_headers_len();
        let body = answer.body().map_or(&[][..], |b| &b[..]);
        // One allocation, of the exact size: the headers are encoded in place.
        let mut out = Vec::with_capacity(HEAD + headers + body.len());
        out.put_u16(answer.status().as_u16());
        out.put_u8(u8::from(answer.body().is_some()));
        // Headers are far shorter than 4 GiB (hyper caps a whole head at a few hundred KiB);
        // saturating, the decoding would report the answer corrupt rather than misread it.
        out.put_u32(u32::try_from(headers).unwrap_or(u32::MAX));
        answer.encode_headers_into(&mut out);
        out.put_slice(body);
        Self(out.into_boxed_slice())
    }

    /// The bytes it holds.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn decode(&self) -> Result<StoredResponse, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("stored answer: {what}"));
        let mut buf = &self.0[..];
        if buf.remaining() < HEAD {
            return Err(corrupt("truncated"));
        }
        let status = StatusCode::from_u16(buf.get_u16()).map_err(|_| corrupt("bad status"))?;
        let has_body = buf.get_u8() != 0;
        let n = usize::try_from(buf.get_u32()).map_err(|_| corrupt("headers too long"))?;
        let (headers, body) = buf
            .split_at_checked(n)
            .ok_or_else(|| corrupt("truncated headers"))?;
        let body = has_body.then(|| Bytes::copy_from_slice(body));
        StoredResponse::decode(status, headers, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderValue, header};

    #[test]
    fn answers_round_trip() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.append("x-multi", HeaderValue::from_static("1"));
        h.append("x-multi", HeaderValue::from_static("2"));
        h.insert("x-bin", HeaderValue::from_bytes(b"\xff\x80ok").unwrap());
        for answer in [
            StoredResponse::new(StatusCode::CREATED, h.clone(), Bytes::from_static(b"{}")),
            StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new()),
            StoredResponse::without_body(StatusCode::ACCEPTED, h),
        ] {
            let stored = Answer::encode(&answer);
            assert_eq!(stored.decode().unwrap(), answer);
        }
    }
}
