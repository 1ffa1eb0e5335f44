//! The whole story of an idempotent payment, as one runnable axum server.
//!
//! A client posts a charge with an `Idempotency-Key`. The payments service runs the charge at
//! a (fake) payment provider and records the payment. Networks fail, so the client retries;
//! the [`IdempotencyLayer`] makes sure that a retry gets the answer of the first attempt
//! instead of a second charge. The provider is protected by the same layer, and the payments
//! service passes it a key *derived* from the client's (`<key>:charge`), so even a retry that
//! gets past the payments layer (after a crash, say) never charges twice.
//!
//! ```text
//! client ──POST /payments──▶ [auth] ▶ [idempotency] ▶ create_payment ──┐
//!         Idempotency-Key: k                                           │ in process, with
//!                                                                      │ Idempotency-Key: k:charge
//!          POST /provider/charges ──▶ [auth] ▶ [idempotency] ▶ charge ◀┘
//!
//! provider ──POST /webhooks/provider──▶ [idempotency on webhook-id] ▶ receive_webhook
//! ```
//!
//! With `PROVIDER_URL` set, the charge leaves the process: `POST {PROVIDER_URL}/provider/charges`
//! over HTTP, through the crate's outbound client layer
//! ([`IdempotentClientLayer`](tower_idempotency::client::IdempotentClientLayer)). It sends the
//! derived key `k:charge` and, when the provider's answer is lost (a closed connection, a
//! timeout) or says "later" (`409`, `429`, `503`), sends the charge again with the same key,
//! so the provider answers with the charge it made instead of making another. Run a second
//! instance as the provider and point `PROVIDER_URL` at it:
//!
//! ```text
//! BIND=127.0.0.1:4000 cargo run --release --example payments            # the provider
//! PROVIDER_URL=http://127.0.0.1:4000 cargo run --release --example payments
//! curl localhost:4000/provider/charges                                  # the real charges
//! ```
//!
//! With `DATABASE_URL` set, the routes that call out run in **phased mode**
//! ([`PostgresStore::phased`]) and the others in transactional mode
//! ([`PostgresStore::transactional`]):
//!
//! - `POST /payments` runs in phases, and holds no transaction (and no pooled connection)
//!   while the provider works: (1) the key is claimed and the payment recorded as `pending`,
//!   committed with the recovery point `pending`; (2) the provider is called with the derived
//!   key `k:charge`, no transaction open; (3) the charge is recorded, the payment becomes
//!   `charged`, and the layer stores the answer, in one commit. A retry after a crash between
//!   phases resumes after the last committed one: it finds its pending payment, calls the
//!   provider again with the same derived key (which replays its charge) and completes.
//! - The provider, too, waits (`CHARGE_DELAY_MS`) outside any transaction and records its
//!   charge in the last phase, with the answer to `k:charge`.
//! - `PATCH /orders/{id}` and the webhook receiver only write to the database: transactional
//!   mode, their writes ([`IdempotentTx`]) and the key commit in one transaction.
//!
//! # Run it
//!
//! ```text
//! cargo run --release --example payments
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --release --example payments
//! ```
//!
//! Then, from another terminal:
//!
//! ```text
//! curl -i localhost:3000/payments -H 'Idempotency-Key: 4f1c' -H 'Authorization: Bearer acme' \
//!      -d '{"order_id": 1, "amount_cents": 1999}'
//! # run it again: the same answer, with `Idempotent-Replayed: true`, and no second charge
//! # the same JSON reordered or re-spaced, '{ "amount_cents": 1999, "order_id": 1 }': the same
//! # replay (JSON bodies are fingerprinted semantically); another amount: 422, no charge
//! curl localhost:3000/provider/charges              # {"count":1}
//! curl localhost:3000/orders/1 -H 'Authorization: Bearer acme'
//! ```
//!
//! # Configuration (environment)
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `BIND` | `127.0.0.1:3000` | address to listen on (port `0`: any free port) |
//! | `DATABASE_URL` | unset | unset: everything in memory. Set: Postgres store (migrated at start); payments and charges in phased mode, orders and webhooks in transactional mode; data in `example_*` tables, committed with the key |
//! | `REDIS_URL` | unset | with `DATABASE_URL` unset: the idempotency keys in Redis ([`RedisStore`], plain mode; needs the `redis` feature), shared by every instance pointed at it; payments stay in memory. Refuses to start on a Redis whose `maxmemory-policy` evicts keys |
//! | `IDEMPOTENCY_TTL_SECS` | `86400` | how long a key is remembered ([`IdempotencyLayer::with_ttl`]) |
//! | `IDEMPOTENCY_LEASE_MS` | `30000` | how long a claim holds a key ([`IdempotencyLayer::with_lease`]); in memory only: in Postgres a claim lasts as long as its transaction |
//! | `IDEMPOTENCY_STORE_TIMEOUT_MS` | `5000` | the longest one store call may take ([`IdempotencyLayer::with_store_timeout`]; in Postgres also the store's own `statement_timeout`): a store that does not answer in time is answered `503` with `Retry-After` |
//! | `CHARGE_DELAY_MS` | `0` | how long the provider takes for each new charge |
//! | `IDEMPOTENCY_WAIT_MS` | `0` | > 0: a duplicate of a request still running waits up to this long for its answer and gets it as a replay ([`IdempotencyLayer::with_wait_for_completion`]; in Postgres woken by `LISTEN/NOTIFY`, see [`PostgresStore::with_notifications`]); then `409` as with `0` |
//! | `MAX_BODY_BYTES` | `1048576` | larger request bodies are answered `413` |
//! | `IDEMPOTENCY` | `on` | `off`: the same routes without the layer (a baseline for benchmarks) |
//! | `PROVIDER_URL` | unset | unset: the provider is called in process. Set (`http://host:port`): `POST /payments` calls `POST {PROVIDER_URL}/provider/charges` over HTTP through the outbound client layer, with the derived key, retrying that key on lost answers, `409`, `429`, `503` (never on another `4xx`) |
//!
//! The server prints one line, `listening on http://ADDR`, once it accepts connections, and
//! stops cleanly on `SIGTERM` or `SIGINT`.
//!
//! # Routes
//!
//! | route | what it does |
//! |---|---|
//! | `POST /payments` | `{"order_id", "amount_cents"}`: charge at the provider, record the payment, `201` |
//! | `PATCH /orders/{order_id}` | `{"shipping_address"}`: set the order's shipping address, `200` |
//! | `GET /orders/{order_id}` | the order: total charged, number of payments, shipping address |
//! | `POST /provider/charges` | the fake provider: `{"amount_cents"}`, `201` with a `charge_id` |
//! | `GET /provider/charges` | how many charges the provider really made |
//! | `POST /webhooks/provider` | a webhook receiver, deduplicated on its `webhook-id` header |
//! | `GET /webhooks/provider` | how many distinct webhook events were applied |
//!
//! Inputs are bounded, and errors are `application/problem+json` documents:
//!
//! - `amount_cents` is a whole number of cents from 1 to 1 000 000 000 (10 million in currency
//!   units), at the payments service and at the provider; any other number is `422`. An
//!   order's `total_cents` is summed exactly (as an `i128`, and in Postgres as a `numeric`),
//!   so it never overflows;
//! - an order id is any whole number that fits 64 bits (negative ones too); in a body another
//!   number is `422`, in a path anything else is `404`;
//! - a body that is not JSON of the expected shape is `400`.
//! - the database out of reach (a lost connection, a failover, a restart) is `503` with
//!   `Retry-After`, like the layer's own `503`: nothing was committed, retry with the same key.
//!
//! Authentication is a toy: `Authorization: Bearer <tenant>` names the tenant; without the
//! header the request belongs to the anonymous tenant. Keys are scoped per tenant, so tenants
//! never see (or block) each other's keys. A tenant name is 1 to 128 characters of RFC 6750's
//! token alphabet (`A-Z a-z 0-9 - . _ ~ + /`, then any `=`); another token, or another
//! `Authorization` scheme, is `401` with a `WWW-Authenticate` challenge, answered before the
//! idempotency layer claims anything.

