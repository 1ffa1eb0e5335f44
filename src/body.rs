//! The body types the layer hands to the inner service and back to the client.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::error::BoxError;

/// Chunks after the first one that are shorter than this are copied into a shared buffer
/// instead of being kept as handles of their own.
const SMALL_CHUNK: usize = 4 * 1024;

/// A buffer of copied small chunks is closed (and a new one begun) at this size.
const COALESCED: usize = 64 * 1024;

/// Buffered body chunks, in order.
///
/// The first chunk is kept inline and as it came: most bodies arrive in one frame, and then
/// buffering them allocates and copies nothing. Later chunks of [`SMALL_CHUNK`] bytes or more
/// are kept as they came too (no copy); smaller ones are copied into buffers of up to
/// [`COALESCED`] bytes, so that a body sent a byte at a time is a few buffers, not a handle
/// (and an allocation) per byte.
#[derive(Default)]
pub(crate) struct Chunks {
    first: Option<Bytes>,
    // Boxed: a body of one frame never needs it, and keeps `Chunks` small.
    rest: Option<Box<Rest>>,
}

/// The chunks after the first.
#[derive(Default)]
struct Rest {
    chunks: VecDeque<Bytes>,
    /// Small chunks, copied; they come after everything in `chunks`.
    small: BytesMut,
}

impl Rest {
    /// Moves the buffer of small chunks to the end of `chunks`.
    fn close_small(&mut self) {
        if !self.small.is_empty() {
            self.chunks
                .push_back(std::mem::take(&mut self.small).freeze());
        }
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.small.is_empty()
    }
}

impl Chunks {
    /// Appends a chunk (all pushes come before the first pop).
    pub(crate) fn push(&mut self, chunk: Bytes) {
        if self.is_empty() {
            self.first = Some(chunk);
            return;
        }
        let rest = self.rest.get_or_insert_with(Box::default);
        if chunk.len() >= SMALL_CHUNK {
            rest.close_small();
            rest.chunks.push_back(chunk);
        } else {
            if rest.small.len() + chunk.len() > COALESCED {
                rest.close_small();
            }
            rest.small.extend_from_slice(&chunk);
        }
    }

    pub(crate) fn pop_front(&mut self) -> Option<Bytes> {
        if let Some(first) = self.first.take() {
            return Some(first);
        }
        let rest = self.rest.as_mut()?;
        rest.close_small();
        rest.chunks.pop_front()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.first.is_none() && self.rest.as_ref().is_none_or(|r| r.is_empty())
    }

    pub(crate) fn byte_len(&self) -> u64 {
        let first = self.first.as_ref().map_or(0, |c| c.len() as u64);
        let rest = self.rest.as_ref().map_or(0, |r| {
            r.chunks.iter().map(|c| c.len() as u64).sum::<u64>() + r.small.len() as u64
        });
        first + rest
    }

    /// All chunks as one `Bytes`, copying only when there are several.
    pub(crate) fn into_bytes(mut self) -> Bytes {
        if self.rest.as_ref().is_none_or(|r| r.is_empty()) {
            return self.first.unwrap_or_default();
        }
        let len = usize::try_from(self.byte_len()).unwrap_or(usize::MAX);
        let mut all = BytesMut::with_capacity(len);
        while let Some(c) = self.pop_front() {
            all.extend_from_slice(&c);
        }
        all.freeze()
    }
}

