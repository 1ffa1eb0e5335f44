//! tower-idempotency (this repository, as a path dependency), on Postgres and in memory.

use anyhow::{Context, Result};
use axum::Router;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{ClaimStrategy, IdempotencyLayer, MemoryStore, PostgresStore};

use super::{Built, POOL_SIZE};
use crate::app::Principal;

pub const VERSION: &str = "tower-idempotency 0.1.0 (path ../..)";

/// The layer as the README's Security section asks: keys scoped to the authenticated
/// principal, and a keyed request without one refused.
fn layer<St: Clone>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .with_scope(|parts| {
            let principal = parts.extensions.get::<Principal>()?;
            Some(format!("principal:{}", principal.0))
        })
        .with_scope_required(true)
}

pub async fn postgres(
    routes: Router,
    db_url: &str,
    prepared: bool,
    strategy: ClaimStrategy,
) -> Result<Built> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(db_url)
        .await
        .with_context(|| format!("tower-idempotency: connecting to {db_url}"))?;
    let store = PostgresStore::new(pool.clone())
        .with_prepared_statements(prepared)
        .with_claim_strategy(strategy);
    store
        .migrate()
        .await
        .context("tower-idempotency: PostgresStore::migrate")?;
    sqlx::raw_sql("TRUNCATE tower_idempotency_keys, tower_idempotency_waiting")
        .execute(&pool)
        .await
        .context("tower-idempotency: emptying its tables")?;
    Ok(Built {
        router: routes.layer(layer(store)),
        needs_login: false,
        shutdown: Box::pin(async move { pool.close().await }),
    })
}

pub fn memory(routes: Router) -> Router {
    routes.layer(layer(MemoryStore::new()))
}