use std::collections::{HashMap, HashSet};
use std::io::{IsTerminal as _, Write as _};
use std::ops::{Deref, DerefMut};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, FromRequest as _, Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::{patch, post};
use axum::{Extension, Json, Router};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Number;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool, Postgres, Row as _, Transaction};
use tower::Layer as _;
use tower::ServiceExt as _;
#[cfg(feature = "redis")]
use tower_idempotency::RedisStore;
use tower_idempotency::client::{IdempotentClient, IdempotentClientLayer, ReplayBody};
use tower_idempotency::{
    ConfigError, IDEMPOTENCY_KEY, IdempotencyKey, IdempotencyLayer, IdempotentTx, MemoryStore,
    Mode, PhaseError, Phases, PostgresStore, TxConn, spawn_purge_task,
};
use tracing_subscriber::EnvFilter;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// The settings read from the environment (see the table at the top of this file).
#[derive(Debug, Clone)]
struct Config {
    bind: String,
    database_url: Option<String>,
    /// `REDIS_URL`: the idempotency keys in Redis (plain mode) when `DATABASE_URL` is unset.
    redis_url: Option<String>,
    ttl: Duration,
    lease: Duration,
    store_timeout: Duration,
    charge_delay: Duration,
    /// How long a duplicate of a request in flight waits for its answer (zero: not at all).
    wait: Duration,
    max_body_bytes: usize,
    /// `false` (`IDEMPOTENCY=off`): the same routes and handlers, without the layer.
    idempotency: bool,
    /// `PROVIDER_URL`, as `{PROVIDER_URL}/provider/charges`, and the outbound layer the
    /// charges go there through.
    provider_charges: Option<(axum::http::Uri, IdempotentClientLayer)>,
}

impl Config {
    /// Reads the configuration; the error names the variable and what it should hold.
    fn from_env() -> Result<Self, String> {
        let idempotency = match var("IDEMPOTENCY")?.as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(other) => {
                return Err(format!(
                    "invalid IDEMPOTENCY={other:?}: expected \"on\" or \"off\""
                ));
            }
        };
        Ok(Self {
            bind: var("BIND")?.unwrap_or_else(|| "127.0.0.1:3000".to_owned()),
            // An empty DATABASE_URL counts as unset, as it does for most tools.
            database_url: var("DATABASE_URL")?.filter(|url| !url.is_empty()),
            redis_url: var("REDIS_URL")?.filter(|url| !url.is_empty()),
            ttl: Duration::from_secs(positive("IDEMPOTENCY_TTL_SECS", 86_400)?),
            lease: Duration::from_millis(positive("IDEMPOTENCY_LEASE_MS", 30_000)?),
            store_timeout: Duration::from_millis(positive("IDEMPOTENCY_STORE_TIMEOUT_MS", 5_000)?),
            charge_delay: Duration::from_millis(number("CHARGE_DELAY_MS", 0)?),
            wait: Duration::from_millis(number("IDEMPOTENCY_WAIT_MS", 0)?),
            max_body_bytes: number("MAX_BODY_BYTES", 1024 * 1024)?,
            idempotency,
            provider_charges: provider_charges()?,
        })
    }
}

/// `{PROVIDER_URL}/provider/charges`, or `None` when `PROVIDER_URL` is unset or empty. The
/// URL is `http://` (the example's client speaks plain HTTP), with a host.
fn provider_charges() -> Result<Option<(axum::http::Uri, IdempotentClientLayer)>, String> {
    let Some(url) = var("PROVIDER_URL")?.filter(|url| !url.is_empty()) else {
        return Ok(None);
    };
    let invalid = || format!("invalid PROVIDER_URL={url:?}: expected http://host:port");
    let uri: axum::http::Uri = format!("{}/provider/charges", url.trim_end_matches('/'))
        .parse()
        .map_err(|_| invalid())?;
    if uri.scheme_str() != Some("http") || uri.host().is_none_or(str::is_empty) {
        return Err(invalid());
    }
    // The key of a charge is the payment's, derived with the purpose "charge".
    let layer = IdempotentClientLayer::new("charge")
        .map_err(|e| format!("cannot make the provider's client: {e}"))?;
    Ok(Some((uri, layer)))
}

/// An environment variable: `None` when unset, an error when it is not Unicode.
fn var(name: &str) -> Result<Option<String>, String> {
    match std::env::var(name) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not valid Unicode")),
    }
}

/// A whole, non-negative number from the environment, or `default` when unset.
fn number<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match var(name)? {
        None => Ok(default),
        Some(value) => value
            .trim()
            .parse()
            .map_err(|_| format!("invalid {name}={value:?}: expected a whole number, at least 0")),
    }
}

/// Like [`number`], but 0 is refused too: a zero TTL or lease would make the layer useless.
fn positive(name: &str, default: u64) -> Result<u64, String> {
    match number(name, default)? {
        0 => Err(format!(
            "invalid {name}=0: expected a whole number, at least 1"
        )),
        n => Ok(n),
    }
}

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

fn main() -> ExitCode {
    // Logs go to stderr: stdout carries only the `listening on` line.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn")),
        )
        .init();

    let config = match Config::from_env() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("payments: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("payments: cannot start the Tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payments: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How often expired keys are deleted, and how many per statement.
const PURGE_EVERY: Duration = Duration::from_secs(60);
const PURGE_BATCH: usize = 1000;

/// Connects the storage, serves until `SIGTERM` or `SIGINT`, then closes the storage.
async fn serve(config: Config) -> Result<(), BoxError> {
    // Listen for the signals before announcing the address, so that a signal sent right
    // after the announcement already means "shut down" and not "die".
    let shutdown = shutdown_signal()?;

    let storage = match &config.database_url {
        None => Storage::memory(),
        Some(url) => Storage::postgres(url).await?,
    };

    // The idempotency keys live next to the data: in Postgres, where every instance of the
    // service sees them, or in memory. (With `IDEMPOTENCY=off` the store is never used.)
    // Expired keys are never replayed, but they take space until deleted: purge them.
    let (router, purge) = match storage.pools() {
        Some((payments, provider)) if config.idempotency => {
            // Waiting duplicates (IDEMPOTENCY_WAIT_MS) are woken by a NOTIFY from whichever
            // instance finishes their key: the store's default.
            let store =
                PostgresStore::new(payments.clone()).with_statement_timeout(config.store_timeout);
            store
                .migrate()
                .await
                .map_err(|e| format!("cannot create the idempotency tables: {e}"))?;
            // One table for every layer, so one purge task.
            let purge = spawn_purge_task(store.clone(), PURGE_EVERY, PURGE_BATCH)?;
            // Each layer opens its transactions on its service's pool. The routes that call
            // out (or wait, as the provider does) run in phases; the others in one
            // transaction.
            let provider_store = PostgresStore::new(provider.clone())
                .with_statement_timeout(config.store_timeout)
                .phased();
            let router = app(
                &config,
                &storage,
                store.transactional(),
                store.phased(),
                provider_store,
            )?;
            (router, purge)
        }
        _ => match &config.redis_url {
            Some(url) if config.idempotency => {
                let store = redis_store(url, &config).await?;
                let purge = spawn_purge_task(store.clone(), PURGE_EVERY, PURGE_BATCH)?;
                let router = app(&config, &storage, store.clone(), store.clone(), store)?;
                (router, purge)
            }
            _ => {
                let store = MemoryStore::new();
                let purge = spawn_purge_task(store.clone(), PURGE_EVERY, PURGE_BATCH)?;
                let router = app(&config, &storage, store.clone(), store.clone(), store)?;
                (router, purge)
            }
        },
    };

    let listener = tokio::net::TcpListener::bind(&config.bind)
        .await
        .map_err(|e| format!("cannot listen on BIND={:?}: {e}", config.bind))?;
    let addr = listener.local_addr()?;
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on http://{addr}")?;
        stdout.flush()?;
    }
    tracing::info!(
        %addr,
        idempotency = config.idempotency,
        postgres = config.database_url.is_some(),
        "payments example started"
    );

    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await?;

    purge.abort();
    storage.close().await;
    tracing::info!("payments example stopped");
    Ok(())
}

