//! The response future of [`Idempotency`](crate::Idempotency).

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::task::JoinHandle;

use crate::body::ResponseBody;

/// What the crate's futures answer when polled again after they finished: `Pending`, for
/// good. No Tower or hyper driver polls a finished future; a caller that does gets a future
/// that never finishes again, not a panic (the crate does not panic on its caller's misuse).
pub(crate) fn polled_after_finishing<T>() -> Poll<T> {
    Poll::Pending
}

pub(crate) type BoxResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// Spawns a keyed request's future on a runtime. A function pointer, made where the bounds
/// that spawning needs (`Send + 'static` output) are known, so that this future's `Future`
/// implementation needs none of them.
pub(crate) type Spawn<B, E> = fn(
    &tokio::runtime::Handle,
    BoxResponseFuture<B, E>,
) -> JoinHandle<Result<Response<ResponseBody<B>>, E>>;

pin_project! {
    /// Response future for [`Idempotency`](crate::Idempotency).
    ///
    /// Requests the layer does not cover, and requests it rejects before touching the store
    /// (no key, a malformed key), are served without allocating. Keyed requests run in one
    /// boxed future, polled here until it first has to wait and then moved into a Tokio task
    /// of its own, which this future waits for (dropping it does not cancel the task); or,
    /// with
    /// [`with_cancel_on_disconnect(true)`](crate::IdempotencyLayer::with_cancel_on_disconnect)
    /// or outside a Tokio runtime, in one boxed future.
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        Passthrough { #[pin] future: F },
        Keyed { future: BoxResponseFuture<B, E> },
        // Polled here until it first has to wait (most keyed requests on the memory store
        // answer at once), then moved into a task of its own, which a dropped response future
        // does not cancel.
        Detached {
            future: Option<BoxResponseFuture<B, E>>,
            runtime: tokio::runtime::Handle,
            spawn: Spawn<B, E>,
        },
        Spawned { task: JoinHandle<Result<Response<ResponseBody<B>>, E>> },
        Ready { response: Option<Response<ResponseBody<B>>> },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn keyed(future: BoxResponseFuture<B, E>) -> Self {
        Self {
            kind: Kind::Keyed { future },
        }
    }

    /// A keyed request that runs to its end even if this future is dropped: polled in place
    /// until it first waits, then moved into a task on `runtime`.
    pub(crate) fn detached(
        future: BoxResponseFuture<B, E>,
        runtime: tokio::runtime::Handle,
        spawn: Spawn<B, E>,
    ) -> Self {
        Self {
            kind: Kind::Detached {
                future: Some(future),
                runtime,
                spawn,
            },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B: Body, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Keyed { .. } => "Keyed",
            Kind::Detached { .. } => "Detached",
            Kind::Spawned { .. } => "Spawned",
            Kind::Ready { .. } => "Ready",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        if let KindProj::Detached {
            future,
            runtime,
            spawn,
        } = kind.as_mut().project()
        {
            let Some(running) = future.as_mut() else {
                return polled_after_finishing();
            };
            if let Poll::Ready(output) = running.as_mut().poll(cx) {
                *future = None;
                return Poll::Ready(output);
            }
            // It waits (for the store, the handler or a body): from here on it runs in a task,
            // so that a dropped response future cannot cut it. The task polls it again, which
            // registers its own wakers.
            let Some(waiting) = future.take() else {
                return Poll::Pending;
            };
            let task = spawn(runtime, waiting);
            kind.set(Kind::Spawned { task });
        }
        match kind.project() {
            KindProj::Passthrough { future } => {
                let res = ready!(future.poll(cx))?;
                Poll::Ready(Ok(res.map(ResponseBody::inner)))
            }
            KindProj::Keyed { future } => future.as_mut().poll(cx),
            // Moved on to `Spawned` above.
            KindProj::Detached { .. } => Poll::Pending,
            KindProj::Spawned { task } => match ready!(Pin::new(task).poll(cx)) {
                Ok(output) => Poll::Ready(output),
                // The handler panicked (its key was released as the task unwound): the panic
                // goes on here, as if the handler had run in this future.
                Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
                // Cancelled: the runtime is shutting down.
                Err(err) => {
                    tracing::error!(
                        error = &err as &dyn std::error::Error,
                        "idempotent request's task was cancelled"
                    );
                    let mut res = Response::new(ResponseBody::full(Bytes::new()));
                    *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    Poll::Ready(Ok(res))
                }
            },
            KindProj::Ready { response } => match response.take() {
                Some(res) => Poll::Ready(Ok(res)),
                None => polled_after_finishing(),
            },
        }
    }
}

pin_project! {
    /// Two futures in a row, in the room of the larger: `first` either breaks with the output
    /// or continues with a value from which `next` makes the second future.
    #[project = StepsProj]
    #[project_replace = StepsReplace]
    pub(crate) enum Steps<A, F, B> {
        First { #[pin] first: A, next: F },
        Second { #[pin] second: B },
        Done,
    }
}

impl<A, F, B> Steps<A, F, B> {
    pub(crate) fn new(first: A, next: F) -> Self {
        Self::First { first, next }
    }
}

impl<A, F, B, T> Future for Steps<A, F, B>
where
    A: Future<Output = ControlFlow<B::Output, T>>,
    F: FnOnce(T) -> B,
    B: Future,
{
    type Output = B::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                StepsProj::First { first, .. } => {
                    let flow = ready!(first.poll(cx));
                    let StepsReplace::First { next, .. } =
                        self.as_mut().project_replace(Self::Done)
                    else {
                        // The state was `First` just above.
                        return Poll::Pending;
                    };
                    match flow {
                        ControlFlow::Break(output) => return Poll::Ready(output),
                        ControlFlow::Continue(value) => self.set(Self::Second {
                            second: next(value),
                        }),
                    }
                }
                StepsProj::Second { second } => {
                    let output = ready!(second.poll(cx));
                    self.set(Self::Done);
                    return Poll::Ready(output);
                }
                StepsProj::Done => return polled_after_finishing(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use http::Response;
    use http_body_util::Full;

    use super::ResponseFuture;
    use crate::body::ResponseBody;

    type Inner = std::future::Ready<Result<Response<Full<bytes::Bytes>>, std::io::Error>>;

    /// A future polled again after it finished waits for good: no panic on a caller's misuse.
    #[test]
    fn a_finished_future_polled_again_is_pending_not_a_panic() {
        let mut cx = Context::from_waker(Waker::noop());
        let answer = ResponseFuture::<Inner, _, _>::ready(Response::new(ResponseBody::full(
            bytes::Bytes::from_static(b"done"),
        )));
        let mut answer = pin!(answer);
        assert!(matches!(answer.as_mut().poll(&mut cx), Poll::Ready(Ok(_))));
        assert!(answer.as_mut().poll(&mut cx).is_pending());
    }
}