pin_project! {
    /// The request body seen by the inner service.
    ///
    /// Requests the layer does not cover pass their body through untouched. Keyed requests
    /// were read in full (to fingerprint them before the handler runs); their body is replayed
    /// from the buffered chunks. Frames of 4 KiB or more, and the first frame whatever its
    /// size, are handed on as they came, without a copy; smaller frames after the first are
    /// joined into frames of up to 64 KiB, so the handler may see fewer, larger frames than the
    /// client sent (the same bytes, in the same order).
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Passthrough { #[pin] body: B },
        // Trailers are rare: boxed, they keep the body small.
        Buffered { chunks: Chunks, trailers: Option<Box<HeaderMap>>, remaining: u64 },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: RequestKind::Passthrough { body },
        }
    }

    pub(crate) fn buffered(chunks: Chunks, trailers: Option<Box<HeaderMap>>) -> Self {
        let remaining = chunks.byte_len();
        Self {
            kind: RequestKind::Buffered {
                chunks,
                trailers,
                remaining,
            },
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Passthrough { body } => body.poll_frame(cx),
            RequestKindProj::Buffered {
                chunks,
                trailers,
                remaining,
            } => Poll::Ready(match chunks.pop_front() {
                Some(chunk) => {
                    *remaining -= chunk.len() as u64;
                    Some(Ok(Frame::data(chunk)))
                }
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Passthrough { body } => body.is_end_stream(),
            RequestKind::Buffered {
                chunks, trailers, ..
            } => chunks.is_empty() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Passthrough { body } => body.size_hint(),
            RequestKind::Buffered { remaining, .. } => SizeHint::with_exact(*remaining),
        }
    }
}

pin_project! {
    /// The response body the layer returns.
    ///
    /// Either the handler's own body (passthrough, or an answer too large to store whose
    /// buffered head is sent first), or a complete body (a replay, a rejection, or a handler
    /// answer that was buffered to be stored, followed by the handler's trailers if it sent
    /// any: they are not stored, so a replay has none).
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B: Body> {
        Inner { #[pin] body: B },
        // Trailers are rare: boxed, they keep the body small.
        Full { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
        Prefixed { head: Chunks, rest: Pin<Box<B>> },
        Failed { head: Chunks, error: Option<B::Error> },
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: ResponseKind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self::full_with_trailers(data, None)
    }

    /// A complete body, then its trailers.
    pub(crate) fn full_with_trailers(data: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        Self {
            kind: ResponseKind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    pub(crate) fn prefixed(head: Chunks, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: ResponseKind::Prefixed { head, rest },
        }
    }

    pub(crate) fn failed(head: Chunks, error: B::Error) -> Self {
        Self {
            kind: ResponseKind::Failed {
                head,
                error: Some(error),
            },
        }
    }
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Inner { body } => body.poll_frame(cx),
            ResponseKindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
            ResponseKindProj::Prefixed { head, rest } => match head.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => rest.as_mut().poll_frame(cx),
            },
            ResponseKindProj::Failed { head, error } => Poll::Ready(match head.pop_front() {
                Some(chunk) => Some(Ok(Frame::data(chunk))),
                None => error.take().map(Err),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner { body } => body.is_end_stream(),
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseKind::Prefixed { head, rest } => head.is_empty() && rest.is_end_stream(),
            ResponseKind::Failed { head, error } => head.is_empty() && error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner { body } => body.size_hint(),
            ResponseKind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseKind::Prefixed { head, rest } => {
                let h = head.byte_len();
                let r = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(r.lower() + h);
                if let Some(u) = r.upper() {
                    hint.set_upper(u + h);
                }
                hint
            }
            ResponseKind::Failed { .. } => SizeHint::default(),
        }
    }
}

/// Why [`read_frames`] stopped before the body's end.
pub(crate) enum ReadError {
    /// The body's data passed `limit` bytes.
    TooLarge,
    /// The body failed.
    Failed(BoxError),
}

/// Reads `body` to its end, at most `limit` bytes of data: each non-empty data frame goes to
/// `data` as it arrives; trailers (every trailer frame, merged) are returned. The one loop over
/// a body's frames that the layer (a request it keeps) and the client (a body it sends again)
/// both read with.
pub(crate) async fn read_frames<B>(
    body: B,
    limit: usize,
    mut data: impl FnMut(B::Data),
) -> Result<Option<HeaderMap>, ReadError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    let mut trailers: Option<HeaderMap> = None;
    let mut len = 0usize;
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        match frame.map_err(|e| ReadError::Failed(e.into()))?.into_data() {
            Ok(chunk) => {
                len = len.saturating_add(chunk.remaining());
                if len > limit {
                    return Err(ReadError::TooLarge);
                }
                if chunk.has_remaining() {
                    data(chunk);
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    Ok(trailers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn buffered_body_replays_its_chunks_then_its_trailers() {
        let mut chunks = Chunks::default();
        chunks.push(Bytes::from_static(b"ab"));
        chunks.push(Bytes::from_static(b"c"));
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
        let body = RequestBody::<http_body_util::Empty<Bytes>>::buffered(
            chunks,
            Some(Box::new(trailers.clone())),
        );
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "abc");
    }

    #[test]
    fn small_chunks_are_coalesced_and_keep_their_order() {
        let mut chunks = Chunks::default();
        let mut expected = Vec::new();
        let mut push = |chunks: &mut Chunks, chunk: Bytes| {
            expected.extend_from_slice(&chunk);
            chunks.push(chunk);
        };
        let first = Bytes::from_static(b"first");
        push(&mut chunks, first.clone());
        for i in 0..(3 * COALESCED) {
            push(
                &mut chunks,
                Bytes::from(vec![u8::try_from(i % 251).unwrap()]),
            );
        }
        let large = Bytes::from(vec![7u8; SMALL_CHUNK]);
        push(&mut chunks, large.clone());
        push(&mut chunks, Bytes::from_static(b"last"));
        assert_eq!(chunks.byte_len(), expected.len() as u64);

        let mut popped = Vec::new();
        while let Some(chunk) = chunks.pop_front() {
            popped.push(chunk);
        }
        // The first chunk and the large one are the caller's own buffers, not copies.
        assert_eq!(popped[0].as_ptr(), first.as_ptr());
        assert!(popped.iter().any(|c| c.as_ptr() == large.as_ptr()));
        // first, three full buffers of one-byte chunks, the large chunk, "last".
        assert_eq!(
            popped.len(),
            6,
            "{:?}",
            popped.iter().map(Bytes::len).collect::<Vec<_>>()
        );
        assert_eq!(popped.concat(), expected);
        assert!(chunks.is_empty());
    }

    #[test]
    fn into_bytes_keeps_a_single_chunk_and_joins_several() {
        let one = Bytes::from_static(b"only");
        let mut chunks = Chunks::default();
        chunks.push(one.clone());
        assert_eq!(chunks.into_bytes().as_ptr(), one.as_ptr());

        let mut chunks = Chunks::default();
        for part in [&b"a"[..], b"b", b"c"] {
            chunks.push(Bytes::from_static(part));
        }
        assert_eq!(chunks.byte_len(), 3);
        assert_eq!(chunks.into_bytes(), "abc");
    }
}
