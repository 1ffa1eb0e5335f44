//! Plain mode: claim the key in the store, run the handler, store its answer.
//!
//! A keyed request runs in one task (or, with `cancel_on_disconnect`, one boxed future), whose
//! size is what every keyed request allocates and moves. An `async fn` for the whole run would keep each part of it at once: the request
//! head while the handler runs, the handler's future while its answer is stored. So the run is
//! two steps, chained by [`Steps`] so that they share their room:
//!
//! 1. [`claim`] (an `async` block): read and fingerprint the request, claim its key;
//! 2. [`Handling`] (by hand, each state holding only what it needs): run the handler and read
//!    its answer while renewing the lease, then store the answer or release the key.

use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::answer::{Keep, ToStore, answer_taken, render, to_store};
use crate::body::{RequestBody, ResponseBody};
use crate::config::Config;
use crate::error::BoxError;
use crate::future::{Steps, polled_after_finishing};
use crate::key::IdempotencyKey;
use crate::lease::Lease;
use crate::outcome::{
    InFlightGauge, Operation, Outcome, acquired_or_taken, log_store_error, record, store_call,
};
use crate::rejection::Rejection;
use crate::request::{Buffered, Keyed, read_request};
use crate::store::{ClaimRequest, Store};
use crate::wait::claim_or_wait;
use held::{Held, ReleaseGuard, Renewal, poll_renewal};

mod held;

type BoxTask = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs a keyed request in plain mode.
pub(crate) fn run_plain<St, S, ReqBody, ResBody>(
    store: St,
    keyed: Keyed,
    inner: S,
    req: Request<ReqBody>,
) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>> + Send
where
    St: Store,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    let Keyed { config, key } = keyed;
    let (parts, body) = req.into_parts();
    Steps::new(claim(store, config, key, parts, body), move |claimed| {
        Handling::start(claimed, inner)
    })
}

/// A claimed key and its request, read in full.
struct Claimed<St> {
    held: Held<St>,
    parts: Parts,
    buffered: Buffered,
    config: Arc<Config>,
}

/// Step 1: reads and fingerprints the request and claims its key. Breaks with the layer's
/// own answer when the handler is not to run (a rejection, a replay, a key in flight).
///
/// Not an `async fn`: one keeps a copy of each argument besides the argument itself (the
/// request head twice); an `async` block uses what it captured in place.
#[allow(clippy::manual_async_fn)]
fn claim<St, ReqBody, ResBody, E>(
    store: St,
    config: Arc<Config>,
    key: IdempotencyKey,
    parts: Parts,
    body: ReqBody,
) -> impl Future<Output = ControlFlow<Result<Response<ResponseBody<ResBody>>, E>, Claimed<St>>>
where
    St: Store,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    async move {
        let (scope, fingerprint, buffered) = match read_request(&config, &parts, body).await {
            Ok(read) => read,
            Err(rejected) => return ControlFlow::Break(Ok(rejected)),
        };
        let request = ClaimRequest {
            scope: &scope,
            key: &key,
            fingerprint,
            lease: config.lease,
            ttl: config.ttl,
        };
        let claim = || {
            // The lease runs from some moment after this: renewals count from here.
            let sent = Instant::now();
            let call = store_call(Operation::Claim, config.store_timeout, store.claim(request));
            async move {
                Ok(acquired_or_taken(call.await?).map(|(token, takeover)| (token, takeover, sent)))
            }
        };
        let answer = match claim_or_wait(&config, &store, &scope, &key, claim).await {
            Ok(Ok((token, takeover, claimed_at))) => {
                record(if takeover {
                    Outcome::Takeover
                } else {
                    Outcome::Executed
                });
                return ControlFlow::Continue(Claimed {
                    held: Held {
                        store,
                        scope,
                        key,
                        token,
                        claimed_at,
                        lease: config.lease,
                        timeout: config.store_timeout,
                    },
                    parts,
                    buffered,
                    config,
                });
            }
            Ok(Err(taken)) => answer_taken(&config, taken),
            Err(err) => {
                record(Outcome::StoreError);
                log_store_error(&err, "claim a key; answered 503");
                render(&config, &Rejection::StoreUnavailable)
            }
        };
        ControlFlow::Break(Ok(answer))
    }
}