/// The idempotency keys in Redis (`REDIS_URL`, `DATABASE_URL` unset): plain mode, shared by
/// every instance pointed at the same Redis; the payments stay in this process's memory.
///
/// Refuses to start on a Redis that evicts keys (it could drop a key in progress, and its
/// retry would charge twice). A Redis that does not answer at start is not a reason to
/// refuse: requests with a key are answered `503` until it does.
#[cfg(feature = "redis")]
async fn redis_store(url: &str, config: &Config) -> Result<RedisStore, BoxError> {
    let mut store = RedisStore::open(url)
        .map_err(|e| format!("invalid REDIS_URL: {e}"))?
        .with_timeout(config.store_timeout);
    if !config.wait.is_zero() {
        let client = redis::Client::open(url).map_err(|e| format!("invalid REDIS_URL: {e}"))?;
        store = store.with_notifications(client);
    }
    match store.check_eviction_policy().await {
        Ok(()) => {}
        Err(e @ tower_idempotency::StoreError::Misconfigured(_)) => {
            return Err(format!("REDIS_URL: {e}").into());
        }
        Err(e) => tracing::warn!(
            error = &e as &dyn std::error::Error,
            "cannot check Redis's eviction policy; answering 503 until Redis answers"
        ),
    }
    Ok(store)
}

#[cfg(not(feature = "redis"))]
async fn redis_store(_url: &str, _config: &Config) -> Result<MemoryStore, BoxError> {
    Err(
        "REDIS_URL is set, but the example was built without the `redis` feature \
         (cargo run --features redis --example payments)"
            .into(),
    )
}

/// A future that completes on `SIGTERM` or `SIGINT` (Ctrl-C). The handlers are installed
/// now, not when the future is first polled.
#[cfg(unix)]
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}

/// A future that completes on Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    Ok(async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The router
// ---------------------------------------------------------------------------------------------

/// What the payments handlers share.
#[derive(Clone)]
struct AppState {
    db: Db,
    /// Where the payments handler charges.
    provider: Provider,
}

/// Where the payments service charges.
#[derive(Clone)]
enum Provider {
    /// `PROVIDER_URL` unset: the provider's router, layers included, called in process,
    /// exactly as a client calls it over HTTP under `/provider/charges`.
    InProcess(Router),
    /// `PROVIDER_URL` set: `POST {PROVIDER_URL}/provider/charges` over HTTP, through the
    /// crate's outbound client layer.
    Http(Arc<HttpProvider>),
}

/// The provider over HTTP: the client (the client layer over hyper-util's), and where to post.
struct HttpProvider {
    client: IdempotentClient<Client<HttpConnector, ReplayBody>>,
    charges: axum::http::Uri,
}

impl Provider {
    fn new(config: &Config, in_process: Router) -> Self {
        let Some((charges, layer)) = config.provider_charges.clone() else {
            return Self::InProcess(in_process);
        };
        let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
        Self::Http(Arc::new(HttpProvider {
            client: layer.layer(http),
            charges,
        }))
    }
}

/// What the provider's handlers share.
#[derive(Clone)]
struct ProviderState {
    db: Db,
    charge_delay: Duration,
}

/// The whole server: payments and orders, the fake provider, and the webhook receiver, each
/// behind its own idempotency layer (unless `IDEMPOTENCY=off`).
///
/// The three layers keep their keys in one place (in Postgres, one table); in Postgres the
/// provider's layer reaches it through the provider's own pool (`provider_store`). Each layer
/// gives its scopes its own prefix, so that a key of one service can never collide with a
/// key of another.
/// `payments_store` keeps the keys of the routes that only write to the database;
/// `calls_out` and `provider_store` those of the routes that call out or wait (in Postgres:
/// phased mode).
fn app<M: Mode, P: Mode>(
    config: &Config,
    storage: &Storage,
    payments_store: M,
    calls_out: P,
    provider_store: P,
) -> Result<Router, ConfigError> {
    // The settings from the environment, common to the layers.
    fn layer<M: Mode>(
        config: &Config,
        store: &M,
    ) -> Result<Option<IdempotencyLayer<M>>, ConfigError> {
        if !config.idempotency {
            return Ok(None);
        }
        Ok(Some(
            IdempotencyLayer::new(store.clone())
                .with_ttl(config.ttl)?
                .with_lease(config.lease)
                .with_store_timeout(config.store_timeout)
                .with_max_request_body(config.max_body_bytes)
                // Zero (the default) leaves waiting off: a duplicate gets 409 at once.
                .with_wait_for_completion(config.wait),
        ))
    }
    // The payments service's scope: its tenant.
    fn tenant_scope<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
        layer.with_scope(|parts| match tenant_of(parts) {
            "" => None, // the anonymous tenant: the shared scope
            tenant => Some(format!("tenant:{tenant}")),
        })
    }

    // The payment provider. Like Stripe with connected accounts, it scopes keys per tenant
    // (the account the call is made for), so two tenants' `k:charge` are different charges.
    let provider = protect(
        Router::new().route(
            "/provider/charges",
            post(provider_charge).get(provider_charge_count),
        ),
        layer(config, &provider_store)?
            .map(|l| l.with_scope(|parts| Some(format!("provider:{}", tenant_of(parts))))),
    )
    // `route_layer`s wrap the ones added before them: authentication runs first, so the
    // scope function sees the authenticated tenant.
    .route_layer(from_fn(authenticate))
    .with_state(ProviderState {
        db: storage.provider.clone(),
        charge_delay: config.charge_delay,
    });

    // The payments service. GET requests pass through the layer untouched. A retry that
    // rebuilt its JSON (members reordered, other whitespace) is the same request; another
    // value is still `422`.
    let payments = protect(
        Router::new().route("/payments", post(create_payment)),
        layer(config, &calls_out)?.map(|l| tenant_scope(l).pipe(json_fingerprint)),
    )
    .merge(protect(
        Router::new().route("/orders/{order_id}", patch(update_order).get(get_order)),
        layer(config, &payments_store)?.map(|l| tenant_scope(l).pipe(json_fingerprint)),
    ))
    .route_layer(from_fn(authenticate))
    .with_state(AppState {
        db: storage.payments.clone(),
        provider: Provider::new(config, provider.clone()),
    });

    // The webhook receiver. The provider names each event in a `webhook-id` header
    // (Standard Webhooks) and redelivers until it gets a 2xx; the layer turns redeliveries
    // into replays. A real receiver verifies the webhook's signature before this layer.
    let webhooks = protect(
        Router::new().route(
            "/webhooks/provider",
            post(receive_webhook).get(webhooks_processed),
        ),
        layer(config, &payments_store)?.map(|l| {
            l.with_header(HeaderName::from_static("webhook-id"))
                .with_scope(|_| Some("webhooks:provider".to_owned()))
        }),
    )
    .with_state(storage.payments.clone());

    Ok(Router::new()
        .merge(payments)
        .merge(provider)
        .merge(webhooks)
        // Bounds what axum's extractors read, so `IDEMPOTENCY=off` answers 413 alike.
        .layer(DefaultBodyLimit::max(config.max_body_bytes)))
}

