//! rustango's idempotency middleware on its `DatabaseCache` (Postgres) and its
//! `InMemoryCache`.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use axum::Router;
use rustango::cache::{BoxedCache, DatabaseCache, InMemoryCache};
use rustango::idempotency::{IdempotencyLayer, IdempotencyRouterExt};
use sqlx08::postgres::PgPoolOptions;

use super::{Built, POOL_SIZE};

/// The table name of its documentation.
const TABLE: &str = "rustango_cache";

pub async fn postgres(routes: Router, db_url: &str) -> Result<Built> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(db_url)
        .await
        .with_context(|| format!("rustango: connecting to {db_url}"))?;
    let cache = DatabaseCache::new(rustango::sql::Pool::from(pool.clone()), TABLE);
    cache
        .ensure_table()
        .await
        .map_err(|e| anyhow!("rustango: DatabaseCache::ensure_table: {e}"))?;
    sqlx08::raw_sql("TRUNCATE rustango_cache")
        .execute(&pool)
        .await
        .context("rustango: emptying its cache table")?;
    let cache: BoxedCache = Arc::new(cache);
    Ok(Built {
        router: routes.idempotency(IdempotencyLayer::new(cache)),
        needs_login: false,
        shutdown: Box::pin(async move { pool.close().await }),
    })
}

pub fn memory(routes: Router) -> Router {
    let cache: BoxedCache = Arc::new(InMemoryCache::new());
    routes.idempotency(IdempotencyLayer::new(cache))
}
