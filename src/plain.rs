//! Plain mode: claim the key in the store, run the handler, store its answer.
//!
//! A keyed request runs in one boxed future, whose size is what every keyed request allocates
//! and moves. An `async fn` for the whole run would keep each part of it at once: the request
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
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::error::BoxError;
use crate::future::Steps;
use crate::key::IdempotencyKey;
use crate::layer::Config;
use crate::mode::Keyed;
use crate::rejection::Rejection;
use crate::response::StoredResponse;
use crate::service::{
    Buffered, Outcome, Taken, ToStore, answer_taken, log_store_error, read_request, record, render,
    to_store,
};
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken, Store};

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
        let answer = match store.claim(request).await {
            Ok(ClaimOutcome::Acquired { token, takeover }) => {
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
                    },
                    parts,
                    buffered,
                    config,
                });
            }
            Ok(ClaimOutcome::Completed(stored)) => answer_taken(&config, Taken::Completed(stored)),
            Ok(ClaimOutcome::InFlight { retry_after }) => {
                answer_taken(&config, Taken::InFlight(retry_after))
            }
            Ok(ClaimOutcome::Mismatch) => answer_taken(&config, Taken::Mismatch),
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
    struct Handling<St: Store, F, B: Body, E> {
        // Releases the key if this future is dropped (the client went away) or unwinds (the
        // handler panicked) before the handler's work is done, so a retry is not locked out.
        guard: ReleaseGuard<St>,
        config: Arc<Config>,
        // Made when the handler first waits: most answer at once.
        renew: Option<BoxTask>,
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B: Body, E> {
        Calling { #[pin] future: F },
        Reading { answer: ToStore<B> },
        // Storing the answer did not finish at its first poll: it goes on in a task of its
        // own, which finishes even if this future is dropped meanwhile.
        Storing { response: Option<Response<ResponseBody<B>>>, task: tokio::task::JoinHandle<()> },
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
    B: Body<Data = Bytes>,
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
        let guard = ReleaseGuard { held: Some(held) };
        let req = Request::from_parts(
            parts,
            RequestBody::buffered(buffered.chunks, buffered.trailers),
        );
        let future = inner.call(req);
        Self {
            guard,
            config,
            renew: None,
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
                        answer: to_store(this.config, response),
                    },
                    Poll::Ready(Err(err)) => releasing(this.guard, Err(err)),
                    Poll::Pending => {
                        poll_renewal(this.guard, this.renew, this.config.lease, cx);
                        return Poll::Pending;
                    }
                },
                StateProj::Reading { answer } => match Pin::new(answer).poll(cx) {
                    Poll::Ready((response, Some(stored))) => {
                        // The handler's work is done: from here on, a dropped request must not
                        // release the key (a retry would run the handler twice).
                        let Some(held) = this.guard.held.take() else {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        };
                        let ttl = this.config.ttl;
                        let mut completion: BoxTask =
                            Box::pin(async move { held.complete(&stored, ttl).await });
                        // Most stores finish at the first poll (the memory store always does);
                        // only a pending completion moves to a task.
                        if completion.as_mut().poll(cx).is_ready() {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        State::Storing {
                            response: Some(response),
                            task: tokio::spawn(completion),
                        }
                    }
                    Poll::Ready((response, None)) => releasing(this.guard, Ok(response)),
                    Poll::Pending => {
                        poll_renewal(this.guard, this.renew, this.config.lease, cx);
                        return Poll::Pending;
                    }
                },
                StateProj::Storing { response, task } => {
                    if let Err(e) = ready!(Pin::new(task).poll(cx)) {
                        tracing::error!(
                            error = &e as &dyn std::error::Error,
                            "storing the answer panicked"
                        );
                    }
                    let response = response.take();
                    this.state.set(State::Done);
                    return finished(response.map(Ok));
                }
                StateProj::Releasing { result, release } => {
                    ready!(release.as_mut().poll(cx));
                    let result = result.take();
                    this.state.set(State::Done);
                    return finished(result);
                }
                // Polled after it finished: the layer never does.
                StateProj::Done => return Poll::Pending,
            };
            this.state.set(next);
        }
    }
}

/// The output of a finished state, which always has it.
fn finished<T>(output: Option<T>) -> Poll<T> {
    output.map_or(Poll::Pending, Poll::Ready)
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

/// Polls the renewal of the lease (made at the first call), which renews it every third of
/// it while the handler runs.
fn poll_renewal<St: Store>(
    guard: &ReleaseGuard<St>,
    renew: &mut Option<BoxTask>,
    lease: Duration,
    cx: &mut Context<'_>,
) {
    if renew.is_none()
        && let Some(held) = &guard.held
    {
        let (store, scope, key, token) = (
            held.store.clone(),
            held.scope.clone(),
            held.key.clone(),
            held.token,
        );
        *renew = Some(Box::pin(async move {
            let period = lease / 3;
            loop {
                tokio::time::sleep(period).await;
                match store.renew(&scope, &key, token, lease).await {
                    Ok(true) => tracing::trace!("idempotency lease renewed"),
                    Ok(false) => {
                        tracing::warn!("idempotency lease lost: another request took the key over");
                        return;
                    }
                    // Try again at the next period; the lease outlives two missed renewals.
                    Err(err) => log_store_error(&err, "renew a lease"),
                }
            }
        }));
    }
    if let Some(renew) = renew {
        let _: Poll<()> = renew.as_mut().poll(cx);
    }
}

struct Held<St> {
    store: St,
    scope: String,
    key: IdempotencyKey,
    token: LeaseToken,
}

/// Releases a claimed key on drop (in a task), unless its `held` was taken.
struct ReleaseGuard<St: Store> {
    held: Option<Held<St>>,
}

impl<St: Store> Held<St> {
    /// Stores the answer. On failure the key is not released (the work was done): it is left
    /// to its lease, so a retry cannot run the handler twice while the store is failing.
    async fn complete(self, stored: &StoredResponse, ttl: Duration) {
        match self
            .store
            .complete(&self.scope, &self.key, self.token, stored, ttl)
            .await
        {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "idempotency lease was lost while the handler ran (another request took the key \
                 over); this answer was not stored"
            ),
            Err(err) => log_store_error(
                &err,
                "store the answer; the client gets it, the key waits for its lease",
            ),
        }
    }

    async fn release(self) {
        match self.store.release(&self.scope, &self.key, self.token).await {
            Ok(_) => tracing::debug!("idempotency key released"),
            Err(err) => {
                log_store_error(&err, "release a key; it stays locked until its lease ends")
            }
        }
    }
}

impl<St: Store> Drop for ReleaseGuard<St> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            // Dropped mid-request: the client went away or the handler panicked. Release in the
            // background; without a runtime the lease frees the key when it runs out.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                tracing::debug!("idempotent request dropped before it finished; releasing its key");
                handle.spawn(held.release());
            }
        }
    }
}