/// Fingerprints the JSON bodies of `POST /payments` and `PATCH /orders/{id}` by their
/// meaning ([`JsonFingerprint`](tower_idempotency::JsonFingerprint), RFC 8785's canonical
/// form): the handlers read JSON whatever the `Content-Type` (`curl -d` sends a form type),
/// so every body is read as JSON, and one that is not JSON is compared by its bytes.
#[cfg(feature = "json")]
fn json_fingerprint<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
    layer.with_json_fingerprint(tower_idempotency::JsonFingerprint::new().with_any_content_type())
}

/// Built without the crate's `json` feature: the same semantics through a fingerprint
/// function of the example's own, over `serde_json`'s reading of the body (members sorted,
/// whitespace gone; numbers as `serde_json` keeps them, which is exact for the example's
/// whole-number amounts and ids).
#[cfg(not(feature = "json"))]
fn json_fingerprint<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
    layer.with_fingerprint_fn(|parts, body| {
        // Tagged, so that a JSON body and a non-JSON one never share an input.
        let tagged = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(value) => [b"json:".as_slice(), sorted(&value).to_string().as_bytes()].concat(),
            Err(_) => [b"raw:".as_slice(), body].concat(),
        };
        tower_idempotency::fingerprint::fingerprint(parts, &[], &tagged)
    })
}

/// `value` with every object's members in order of their names.
#[cfg(not(feature = "json"))]
fn sorted(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            members.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                members
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// `x.pipe(f)` is `f(x)`, to keep a builder chain in one expression.
trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}

impl<T> Pipe for T {}

/// Puts `layer` (if any) around the routes of `router`. `route_layer`, not `layer`: unknown
/// paths stay `404` instead of going through the layer (which would demand a key).
fn protect<S, M>(router: Router<S>, layer: Option<IdempotencyLayer<M>>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    M: Mode,
{
    match layer {
        Some(layer) => router.route_layer(layer),
        None => router,
    }
}

// ---------------------------------------------------------------------------------------------
// Authentication (a toy)
// ---------------------------------------------------------------------------------------------

/// The authenticated tenant; `""` is the anonymous tenant.
#[derive(Clone, Debug)]
struct Tenant(Arc<str>);

/// The longest tenant name a bearer token may carry.
const MAX_TENANT_LEN: usize = 128;

/// `Authorization: Bearer <tenant>` names the tenant; no header, the anonymous tenant. Any
/// other `Authorization`, and a token that is no tenant name ([`is_tenant`]), is refused with
/// `401`, before the idempotency layer sees the request: nothing is claimed or stored for a
/// request that is refused here.
///
/// `401`, not `400`, for a malformed or over-long token: it is a bad credential (RFC 6750's
/// `invalid_token`), and a client answers a `401` by fixing its credentials, not by retrying
/// the same request.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let tenant = match request.headers().get(AUTHORIZATION) {
        None => String::new(),
        Some(value) => match bearer_token(value) {
            Some(token) if is_tenant(token) => token.to_owned(),
            Some(_) => {
                return unauthorized(
                    format!(
                        "the bearer token names the tenant: 1 to {MAX_TENANT_LEN} characters \
                         of A-Z a-z 0-9 - . _ ~ + /, then any number of ="
                    ),
                    r#"Bearer error="invalid_token""#,
                );
            }
            None => {
                return unauthorized("expected `Authorization: Bearer <tenant>`", "Bearer");
            }
        },
    };
    request.extensions_mut().insert(Tenant(tenant.into()));
    next.run(request).await
}

/// A `401` problem with a `WWW-Authenticate` challenge.
fn unauthorized(detail: impl Into<String>, challenge: &'static str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, detail).into_response();
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    response
}

/// Whether `token` is a tenant name: RFC 6750's token syntax (`b64token`), at most
/// [`MAX_TENANT_LEN`] characters. The bound keeps the keys' scopes (`tenant:<name>`) small:
/// in Postgres a scope of a few thousand characters would not fit the keys' index.
fn is_tenant(token: &str) -> bool {
    let name = token.trim_end_matches('=');
    token.len() <= MAX_TENANT_LEN
        && !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// The token of `Bearer <token>` (the scheme is case-insensitive).
fn bearer_token(value: &HeaderValue) -> Option<&str> {
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The tenant that [`authenticate`] found, for the layers' scope functions.
fn tenant_of(parts: &Parts) -> &str {
    // `authenticate` runs before every layer that asks, so the tenant is always there.
    parts.extensions.get::<Tenant>().map_or("", |t| &t.0)
}

// ---------------------------------------------------------------------------------------------
// Payments and orders
// ---------------------------------------------------------------------------------------------

/// The body of `POST /payments`. The numbers are kept as sent and checked by [`order_id`]
/// and [`amount_cents`], so that a number out of range is a `422` that says so.
#[derive(Deserialize)]
struct NewPayment {
    order_id: Number,
    amount_cents: Number,
}

/// The largest amount of one payment, and of one charge: 10 million in currency units.
/// Amounts are whole numbers of cents from 1 to this; others are refused with `422`.
const MAX_AMOUNT_CENTS: i64 = 1_000_000_000;

/// A checked `amount_cents`: a whole number from 1 to [`MAX_AMOUNT_CENTS`].
fn amount_cents(amount: &Number) -> Result<i64, ApiError> {
    amount
        .as_i64()
        .filter(|cents| (1..=MAX_AMOUNT_CENTS).contains(cents))
        .ok_or_else(|| {
            ApiError::unprocessable(format!(
                "amount_cents must be a whole number of cents from 1 to {MAX_AMOUNT_CENTS}, \
                 not {amount}"
            ))
        })
}

/// A checked `order_id` of a body: any whole number that fits 64 bits.
fn order_id(id: &Number) -> Result<i64, ApiError> {
    id.as_i64().ok_or_else(|| {
        ApiError::unprocessable(format!(
            "order_id must be a whole number from {} to {}, not {id}",
            i64::MIN,
            i64::MAX
        ))
    })
}

/// The `{order_id}` of a path. Anything but a 64-bit whole number (or a path segment that is
/// not UTF-8 once percent-decoded) names no order: `404`.
fn path_order_id(id: Result<Path<String>, PathRejection>) -> Result<i64, ApiError> {
    let id = id.ok().and_then(|Path(id)| id.parse().ok());
    id.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no such order: order ids are whole numbers from {} to {}",
                i64::MIN,
                i64::MAX
            ),
        )
    })
}

#[derive(Serialize, Deserialize, Clone, Debug)]
struct Payment {
    payment_id: String,
    order_id: i64,
    amount_cents: i64,
    charge_id: String,
}

#[derive(Deserialize)]
struct OrderUpdate {
    shipping_address: String,
}

#[derive(Serialize, Debug)]
struct Order {
    order_id: i64,
    /// The sum charged for the order. An `i128`, which no sum of `i64` amounts overflows in
    /// practice (it would take 2^64 payments of `i64::MAX`); with amounts bounded by
    /// [`MAX_AMOUNT_CENTS`] it stays below 2^93.
    total_cents: i128,
    /// The number of payments.
    payments: i64,
    shipping_address: Option<String>,
}

