//! What happened to a keyed request and to its store calls, as tracing and metrics report
//! it, and what a claim found.

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use crate::error::StoreError;
use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, LeaseToken};

/// What happened to a keyed request: the `outcome` of its tracing span and metrics counter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outcome {
    /// The handler ran (key acquired fresh).
    Executed,
    /// The handler ran after taking over a key whose lease ran out.
    Takeover,
    /// A stored answer was replayed.
    Replayed,
    /// Answered 409: the first request is still running.
    InFlight,
    /// Answered 422: the key was used with another request.
    Mismatch,
    /// Answered 503: the store failed before the handler ran.
    StoreError,
    /// Answered 400, 401 or 413 before the store was asked.
    Rejected,
}

/// Names the values of an enum for tracing and metrics: `as_str`, and (feature `metrics`)
/// `label`, the name as a label under `$key` in a static, so that recording it allocates
/// nothing. (`metrics::counter!(name, "key" => value)` with a value that is not a literal
/// builds a `Vec` of labels at every call: a keyed request would pay two or three.)
macro_rules! named {
    ($ty:ident, $key:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            // `Operation`'s is read by metrics only.
            #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
            pub(crate) fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }

            #[cfg(feature = "metrics")]
            fn label(self) -> &'static [metrics::Label] {
                match self {
                    $(Self::$variant => {
                        static LABEL: [metrics::Label; 1] =
                            [metrics::Label::from_static_parts($key, $name)];
                        &LABEL
                    }),+
                }
            }
        }
    };
}

named!(Outcome, "outcome", {
    Executed => "executed",
    Takeover => "takeover",
    Replayed => "replayed",
    InFlight => "in_flight",
    Mismatch => "mismatch",
    StoreError => "store_error",
    Rejected => "rejected",
});

/// A store call, as [`store_call`] names it in metrics (the label `operation`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operation {
    /// The claim of a key.
    Claim,
    /// Storing the answer (plain mode).
    Complete,
    /// Giving a key back.
    Release,
    /// Renewing a lease.
    Renew,
    /// Transactional mode's completion.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Commit,
    /// A waiting duplicate's wait for the key to change.
    Watch,
}

named!(Operation, "operation", {
    Claim => "claim",
    Complete => "complete",
    Release => "release",
    Renew => "renew",
    Commit => "commit",
    Watch => "watch",
});

/// Where the crate's metrics come from, as `metrics::counter!` would say it.
#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// A key whose record is there already, as a claim found it.
pub(crate) enum Taken {
    /// Completed: its answer is replayed.
    Completed(StoredResponse),
    /// Another request holds it: retry after this long.
    InFlight(Duration),
    /// Reused with another payload.
    Mismatch,
}

/// A store's claim outcome as a mode reads it: the key acquired (its token, and whether it
/// was taken over), or taken.
pub(crate) fn acquired_or_taken(outcome: ClaimOutcome) -> Result<(LeaseToken, bool), Taken> {
    match outcome {
        ClaimOutcome::Acquired { token, takeover } => Ok((token, takeover)),
        ClaimOutcome::Completed(stored) => Err(Taken::Completed(stored)),
        ClaimOutcome::InFlight { retry_after } => Err(Taken::InFlight(retry_after)),
        ClaimOutcome::Mismatch => Err(Taken::Mismatch),
    }
}

pub(crate) fn record(outcome: Outcome) {
    // Recorded into the request's span, which exists only when DEBUG is enabled (otherwise
    // the current span is some outer one, not ours to write to).
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record("outcome", outcome.as_str());
    }
    tracing::debug!(outcome = outcome.as_str(), "idempotency outcome");
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|recorder| {
        let key =
            metrics::Key::from_static_parts("tower_idempotency_requests_total", outcome.label());
        recorder.register_counter(&key, &METADATA).increment(1);
    });
}

/// Runs one store call (`operation` names it in metrics), bounded by the layer's store
/// timeout: a call that does not answer in time is dropped and becomes
/// [`StoreError::Timeout`].
pub(crate) async fn store_call<T>(
    operation: Operation,
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    #[cfg(feature = "metrics")]
    let started = std::time::Instant::now();
    // A call answered at its first poll (the memory store's always are) needs no timer:
    // arming one reads the clock and takes a reference to the runtime's timer, which costs a
    // keyed request more than the memory store's work. The bound starts after that poll,
    // which returned at once.
    let mut call = std::pin::pin!(call);
    let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    let result = match first {
        Poll::Ready(result) => result,
        // Outside a Tokio runtime (a keyed request polled by another executor) there is no
        // timer to bound the call with: it runs unbounded, as the store itself allows.
        Poll::Pending if tokio::runtime::Handle::try_current().is_err() => call.await,
        Poll::Pending => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(limit)),
        },
    };
    #[cfg(feature = "metrics")]
    {
        let seconds = started.elapsed().as_secs_f64();
        metrics::with_recorder(|recorder| {
            let key = metrics::Key::from_static_parts(
                "tower_idempotency_store_call_seconds",
                operation.label(),
            );
            recorder.register_histogram(&key, &METADATA).record(seconds);
        });
        if let Err(err) = &result {
            let kind = if matches!(err, StoreError::Timeout(_)) {
                "timeout"
            } else {
                "error"
            };
            metrics::counter!(
                "tower_idempotency_store_errors_total",
                "operation" => operation.as_str(),
                "kind" => kind
            )
            .increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = operation;
    result
}

/// A keyed request whose handler runs, from its claim until its answer is stored (or its key
/// released), counted in the gauge `tower_idempotency_in_flight` (feature `metrics`).
pub(crate) struct InFlightGauge(());

impl InFlightGauge {
    pub(crate) fn start() -> Self {
        #[cfg(feature = "metrics")]
        metrics::gauge!("tower_idempotency_in_flight").increment(1.0);
        Self(())
    }
}

impl Drop for InFlightGauge {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        metrics::gauge!("tower_idempotency_in_flight").decrement(1.0);
    }
}

/// Tries `end` (a claim's release, or the end of its lease) again in the background, from
/// 100 ms apart to 2 s apart, until it succeeds or `until` (the lease's end) comes: a claim
/// the store could not end would otherwise turn every retry away with `409` until its lease
/// ran out, though the store may be back in a moment. Nothing without a runtime (the lease
/// frees the key then).
pub(crate) fn end_in_background<F>(until: tokio::time::Instant, mut end: F)
where
    F: FnMut() -> std::pin::Pin<Box<dyn Future<Output = bool> + Send>> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut pause = Duration::from_millis(100);
        while tokio::time::Instant::now() + pause < until {
            tokio::time::sleep(pause).await;
            if end().await {
                tracing::debug!("idempotency claim ended once the store answered again");
                return;
            }
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    });
}

/// A claim lost its key while its handler ran (its lease ran out and another request may
/// take the key over): the counter `tower_idempotency_leases_lost_total` (feature
/// `metrics`). Worth an alert: it means renewals failed for most of a lease.
pub(crate) fn lease_lost() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_leases_lost_total").increment(1);
}

pub(crate) fn log_store_error(err: &StoreError, what: &'static str) {
    // A full store is a capacity limit working as configured (and counted by the store),
    // not a failure: a warning, not an error.
    if matches!(err, StoreError::Full) {
        tracing::warn!(
            error = err as &dyn std::error::Error,
            "idempotency store is full: failed to {what}"
        );
        return;
    }
    tracing::error!(
        error = err as &dyn std::error::Error,
        "idempotency store failed to {what}"
    );
}
