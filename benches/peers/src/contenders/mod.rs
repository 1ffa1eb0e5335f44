//! The contenders: each wraps the same routes ([`crate::app::routes`]) in one published
//! idempotency middleware, configured as its documentation says.

mod axum_idempotent;
mod cratestack;
mod rustango;
mod tower_idem;

use std::future::Future;
use std::pin::Pin;

use anyhow::Result;
use axum::Router;

use tower_idempotency::ClaimStrategy;

use crate::app::Counters;

pub use self::axum_idempotent::COOKIE as SESSION_COOKIE;

/// Which middleware, and on which store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    None,
    Tower,
    TowerPrepared,
    TowerCombined,
    TowerReadFirst,
    TowerInsertFirst,
    TowerMemory,
    Cratestack,
    AxumIdempotent,
    AxumIdempotentMemory,
    Rustango,
    RustangoMemory,
}

/// Where a contender keeps its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    Nothing,
    Postgres,
    Memory,
}

pub struct Contender {
    pub name: &'static str,
    pub kind: Kind,
    pub storage: Storage,
    /// The crates and versions it runs.
    pub version: &'static str,
    /// How it is configured.
    pub config: &'static str,
}

/// Every contender, baseline first, in the order of the tables.
pub const ALL: &[Contender] = &[
    Contender {
        name: "none",
        kind: Kind::None,
        storage: Storage::Nothing,
        version: "axum 0.8",
        config: "the handler behind the authentication layer, no idempotency layer",
    },
    Contender {
        name: "tower-idempotency",
        kind: Kind::Tower,
        storage: Storage::Postgres,
        version: tower_idem::VERSION,
        config: "IdempotencyLayer::new(PostgresStore::new(pool)) after store.migrate(); \
                 with_scope(principal) + with_scope_required(true); defaults otherwise \
                 (simple protocol, plain mode, ClaimStrategy::Adaptive)",
    },
    Contender {
        name: "tower-idempotency-prepared",
        kind: Kind::TowerPrepared,
        storage: Storage::Postgres,
        version: tower_idem::VERSION,
        config: "as tower-idempotency, with PostgresStore::new(pool).with_prepared_statements(true)",
    },
    Contender {
        name: "tower-idempotency-combined",
        kind: Kind::TowerCombined,
        storage: Storage::Postgres,
        version: tower_idem::VERSION,
        config: "as tower-idempotency, with \
                 PostgresStore::new(pool).with_claim_strategy(ClaimStrategy::Combined)",
    },
    Contender {
        name: "tower-idempotency-read-first",
        kind: Kind::TowerReadFirst,
        storage: Storage::Postgres,
        version: tower_idem::VERSION,
        config: "as tower-idempotency, with \
                 PostgresStore::new(pool).with_claim_strategy(ClaimStrategy::ReadFirst)",
    },
    Contender {
        name: "tower-idempotency-insert-first",
        kind: Kind::TowerInsertFirst,
        storage: Storage::Postgres,
        version: tower_idem::VERSION,
        config: "as tower-idempotency, with \
                 PostgresStore::new(pool).with_claim_strategy(ClaimStrategy::InsertFirst)",
    },
    Contender {
        name: "tower-idempotency-memory",
        kind: Kind::TowerMemory,
        storage: Storage::Memory,
        version: tower_idem::VERSION,
        config: "IdempotencyLayer::new(MemoryStore::new()); with_scope(principal) + \
                 with_scope_required(true)",
    },
    Contender {
        name: "cratestack",
        kind: Kind::Cratestack,
        storage: Storage::Postgres,
        version: "cratestack-axum 0.8.15 + cratestack-sqlx 0.8.15",
        config: "IdempotencyLayer::new(Arc::new(SqlxIdempotencyStore::new(pool)), 24 h) after \
                 ensure_schema(); default principal fingerprint (SHA-256 of Authorization)",
    },
    Contender {
        name: "axum-idempotent",
        kind: Kind::AxumIdempotent,
        storage: Storage::Postgres,
        version: "axum-idempotent 0.6.0 + ruts 0.13.0 (postgres-store)",
        config: "IdempotentLayer::<PostgresStore>::new(IdempotentOptions::default()\
                 .use_idempotency_key_header(Some(\"Idempotency-Key\"), true).expire_after(300)) \
                 inside SessionLayer(PostgresStoreBuilder::new(pool).create_table(true)) inside \
                 CookieManagerLayer; one session, opened by POST /login",
    },
    Contender {
        name: "axum-idempotent-memory",
        kind: Kind::AxumIdempotentMemory,
        storage: Storage::Memory,
        version: "axum-idempotent 0.6.0 + ruts 0.13.0 (moka-store)",
        config: "as axum-idempotent, on ruts' MokaStore::builder().build()",
    },
    Contender {
        name: "rustango",
        kind: Kind::Rustango,
        storage: Storage::Postgres,
        version: "rustango 0.62.0 (features postgres, admin, cache)",
        config: "Router::idempotency(IdempotencyLayer::new(Arc::new(DatabaseCache::new(pool, \
                 \"rustango_cache\")))) after ensure_table(); defaults (24 h TTL, 60 s in-flight \
                 marker, caller = Authorization/Cookie/X-Api-Key)",
    },
    Contender {
        name: "rustango-memory",
        kind: Kind::RustangoMemory,
        storage: Storage::Memory,
        version: "rustango 0.62.0 (features postgres, admin, cache)",
        config: "as rustango, on InMemoryCache::new()",
    },
];

