//! What a scenario is and what the scenarios share: the [`Scenario`] entry (name,
//! descriptions, target, build function), what its build returns ([`Built`], [`KeyPlan`]),
//! every scenario of this build in run order ([`all_scenarios`]), the create handler and the
//! small helpers the baselines share, and the completion of the replay keys before a replay
//! scenario runs.

use std::future::Future;
use std::pin::Pin;

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tower::ServiceExt;

use crate::client::request;
use crate::pg_schema::PgSchema;
use crate::runner::Args;
use crate::{
    BoxError, common, memory, memory_full, postgres_plain, realistic, transactional, two_hops,
    waiting,
};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The path every scenario serves.
pub(crate) const PATH: &str = "/orders";

/// A scenario: the layered route and its baseline.
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    /// What the layer side does (for the report).
    pub(crate) layer_side: &'static str,
    /// What the baseline's handler does by hand.
    pub(crate) baseline: &'static str,
    /// The target for layer ÷ baseline requests per second.
    pub(crate) target: f64,
    pub(crate) build: for<'a> fn(&'a Ctx) -> BoxFuture<'a, Result<Built, BoxError>>,
}

/// Every scenario this build has, group by group (the order they run in, and are listed in,
/// when none is named).
pub(crate) fn all_scenarios() -> impl Iterator<Item = &'static Scenario> {
    realistic::SCENARIOS
        .iter()
        .chain(memory::SCENARIOS)
        .chain(memory_full::SCENARIOS)
        .chain(two_hops::SCENARIOS)
        .chain(postgres_plain::SCENARIOS)
        .chain(transactional::SCENARIOS)
        .chain(waiting::SCENARIOS)
        .chain(REDIS_SCENARIOS)
}

/// The Redis scenarios, when the bench is built with `--features redis` (as
/// `scripts/test.sh` builds it): see `benches/load/redis.rs`.
#[cfg(feature = "redis")]
const REDIS_SCENARIOS: &[Scenario] = crate::redis_scenarios::SCENARIOS;
#[cfg(not(feature = "redis"))]
const REDIS_SCENARIOS: &[Scenario] = &[];

/// What a scenario's build returns.
pub(crate) struct Built {
    pub(crate) layer: Router,
    pub(crate) baseline: Router,
    pub(crate) keys: KeyPlan,
    /// The baseline side's keys, when they differ from the layer side's.
    pub(crate) baseline_keys: Option<KeyPlan>,
    /// The status every answer must have.
    pub(crate) expect: StatusCode,
    /// The Postgres schema the scenario works in (emptied between sides for new keys,
    /// dropped at the end).
    pub(crate) schema: Option<PgSchema>,
    /// Builds the (layer, baseline) routers anew, with empty in-process state, for each side
    /// (used instead of `layer` and `baseline`).
    pub(crate) fresh: Option<fn() -> (Router, Router)>,
    /// What the scenario keeps alive until its end (servers it started), then drops.
    pub(crate) owned: Option<Box<dyn Send>>,
}

/// Which keys the client sends.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyPlan {
    /// A key never sent before, on every request.
    New,
    /// One of `count` keys completed before the run (`replay-0` …), picked at random.
    Replay { count: usize },
}

/// The layer side's handler (and the work every baseline does besides the idempotency part):
/// a create endpoint that answers `201` with a small JSON document.
pub(crate) async fn create(body: Bytes) -> Response {
    created(body.len())
}

pub(crate) fn created(len: usize) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        common::created_json(len),
    )
        .into_response()
}

pub(crate) fn key_of(headers: &HeaderMap) -> Option<&str> {
    headers.get("idempotency-key")?.to_str().ok()
}

pub(crate) fn problem(status: StatusCode) -> Response {
    (status, status.canonical_reason().unwrap_or_default()).into_response()
}

/// The shared context a scenario is built in.
pub(crate) struct Ctx {
    pub(crate) args: Args,
}

/// Sends `replay-0` … `replay-{count - 1}` through `router` once (in process, 32 at a time),
/// so that later requests for them are replays.
pub(crate) async fn complete_replay_keys(router: &Router, count: usize) -> Result<(), BoxError> {
    let body = common::json_body(common::BODY_LEN);
    let mut next = 0;
    while next < count {
        let batch = (next..count.min(next + 32)).map(|i| {
            let req = request("127.0.0.1", &replay_key(i), &body);
            router.clone().oneshot(req.map(axum::body::Body::new))
        });
        for res in futures_join_all(batch).await {
            let res = res?;
            if res.status() != StatusCode::CREATED {
                return Err(format!("completing a replay key: {}", res.status()).into());
            }
        }
        next += 32;
    }
    Ok(())
}

pub(crate) fn replay_key(i: usize) -> String {
    format!("replay-{i}")
}

/// Awaits every future of `futs` concurrently (a tiny `join_all`, to need no extra crate).
async fn futures_join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pinned: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (fut, slot) in pinned.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

/// FNV-1a of `key`: a cheap, stable hash for the by-hand baselines (advisory lock ids, which
/// order a key pays).
pub(crate) fn fnv1a(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
