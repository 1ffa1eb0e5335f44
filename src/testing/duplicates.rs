//! Duplicate injection for your own code: deliver a message or send a request the ways the
//! real world repeats it, and check through a probe of your own that its effect happened
//! once.
//!
//! The probe counts the effect where it lands (rows in your ledger, calls to a fake provider,
//! e-mails in a fake outbox). Every check starts from a probe reading of zero for a fresh
//! message or key, and fails with a [`Failure`] that says what was seen.
//!
//! For consumers, `deliver` is your consume function for one fixed message (its ID and
//! payload chosen by the test), given the [`Attempt`] so that it can pass the broker's
//! redelivery flag on:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use tower_idempotency::testing::duplicates::{self, Attempt};
//!
//! // A stand-in consumer: applies message "m1" unless it has seen it.
//! let seen = std::sync::Mutex::new(std::collections::HashSet::new());
//! let applied = AtomicUsize::new(0);
//! let deliver = async |_: Attempt| {
//!     if seen.lock().unwrap().insert("m1") {
//!         applied.fetch_add(1, Ordering::SeqCst);
//!     }
//! };
//! let probe = async || applied.load(Ordering::SeqCst);
//! duplicates::message_twice(&deliver, &probe).await.unwrap();
//! duplicates::message_after_a_lost_ack(&deliver, &probe).await.unwrap();
//! duplicates::message_concurrently(10, &deliver, &probe).await.unwrap();
//! # }
//! ```
//!
//! For HTTP handlers behind the layer, `send` sends one request carrying a fixed
//! `Idempotency-Key` (and the body it is given) through your service, and answers its status
//! and body; see [`request_twice`].

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::Poll;

use bytes::Bytes;
use http::StatusCode;

use super::Failure;

/// Which delivery of the message this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// 1 for the first delivery, 2 for the second, …
    pub number: usize,
    /// Whether a broker would flag this delivery as a redelivery.
    pub redelivered: bool,
}

/// An answer to one request: its status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The body.
    pub body: Bytes,
}

fn fail(check: &'static str, detail: String) -> Failure {
    Failure { check, detail }
}

/// Checks that the probe reads one.
async fn once<P: AsyncFn() -> usize>(
    check: &'static str,
    probe: &P,
    what: &str,
) -> Result<(), Failure> {
    match probe().await {
        1 => Ok(()),
        n => Err(fail(
            check,
            format!("{what}: the effect happened {n} times"),
        )),
    }
}

/// Runs the futures at once (on this task: their I/O interleaves) and returns their outputs.
async fn all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pending: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut done = true;
        for (future, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(out) => *output = Some(out),
                    Poll::Pending => done = false,
                }
            }
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// The message delivered twice in a row, the second time flagged as a redelivery (a broker
/// that lost track of the first acknowledgement): one effect.
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one.
pub async fn message_twice<D, P>(deliver: &D, probe: &P) -> Result<(), Failure>
where
    D: AsyncFn(Attempt),
    P: AsyncFn() -> usize,
{
    for number in 1..=2 {
        deliver(Attempt {
            number,
            redelivered: number > 1,
        })
        .await;
    }
    once("message_twice", probe, "delivered twice").await
}

/// The message delivered, its acknowledgement lost, and delivered again as a redelivery; then
/// once more, as a broker replaying a dead-letter queue would: one effect.
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one after any delivery.
pub async fn message_after_a_lost_ack<D, P>(deliver: &D, probe: &P) -> Result<(), Failure>
where
    D: AsyncFn(Attempt),
    P: AsyncFn() -> usize,
{
    deliver(Attempt {
        number: 1,
        redelivered: false,
    })
    .await;
    once("message_after_a_lost_ack", probe, "the first delivery").await?;
    for number in 2..=3 {
        deliver(Attempt {
            number,
            redelivered: true,
        })
        .await;
        once(
            "message_after_a_lost_ack",
            probe,
            &format!("delivery {number} after a lost acknowledgement"),
        )
        .await?;
    }
    Ok(())
}

/// The message delivered `n` times at once (two workers given the same message after an ack
/// wait ran out, a rebalance): one effect.
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one.
pub async fn message_concurrently<D, P>(n: usize, deliver: &D, probe: &P) -> Result<(), Failure>
where
    D: AsyncFn(Attempt),
    P: AsyncFn() -> usize,
{
    let deliveries = (1..=n.max(2))
        .map(|number| {
            deliver(Attempt {
                number,
                redelivered: number > 1,
            })
        })
        .collect();
    all(deliveries).await;
    once(
        "message_concurrently",
        probe,
        &format!("delivered {} times at once", n.max(2)),
    )
    .await
}

/// The request sent twice in a row with the same key and body: one effect, and the second
/// answer is the first one (status and body).
///
/// `send(body)` sends one request with the test's fixed key and `body` through your service.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use bytes::Bytes;
/// use http::StatusCode;
/// use tower_idempotency::testing::duplicates::{self, Answer};
///
/// // A stand-in for a service behind the layer: runs once, then replays.
/// let runs = AtomicUsize::new(0);
/// let send = async |_body: Bytes| {
///     runs.fetch_add(1, Ordering::SeqCst);
///     Answer { status: StatusCode::CREATED, body: Bytes::from_static(b"{\"id\":1}") }
/// };
/// let probe = async || runs.load(Ordering::SeqCst).min(1);
/// duplicates::request_twice(&send, Bytes::from_static(b"{}"), &probe).await.unwrap();
/// # }
/// ```
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one, or the answers differ.
pub async fn request_twice<S, P>(send: &S, body: Bytes, probe: &P) -> Result<(), Failure>
where
    S: AsyncFn(Bytes) -> Answer,
    P: AsyncFn() -> usize,
{
    sent_twice("request_twice", send, body.clone(), body, probe).await
}

