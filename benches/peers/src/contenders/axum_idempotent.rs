//! axum-idempotent's `IdempotentLayer`, which keeps answers in a ruts session: ruts'
//! Postgres session store, or its in-memory Moka store.
//!
//! Its README: the layer sits inside ruts' `SessionLayer`, inside tower-cookies'
//! `CookieManagerLayer`, and caches only for a request that already carries a session. The
//! middleware never opens one, so the application does: `POST /login` (outside the
//! idempotency layer) sets a session field, and the client sends that session's cookie.

use std::sync::Arc;

use anyhow::{Context, Result};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::SessionStore;
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::store::postgres::{PostgresStore, PostgresStoreBuilder};
use ruts::{CookieOptions, Session, SessionLayer};
use sqlx08::postgres::PgPoolOptions;
use tower_cookies::CookieManagerLayer;

use super::{Built, POOL_SIZE};

/// The cookie that carries the session.
pub const COOKIE: &str = "session";

/// Cached answers live 5 minutes (its README's example).
const ANSWER_TTL_SECS: i64 = 300;

fn options() -> IdempotentOptions {
    IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(ANSWER_TTL_SECS)
}

/// Opens the session that the idempotency layer keeps its answers in.
async fn login<T: SessionStore>(session: Session<T>) -> StatusCode {
    let ttl = match Ttl::new(3600) {
        Ok(ttl) => ttl,
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR,
    };
    match session.set("user", &"bench", ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn wire<T: SessionStore>(routes: Router, store: Arc<T>) -> Router {
    routes
        .layer(IdempotentLayer::<T>::new(options()))
        .merge(Router::new().route("/login", post(login::<T>)))
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name(COOKIE)))
        .layer(CookieManagerLayer::new())
}

pub async fn postgres(routes: Router, db_url: &str) -> Result<Built> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(db_url)
        .await
        .with_context(|| format!("axum-idempotent: connecting to {db_url}"))?;
    let store: PostgresStore = PostgresStoreBuilder::new(pool.clone())
        .create_table(true)
        .build()
        .await
        .context("axum-idempotent: building ruts' PostgresStore")?;
    sqlx08::raw_sql("TRUNCATE t_sessions")
        .execute(&pool)
        .await
        .context("axum-idempotent: emptying ruts' session table")?;
    Ok(Built {
        router: wire(routes, Arc::new(store)),
        needs_login: true,
        shutdown: Box::pin(async move { pool.close().await }),
    })
}

pub fn memory(routes: Router) -> Built {
    let store = Arc::new(MokaStore::builder().build());
    Built {
        router: wire(routes, store),
        needs_login: true,
        shutdown: Box::pin(async {}),
    }
}
