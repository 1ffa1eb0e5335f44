//! The quick start: an axum service whose `POST /payments` runs once per account and
//! `Idempotency-Key`, keys in memory. `cargo run --example quickstart`, then send the same
//! request twice:
//!
//! ```sh
//! curl -i -X POST localhost:3000/payments -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: k1' -d '{"amount":100}'
//! ```
//!
//! The second answer is the first one again, with `Idempotent-Replayed: true`. The same key
//! sent for another account (`Bearer bob`) is that account's own request.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{Request, State};
use axum::http::{StatusCode, header::AUTHORIZATION};
use axum::middleware::{Next, from_fn};
use axum::response::Response;
use axum::{Extension, Router, routing::post};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};

/// The account a request acts for, set by the authentication layer.
#[derive(Clone)]
struct Account(String);

/// A stand-in for your authentication: here the bearer token names the account (a real
/// service verifies the token and looks its account up). No account, no request.
async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
    let account = (req.headers().get(AUTHORIZATION))
        .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
        .filter(|name| !name.is_empty())
        .ok_or(StatusCode::UNAUTHORIZED)?;
    let account = Account(account.to_owned());
    req.extensions_mut().insert(account);
    Ok(next.run(req).await)
}

/// The handler runs once per key; a retry with the key gets this answer replayed.
async fn create_payment(
    State(charges): State<Arc<AtomicU64>>,
    Extension(key): Extension<IdempotencyKey>,
    body: String,
) -> (StatusCode, String) {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    // Work that leaves the process carries a key derived from this one (`<key>:charge`),
    // so the payment provider deduplicates it too.
    let charge_key = key.derive("charge").map(|k| k.to_string());
    let answer = format!(
        "charge #{n} (provider key {}) for {} bytes\n",
        charge_key.unwrap_or_default(),
        body.len()
    );
    (StatusCode::CREATED, answer)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let idempotency = IdempotencyLayer::new(MemoryStore::new())
        // Keys belong to the account: no client can replay another's answer.
        .with_scope(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .with_scope_required(true);
    let app = Router::new()
        .route("/payments", post(create_payment))
        .with_state(Arc::new(AtomicU64::new(0)))
        // In production keep the keys in Postgres (`PostgresStore`): see the README and
        // `examples/payments/`.
        .layer(idempotency)
        // Added last, so it runs first: the account is known when the key is scoped.
        .layer(from_fn(authenticate));
    let addr = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