/// `POST /payments`: charge at the provider, and record the payment.
///
/// The layer runs this once per (tenant, key) and replays its answer to retries. In Postgres
/// it runs in phases ([`pay_in_phases`]). In memory the payment is recorded after the charge;
/// the provider gets a key derived from the client's, so it answers a repeated charge with
/// the charge it already made.
///
/// Without the layer (`IDEMPOTENCY=off`) a payment has no key and is simply new each time;
/// its row is written in a transaction of its own.
async fn create_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    key: Option<Extension<IdempotencyKey>>,
    phases: Option<Extension<Phases>>,
    request: Request,
) -> Result<(StatusCode, Json<Payment>), ApiError> {
    let authorization = request.headers().get(AUTHORIZATION).cloned();
    let new: NewPayment = read_json(request).await?;
    let order_id = order_id(&new.order_id)?;
    let amount_cents = amount_cents(&new.amount_cents)?;
    if let Some(Extension(phases)) = phases {
        let payment = pay_in_phases(
            &state,
            &tenant.0,
            &phases,
            authorization,
            order_id,
            amount_cents,
        );
        return Ok((StatusCode::CREATED, Json(payment.await?)));
    }
    let key = key.map(|Extension(key)| key);

    let charge =
        charge_at_provider(&state.provider, authorization, key.as_ref(), amount_cents).await?;

    let mut writer = state.db.writer(None).await?;
    let payment = writer
        .record_payment(
            &tenant.0,
            key.as_ref().map(IdempotencyKey::as_str),
            order_id,
            amount_cents,
            &charge.charge_id,
        )
        .await?;
    writer.commit().await?;
    Ok((StatusCode::CREATED, Json(payment)))
}

/// A payment in phases (Postgres, phased mode), none of them holding a transaction while the
/// provider works:
///
/// 1. the payment is recorded as `pending`, committed with the recovery point `pending` (the
///    key's claim committed before the handler ran);
/// 2. the provider is called with the derived key, with no transaction open and no pooled
///    connection held;
/// 3. the charge is recorded and the payment becomes `charged` in the last phase's
///    transaction, which the layer commits with the answer.
///
/// A retry after a crash resumes: step 1 returns the payment recorded before (it does not
/// insert another), the provider replays its charge for the same derived key, and the answer
/// is the one a run without the crash would have given.
async fn pay_in_phases(
    state: &AppState,
    tenant: &str,
    phases: &Phases,
    authorization: Option<HeaderValue>,
    order_id: i64,
    amount_cents: i64,
) -> Result<Payment, ApiError> {
    let key = phases.key().clone();
    let id: i64 = phases
        .step("pending", async |conn| {
            sqlx::query_scalar(
                "INSERT INTO example_payments
                     (tenant, idempotency_key, order_id, amount_cents, status)
                 VALUES ($1, $2, $3, $4, 'pending')
                 RETURNING id",
            )
            .bind(tenant)
            .bind(key.as_str())
            .bind(order_id)
            .bind(amount_cents)
            .persistent(false)
            .fetch_one(conn)
            .await
        })
        .await
        .map_err(phase_error)?;
    let charge =
        charge_at_provider(&state.provider, authorization, Some(&key), amount_cents).await?;
    let mut conn = phases.tx().await.map_err(phase_error)?;
    sqlx::query("UPDATE example_payments SET status = 'charged', charge_id = $1 WHERE id = $2")
        .bind(&charge.charge_id)
        .bind(id)
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(Payment {
        payment_id: format!("pay_{id}"),
        order_id,
        amount_cents,
        charge_id: charge.charge_id,
    })
}

/// A phase that committed nothing: the database's error as any other, a lost lease (another
/// attempt holds the key now) as `503`, which stores nothing.
fn phase_error<E: Into<ApiError> + std::error::Error + 'static>(error: PhaseError<E>) -> ApiError {
    match error {
        PhaseError::Work(e) => e.into(),
        PhaseError::LeaseLost => {
            ApiError::unavailable("another attempt of this payment holds its key; retry later")
        }
        other => {
            tracing::error!(
                error = &other as &dyn std::error::Error,
                "a payment phase failed"
            );
            ApiError::unavailable("the payment could not be recorded; retry later")
        }
    }
}

/// Calls the provider as `POST /provider/charges`, on behalf of the same tenant (the same
/// `Authorization`) and with the key derived from the payment's (`key`; `<key>:charge`): the
/// provider's router in process, or `PROVIDER_URL` over HTTP.
async fn charge_at_provider(
    provider: &Provider,
    authorization: Option<HeaderValue>,
    key: Option<&IdempotencyKey>,
    amount_cents: i64,
) -> Result<Charge, ApiError> {
    let body = serde_json::to_vec(&NewCharge { amount_cents })
        .map_err(|e| ApiError::internal(format!("cannot encode the charge: {e}")))?;
    let mut request =
        axum::http::Request::post("/provider/charges").header(CONTENT_TYPE, "application/json");
    if let Some(authorization) = authorization {
        request = request.header(AUTHORIZATION, authorization);
    }
    let build_error = |e: axum::http::Error| {
        ApiError::internal(format!("cannot build the provider request: {e}"))
    };

    let response = match provider {
        Provider::InProcess(router) => {
            if let Some(key) = key {
                // `<key>:charge`; always a valid key, even when the client's is 255
                // characters long.
                let charge_key = key
                    .derive("charge")
                    .map_err(|e| ApiError::internal(format!("cannot derive a key: {e}")))?;
                request = request.header(IDEMPOTENCY_KEY, HeaderValue::from(charge_key));
            }
            let request = request.body(Body::from(body)).map_err(build_error)?;
            // A router never fails: its error type is `Infallible`.
            let Ok(response) = router.clone().oneshot(request).await;
            response
        }
        Provider::Http(http) => {
            let mut request = request
                .uri(http.charges.clone())
                .body(Body::from(body))
                .map_err(build_error)?;
            // The client layer derives `<key>:charge` from the payment's key, the same
            // derivation as above, and sends it on every attempt. (Without a key,
            // `IDEMPOTENCY=off`, it sends a random one per charge.)
            if let Some(key) = key {
                request.extensions_mut().insert(key.clone());
            }
            let response = http.client.clone().oneshot(request).await.map_err(|e| {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "the payment provider did not answer"
                );
                // Whether the charge was made is unknown; a retry of the payment sends the
                // same derived key, so the provider answers with the charge if it made it.
                ApiError::unavailable("the payment provider did not answer; retry later")
            })?;
            response.map(Body::new)
        }
    };
    let status = response.status();
    let body = tokio::time::timeout(
        PROVIDER_BODY_TIMEOUT,
        axum::body::to_bytes(response.into_body(), 64 * 1024),
    )
    .await
    .map_err(|_| ApiError::bad_gateway("the provider's answer did not arrive in time"))?
    .map_err(|e| ApiError::bad_gateway(format!("cannot read the provider's answer: {e}")))?;
    // A 5xx of ours releases the client's key, so the client may retry; the provider
    // deduplicates that retry by the derived key.
    if status == StatusCode::SERVICE_UNAVAILABLE
        || status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
    {
        // The provider's store is unreachable, an earlier attempt's charge is still in
        // flight, or (over HTTP, once the client layer's retries are spent) the provider
        // asks to slow down: retrying later is right (and a 503 is not stored, unlike a 4xx
        // would be).
        return Err(ApiError::unavailable(format!(
            "the payment provider answered {status}; retry later"
        )));
    }
    if !status.is_success() {
        tracing::warn!(%status, body = %String::from_utf8_lossy(&body), "the provider refused a charge");
        return Err(ApiError::bad_gateway(format!(
            "the payment provider answered {status}"
        )));
    }
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_gateway(format!("unexpected answer from the provider: {e}")))
}

/// How long the provider's answer may take to arrive once its head has (the client layer
/// bounds the wait for the head).
const PROVIDER_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// `PATCH /orders/{order_id}`: sets the shipping address, creating the order if needed. In
/// Postgres the new address commits with the key.
async fn update_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    order_id: Result<Path<String>, PathRejection>,
    tx: Option<Extension<IdempotentTx>>,
    request: Request,
) -> Result<Json<Order>, ApiError> {
    let order_id = path_order_id(order_id)?;
    let update: OrderUpdate = read_json(request).await?;
    let mut writer = state.db.writer(tx).await?;
    let order = writer
        .set_shipping_address(&tenant.0, order_id, &update.shipping_address)
        .await?;
    writer.commit().await?;
    Ok(Json(order))
}

