//! The quick start: an axum service whose `POST /payments` runs once per `Idempotency-Key`,
//! keys in memory. `cargo run --example quickstart`, then send the same request twice:
//!
//! ```sh
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: k1' -d '{"amount":100}'
//! ```
//!
//! The second answer is the first one again, with `Idempotent-Replayed: true`.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::{Extension, Router, extract::State, http::StatusCode, routing::post};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};

/// The handler runs once per key; a retry with the key gets this answer replayed.
async fn create_payment(
    State(charges): State<Arc<AtomicU64>>,
    Extension(key): Extension<IdempotencyKey>,
    body: String,
) -> (StatusCode, String) {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    // Work that leaves the process carries a key derived from this one (`<key>:charge`),
    // so the payment provider deduplicates it too.
    let charge_key = key
        .derive("charge")
        .map(|k| k.to_string())
        .unwrap_or_default();
    let answer = format!(
        "charge #{n} (provider key {charge_key}) for {} bytes\n",
        body.len()
    );
    (StatusCode::CREATED, answer)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let app = Router::new()
        .route("/payments", post(create_payment))
        .with_state(Arc::new(AtomicU64::new(0)))
        // In production, scope keys to the authenticated client (`with_scope`) and keep
        // them in Postgres (`PostgresStore`): see the README and `examples/payments.rs`.
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_shared_scope());
    let addr = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