pub fn by_name(name: &str) -> Option<&'static Contender> {
    ALL.iter().find(|c| c.name == name)
}

pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A contender, ready to serve.
pub struct Built {
    /// The routes wrapped in the contender's layer (not yet in the authentication layer).
    pub router: Router,
    /// Whether requests need a session cookie from `POST /login` first.
    pub needs_login: bool,
    /// Closes its pools.
    pub shutdown: Shutdown,
}

impl Built {
    fn without_pool(router: Router) -> Self {
        Self {
            router,
            needs_login: false,
            shutdown: Box::pin(async {}),
        }
    }
}

/// Builds a fresh instance of `kind` (new store, new pool; its Postgres tables created if
/// missing and emptied), on the current runtime.
pub async fn build(kind: Kind, counters: Counters, db_url: &str) -> Result<Built> {
    let routes = crate::app::routes(counters);
    match kind {
        Kind::None => Ok(Built::without_pool(routes)),
        Kind::Tower => tower_idem::postgres(routes, db_url, false, ClaimStrategy::default()).await,
        Kind::TowerPrepared => {
            tower_idem::postgres(routes, db_url, true, ClaimStrategy::default()).await
        }
        Kind::TowerCombined => {
            tower_idem::postgres(routes, db_url, false, ClaimStrategy::Combined).await
        }
        Kind::TowerReadFirst => {
            tower_idem::postgres(routes, db_url, false, ClaimStrategy::ReadFirst).await
        }
        Kind::TowerInsertFirst => {
            tower_idem::postgres(routes, db_url, false, ClaimStrategy::InsertFirst).await
        }
        Kind::TowerMemory => Ok(Built::without_pool(tower_idem::memory(routes))),
        Kind::Cratestack => cratestack::postgres(routes, db_url).await,
        Kind::AxumIdempotent => axum_idempotent::postgres(routes, db_url).await,
        Kind::AxumIdempotentMemory => Ok(axum_idempotent::memory(routes)),
        Kind::Rustango => rustango::postgres(routes, db_url).await,
        Kind::RustangoMemory => Ok(Built::without_pool(rustango::memory(routes))),
    }
}

/// The pool every Postgres contender uses: sqlx's default size, 10 connections.
pub const POOL_SIZE: u32 = 10;