/// Sends `first`, then `second` as its retry: one effect, and the same answer.
async fn sent_twice<S, P>(
    check: &'static str,
    send: &S,
    first: Bytes,
    second: Bytes,
    probe: &P,
) -> Result<(), Failure>
where
    S: AsyncFn(Bytes) -> Answer,
    P: AsyncFn() -> usize,
{
    let answer = send(first).await;
    let retry = send(second).await;
    once(check, probe, "sent twice").await?;
    if answer != retry {
        return Err(fail(
            check,
            format!("the retry was answered {retry:?}, the first request {answer:?}"),
        ));
    }
    Ok(())
}

/// The request sent `n` times at once (a double click, a client retrying on a short
/// timeout): one effect; every answer is the first request's, or `409 Conflict` (in
/// progress, retry later).
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one, or two answers other than `409` differ.
pub async fn request_concurrently<S, P>(
    n: usize,
    send: &S,
    body: Bytes,
    probe: &P,
) -> Result<(), Failure>
where
    S: AsyncFn(Bytes) -> Answer,
    P: AsyncFn() -> usize,
{
    let answers = all((0..n.max(2)).map(|_| send(body.clone())).collect()).await;
    once(
        "request_concurrently",
        probe,
        &format!("sent {} times at once", n.max(2)),
    )
    .await?;
    let mut done = answers.iter().filter(|a| a.status != StatusCode::CONFLICT);
    if let Some(first) = done.next()
        && let Some(other) = done.find(|a| *a != first)
    {
        return Err(fail(
            "request_concurrently",
            format!("two answers differ: {first:?} and {other:?}"),
        ));
    }
    Ok(())
}

/// The request sent with its JSON body, then with the same JSON with its members reordered
/// and its whitespace changed (`reordered`), as another client library would serialize it:
/// one effect, and the retry is answered as the first request (with the layer's
/// `JsonFingerprint`; a byte fingerprint answers `422` here, which this check reports).
///
/// # Errors
///
/// A [`Failure`] when the probe does not read one, or the answers differ.
pub async fn request_with_reordered_json<S, P>(
    send: &S,
    body: Bytes,
    reordered: Bytes,
    probe: &P,
) -> Result<(), Failure>
where
    S: AsyncFn(Bytes) -> Answer,
    P: AsyncFn() -> usize,
{
    sent_twice("request_with_reordered_json", send, body, reordered, probe).await
}

/// How long [`request_with_first_answer_dropped`] waits for its first request to be answered
/// or seen running.
const FIRST_RUN_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// The request's first answer dropped (the client timed out, the connection broke): the
/// first send is started and abandoned once `started` completes (a signal your handler or
/// fake provider gives when the run has begun, e.g. `Notify::notified`), then the request is
/// retried, 100 ms apart, until it is not answered `409`: one effect, and an answer that is
/// not a server error (`5xx`).
///
/// # Errors
///
/// A [`Failure`] when the first request is answered before `started`, neither happens
/// within 30 s, the probe does not
/// read one, the retry gets a `5xx`, or it is still `409` after `max_retries` retries.
pub async fn request_with_first_answer_dropped<S, P>(
    send: &S,
    body: Bytes,
    started: impl Future<Output = ()>,
    probe: &P,
    max_retries: usize,
) -> Result<(), Failure>
where
    S: AsyncFn(Bytes) -> Answer,
    P: AsyncFn() -> usize,
{
    const CHECK: &str = "request_with_first_answer_dropped";
    {
        let mut first = std::pin::pin!(send(body.clone()));
        let mut started = std::pin::pin!(started);
        let answered = tokio::time::timeout(
            FIRST_RUN_BOUND,
            poll_fn(|cx| {
                if first.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(true);
                }
                started.as_mut().poll(cx).map(|()| false)
            }),
        )
        .await;
        let Ok(answered) = answered else {
            return Err(fail(
                CHECK,
                format!(
                    "the first request was neither answered nor seen running within \
                     {FIRST_RUN_BOUND:?}: does `started` complete when the handler runs?"
                ),
            ));
        };
        if answered {
            return Err(fail(
                CHECK,
                "the first request was answered before its handler was seen running".into(),
            ));
        }
        // Dropped here, mid-run.
    }
    for _ in 0..=max_retries {
        let retry = send(body.clone()).await;
        if retry.status == StatusCode::CONFLICT {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            continue;
        }
        if retry.status.is_server_error() {
            return Err(fail(CHECK, format!("the retry was answered {retry:?}")));
        }
        return once(CHECK, probe, "the first answer dropped, then retried").await;
    }
    Err(fail(
        CHECK,
        format!("still 409 after {max_retries} retries"),
    ))
}
