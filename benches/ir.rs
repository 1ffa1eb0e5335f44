//! Instruction-count driver: runs N requests of one scenario in process through an axum
//! `Router` (as the load harness serves them), for `valgrind --tool=callgrind`.
//!
//! ```text
//! cargo bench --bench ir --no-run
//! valgrind --tool=callgrind target/release/deps/ir-… <scenario> <requests>
//! ```
//!
//! Scenarios: `none` (the route without the layer), `new` (the layer, a new key per request),
//! `replay` (the layer, one completed key), `get` (the layer on a `GET`: passed through),
//! `baseline` (the load harness's hand-written memory baseline). Two runs with different request counts give the cost of one request
//! (the difference of their totals, divided by the difference of the counts), free of the
//! start-up. Without arguments (as under `cargo test`) it runs each scenario a few times.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

async fn create(body: Bytes) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        common::created_json(body.len()),
    )
        .into_response()
}

type Map = Arc<Mutex<HashMap<String, (tower_idempotency::Fingerprint, Option<Bytes>)>>>;

/// The load harness's baseline, shortened: fingerprint, claim in a map, answer, store.
async fn baseline(State(map): State<Map>, parts: Parts, body: Bytes) -> Response {
    let key = parts.headers["idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    let fp = fingerprint(&parts, &[], &body);
    map.lock().unwrap().insert(key.clone(), (fp, None));
    let answer = common::created_json(body.len());
    if let Some(r) = map.lock().unwrap().get_mut(&key) {
        r.1 = Some(answer.clone());
    }
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        answer,
    )
        .into_response()
}

fn main() {
    // `cargo bench` and `cargo test` add flags (`--bench`); the rest is `[scenario [requests]]`.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let runs: Vec<(String, usize)> = match args.as_slice() {
        [] => ["none", "new", "replay", "get", "baseline"]
            .iter()
            .map(|s| ((*s).to_owned(), 3))
            .collect(),
        [scenario] => vec![(scenario.clone(), 1000)],
        [scenario, n, ..] => vec![(scenario.clone(), n.parse().expect("a number of requests"))],
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = common::json_body(common::BODY_LEN);
    for (scenario, n) in runs {
        let app = match scenario.as_str() {
            "none" => Router::new().route("/orders", post(create)),
            "new" | "replay" | "get" => Router::new()
                .route("/orders", post(create).get(create))
                .layer(IdempotencyLayer::new(MemoryStore::new())),
            "baseline" => Router::new()
                .route("/orders", post(baseline))
                .with_state(Map::default()),
            other => panic!("unknown scenario {other}"),
        };
        let replay = scenario == "replay";
        let method = if scenario == "get" {
            Method::GET
        } else {
            Method::POST
        };
        rt.block_on(async {
            // Warm up (and complete the replayed key).
            for i in 0..n.min(10) + 1 {
                send(&app, &method, i, replay, &body).await;
            }
            for i in 0..n {
                send(&app, &method, i + 1000, replay, &body).await;
            }
        });
    }
}

async fn send(app: &Router, method: &Method, i: usize, replay: bool, body: &Bytes) {
    let key = format!("key-{:08}", if replay { 0 } else { i });
    let req = Request::builder()
        .method(method)
        .uri("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.clone()))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    black_box(res.into_body().collect().await.unwrap().to_bytes());
}
