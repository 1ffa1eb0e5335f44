//! `memory-two-hops`: the payments example's keyed path in memory mode, in process. A payment
//! passes two keyed layers on one `MemoryStore`: the payments route's, and the provider's,
//! which the payments handler calls in process (`Router::oneshot`) with the derived key
//! `<key>:charge`. The baseline is the same two routes with no layer at all, as the example
//! runs with `IDEMPOTENCY=off`: it stores nothing, so the layer side also pays for what keeping
//! the answers costs (the allocator's work on a heap that grows by two records per payment),
//! which `memory-new`'s baseline, storing the same answers by hand, pays too.
//!
//! `memory-two-hops-by-hand` (a reference, no layer) puts the least a keyed hop can do in
//! front of the same two routes, by hand: the SHA-256 fingerprint of the request, its key
//! claimed in a map, the answer read and kept. Against the same baseline it is the ceiling of
//! any layer that fingerprints and keeps the answers of both hops.

use axum::Router;
use axum::body::Body;
use axum::extract::{Request as AxumRequest, State};
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{IDEMPOTENCY_KEY, IdempotencyKey, IdempotencyLayer};

use crate::memory::MemoryBaseline;
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, problem};
use crate::{BoxError, common};

/// The two-hop scenarios.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "memory-two-hops",
        layer_side: "the payments example's path in memory mode: a keyed route whose handler \
                     calls a keyed provider route in process with <key>:charge, both on one \
                     MemoryStore",
        baseline: "the same two routes without the layer (IDEMPOTENCY=off)",
        target: 0.85,
        build: |ctx| Box::pin(build_two_hops(ctx, Keyed::Layer)),
    },
    Scenario {
        name: "memory-two-hops-by-hand",
        layer_side: "reference, no layer: both routes behind a keyed step written by hand \
                     (SHA-256 fingerprint, the key claimed in a map, the answer kept): the \
                     ceiling of keeping both hops' answers",
        baseline: "the same two routes without the layer (IDEMPOTENCY=off)",
        target: 0.85,
        build: |ctx| Box::pin(build_two_hops(ctx, Keyed::ByHand)),
    },
];

/// What keys the two routes of a scenario's layer side.
#[derive(Clone, Copy)]
enum Keyed {
    Layer,
    ByHand,
}

/// The provider's answer to a charge.
async fn charge(body: Bytes) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(r#"{{"charge_id":"ch_{}","amount_cents":1999}}"#, body.len()),
    )
        .into_response()
}

/// The payments handler: charges at the provider (in process, with the derived key when the
/// request has one) and answers with the charge.
async fn pay(State(provider): State<Router>, request: Request<Body>) -> Response {
    let key = request
        .extensions()
        .get::<IdempotencyKey>()
        .and_then(|k| k.derive("charge").ok());
    let Ok(body) = request.into_body().collect().await else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let mut charge = Request::post("/charges").header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        charge = charge.header(IDEMPOTENCY_KEY, HeaderValue::from(key));
    }
    let Ok(charge) = charge.body(Body::from(body.to_bytes())) else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR);
    };
    let Ok(charged) = provider.oneshot(charge).await;
    if charged.status() != StatusCode::CREATED {
        return problem(StatusCode::BAD_GATEWAY);
    }
    let Ok(answer) = charged.into_body().collect().await else {
        return problem(StatusCode::BAD_GATEWAY);
    };
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        answer.to_bytes(),
    )
        .into_response()
}

/// The two routes, `keyed` by the layer, by hand or (`None`) not at all.
fn payments(keyed: Option<Keyed>) -> Router {
    // One store (or map) for both routes, as in the example.
    let key: Box<dyn Fn(Router) -> Router> = match keyed {
        Some(Keyed::Layer) => {
            let layer = IdempotencyLayer::new(common::unbounded_memory_store());
            Box::new(move |router| router.route_layer(layer.clone()))
        }
        Some(Keyed::ByHand) => {
            let hand = MemoryBaseline::default();
            Box::new(move |router| {
                router.route_layer(middleware::from_fn_with_state(hand.clone(), by_hand))
            })
        }
        None => Box::new(|router| router),
    };
    let provider = key(Router::new().route("/charges", post(charge)));
    key(Router::new().route(PATH, post(pay)).with_state(provider))
}

/// The least a keyed hop does, by hand, with `memory-new`'s map: fingerprint the request,
/// claim its key (or answer from it), run the route, read and keep its answer. A reference
/// for the happy path only: it keeps no headers, never releases a key, and stores whatever
/// the route answers.
async fn by_hand(
    State(answers): State<MemoryBaseline>,
    request: AxumRequest,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let Some(key) = parts
        .headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| IdempotencyKey::from_header(v).ok())
    else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    if let Some(answered) = answers.claim(key.as_str(), fingerprint(&parts, &[], &body)) {
        return answered;
    }
    parts.extensions.insert(key.clone());
    let response = next
        .run(AxumRequest::from_parts(parts, Body::from(body)))
        .await;
    let (parts, body) = response.into_parts();
    let Ok(answer) = body.collect().await.map(|b| b.to_bytes()) else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR);
    };
    answers.keep(key.as_str(), parts.status, answer.clone());
    Response::from_parts(parts, Body::from(answer))
}

/// A new pair for every side: the layer's store (or the map) starts empty each time.
fn two_hop_routers(keyed: Keyed) -> (Router, Router) {
    (payments(Some(keyed)), payments(None))
}

async fn build_two_hops(_ctx: &Ctx, keyed: Keyed) -> Result<Built, BoxError> {
    let (layer, baseline) = two_hop_routers(keyed);
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(match keyed {
            Keyed::Layer => || two_hop_routers(Keyed::Layer),
            Keyed::ByHand => || two_hop_routers(Keyed::ByHand),
        }),
        owned: None,
    })
}
