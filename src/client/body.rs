//! [`ReplayBody`], the request body the inner client gets, and the reading of the caller's.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::ClientError;
use crate::body::{ReadError, read_frames};
use crate::error::BoxError;

/// The request body the inner service receives: the caller's body, read once in full and
/// sent again, byte for byte, on every attempt (its trailers too, if it had any).
///
/// Cloning it is cheap (reference counts).
#[derive(Clone, Debug, Default)]
pub struct ReplayBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl ReplayBody {
    /// The body's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_deref().unwrap_or_default()
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(data) = this.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// Reads `body` in full, up to `limit` bytes. A body that says it is longer (its size hint)
/// is refused before it is read.
pub(crate) async fn read_body<B, E>(body: B, limit: usize) -> Result<ReplayBody, ClientError<E>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ClientError::BodyTooLarge { limit });
    }
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let read = read_frames(body, limit, |mut data| {
        // A body of one frame (the usual case) is kept as it came, without a copy.
        let chunk = data.copy_to_bytes(data.remaining());
        match first.take() {
            None if joined.is_empty() => first = Some(chunk),
            earlier => {
                if let Some(earlier) = earlier {
                    joined.extend_from_slice(&earlier);
                }
                joined.extend_from_slice(&chunk);
            }
        }
    })
    .await;
    let trailers = match read {
        Ok(trailers) => trailers,
        Err(ReadError::TooLarge) => return Err(ClientError::BodyTooLarge { limit }),
        Err(ReadError::Failed(e)) => return Err(ClientError::Body(e)),
    };
    let data = first.or_else(|| (!joined.is_empty()).then(|| joined.freeze()));
    Ok(ReplayBody { data, trailers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_body_sends_its_bytes_then_its_trailers_then_ends() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-sum", http::HeaderValue::from_static("1"));
        let mut body = ReplayBody {
            data: Some(Bytes::from_static(b"abc")),
            trailers: Some(trailers.clone()),
        };
        assert_eq!(body.size_hint().exact(), Some(3));
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let Poll::Ready(Some(Ok(frame))) = Pin::new(&mut body).poll_frame(&mut cx) else {
            panic!("no data frame");
        };
        assert_eq!(frame.into_data().unwrap(), "abc");
        let Poll::Ready(Some(Ok(frame))) = Pin::new(&mut body).poll_frame(&mut cx) else {
            panic!("no trailers");
        };
        assert_eq!(frame.into_trailers().unwrap(), trailers);
        assert!(body.is_end_stream());
        assert!(matches!(
            Pin::new(&mut body).poll_frame(&mut cx),
            Poll::Ready(None)
        ));
    }
}