/// `GET /orders/{order_id}`: an order never seen is empty, not missing.
async fn get_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    order_id: Result<Path<String>, PathRejection>,
) -> Result<Json<Order>, ApiError> {
    let order_id = path_order_id(order_id)?;
    Ok(Json(state.db.order(&tenant.0, order_id).await?))
}

// ---------------------------------------------------------------------------------------------
// The fake payment provider
// ---------------------------------------------------------------------------------------------

/// The body of `POST /provider/charges`, as the payments service sends it.
#[derive(Serialize)]
struct NewCharge {
    amount_cents: i64,
}

/// The body of `POST /provider/charges`, as received: the amount is checked by
/// [`amount_cents`].
#[derive(Deserialize)]
struct ChargeRequest {
    amount_cents: Number,
}

#[derive(Serialize, Deserialize, Debug)]
struct Charge {
    charge_id: String,
    amount_cents: i64,
}

/// `POST /provider/charges`: makes a charge. Slow on purpose with `CHARGE_DELAY_MS`, to show
/// what a retry sees while the first attempt still runs (`409` and `Retry-After`). In
/// Postgres the charge row commits with the provider's key (`<key>:charge`), in the last
/// (and only) phase of the provider's request, opened after the delay.
async fn provider_charge(
    State(provider): State<ProviderState>,
    Extension(tenant): Extension<Tenant>,
    phases: Option<Extension<Phases>>,
    request: Request,
) -> Result<(StatusCode, Json<Charge>), ApiError> {
    let new: ChargeRequest = read_json(request).await?;
    let amount_cents = amount_cents(&new.amount_cents)?;
    // In Postgres (phased mode) no transaction is open yet: the delay holds none.
    if !provider.charge_delay.is_zero() {
        tokio::time::sleep(provider.charge_delay).await;
    }
    let mut writer = provider.db.last_phase_writer(phases).await?;
    let charge = writer.create_charge(&tenant.0, amount_cents).await?;
    writer.commit().await?;
    Ok((StatusCode::CREATED, Json(charge)))
}

/// `GET /provider/charges`: the number of charges made, all tenants together.
async fn provider_charge_count(
    State(provider): State<ProviderState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let count = provider.db.charge_count().await?;
    Ok(Json(serde_json::json!({ "count": count })))
}

// ---------------------------------------------------------------------------------------------
// The webhook receiver
// ---------------------------------------------------------------------------------------------

/// `POST /webhooks/provider`: applies an event (any JSON) once per `webhook-id`.
///
/// In Postgres the event row commits with the key. Recording is unique per event id as well:
/// an event id names one event forever, so even a redelivery after the layer forgot the key
/// (after the TTL) is not applied twice.
async fn receive_webhook(
    State(db): State<Db>,
    event_id: Option<Extension<IdempotencyKey>>,
    tx: Option<Extension<IdempotentTx>>,
    request: Request,
) -> Result<Json<serde_json::Value>, ApiError> {
    let event: serde_json::Value = read_json(request).await?;
    let event_id = event_id.map(|Extension(id)| id);
    let mut writer = db.writer(tx).await?;
    writer
        .record_webhook(
            event_id.as_ref().map(IdempotencyKey::as_str),
            &event.to_string(),
        )
        .await?;
    writer.commit().await?;
    Ok(Json(serde_json::json!({ "received": true })))
}

/// `GET /webhooks/provider`: the number of distinct events applied.
async fn webhooks_processed(State(db): State<Db>) -> Result<Json<serde_json::Value>, ApiError> {
    let processed = db.webhooks_processed().await?;
    Ok(Json(serde_json::json!({ "processed": processed })))
}

// ---------------------------------------------------------------------------------------------
// Request bodies and errors
// ---------------------------------------------------------------------------------------------

/// Reads the body as JSON, whatever its `Content-Type` says (`curl -d` sends a form type).
/// Honours `DefaultBodyLimit`.
async fn read_json<T: DeserializeOwned>(request: Request) -> Result<T, ApiError> {
    let body = Bytes::from_request(request, &())
        .await
        .map_err(|rejection| ApiError::new(rejection.status(), rejection.body_text()))?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// An error answer of the example's own: an RFC 9457 `application/problem+json` document,
/// like the layer's.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    detail: String,
}

impl ApiError {
    fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            detail: detail.into(),
        }
    }

    fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, detail)
    }

    fn unprocessable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, detail)
    }

    fn bad_gateway(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, detail)
    }

    fn internal(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, detail)
    }

    /// `503`, answered with `Retry-After`: nothing was done, try again later.
    fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, detail)
    }
}

impl From<std::convert::Infallible> for ApiError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

impl From<sqlx::Error> for ApiError {
    /// Database errors are logged, not shown. The database out of reach (a lost connection, a
    /// failover, a restart) or a transient conflict is a `503` with `Retry-After`; any other
    /// error a `500`. Both release the idempotency key (nothing is committed), so the client
    /// may retry.
    fn from(error: sqlx::Error) -> Self {
        tracing::error!(error = &error as &dyn std::error::Error, "database error");
        if is_transient(&error) {
            Self::unavailable("the database is unavailable; retry later")
        } else {
            Self::internal("the database failed; retry later")
        }
    }
}

/// Whether a database error says "try again": the connection or the server is gone (or not
/// yet a primary), or the transaction lost a conflict.
fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            // 08: connection exception; 57P01-57P03: the server shuts down or starts;
            // 40001, 40P01: serialization failure, deadlock; 25006: a read-only standby;
            // 53300: too many connections; 57014: a statement timeout.
            code.starts_with("08")
                || [
                    "57P01", "57P02", "57P03", "40001", "40P01", "25006", "53300", "57014",
                ]
                .contains(&code.as_ref())
        }),
        _ => false,
    }
}

/// The members of a problem document, in the order RFC 9457 lists them.
#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let problem = Problem {
            kind: "about:blank",
            title: self.status.canonical_reason().unwrap_or("Error"),
            status: self.status.as_u16(),
            detail: &self.detail,
        };
        let content_type = HeaderValue::from_static("application/problem+json");
        let mut response = match serde_json::to_string(&problem) {
            Ok(body) => (self.status, [(CONTENT_TYPE, content_type)], body).into_response(),
            // Serialising strings and a number cannot fail; answer the bare status if it did.
            Err(_) => self.status.into_response(),
        };
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

// ---------------------------------------------------------------------------------------------
// Storage of the example's own data
// ---------------------------------------------------------------------------------------------

/// The data of the two services: the payments service (payments, orders, webhook events) and
/// the provider (its charges).
struct Storage {
    payments: Db,
    provider: Db,
}

/// Connections per pool. A keyed request holds one connection of its service's pool (its
/// transaction) for as long as its handler runs, so this is how many idempotent requests
/// each service runs at once; more wait for a connection, up to [`ACQUIRE_TIMEOUT`]. Two
/// pools: up to 64 connections per instance, within Postgres's default `max_connections`
/// (100).
const POOL_SIZE: u32 = 32;
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serialises the `CREATE TABLE`s of instances that start together. (The bytes of "expaymnt".)
const SCHEMA_LOCK: i64 = 0x6578_7061_796d_6e74;

impl Storage {
    /// Everything in this process; the two services share it.
    fn memory() -> Self {
        let db = Db::Memory(Arc::default());
        Self {
            payments: db.clone(),
            provider: db,
        }
    }

