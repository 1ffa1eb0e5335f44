//! `memory-two-hops`: the payments example's keyed path in memory mode, in process. A payment
//! passes two keyed layers on one `MemoryStore`: the payments route's, and the provider's,
//! which the payments handler calls in process (`Router::oneshot`) with the derived key
//! `<key>:charge`. The baseline is the same two routes with no layer at all, as the example
//! runs with `IDEMPOTENCY=off`: it stores nothing, so the layer side also pays for what keeping
//! the answers costs (the allocator's work on a heap that grows by two records per payment),
//! which `memory-new`'s baseline, storing the same answers by hand, pays too.

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IDEMPOTENCY_KEY, IdempotencyKey, IdempotencyLayer, MemoryStore};

use crate::BoxError;
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, problem};

/// The two-hop scenario.
pub(crate) const SCENARIOS: &[Scenario] = &[Scenario {
    name: "memory-two-hops",
    layer_side: "the payments example's path in memory mode: a keyed route whose handler calls \
                 a keyed provider route in process with <key>:charge, both on one MemoryStore",
    baseline: "the same two routes without the layer (IDEMPOTENCY=off)",
    target: 0.85,
    build: |ctx| Box::pin(build_two_hops(ctx)),
}];

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

fn payments(layer: Option<IdempotencyLayer<MemoryStore>>) -> Router {
    let provider = Router::new().route("/charges", post(charge));
    let provider = match &layer {
        Some(layer) => provider.route_layer(layer.clone()),
        None => provider,
    };
    let payments = Router::new().route(PATH, post(pay)).with_state(provider);
    match layer {
        Some(layer) => payments.route_layer(layer),
        None => payments,
    }
}

/// A new pair for every side: the layer's store starts empty each time.
fn two_hop_routers() -> (Router, Router) {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    (payments(Some(layer)), payments(None))
}

async fn build_two_hops(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, baseline) = two_hop_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(two_hop_routers),
        owned: None,
    })
}