pin_project! {
    /// Step 2: runs the handler of a claimed key and reads its answer, renewing the lease
    /// meanwhile; then stores the answer, or releases the key.
    struct Handling<St, F, B, E>
    where
        St: Store,
        B: Body<Data = Bytes>,
        B: Send,
        B: 'static,
        B::Error: Send,
        B::Error: 'static,
    {
        // Releases the key if this future is dropped (the client went away, with
        // `cancel_on_disconnect`) or unwinds (the handler panicked) while the handler runs, so
        // a retry is not locked out.
        guard: ReleaseGuard<St>,
        in_flight: InFlightGauge,
        config: Arc<Config>,
        // The handler's view of the lease (in its request's extensions).
        lease: Lease,
        renewal: Renewal,
        #[pin]
        state: State<F, B, E>,
    }

    impl<St, F, B, E> PinnedDrop for Handling<St, F, B, E>
    where
        St: Store,
        B: Body<Data = Bytes>,
        B: Send,
        B: 'static,
        B::Error: Send,
        B::Error: 'static,
    {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // Dropped after the handler answered, while its body is read: the handler's work
            // is done, so the rest of the body is read and the answer stored in a task (the
            // key is released only if the body fails), instead of releasing the key for a
            // retry to run the handler again. (Unwinding, the body panicked: the guard releases
            // the key.)
            if let StateProj::Reading { answer } = this.state.project()
                && !std::thread::panicking()
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
                && let Some(answer) = answer.take()
                && let Some(held) = this.guard.held.take()
            {
                let ttl = this.config.ttl;
                tracing::debug!("idempotent request dropped while its answer was read; storing it");
                runtime.spawn(async move {
                    let (_, stored) = answer.await;
                    match stored {
                        Some(stored) => held.complete(&stored.answer, ttl).await,
                        None => held.release().await,
                    }
                });
            }
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B: Body, E> {
        Calling { #[pin] future: F },
        // `None` once taken by the drop (see `Handling`'s `PinnedDrop`).
        Reading { answer: Option<ToStore<B>> },
        // Storing the answer did not finish at its first poll: it goes on in a task of its
        // own, which finishes even if this future is dropped meanwhile (outside a Tokio
        // runtime, in place).
        Storing {
            response: Option<(Response<ResponseBody<B>>, Keep)>,
            task: Completion,
        },
        // A 5xx, a failed response body or a handler error: nothing is stored, and the key is
        // released so that a retry runs the handler again.
        Releasing { result: Option<Result<Response<ResponseBody<B>>, E>>, release: BoxTask },
        Done,
    }
}

impl<St, F, B, E> Handling<St, F, B, E>
where
    St: Store,
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
{
    fn start<S, ReqBody>(claimed: Claimed<St>, mut inner: S) -> Self
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<B>, Error = E, Future = F>,
    {
        let Claimed {
            held,
            mut parts,
            buffered,
            config,
        } = claimed;
        parts.extensions.insert(held.key.clone());
        let lease = Lease::new();
        parts.extensions.insert(lease.clone());
        let guard = ReleaseGuard { held: Some(held) };
        let req = Request::from_parts(
            parts,
            RequestBody::buffered(buffered.chunks, buffered.trailers),
        );
        let future = inner.call(req);
        Self {
            guard,
            in_flight: InFlightGauge::start(),
            config,
            lease,
            renewal: Renewal::Idle,
            state: State::Calling { future },
        }
    }
}

impl<St, F, B, E> Future for Handling<St, F, B, E>
where
    St: Store,
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Calling { future } => match future.poll(cx) {
                    Poll::Ready(Ok(response)) => State::Reading {
                        answer: Some(to_store(this.config, response)),
                    },
                    Poll::Ready(Err(err)) => releasing(this.guard, Err(err)),
                    Poll::Pending => {
                        poll_renewal(this.guard, this.renewal, this.lease, this.config.lease, cx);
                        return Poll::Pending;
                    }
                },
                // Never `None` here: it is taken only on drop.
                StateProj::Reading { answer: None } => return Poll::Pending,
                StateProj::Reading {
                    answer: Some(answer),
                } => match Pin::new(answer).poll(cx) {
                    Poll::Ready((mut response, Some(stored))) => {
                        // The handler's work is done: from here on, a dropped request must not
                        // release the key (a retry would run the handler twice).
                        let Some(held) = this.guard.held.take() else {
                            stored.restore(&mut response);
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        };
                        let ttl = this.config.ttl;
                        let answer = stored.answer.clone();
                        let mut completion: BoxTask =
                            Box::pin(async move { held.complete(&answer, ttl).await });
                        // Most stores finish at the first poll (the memory store always does);
                        // only a pending completion moves to a task.
                        if completion.as_mut().poll(cx).is_ready() {
                            // Dropped first, so that the headers come back without a copy.
                            drop(completion);
                            stored.restore(&mut response);
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        State::Storing {
                            response: Some((response, stored)),
                            task: Completion::start(completion),
                        }
                    }
                    Poll::Ready((response, None)) => releasing(this.guard, Ok(response)),
                    Poll::Pending => {
                        poll_renewal(this.guard, this.renewal, this.lease, this.config.lease, cx);
                        return Poll::Pending;
                    }
                },
                StateProj::Storing { response, task } => {
                    ready!(task.poll(cx));
                    let response = response.take().map(|(mut response, stored)| {
                        stored.restore(&mut response);
                        Ok(response)
                    });
                    this.state.set(State::Done);
                    return finished(response);
                }
                StateProj::Releasing { result, release } => {
                    ready!(release.as_mut().poll(cx));
                    let result = result.take();
                    this.state.set(State::Done);
                    return finished(result);
                }
                StateProj::Done => return polled_after_finishing(),
            };
            this.state.set(next);
        }
    }
}

/// A completion that did not finish at its first poll.
enum Completion {
    /// In a task of its own, which a dropped request does not cancel.
    Spawned(tokio::task::JoinHandle<()>),
    /// Outside a Tokio runtime (another executor polls the request): polled in place.
    Inline(BoxTask),
}

impl Completion {
    fn start(completion: BoxTask) -> Self {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => Self::Spawned(runtime.spawn(completion)),
            Err(_) => Self::Inline(completion),
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            Self::Spawned(task) => Pin::new(task).poll(cx).map(|joined| {
                if let Err(e) = joined {
                    tracing::error!(
                        error = &e as &dyn std::error::Error,
                        "storing the answer panicked"
                    );
                }
            }),
            Self::Inline(task) => task.as_mut().poll(cx),
        }
    }
}

/// The output of a finished state, which always has it.
fn finished<T>(output: Option<T>) -> Poll<T> {
    output.map_or_else(polled_after_finishing, Poll::Ready)
}

fn releasing<St: Store, F, B: Body, E>(
    guard: &mut ReleaseGuard<St>,
    result: Result<Response<ResponseBody<B>>, E>,
) -> State<F, B, E> {
    let release: BoxTask = match guard.held.take() {
        Some(held) => Box::pin(held.release()),
        None => Box::pin(std::future::ready(())),
    };
    State::Releasing {
        result: Some(result),
        release,
    }
}