    /// Connects to Postgres and creates the example's tables.
    ///
    /// Each service gets a pool of its own, as two real services would. A payment in flight
    /// holds a connection of the payments pool (its transaction) while it waits for the
    /// provider, which needs a connection for its own transaction: with one shared pool,
    /// [`POOL_SIZE`] concurrent payments could hold every connection and wait for the
    /// provider until the acquire timeout failed them all. For the same reason no handler
    /// takes a second connection from its pool while it holds its transaction.
    ///
    /// `DATABASE_URL` may name a pooler in transaction pooling mode (PgBouncer, say), which
    /// hands each transaction, and each statement outside one, to whichever server connection
    /// is free. So the example's own SQL never leaves anything on a server connection: a
    /// statement with parameters runs inside a transaction and unprepared
    /// (`.persistent(false)`; sqlx would otherwise prepare it under a name and reuse that
    /// name on the next connection), and one outside a transaction has no parameters and goes
    /// over the simple query protocol ([`sqlx::raw_sql`]). Locks are transaction-level
    /// (`pg_advisory_xact_lock`). Mind the pooler's pool size: a payment in flight holds a
    /// server connection (its transaction) while the provider needs another for its own.
    async fn postgres(url: &str) -> Result<Self, BoxError> {
        let payments = connect(url).await?;
        let mut tx = payments.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(SCHEMA_LOCK)
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(SCHEMA)
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("cannot create the example's tables: {e}"))?;
        tx.commit().await?;
        let provider = connect(url).await?;
        Ok(Self {
            payments: Db::Postgres(payments),
            provider: Db::Postgres(provider),
        })
    }

    /// The pools of the payments service and of the provider, in Postgres.
    fn pools(&self) -> Option<(&PgPool, &PgPool)> {
        match (&self.payments, &self.provider) {
            (Db::Postgres(payments), Db::Postgres(provider)) => Some((payments, provider)),
            _ => None,
        }
    }

    async fn close(&self) {
        if let Some((payments, provider)) = self.pools() {
            tokio::join!(payments.close(), provider.close());
        }
    }
}

async fn connect(url: &str) -> Result<PgPool, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    Ok(pool)
}

/// Where one service keeps its data.
#[derive(Clone)]
enum Db {
    /// `DATABASE_URL` unset: in this process, gone when it exits.
    Memory(Arc<Mutex<MemoryDb>>),
    /// `DATABASE_URL` set: in the `example_*` tables, which survive a restart.
    Postgres(PgPool),
}

/// The in-memory twin of the Postgres tables.
#[derive(Default)]
struct MemoryDb {
    /// Charges the provider made (the last `ch_<n>`).
    charges: i64,
    /// Payments recorded (the last `pay_<n>`).
    payments: i64,
    /// Orders by (tenant, order id).
    orders: HashMap<(String, i64), MemoryOrder>,
    /// Webhook event ids applied.
    webhook_ids: HashSet<String>,
    /// Webhooks applied without an id (`IDEMPOTENCY=off`).
    webhooks_without_id: i64,
}

#[derive(Default)]
struct MemoryOrder {
    total_cents: i128,
    payments: i64,
    shipping_address: Option<String>,
}

impl MemoryDb {
    /// An order of a tenant; empty when never seen.
    fn order(&self, tenant: &str, order_id: i64) -> Order {
        let order = self.orders.get(&(tenant.to_owned(), order_id));
        Order {
            order_id,
            total_cents: order.map_or(0, |o| o.total_cents),
            payments: order.map_or(0, |o| o.payments),
            shipping_address: order.and_then(|o| o.shipping_address.clone()),
        }
    }
}

/// Runs `f` on the in-memory data. Never held across an `.await`.
fn with_memory<T>(memory: &Mutex<MemoryDb>, f: impl FnOnce(&mut MemoryDb) -> T) -> T {
    // A panic while holding the lock cannot leave the data half-updated in a way that
    // matters for a demo; keep serving.
    let mut guard = memory.lock().unwrap_or_else(PoisonError::into_inner);
    f(&mut guard)
}

/// The example's tables. `IF NOT EXISTS`: created at the first start, kept afterwards.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS example_provider_charges (
    id           bigserial   PRIMARY KEY,
    tenant       text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS example_payments (
    id              bigserial   PRIMARY KEY,
    tenant          text        NOT NULL,
    -- The key of the request that made the payment (committed with it); NULL without the
    -- layer (IDEMPOTENCY=off).
    idempotency_key text,
    order_id        bigint      NOT NULL,
    amount_cents    bigint      NOT NULL,
    -- NULL while the payment is pending (recorded, the provider not yet called back).
    charge_id       text,
    status          text        NOT NULL DEFAULT 'charged',
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Tables made before payments had phases.
ALTER TABLE example_payments ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'charged';
ALTER TABLE example_payments ALTER COLUMN charge_id DROP NOT NULL;

CREATE INDEX IF NOT EXISTS example_payments_order ON example_payments (tenant, order_id);

CREATE TABLE IF NOT EXISTS example_orders (
    tenant           text        NOT NULL,
    order_id         bigint      NOT NULL,
    shipping_address text,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, order_id)
);

CREATE TABLE IF NOT EXISTS example_webhook_events (
    id          bigserial   PRIMARY KEY,
    -- The webhook-id; NULL without the layer (IDEMPOTENCY=off).
    event_id    text        UNIQUE,
    payload     jsonb       NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
";

/// An order with its payments, read in a transaction: a request's (which sees the request's
/// own writes), or one of its own ([`Db::order`]).
async fn select_order(
    conn: &mut PgConnection,
    tenant: &str,
    order_id: i64,
) -> Result<Order, sqlx::Error> {
    // SUM of bigints is a numeric, which never overflows; read as text, as sqlx decodes
    // numerics only with features this example does not use.
    let (total_cents, payments, shipping_address): (String, i64, Option<String>) = sqlx::query_as(
        "SELECT COALESCE(SUM(p.amount_cents), 0)::text,
                COUNT(p.id),
                (SELECT o.shipping_address FROM example_orders o
                  WHERE o.tenant = $1 AND o.order_id = $2)
           FROM example_payments p
          WHERE p.tenant = $1 AND p.order_id = $2 AND p.status = 'charged'",
    )
    .bind(tenant)
    .bind(order_id)
    .persistent(false)
    .fetch_one(conn)
    .await?;
    let total_cents = total_cents
        .parse()
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    Ok(Order {
        order_id,
        total_cents,
        payments,
        shipping_address,
    })
}

/// The number of rows in `table`, in one simple-protocol statement (no parameters, nothing
/// prepared: safe through a transaction-mode pooler; see `Storage`).
async fn count_rows(pool: &PgPool, table: &'static str) -> Result<i64, sqlx::Error> {
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await?;
    row.try_get(0)
}

impl Db {
    /// Where a request's writes go. In Postgres: the layer's transaction when there is one,
    /// so that the writes commit with the key; without the layer (`IDEMPOTENCY=off`), a
    /// transaction of the request's own.
    async fn writer(&self, layer_tx: Option<Extension<IdempotentTx>>) -> Result<Writer, ApiError> {
        Ok(match (self, layer_tx) {
            (Self::Memory(memory), _) => Writer::Memory(memory.clone()),
            (Self::Postgres(_), Some(Extension(tx))) => Writer::Postgres(PgTx::Layer(tx)),
            (Self::Postgres(pool), None) => Writer::Postgres(PgTx::Own(pool.begin().await?)),
        })
    }

    /// Where a phased request's writes go: in Postgres, the last phase's transaction, which
    /// the layer commits with the answer; else as [`writer`](Self::writer).
    async fn last_phase_writer(
        &self,
        phases: Option<Extension<Phases>>,
    ) -> Result<Writer, ApiError> {
        match (self, phases) {
            (Self::Postgres(_), Some(Extension(phases))) => {
                Ok(Writer::Postgres(PgTx::LastPhase(phases)))
            }
            _ => self.writer(None).await,
        }
    }

    /// The number of charges the provider made.
    async fn charge_count(&self) -> Result<i64, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| m.charges)),
            Self::Postgres(pool) => count_rows(pool, "example_provider_charges").await,
        }
    }

    /// An order of a tenant; empty when never seen.
    async fn order(&self, tenant: &str, order_id: i64) -> Result<Order, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| m.order(tenant, order_id))),
            Self::Postgres(pool) => {
                // A statement with parameters outside a transaction is two exchanges with the
                // server, which a pooler may send to two server connections: read in a
                // transaction of its own (see `Storage`).
                let mut tx = pool.begin().await?;
                let order = select_order(&mut tx, tenant, order_id).await?;
                tx.commit().await?;
                Ok(order)
            }
        }
    }

    /// The number of webhook events applied.
    async fn webhooks_processed(&self) -> Result<i64, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| {
                // A count of events held in memory always fits an i64.
                i64::try_from(m.webhook_ids.len())
                    .unwrap_or(i64::MAX)
                    .saturating_add(m.webhooks_without_id)
            })),
            Self::Postgres(pool) => count_rows(pool, "example_webhook_events").await,
        }
    }
}

