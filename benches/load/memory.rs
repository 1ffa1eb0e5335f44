//! The in-process scenario `memory-new`: the layer on a `MemoryStore`, a new key per
//! request, against a handler that fingerprints the request and claims its key in a
//! `Mutex<HashMap>` by hand.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderName, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{Fingerprint, IdempotencyLayer};

use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, create, key_of, problem};
use crate::{BoxError, common};

/// The memory scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[Scenario {
    name: "memory-new",
    layer_side: "MemoryStore, new key per request",
    baseline: "fingerprint + insert and complete in a Mutex<HashMap>",
    target: 0.95,
    build: |ctx| Box::pin(build_memory_new(ctx)),
}];

/// A map of records kept by hand ([`memory_baseline`]).
#[derive(Clone, Default)]
pub(crate) struct MemoryBaseline(Arc<Mutex<HashMap<String, MemoryRecord>>>);

struct MemoryRecord {
    fingerprint: Fingerprint,
    /// `None` while the handler runs.
    response: Option<(StatusCode, Bytes)>,
}

impl MemoryBaseline {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, MemoryRecord>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `key` for a request fingerprinted `fp` (`None`); a key already there answers
    /// instead: `422` for another payload, `409` while it runs, its stored answer (marked
    /// replayed) once done.
    pub(crate) fn claim(&self, key: &str, fp: Fingerprint) -> Option<Response> {
        match self.lock().entry(key.to_owned()) {
            Entry::Occupied(e) => {
                let record = e.get();
                Some(match &record.response {
                    _ if record.fingerprint != fp => problem(StatusCode::UNPROCESSABLE_ENTITY),
                    None => problem(StatusCode::CONFLICT),
                    Some((status, answer)) => (
                        *status,
                        [
                            (header::CONTENT_TYPE, "application/json"),
                            (HeaderName::from_static("idempotent-replayed"), "true"),
                        ],
                        answer.clone(),
                    )
                        .into_response(),
                })
            }
            Entry::Vacant(v) => {
                v.insert(MemoryRecord {
                    fingerprint: fp,
                    response: None,
                });
                None
            }
        }
    }

    /// Stores the answer of the claimed `key`.
    pub(crate) fn keep(&self, key: &str, status: StatusCode, answer: Bytes) {
        if let Some(record) = self.lock().get_mut(key) {
            record.response = Some((status, answer));
        }
    }
}

/// By hand, what the layer does with a memory store: fingerprint, claim the key in a map
/// (or answer from it), run the handler, store the answer.
pub(crate) async fn memory_baseline(
    State(map): State<MemoryBaseline>,
    parts: Parts,
    body: Bytes,
) -> Response {
    let Some(key) = key_of(&parts.headers) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    if let Some(answered) = map.claim(key, fingerprint(&parts, &[], &body)) {
        return answered;
    }
    let answer = common::created_json(body.len());
    map.keep(key, StatusCode::CREATED, answer.clone());
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        answer,
    )
        .into_response()
}

/// The two routers of `memory-new`, each with an empty store (a new pair for every side, as
/// the Postgres scenarios empty their tables: a store that kept the previous rounds' keys
/// would make later rounds work on a bigger map).
fn memory_routers() -> (Router, Router) {
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(common::unbounded_memory_store()));
    let baseline = Router::new()
        .route(PATH, post(memory_baseline))
        .with_state(MemoryBaseline::default());
    (layer, baseline)
}

async fn build_memory_new(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, baseline) = memory_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(memory_routers),
        owned: None,
    })
}
