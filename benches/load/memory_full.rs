//! The memory store full: the layer on a `MemoryStore` that holds `--full-records` records
//! (default 1,000,000) against the same layer on a store that holds few.
//!
//! - `memory-new-full`: new keys; the layer side's store is filled with `--full-records`
//!   completed records before each side runs, the baseline's store starts empty.
//! - `memory-replay-full`: replays drawn at random from all the layer side's
//!   `--full-records` records, against replays drawn from the baseline store's
//!   `--replay-keys` (10,000).
//! - `memory-replay-full-by-hand` (a reference, no layer): the same replays answered by
//!   `memory-new`'s baseline, a `Mutex<HashMap>` filled by hand, holding `--full-records`
//!   against `--replay-keys`: what a map of that size costs a replay without the layer.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

use crate::memory::{MemoryBaseline, memory_baseline};
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, complete_replay_keys, create};
use crate::{BoxError, common};

/// The memory-full scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "memory-new-full",
        layer_side: "MemoryStore holding --full-records records, new key per request",
        baseline: "the same layer on an empty MemoryStore",
        target: 0.9,
        build: |ctx| Box::pin(build_new_full(ctx)),
    },
    Scenario {
        name: "memory-replay-full",
        layer_side: "replays drawn from a MemoryStore's --full-records records",
        baseline: "replays drawn from a MemoryStore's --replay-keys records",
        target: 0.9,
        build: |ctx| Box::pin(build_replay_full(ctx, router)),
    },
    Scenario {
        name: "memory-replay-full-by-hand",
        layer_side: "reference, no layer: replays drawn from a map kept by hand (memory-new's \
                     baseline) holding --full-records records",
        baseline: "replays drawn from the same kind of map holding --replay-keys records",
        target: 0.9,
        build: |ctx| Box::pin(build_replay_full(ctx, by_hand)),
    },
];

/// `--full-records`, for [`new_full_routers`] (a plain `fn`, called before each side).
static FULL_RECORDS: AtomicUsize = AtomicUsize::new(0);

fn router() -> Router {
    with_layer(common::unbounded_memory_store())
}

fn with_layer(store: MemoryStore) -> Router {
    Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(store))
}

/// `memory-new`'s baseline: the records kept by hand in a map.
fn by_hand() -> Router {
    Router::new()
        .route(PATH, post(memory_baseline))
        .with_state(MemoryBaseline::default())
}

/// The output of memory store calls, which are ready at their first poll.
fn at_once<T>(call: impl Future<Output = T>) -> T {
    let mut call = std::pin::pin!(call);
    match call.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a memory store call was not ready at once"),
    }
}

/// A full store for the layer side, an empty one for the baseline.
fn new_full_routers() -> (Router, Router) {
    let full = common::unbounded_memory_store();
    at_once(common::fill_memory_store(
        &full,
        FULL_RECORDS.load(Ordering::Relaxed),
    ));
    (with_layer(full), router())
}

async fn build_new_full(ctx: &Ctx) -> Result<Built, BoxError> {
    FULL_RECORDS.store(ctx.args.full_records, Ordering::Relaxed);
    let (layer, baseline) = new_full_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(new_full_routers),
        owned: None,
    })
}

/// Replays from `full` records against replays from `few`, each side on a router that
/// `make` builds empty.
async fn build_replay_full(ctx: &Ctx, make: fn() -> Router) -> Result<Built, BoxError> {
    let (full, few) = (ctx.args.full_records, ctx.args.replay_keys);
    let layer = make();
    complete_replay_keys(&layer, full).await?;
    let baseline = make();
    complete_replay_keys(&baseline, few).await?;
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::Replay { count: full },
        baseline_keys: Some(KeyPlan::Replay { count: few }),
        expect: StatusCode::CREATED,
        schema: None,
        fresh: None,
        owned: None,
    })
}
