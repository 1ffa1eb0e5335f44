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
//! | `IDEMPOTENCY_LEASE_MS` | `30000` | how long a claim holds a key before another request may take it over ([`IdempotencyLayer::with_lease`]); renewed every third of it while the request runs |
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

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

#[cfg(feature = "redis")]
use tower_idempotency::RedisStore;
use tower_idempotency::client::IdempotentClientLayer;
use tower_idempotency::{MemoryStore, PostgresStore, spawn_purge_task};
use tracing_subscriber::EnvFilter;

mod db;
mod errors;
mod payments;
mod provider;
mod router;
mod webhooks;

use db::*;
use errors::*;
use payments::*;
use provider::*;
use router::*;
use webhooks::*;

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
