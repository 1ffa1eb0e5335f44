//! The response future of [`IdempotentClient`](super::IdempotentClient).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::ClientError;

pub(crate) type BoxCall<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<B>, ClientError<E>>> + Send>>;

/// Response future of [`IdempotentClient`](super::IdempotentClient): the whole call, every
/// attempt and wait included, in one boxed future. Dropping it stops the call (an attempt in
/// flight is dropped with it; the key makes a later call with the same key safe).
pub struct ResponseFuture<B, E> {
    inner: BoxCall<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: BoxCall<B, E>) -> Self {
        Self { inner }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<B>, ClientError<E>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
