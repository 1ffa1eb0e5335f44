//! cratestack-axum's `IdempotencyLayer` on cratestack-sqlx's `SqlxIdempotencyStore`.
//!
//! cratestack 0.8.15 publishes no in-memory `IdempotencyStore` (the only one is in its test
//! code), so it runs on Postgres only.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use axum::Router;
use cratestack_axum::idempotency::IdempotencyLayer;
use cratestack_sqlx::SqlxIdempotencyStore;
use cratestack_sqlx::sqlx::postgres::PgPoolOptions;

use super::{Built, POOL_SIZE};

/// The TTL of its documentation's example.
const TTL: Duration = Duration::from_secs(24 * 3600);

pub async fn postgres(routes: Router, db_url: &str) -> Result<Built> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(db_url)
        .await
        .with_context(|| format!("cratestack: connecting to {db_url}"))?;
    let store = SqlxIdempotencyStore::new(pool.clone());
    store
        .ensure_schema()
        .await
        .map_err(|e| anyhow!("cratestack: ensure_schema: {e}"))?;
    cratestack_sqlx::sqlx::raw_sql("TRUNCATE cratestack_idempotency")
        .execute(&pool)
        .await
        .context("cratestack: emptying its table")?;
    // The default principal fingerprint: the SHA-256 of `Authorization`, which every request
    // carries (without it, and without `ConnectInfo`, every keyed request is refused).
    let layer = IdempotencyLayer::new(Arc::new(store), TTL);
    Ok(Built {
        router: routes.layer(layer),
        needs_login: false,
        shutdown: Box::pin(async move { pool.close().await }),
    })
}