/// Where one request's writes go ([`Db::writer`]). Nothing needs deduplicating here: in
/// Postgres the writes commit with the request's key (a retry replays, or finds that neither
/// was committed); in memory the data and the keys live and die together, and a handler's
/// write is its last step that can fail.
enum Writer {
    Memory(Arc<Mutex<MemoryDb>>),
    Postgres(PgTx),
}

/// A request's Postgres transaction.
enum PgTx {
    /// The layer's: the layer commits it once it stored the answer (a handler never does),
    /// or rolls it back on a `5xx`, an error, a panic or a dropped request.
    Layer(IdempotentTx),
    /// The last phase of a phased request: opened at the first statement, committed by the
    /// layer with the answer.
    LastPhase(Phases),
    /// The request's own (`IDEMPOTENCY=off`), committed by [`Writer::commit`].
    Own(Transaction<'static, Postgres>),
}

impl PgTx {
    /// The transaction's connection, for a statement or a few.
    async fn conn(&mut self) -> Result<Conn<'_>, ApiError> {
        match self {
            Self::Layer(tx) => tx.conn().await.map(Conn::Layer).map_err(|e| {
                // Only a handler that outlived its request could see this.
                tracing::error!(error = &e as &dyn std::error::Error, "no transaction");
                ApiError::internal("the request's transaction has ended")
            }),
            Self::LastPhase(phases) => phases.tx().await.map(Conn::Layer).map_err(phase_error),
            Self::Own(tx) => Ok(Conn::Own(tx)),
        }
    }
}

/// A connection inside a [`PgTx`]; `&mut *conn` is a sqlx executor.
enum Conn<'a> {
    Layer(TxConn<'a>),
    Own(&'a mut PgConnection),
}

impl Deref for Conn<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Layer(conn) => conn,
            Self::Own(conn) => conn,
        }
    }
}

impl DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Layer(conn) => conn,
            Self::Own(conn) => conn,
        }
    }
}

impl Writer {
    /// The provider makes a charge.
    async fn create_charge(&mut self, tenant: &str, amount_cents: i64) -> Result<Charge, ApiError> {
        let id: i64 = match self {
            Self::Memory(memory) => with_memory(memory, |m| {
                m.charges += 1;
                m.charges
            }),
            Self::Postgres(tx) => {
                sqlx::query_scalar(
                    "INSERT INTO example_provider_charges (tenant, amount_cents)
                     VALUES ($1, $2) RETURNING id",
                )
                .bind(tenant)
                .bind(amount_cents)
                .persistent(false)
                .fetch_one(&mut *tx.conn().await?)
                .await?
            }
        };
        Ok(Charge {
            charge_id: format!("ch_{id}"),
            amount_cents,
        })
    }

    /// Records a payment made with `key` (`None` without the layer).
    async fn record_payment(
        &mut self,
        tenant: &str,
        key: Option<&str>,
        order_id: i64,
        amount_cents: i64,
        charge_id: &str,
    ) -> Result<Payment, ApiError> {
        let id: i64 = match self {
            Self::Memory(memory) => with_memory(memory, |m| {
                let order = m.orders.entry((tenant.to_owned(), order_id)).or_default();
                // Cannot fail (see `Order::total_cents`); checked all the same, so that a
                // total is never capped or wrapped silently.
                order.total_cents = order
                    .total_cents
                    .checked_add(i128::from(amount_cents))
                    .ok_or_else(|| ApiError::internal("the order's total is out of range"))?;
                order.payments += 1;
                m.payments += 1;
                Ok::<_, ApiError>(m.payments)
            })?,
            Self::Postgres(tx) => {
                sqlx::query_scalar(
                    "INSERT INTO example_payments
                         (tenant, idempotency_key, order_id, amount_cents, charge_id)
                     VALUES ($1, $2, $3, $4, $5)
                     RETURNING id",
                )
                .bind(tenant)
                .bind(key)
                .bind(order_id)
                .bind(amount_cents)
                .bind(charge_id)
                .persistent(false)
                .fetch_one(&mut *tx.conn().await?)
                .await?
            }
        };
        Ok(Payment {
            payment_id: format!("pay_{id}"),
            order_id,
            amount_cents,
            charge_id: charge_id.to_owned(),
        })
    }

    /// Sets an order's shipping address, creating the order if needed, and reads it back.
    async fn set_shipping_address(
        &mut self,
        tenant: &str,
        order_id: i64,
        address: &str,
    ) -> Result<Order, ApiError> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| {
                let order = m.orders.entry((tenant.to_owned(), order_id)).or_default();
                order.shipping_address = Some(address.to_owned());
                m.order(tenant, order_id)
            })),
            Self::Postgres(tx) => {
                let mut conn = tx.conn().await?;
                sqlx::query(
                    "INSERT INTO example_orders (tenant, order_id, shipping_address)
                     VALUES ($1, $2, $3)
                     ON CONFLICT (tenant, order_id)
                     DO UPDATE SET shipping_address = EXCLUDED.shipping_address,
                                   updated_at = now()",
                )
                .bind(tenant)
                .bind(order_id)
                .bind(address)
                .persistent(false)
                .execute(&mut *conn)
                .await?;
                // Through the transaction: it sees the new address, and it takes no second
                // connection from the pool.
                Ok(select_order(&mut conn, tenant, order_id).await?)
            }
        }
    }

    /// Applies a webhook event once per event id (`None`: always).
    async fn record_webhook(
        &mut self,
        event_id: Option<&str>,
        payload: &str,
    ) -> Result<(), ApiError> {
        match self {
            Self::Memory(memory) => with_memory(memory, |m| match event_id {
                Some(id) => {
                    m.webhook_ids.insert(id.to_owned());
                }
                None => m.webhooks_without_id += 1,
            }),
            Self::Postgres(tx) => {
                sqlx::query(
                    "INSERT INTO example_webhook_events (event_id, payload)
                     VALUES ($1, $2::jsonb)
                     ON CONFLICT (event_id) DO NOTHING",
                )
                .bind(event_id)
                .bind(payload)
                .persistent(false)
                .execute(&mut *tx.conn().await?)
                .await?;
            }
        }
        Ok(())
    }

    /// Commits a transaction of the request's own. The layer's transaction is left to the
    /// layer, which commits it after it stored the answer.
    async fn commit(self) -> Result<(), ApiError> {
        if let Self::Postgres(PgTx::Own(tx)) = self {
            tx.commit().await?;
        }
        Ok(())
    }
}
