//! Load harness: an axum server in process, driven over loopback by many keep-alive HTTP/1.1
//! connections, each scenario against its baseline in the same run.
//!
//! ```text
//! cargo bench --bench load -- [scenario...] [--connections 64] [--seconds 10] [--warmup 2]
//!                             [--pool 16] [--rounds 1] [--replay-keys 10000]
//!                             [--server-threads 2] [--client-threads 2] [--side both]
//! ```
//!
//! Without a scenario name, every scenario runs. Each scenario starts a server twice on
//! `127.0.0.1:0` (in its own multi-thread runtime): once with the route behind the layer and
//! once with the same route *without* the layer, whose handler does by hand the work the layer
//! would do (the baseline; for `pg-tx`, the handler's own transaction with no idempotency at
//! all). The Postgres scenarios exist once per `ClaimStrategy` (`pg-plain-new`, `pg-replay`:
//! the default, `Combined`; `-insert-first`, `-read-first`). `pg-plain-new-same-sql` sets the
//! default store against its own SQL by hand (`pg-plain-new`'s baseline sends the cheaper
//! insert-first SQL). Two references have no layer on either side: `pg-tx-by-hand` sends the
//! layer's transactional SQL by hand around `pg-tx`'s handler (what the layer adds beyond
//! its SQL), `pg-tx-record-only` the same without the claim (no look, no lock, no placeholder,
//! no savepoint: the completed record inserted with the commit; the ceiling of any design that
//! keeps the record in the handler's transaction). A client in a second runtime opens
//! `--connections` keep-alive connections, sends requests on each back to back for
//! `--warmup` seconds (not counted), then for `--seconds` seconds, and reports requests per
//! second and the p50/p99 latency of the requests completed in that window. The ratio is
//! layer ÷ baseline requests per second.
//! With `--rounds N` the sides run N times each, alternating which goes first, and the
//! figures are over all rounds.
//!
//! Client and server share the machine, so requests per second also move with whatever else
//! runs. The harness therefore also reports, from Linux's `/proc`, the CPU time per request of
//! the server's threads (`app`) and of the pool's Postgres backends (`db`, found by their
//! `application_name`), and how many cores the rest of the machine used meanwhile (`others`):
//! the cost ratio (baseline CPU ÷ layer CPU per request) does not depend on a neighbour.
//! `--side layer` or `--side baseline` runs one side alone, to profile it
//! (`perf record -- target/release/deps/load-… memory-new --side layer`).
//!
//! The Postgres scenarios use `DATABASE_URL` (default the local server) and a fresh schema per
//! scenario, dropped at the end; new-key scenarios empty the tables before each side runs, so
//! both start from the same state. The pool is sqlx's default apart from its size.
//!
//! Adding a scenario: write a `build_*` function that returns the two routers and the key
//! plan ([`Built`]), and add a line to [`SCENARIOS`].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Extension;
use axum::Router;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tower::ServiceExt;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{
    ClaimStrategy, Fingerprint, IdempotencyLayer, IdempotentTx, MemoryStore, PostgresStore,
    StoredResponse,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The path every scenario serves.
const PATH: &str = "/orders";

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

/// A scenario: the layered route and its baseline.
struct Scenario {
    name: &'static str,
    /// What the layer side does (for the report).
    layer_side: &'static str,
    /// What the baseline's handler does by hand.
    baseline: &'static str,
    /// The issue's target for layer ÷ baseline requests per second.
    target: f64,
    build: for<'a> fn(&'a Ctx) -> BoxFuture<'a, Result<Built, BoxError>>,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "memory-new",
        layer_side: "MemoryStore, new key per request",
        baseline: "fingerprint + insert and complete in a Mutex<HashMap>",
        target: 0.95,
        build: |ctx| Box::pin(build_memory_new(ctx)),
    },
    Scenario {
        name: "pg-plain-new",
        layer_side: "PostgresStore (ClaimStrategy::Combined, the default), new key per request",
        baseline: "fingerprint + the store's INSERT … ON CONFLICT DO NOTHING RETURNING, then its \
                   COMPLETE UPDATE (by hand)",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::Combined, false),
                HAND_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-plain-new-same-sql",
        layer_side: "as pg-plain-new (ClaimStrategy::Combined, the default)",
        baseline: "fingerprint + the store's Combined CLAIM (its read of the record, which calls \
                   the insert function for an absent key), then its COMPLETE UPDATE (by hand): \
                   the layer's own overhead over the SQL it sends",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::Combined, false),
                HAND_COMBINED_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-plain-new-prepared",
        layer_side: "as pg-plain-new, with_prepared_statements(true) (direct connections only)",
        baseline: "as pg-plain-new",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::Combined, true),
                HAND_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-plain-new-insert-first",
        layer_side: "PostgresStore (ClaimStrategy::InsertFirst), new key per request",
        baseline: "as pg-plain-new",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::InsertFirst, false),
                HAND_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-plain-new-read-first",
        layer_side: "PostgresStore (ClaimStrategy::ReadFirst), new key per request",
        baseline: "as pg-plain-new",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::ReadFirst, false),
                HAND_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-replay",
        layer_side: "PostgresStore (ClaimStrategy::Combined, the default), completed keys \
                     requested again",
        baseline: "fingerprint + the store's plain SELECT of the record (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::Combined, false))),
    },
    Scenario {
        name: "pg-replay-prepared",
        layer_side: "as pg-replay, with_prepared_statements(true) (direct connections only)",
        baseline: "as pg-replay",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::Combined, true))),
    },
    Scenario {
        name: "pg-replay-read-first",
        layer_side: "PostgresStore (ClaimStrategy::ReadFirst), completed keys requested again",
        baseline: "as pg-replay",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::ReadFirst, false))),
    },
    Scenario {
        name: "pg-replay-insert-first",
        layer_side: "PostgresStore (ClaimStrategy::InsertFirst), completed keys requested again",
        baseline: "as pg-replay",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::InsertFirst, false))),
    },
    Scenario {
        name: "pg-tx",
        layer_side: "PostgresStore transactional, new key per request; handler inserts a payment \
                     row through IdempotentTx",
        baseline: "BEGIN, the same payment INSERT, COMMIT (pool.begin(); no idempotency)",
        target: 0.8,
        build: |ctx| Box::pin(build_pg_tx(ctx, TxSide::Layer)),
    },
    Scenario {
        name: "pg-tx-by-hand",
        layer_side: "reference, no layer: the layer's transactional SQL sent by hand around the \
                     pg-tx handler (the look, BEGIN, the claim_tx placeholder and the savepoint in \
                     one message; the payment INSERT; complete_tx with COMMIT): what the layer \
                     adds to its own SQL",
        baseline: "as pg-tx",
        target: 0.8,
        build: |ctx| Box::pin(build_pg_tx(ctx, TxSide::ByHand { claim: true })),
    },
    Scenario {
        name: "pg-tx-record-only",
        layer_side: "reference, no layer: as pg-tx-by-hand without the claim, i.e. without the \
                     look, the lock, the placeholder and the savepoint (BEGIN, the payment INSERT, \
                     the completed record's INSERT with COMMIT): the ceiling of any design that \
                     keeps the record in the handler's transaction",
        baseline: "as pg-tx",
        target: 0.8,
        build: |ctx| Box::pin(build_pg_tx(ctx, TxSide::ByHand { claim: false })),
    },
    Scenario {
        name: "memory-new-wait",
        layer_side: "as memory-new, with_wait_for_completion(10 s) (no duplicates: what turning \
                     waiting on costs every first request)",
        baseline: "the layer as memory-new (waiting off)",
        target: 0.97,
        build: |ctx| Box::pin(build_memory_new_wait(ctx)),
    },
    Scenario {
        name: "pg-plain-new-notify",
        layer_side: "as pg-plain-new, with_wait_for_completion(10 s), notifications on (the \
                     default): each completion also looks for waiters to NOTIFY",
        baseline: "the layer as pg-plain-new, with_notifications(false)",
        target: 0.97,
        build: |ctx| Box::pin(build_notify(ctx, false)),
    },
    Scenario {
        name: "pg-tx-notify",
        layer_side: "as pg-tx, with_wait_for_completion(10 s), notifications on (the default): \
                     each commit also looks for waiters to NOTIFY",
        baseline: "the layer as pg-tx, with_notifications(false)",
        target: 0.97,
        build: |ctx| Box::pin(build_notify(ctx, true)),
    },
];

#[cfg(feature = "redis")]
#[path = "load/redis.rs"]
mod redis_scenarios;

/// The Redis scenarios, when the bench is built with `--features redis` (as
/// `scripts/test.sh` builds it): see `benches/load/redis.rs`.
#[cfg(feature = "redis")]
const REDIS_SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "redis-new",
        layer_side: "RedisStore, new key per request (its claim and completion scripts)",
        baseline: "fingerprint + SET NX PX of the claim, then SET PX of the answer (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(redis_scenarios::build_redis_new(ctx)),
    },
    Scenario {
        name: "redis-replay",
        layer_side: "RedisStore, completed keys requested again",
        baseline: "fingerprint + GET of the stored answer (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(redis_scenarios::build_redis_replay(ctx)),
    },
    Scenario {
        name: "redis-wait",
        layer_side: "RedisStore with_wait_replicas(1, 100 ms), new key per request, on a master with one replica",
        baseline: "the same RedisStore without WAIT, on the same master",
        target: 0.80,
        build: |ctx| Box::pin(redis_scenarios::build_redis_wait(ctx)),
    },
];
#[cfg(not(feature = "redis"))]
const REDIS_SCENARIOS: &[Scenario] = &[];

/// Every scenario this build has.
fn all_scenarios() -> impl Iterator<Item = &'static Scenario> {
    SCENARIOS.iter().chain(REDIS_SCENARIOS)
}

/// What a scenario's build returns.
struct Built {
    layer: Router,
    baseline: Router,
    keys: KeyPlan,
    /// The status every answer must have.
    expect: StatusCode,
    /// The Postgres schema the scenario works in (emptied between sides for new keys,
    /// dropped at the end).
    schema: Option<PgSchema>,
    /// Builds the (layer, baseline) routers anew, with empty in-process state, for each side
    /// (used instead of `layer` and `baseline`).
    fresh: Option<fn() -> (Router, Router)>,
    /// What the scenario keeps alive until its end (servers it started), then drops.
    owned: Option<Box<dyn Send>>,
}

/// Which keys the client sends.
#[derive(Clone, Copy, Debug)]
enum KeyPlan {
    /// A key never sent before, on every request.
    New,
    /// One of `count` keys completed before the run (`replay-0` …), picked at random.
    Replay { count: usize },
}

/// The layer side's handler (and the work every baseline does besides the idempotency part):
/// a create endpoint that answers `201` with a small JSON document.
async fn create(body: Bytes) -> Response {
    created(body.len())
}

fn created(len: usize) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        common::created_json(len),
    )
        .into_response()
}

fn key_of(headers: &HeaderMap) -> Option<&str> {
    headers.get("idempotency-key")?.to_str().ok()
}

fn problem(status: StatusCode) -> Response {
    (status, status.canonical_reason().unwrap_or_default()).into_response()
}

// --- memory-new ------------------------------------------------------------------------

#[derive(Clone, Default)]
struct MemoryBaseline(Arc<Mutex<HashMap<String, MemoryRecord>>>);

struct MemoryRecord {
    fingerprint: Fingerprint,
    /// `None` while the handler runs.
    response: Option<(StatusCode, Bytes)>,
}

impl MemoryBaseline {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, MemoryRecord>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// By hand, what the layer does with a memory store: fingerprint, claim the key in a map
/// (or answer from it), run the handler, store the answer.
async fn memory_baseline(State(map): State<MemoryBaseline>, parts: Parts, body: Bytes) -> Response {
    let Some(key) = key_of(&parts.headers) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    match map.lock().entry(key.to_owned()) {
        Entry::Occupied(e) => {
            let record = e.get();
            return match &record.response {
                _ if record.fingerprint != fp => problem(StatusCode::UNPROCESSABLE_ENTITY),
                None => problem(StatusCode::CONFLICT),
                Some((status, answer)) => (
                    *status,
                    [
                        (header::CONTENT_TYPE, "application/json"),
                        (HeaderName::from_static("idempotent-replayed"), "true"),
                    ],
                    answer.clone(),
                )
                    .into_response(),
            };
        }
        Entry::Vacant(v) => {
            v.insert(MemoryRecord {
                fingerprint: fp,
                response: None,
            });
        }
    }
    let answer = common::created_json(body.len());
    if let Some(record) = map.lock().get_mut(key) {
        record.response = Some((StatusCode::CREATED, answer.clone()));
    }
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        answer,
    )
        .into_response()
}

/// The two routers of `memory-new`, each with an empty store (a new pair for every side, as
/// the Postgres scenarios empty their tables: a store that kept the previous rounds' keys
/// would make later rounds work on a bigger map).
fn memory_routers() -> (Router, Router) {
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let baseline = Router::new()
        .route(PATH, post(memory_baseline))
        .with_state(MemoryBaseline::default());
    (layer, baseline)
}

async fn build_memory_new(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, baseline) = memory_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(memory_routers),
        owned: None,
    })
}

// --- memory-new-wait, pg-plain-new-notify, pg-tx-notify ----------------------------------

/// How long duplicates may wait in the `*-wait` / `*-notify` scenarios (none arrive: every
/// key is new; what is measured is the first requests' cost of the setting).
const WAIT: Duration = Duration::from_secs(10);

fn memory_wait_routers() -> (Router, Router) {
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_wait_for_completion(WAIT));
    let baseline = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    (layer, baseline)
}

async fn build_memory_new_wait(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, baseline) = memory_wait_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(memory_wait_routers),
        owned: None,
    })
}

/// The layer with notifications and waiting on, against the same layer without, on one
/// schema (plain mode, or transactional with `pg-tx`'s handler).
async fn build_notify(ctx: &Ctx, transactional: bool) -> Result<Built, BoxError> {
    let mut schema = PgSchema::new(ctx.args.pool).await?;
    let plain = PostgresStore::new(schema.pool.clone()).with_notifications(false);
    plain.migrate().await?;
    let notifying = plain.clone().with_notifications(true);
    let (layer, baseline) = if transactional {
        sqlx::query(PAYMENTS_DDL).execute(&schema.pool).await?;
        schema.tables.push("payments");
        (
            Router::new().route(PATH, post(pay_in_layer_tx)).layer(
                IdempotencyLayer::new(notifying.transactional()).with_wait_for_completion(WAIT),
            ),
            Router::new()
                .route(PATH, post(pay_in_layer_tx))
                .layer(IdempotencyLayer::new(plain.transactional())),
        )
    } else {
        (
            Router::new()
                .route(PATH, post(create))
                .layer(IdempotencyLayer::new(notifying).with_wait_for_completion(WAIT)),
            Router::new()
                .route(PATH, post(create))
                .layer(IdempotencyLayer::new(plain)),
        )
    };
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}

// --- pg-plain-new ----------------------------------------------------------------------

// The hand-written SQL is the store's own (src/store/postgres.rs), copied verbatim: the
// baselines send the statements the store sends on its cheapest path, with none of the
// layer's code around them.

/// The claim of a new key, by hand: the store's `INSERT` statement (what
/// `ClaimStrategy::InsertFirst` and `ReadFirst` send to claim; `Combined` sends it inside its
/// one claim statement).
const HAND_CLAIM: &str = "
INSERT INTO tower_idempotency_keys AS k
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES ($1, $2, $3, nextval('tower_idempotency_lease_token_seq'),
        now() + $4::float8 * interval '1 millisecond',
        now() + $5::float8 * interval '1 millisecond')
ON CONFLICT (scope, key) DO NOTHING
RETURNING k.lease_token AS inserted";

/// The claim of `ClaimStrategy::Combined`, by hand: the query that the store's claim function
/// (`tower_idempotency_plain_claim`, migration 6) runs, as a prepared statement (for the
/// `pg-plain-new-same-sql` baseline).
const HAND_COMBINED_CLAIM: &str = "SELECT CASE WHEN scope IS NULL
                 THEN tower_idempotency_insert_key($1, $2, $3, $4, $5) END AS inserted,
               fingerprint, lease_token, expires_at <= now() AS expired,
               (expires_at <= now()
                OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = $3))
                   AS claimable,
               (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
               response_status, response_headers, response_body
          FROM (SELECT) AS one
          LEFT JOIN tower_idempotency_keys ON scope = $1 AND key = $2";

/// The UPDATE that the store's completion function (`tower_idempotency_plain_complete`) runs.
const HAND_COMPLETE: &str = "
UPDATE tower_idempotency_keys
   SET lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + $4::float8 * interval '1 millisecond',
       response_status = $5, response_headers = $6, response_body = $7
 WHERE scope = $1 AND key = $2 AND lease_token = $3";

/// The read of a completed key, by hand: the store's `READ` statement (what
/// `ClaimStrategy::ReadFirst` sends for a replay; `Combined` reads the same inside its claim
/// statement).
const HAND_SELECT: &str = "SELECT fingerprint, lease_token, expires_at <= now() AS expired,
               (expires_at <= now()
                OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = $3))
                   AS claimable,
               (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
               response_status, response_headers, response_body
          FROM tower_idempotency_keys
         WHERE scope = $1 AND key = $2";

/// The layer's defaults, in milliseconds: lease 30 s, TTL 24 h.
const LEASE_MS: i64 = 30_000;
const TTL_MS: i64 = 24 * 3600 * 1000;

/// The `pg-plain-new` baselines' state: the pool, and the claim statement they send.
#[derive(Clone)]
struct PlainBaseline {
    pool: PgPool,
    /// [`HAND_CLAIM`] or [`HAND_COMBINED_CLAIM`]: the token of the inserted record comes
    /// back in the first column (`inserted`) either way.
    claim: &'static str,
}

/// By hand, what the layer does with a Postgres store for a new key: fingerprint, claim
/// (one statement), run the handler, complete (one update).
async fn pg_plain_baseline(
    State(hand): State<PlainBaseline>,
    parts: Parts,
    body: Bytes,
) -> Response {
    match pg_plain(&hand, &parts, &body).await {
        Ok(res) => res,
        Err(e) => {
            eprintln!("baseline: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

async fn pg_plain(hand: &PlainBaseline, parts: &Parts, body: &Bytes) -> Result<Response, BoxError> {
    let pool = &hand.pool;
    let Some(key) = key_of(&parts.headers) else {
        return Ok(problem(StatusCode::BAD_REQUEST));
    };
    let fp = fingerprint(parts, &[], body);
    // The insert returns no row on a conflict; Combined's claim returns a row with a NULL
    // token.
    let token: Option<i64> = sqlx::query_scalar::<_, Option<i64>>(hand.claim)
        .bind("")
        .bind(key)
        .bind(&fp.as_bytes()[..])
        .bind(LEASE_MS)
        .bind(TTL_MS)
        .fetch_optional(pool)
        .await?
        .flatten();
    let Some(token) = token else {
        return Ok(problem(StatusCode::CONFLICT));
    };
    let answer = common::created_json(body.len());
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let status = StatusCode::CREATED;
    let stored = StoredResponse::new(status, headers.clone(), answer.clone());
    sqlx::query(HAND_COMPLETE)
        .bind("")
        .bind(key)
        .bind(token)
        .bind(TTL_MS)
        .bind(i16::try_from(status.as_u16())?)
        .bind(stored.encode_headers())
        .bind(&answer[..])
        .execute(pool)
        .await?;
    Ok((status, headers, answer).into_response())
}

async fn build_pg_plain_new(
    ctx: &Ctx,
    (strategy, prepared): (ClaimStrategy, bool),
    claim: &'static str,
) -> Result<Built, BoxError> {
    let schema = PgSchema::new(ctx.args.pool).await?;
    let store = PostgresStore::new(schema.pool.clone())
        .with_claim_strategy(strategy)
        .with_prepared_statements(prepared);
    store.migrate().await?;
    let baseline = Router::new()
        .route(PATH, post(pg_plain_baseline))
        .with_state(PlainBaseline {
            pool: schema.pool.clone(),
            claim,
        });
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(store));
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}

// --- pg-replay -------------------------------------------------------------------------

/// By hand, what the layer does with a Postgres store for a completed key: fingerprint, one
/// select, replay the stored answer.
async fn pg_replay_baseline(State(pool): State<PgPool>, parts: Parts, body: Bytes) -> Response {
    match pg_replay(&pool, &parts, &body).await {
        Ok(res) => res,
        Err(e) => {
            eprintln!("baseline: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

async fn pg_replay(pool: &PgPool, parts: &Parts, body: &Bytes) -> Result<Response, BoxError> {
    let Some(key) = key_of(&parts.headers) else {
        return Ok(problem(StatusCode::BAD_REQUEST));
    };
    let fp = fingerprint(parts, &[], body);
    let Some(row) = sqlx::query(HAND_SELECT)
        .bind("")
        .bind(key)
        .bind(&fp.as_bytes()[..])
        .fetch_optional(pool)
        .await?
    else {
        return Ok(problem(StatusCode::NOT_FOUND));
    };
    let stored_fp: Vec<u8> = row.try_get("fingerprint")?;
    let claimable: bool = row.try_get("claimable")?;
    let lease: Option<i64> = row.try_get("lease_token")?;
    if claimable || lease.is_some() {
        return Ok(problem(StatusCode::CONFLICT));
    }
    if stored_fp != fp.as_bytes() {
        return Ok(problem(StatusCode::UNPROCESSABLE_ENTITY));
    }
    let status: Option<i16> = row.try_get("response_status")?;
    let status = StatusCode::from_u16(u16::try_from(status.unwrap_or_default())?)?;
    let headers: Option<Vec<u8>> = row.try_get("response_headers")?;
    let mut headers = StoredResponse::decode_headers(headers.as_deref().unwrap_or_default())?;
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    let mut res = Response::new(axum::body::Body::from(body.unwrap_or_default()));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    Ok(res)
}

async fn build_pg_replay(
    ctx: &Ctx,
    (strategy, prepared): (ClaimStrategy, bool),
) -> Result<Built, BoxError> {
    let schema = PgSchema::new(ctx.args.pool).await?;
    let store = PostgresStore::new(schema.pool.clone())
        .with_claim_strategy(strategy)
        .with_prepared_statements(prepared);
    store.migrate().await?;
    let baseline = Router::new()
        .route(PATH, post(pg_replay_baseline))
        .with_state(schema.pool.clone());
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(store));
    // Complete every key once through the layer (in process), so both sides replay them.
    let count = ctx.args.replay_keys;
    complete_replay_keys(&layer, count).await?;
    sqlx::query("ANALYZE tower_idempotency_keys")
        .execute(&schema.pool)
        .await?;
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::Replay { count },
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}

// --- pg-tx -----------------------------------------------------------------------------

/// The table the `pg-tx` handlers write to: what a payments endpoint records.
const PAYMENTS_DDL: &str = "
CREATE TABLE payments (
    id           bigserial   PRIMARY KEY,
    order_id     bigint      NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)";

/// The handler's one write, on both sides.
const INSERT_PAYMENT: &str = "
INSERT INTO payments (order_id, amount_cents, currency) VALUES ($1, $2, $3) RETURNING id";

/// Inserts the payment row on `conn` (a transaction's connection) and returns its id.
async fn insert_payment(conn: &mut sqlx::PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(INSERT_PAYMENT)
        .bind(4711_i64)
        .bind(1999_i64)
        .bind("EUR")
        .fetch_one(conn)
        .await
}

/// The payments endpoint's answer, on both sides.
fn payment_created(id: i64, len: usize) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(r#"{{"payment_id":{id},"status":"created","received":{len}}}"#),
    )
        .into_response()
}

/// The layer side's handler: the payment row goes into the layer's transaction, which the
/// layer commits together with the key after this answers.
async fn pay_in_layer_tx(Extension(tx): Extension<IdempotentTx>, body: Bytes) -> Response {
    let id = {
        let Ok(mut conn) = tx.conn().await else {
            return problem(StatusCode::INTERNAL_SERVER_ERROR);
        };
        insert_payment(&mut conn).await
    };
    match id {
        Ok(id) => payment_created(id, body.len()),
        Err(e) => {
            eprintln!("layer handler: {e}");
            problem(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// The baseline: the same payment row in a transaction of its own, without idempotency.
async fn pay_in_own_tx(State(pool): State<PgPool>, body: Bytes) -> Response {
    let paid = async {
        let mut tx = pool.begin().await?;
        let id = insert_payment(&mut tx).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(id)
    };
    match paid.await {
        Ok(id) => payment_created(id, body.len()),
        Err(e) => {
            eprintln!("baseline: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// What `pg-tx`'s and its references' first side runs around the payments handler.
#[derive(Clone, Copy)]
enum TxSide {
    /// The transactional layer (`pg-tx`).
    Layer,
    /// The layer's SQL by hand, with the claim (`pg-tx-by-hand`) or without it
    /// (`pg-tx-record-only`).
    ByHand { claim: bool },
}

async fn build_pg_tx(ctx: &Ctx, side: TxSide) -> Result<Built, BoxError> {
    let mut schema = PgSchema::new(ctx.args.pool).await?;
    let store = PostgresStore::new(schema.pool.clone());
    store.migrate().await?;
    sqlx::query(PAYMENTS_DDL).execute(&schema.pool).await?;
    schema.tables.push("payments");
    let baseline = Router::new()
        .route(PATH, post(pay_in_own_tx))
        .with_state(schema.pool.clone());
    let layer = match side {
        TxSide::Layer => Router::new()
            .route(PATH, post(pay_in_layer_tx))
            .layer(IdempotencyLayer::new(store.transactional())),
        TxSide::ByHand { claim } => {
            Router::new()
                .route(PATH, post(pay_by_hand))
                .with_state(ByHand {
                    pool: schema.pool.clone(),
                    claim,
                })
        }
    };
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}

// --- pg-tx-by-hand, pg-tx-record-only ---------------------------------------------------

/// References for `pg-tx` (not the layer): its handler with the layer's transactional SQL
/// sent by hand on one pooled connection, the claim included or left out. With the claim,
/// the messages are the layer's own (`src/transactional.rs`, `claim_batch` and
/// `completion_batch`; `round_trips` asserts them): one simple query
/// `BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; SELECT 'look' …; COMMIT; BEGIN;
/// SELECT 'claim', c.* FROM tower_idempotency_claim_tx(…) AS c; SAVEPOINT …` (the look, then
/// the advisory lock and the placeholder record, whose row id the completion needs), the
/// payment `INSERT`, then `SELECT tower_idempotency_complete_tx('(block,offset)', …); COMMIT`
/// (the placeholder updated into the completed record). Without the claim there is no look
/// transaction, no lock, no placeholder and no savepoint: `BEGIN` alone opens the
/// transaction and the completion writes the completed record with one `INSERT` before
/// `COMMIT`, in one message: the least that keeping the record in the handler's transaction
/// can cost, as two requests with one key would both run. The lock id is an FNV-1a hash of
/// the key (the layer's is 64 bits of a SHA-256 of scope and key); the scope is the shared
/// one (`''`), as the layer's in `pg-tx`, which sets no scope.
#[derive(Clone)]
struct ByHand {
    pool: PgPool,
    claim: bool,
}

/// The record's columns the layer's look returns (`RECORD_COLUMNS` in `src/transactional.rs`).
const LOOK_COLUMNS: &str = "k.fingerprint, k.lease_token, \
     (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint AS lease_left_ms, \
     k.response_status, k.response_headers, k.response_body";

async fn pay_by_hand(State(hand): State<ByHand>, parts: Parts, body: Bytes) -> Response {
    let Some(key) = key_of(&parts.headers) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let mut conn = match hand.pool.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("by hand: {e}");
            return problem(StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    let paid = async {
        let placeholder = if hand.claim {
            let lock = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let mut k_arg = String::new();
            push_text(&mut k_arg, key);
            let mut fp_arg = String::new();
            push_hex(&mut fp_arg, fp.as_bytes());
            let sql = format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; SELECT 'look' AS step, \
                 {LOOK_COLUMNS} FROM tower_idempotency_keys AS k WHERE k.scope = E'' AND \
                 k.key = {k_arg} AND k.expires_at > now() AND (k.lease_token IS NULL OR \
                 k.lease_expires_at > now() OR k.fingerprint <> {fp_arg}); COMMIT; BEGIN; \
                 SELECT 'claim' AS step, c.* FROM tower_idempotency_claim_tx({}, E'', \
                 {k_arg}, {fp_arg}) AS c; SAVEPOINT tower_idempotency_handler",
                i64::from_ne_bytes(lock.to_ne_bytes())
            );
            let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .fetch_all(&mut *conn)
                .await?;
            let step = |name: &str| {
                rows.iter()
                    .find(|r| r.try_get::<&str, _>("step").ok() == Some(name))
            };
            if step("look").is_some() {
                return Err("the look found a record for a new key".into());
            }
            let claim = step("claim").ok_or("the claim returned no row")?;
            let outcome: &str = claim.try_get("outcome")?;
            if outcome != "acquired" {
                return Err(format!("the claim of a new key answered {outcome:?}").into());
            }
            Some(claim.try_get::<String, _>("claimed_row")?)
        } else {
            sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
            None
        };
        let id = insert_payment(&mut conn).await?;
        let (head, res_body) = payment_created(id, body.len()).into_parts();
        let res_body = axum::body::to_bytes(res_body, usize::MAX).await?;
        let stored = StoredResponse::new(head.status, head.headers.clone(), res_body.clone());
        let mut sql = String::with_capacity(512 + 2 * res_body.len());
        match &placeholder {
            Some(row) => {
                sql.push_str("SELECT tower_idempotency_complete_tx('");
                sql.push_str(row);
                sql.push_str("',E'',");
                push_text(&mut sql, key);
                sql.push_str(",86400000,");
                sql.push_str(head.status.as_str());
                sql.push_str("::smallint,");
                push_hex(&mut sql, &stored.encode_headers());
                sql.push(',');
                push_hex(&mut sql, &res_body);
                sql.push_str("); COMMIT");
            }
            None => {
                sql.push_str(
                    "INSERT INTO tower_idempotency_keys (scope, key, fingerprint, expires_at, \
                     completed_at, response_status, response_headers, response_body) VALUES \
                     (E'',",
                );
                push_text(&mut sql, key);
                sql.push(',');
                push_hex(&mut sql, fp.as_bytes());
                sql.push_str(",now()+86400000*interval '1 millisecond',now(),");
                sql.push_str(head.status.as_str());
                sql.push(',');
                push_hex(&mut sql, &stored.encode_headers());
                sql.push(',');
                push_hex(&mut sql, &res_body);
                sql.push_str("); COMMIT");
            }
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut *conn)
            .await?;
        Ok::<_, BoxError>(Response::from_parts(head, axum::body::Body::from(res_body)))
    };
    match paid.await {
        Ok(res) => res,
        Err(e) => {
            // The transaction may still be open: close the connection rather than return
            // it to the pool (as the layer's `OpenTx` does).
            conn.close_on_drop();
            eprintln!("by hand: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// Appends `text` as an `E'…'` constant, quotes and backslashes doubled, as the layer does.
fn push_text(sql: &mut String, text: &str) {
    sql.push_str("E'");
    for c in text.chars() {
        if c == '\'' || c == '\\' {
            sql.push(c);
        }
        sql.push(c);
    }
    sql.push('\'');
}

/// Appends `bytes` as `decode('<hex>','hex')`, as the layer does.
fn push_hex(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.push_str("decode('");
    for b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 15)]));
    }
    sql.push_str("','hex')");
}

/// Sends `replay-0` … `replay-{count - 1}` through `router` once (in process, 32 at a time),
/// so that later requests for them are replays.
async fn complete_replay_keys(router: &Router, count: usize) -> Result<(), BoxError> {
    let body = common::json_body(common::BODY_LEN);
    let mut next = 0;
    while next < count {
        let batch = (next..count.min(next + 32)).map(|i| {
            let req = request("127.0.0.1", &replay_key(i), &body);
            router.clone().oneshot(req.map(axum::body::Body::new))
        });
        for res in futures_join_all(batch).await {
            let res = res?;
            if res.status() != StatusCode::CREATED {
                return Err(format!("completing a replay key: {}", res.status()).into());
            }
        }
        next += 32;
    }
    Ok(())
}

fn replay_key(i: usize) -> String {
    format!("replay-{i}")
}

/// Awaits every future of `futs` concurrently (a tiny `join_all`, to need no extra crate).
async fn futures_join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pinned: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (fut, slot) in pinned.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

// ---------------------------------------------------------------------------------------
// Postgres: a fresh schema per scenario
// ---------------------------------------------------------------------------------------

struct PgSchema {
    name: String,
    admin: PgPool,
    pool: PgPool,
    /// The tables emptied before each side of a new-key scenario.
    tables: Vec<&'static str>,
}

impl PgSchema {
    async fn new(pool_size: u32) -> Result<Self, BoxError> {
        let (admin, name, opts) = common::fresh_schema("bench").await?;
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            .min_connections(pool_size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(opts)
            .await?;
        // Open every connection now, so the backends whose CPU time is counted are all there.
        let mut held = Vec::new();
        for _ in 0..pool_size {
            held.push(pool.acquire().await?);
        }
        drop(held);
        Ok(Self {
            name,
            admin,
            pool,
            tables: vec!["tower_idempotency_keys"],
        })
    }

    /// The process IDs of the pool's server backends (found by their application name).
    async fn backend_pids(&self) -> Result<Vec<u32>, BoxError> {
        let pids: Vec<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
                .bind(&self.name)
                .fetch_all(&self.admin)
                .await?;
        Ok(pids
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .collect())
    }

    async fn truncate(&self) -> Result<(), BoxError> {
        let sql = format!("TRUNCATE {}", self.tables.join(", "));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn drop_schema(self) {
        self.pool.close().await;
        let sql = format!("DROP SCHEMA {} CASCADE", self.name);
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.admin)
            .await
        {
            eprintln!("could not drop schema {}: {e}", self.name);
        }
        self.admin.close().await;
    }
}

// ---------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------

struct Server {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn start_server(rt: &Runtime, router: Router) -> Result<Server, BoxError> {
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Server { addr, stop, task })
    })
}

fn stop_server(rt: &Runtime, server: Server) {
    let _ = server.stop.send(());
    rt.block_on(async {
        let abort = server.task.abort_handle();
        match tokio::time::timeout(Duration::from_secs(5), server.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("server failed: {e}"),
            Ok(Err(e)) => eprintln!("server task failed: {e}"),
            Err(_) => {
                eprintln!("server did not stop within 5 s; aborting it");
                abort.abort();
            }
        }
    });
}

// ---------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------

fn request(host: &str, key: &str, body: &Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post(PATH)
        .header(header::HOST, host)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap()
}

/// A small xorshift generator, one per connection: picks replay keys.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let n = u64::try_from(n.max(1)).unwrap_or(u64::MAX);
        usize::try_from(self.0 % n).unwrap_or(0)
    }
}

/// What one side's measured window produced.
struct Stats {
    requests: u64,
    unexpected: u64,
    window: Duration,
    /// Latencies of the requests completed in the window, in microseconds, sorted.
    latencies_us: Vec<u32>,
    /// CPU time used in the window.
    cpu: Cpu,
}

impl Stats {
    /// CPU time of the server's threads per request, in microseconds.
    fn app_us(&self) -> f64 {
        self.cpu.server.as_secs_f64() * 1e6 / self.requests as f64
    }

    /// CPU time of the pool's Postgres backends per request, in microseconds.
    fn db_us(&self) -> Option<f64> {
        Some(self.cpu.db?.as_secs_f64() * 1e6 / self.requests as f64)
    }

    /// What everything else on the machine used while this side ran, in cores.
    fn others_cores(&self) -> Option<f64> {
        let ours = self.cpu.server + self.cpu.client + self.cpu.db.unwrap_or_default();
        let busy = self.cpu.machine?;
        Some(busy.saturating_sub(ours).as_secs_f64() / self.window.as_secs_f64())
    }

    fn rps(&self) -> f64 {
        self.requests as f64 / self.window.as_secs_f64()
    }

    /// The latency at quantile `q` (nearest rank), in milliseconds.
    fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let last = self.latencies_us.len() - 1;
        // `q` is in [0, 1], so the rank is in [0, last]; truncating it is the nearest rank.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((last as f64) * q).round() as usize;
        f64::from(self.latencies_us[rank.min(last)]) / 1000.0
    }

    fn merge(&mut self, other: Stats) {
        self.requests += other.requests;
        self.unexpected += other.unexpected;
        self.window += other.window;
        self.cpu = self.cpu.add(other.cpu);
        self.latencies_us.extend(other.latencies_us);
        self.latencies_us.sort_unstable();
    }
}

struct ConnResult {
    requests: u64,
    unexpected: u64,
    latencies_us: Vec<u32>,
}

/// Drives `addr` with `args.connections` connections: warm-up, then the measured window.
async fn drive(
    addr: SocketAddr,
    args: &Args,
    keys: KeyPlan,
    expect: StatusCode,
    tag: &str,
    db_pids: Vec<u32>,
) -> Result<Stats, BoxError> {
    let body = common::json_body(common::BODY_LEN);
    let host = addr.to_string();
    let mut senders = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                eprintln!("client connection failed: {e}");
            }
        });
        senders.push(sender);
    }
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let measure_until = measure_from + args.seconds;
    let probe = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let before = CpuSnapshot::take(&db_pids);
        tokio::time::sleep_until(measure_until.into()).await;
        CpuSnapshot::take(&db_pids).since(&before)
    });
    let mut tasks = Vec::with_capacity(senders.len());
    for (conn, mut sender) in senders.into_iter().enumerate() {
        let (body, host, tag) = (body.clone(), host.clone(), tag.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut out = ConnResult {
                requests: 0,
                unexpected: 0,
                latencies_us: Vec::new(),
            };
            let seed = u64::try_from(conn)
                .unwrap_or(0)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rng = Rng(seed | 1);
            let mut seq = 0u64;
            loop {
                let sent = Instant::now();
                if sent >= measure_until {
                    break;
                }
                let key = match keys {
                    KeyPlan::New => {
                        seq += 1;
                        format!("{tag}-{conn}-{seq}")
                    }
                    KeyPlan::Replay { count } => replay_key(rng.below(count)),
                };
                sender.ready().await?;
                let res = sender.send_request(request(&host, &key, &body)).await?;
                let status = res.status();
                res.into_body().collect().await?;
                let done = Instant::now();
                if done >= measure_from && done < measure_until {
                    out.requests += 1;
                    if status != expect {
                        out.unexpected += 1;
                    }
                    let us = (done - sent).as_micros();
                    out.latencies_us.push(u32::try_from(us).unwrap_or(u32::MAX));
                }
            }
            Ok::<_, BoxError>(out)
        }));
    }
    let mut stats = Stats {
        requests: 0,
        unexpected: 0,
        window: args.seconds,
        latencies_us: Vec::new(),
        cpu: Cpu::default(),
    };
    for task in tasks {
        let r = task.await??;
        stats.requests += r.requests;
        stats.unexpected += r.unexpected;
        stats.latencies_us.extend(r.latencies_us);
    }
    stats.latencies_us.sort_unstable();
    stats.cpu = probe.await?;
    Ok(stats)
}

// ---------------------------------------------------------------------------------------
// CPU accounting (Linux): so a neighbour taking the CPU shows, and costs can be compared
// ---------------------------------------------------------------------------------------

/// CPU time used in a window.
#[derive(Clone, Copy, Default)]
struct Cpu {
    /// The server runtime's threads (named `server`).
    server: Duration,
    /// The client runtime's threads (named `client`).
    client: Duration,
    /// The pool's Postgres backends, when their `/proc` entries can be read.
    db: Option<Duration>,
    /// Every CPU of the machine (`/proc/stat`), when readable.
    machine: Option<Duration>,
}

impl Cpu {
    fn add(self, other: Cpu) -> Cpu {
        let sum = |a: Option<Duration>, b: Option<Duration>| Some(a? + b?);
        Cpu {
            server: self.server + other.server,
            client: self.client + other.client,
            db: sum(self.db, other.db),
            machine: sum(self.machine, other.machine),
        }
    }
}

/// Cumulative CPU times at one instant.
struct CpuSnapshot {
    server: u64,
    client: u64,
    db: Option<u64>,
    machine: Option<u64>,
}

/// The first field of a `schedstat` file: nanoseconds spent on a CPU.
fn schedstat_ns(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Busy time of the whole machine in nanoseconds: `/proc/stat`'s `cpu` line less idle and
/// iowait, in clock ticks (taken as 100 per second, Linux's `USER_HZ`).
fn machine_busy_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle) * 10_000_000)
}

impl CpuSnapshot {
    fn take(db_pids: &[u32]) -> CpuSnapshot {
        let (mut server, mut client) = (0, 0);
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let dir = task.path().display().to_string();
                let comm = std::fs::read_to_string(format!("{dir}/comm")).unwrap_or_default();
                let ns = schedstat_ns(&format!("{dir}/schedstat")).unwrap_or(0);
                match comm.trim_end() {
                    "server" => server += ns,
                    "client" => client += ns,
                    _ => {}
                }
            }
        }
        let db = if db_pids.is_empty() {
            None
        } else {
            db_pids
                .iter()
                .map(|pid| schedstat_ns(&format!("/proc/{pid}/schedstat")))
                .sum()
        };
        CpuSnapshot {
            server,
            client,
            db,
            machine: machine_busy_ns(),
        }
    }

    fn since(&self, before: &CpuSnapshot) -> Cpu {
        let d = |a: u64, b: u64| Duration::from_nanos(a.saturating_sub(b));
        Cpu {
            server: d(self.server, before.server),
            client: d(self.client, before.client),
            db: self.db.zip(before.db).map(|(a, b)| d(a, b)),
            machine: self.machine.zip(before.machine).map(|(a, b)| d(a, b)),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Running
// ---------------------------------------------------------------------------------------

struct Args {
    scenarios: Vec<&'static Scenario>,
    connections: usize,
    seconds: Duration,
    warmup: Duration,
    pool: u32,
    rounds: usize,
    replay_keys: usize,
    server_threads: usize,
    client_threads: usize,
    side: Side,
}

/// Which sides of each scenario run (`--side`); one side alone is for profiling it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Both,
    Layer,
    Baseline,
}

impl Side {
    fn runs(self, layered: bool) -> bool {
        match self {
            Side::Both => true,
            Side::Layer => layered,
            Side::Baseline => !layered,
        }
    }
}

const USAGE: &str = "usage: cargo bench --bench load -- [scenario...] [--connections N] \
[--seconds S] [--warmup S] [--pool N] [--rounds N] [--replay-keys N] [--server-threads N] \
[--client-threads N] [--side both|layer|baseline]";

fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it.
    // Then, like Criterion's test mode, make one short smoke run that checks every scenario
    // works (options given on the command line still apply).
    let measuring = argv.iter().any(|a| a == "--bench");
    let mut args = if measuring {
        Args {
            scenarios: Vec::new(),
            connections: 64,
            seconds: Duration::from_secs(10),
            warmup: Duration::from_secs(2),
            pool: 16,
            rounds: 1,
            replay_keys: 10_000,
            server_threads: 2,
            client_threads: 2,
            side: Side::Both,
        }
    } else {
        println!("test mode (no --bench): a smoke run; `cargo bench --bench load` measures");
        Args {
            scenarios: Vec::new(),
            connections: 4,
            seconds: Duration::from_millis(100),
            warmup: Duration::from_millis(30),
            pool: 2,
            rounds: 1,
            replay_keys: 50,
            server_threads: 2,
            client_threads: 1,
            side: Side::Both,
        }
    };
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let secs = |v: String| -> Result<Duration, String> {
            v.parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| format!("not a number of seconds: {v}"))
        };
        let num = |v: String| -> Result<usize, String> {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("not a positive number: {v}"))
        };
        match arg.as_str() {
            // `cargo bench` passes `--bench` to every benchmark binary.
            "--bench" => {}
            "--connections" => args.connections = num(value(&arg)?)?,
            "--seconds" => args.seconds = secs(value(&arg)?)?,
            "--warmup" => args.warmup = secs(value(&arg)?)?,
            "--pool" => {
                args.pool = u32::try_from(num(value(&arg)?)?).map_err(|e| e.to_string())?;
            }
            "--rounds" => args.rounds = num(value(&arg)?)?,
            "--replay-keys" => args.replay_keys = num(value(&arg)?)?,
            "--server-threads" => args.server_threads = num(value(&arg)?)?,
            "--client-threads" => args.client_threads = num(value(&arg)?)?,
            "--side" => {
                args.side = match value(&arg)?.as_str() {
                    "both" => Side::Both,
                    "layer" => Side::Layer,
                    "baseline" => Side::Baseline,
                    other => return Err(format!("--side is both, layer or baseline, not {other}")),
                };
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other if other.starts_with('-') => {
                return Err(format!("unknown option {other}\n{USAGE}"));
            }
            name => {
                let scenario = all_scenarios().find(|s| s.name == name).ok_or_else(|| {
                    let names: Vec<_> = all_scenarios().map(|s| s.name).collect();
                    format!(
                        "unknown scenario {name}; the scenarios: {}",
                        names.join(", ")
                    )
                })?;
                args.scenarios.push(scenario);
            }
        }
    }
    if args.scenarios.is_empty() {
        args.scenarios = all_scenarios().collect();
    }
    Ok(args)
}

/// The shared context a scenario is built in.
struct Ctx {
    args: Args,
}

struct Outcome {
    scenario: &'static Scenario,
    layer: Option<Stats>,
    baseline: Option<Stats>,
}

impl Outcome {
    /// Layer ÷ baseline requests per second, when both sides ran.
    fn ratio(&self) -> Option<f64> {
        Some(self.layer.as_ref()?.rps() / self.baseline.as_ref()?.rps())
    }
}

fn run_side(
    ctx: &Ctx,
    server_rt: &Runtime,
    client_rt: &Runtime,
    built: &Built,
    layered: bool,
    round: usize,
) -> Result<Stats, BoxError> {
    if let (KeyPlan::New, Some(schema)) = (built.keys, &built.schema) {
        server_rt.block_on(schema.truncate())?;
    }
    let (layer, baseline) = match built.fresh {
        Some(fresh) => fresh(),
        None => (built.layer.clone(), built.baseline.clone()),
    };
    let (router, tag) = if layered {
        (layer, format!("layer{round}"))
    } else {
        (baseline, format!("base{round}"))
    };
    let db_pids = match &built.schema {
        Some(schema) => server_rt.block_on(schema.backend_pids())?,
        None => Vec::new(),
    };
    let server = start_server(server_rt, router)?;
    let stats = client_rt.block_on(drive(
        server.addr,
        &ctx.args,
        built.keys,
        built.expect,
        &tag,
        db_pids,
    ));
    stop_server(server_rt, server);
    let stats = stats?;
    println!(
        "  {:<8} round {}: {:>7.0} req/s  p50 {:>6.3} ms  p99 {:>6.3} ms  CPU/req: app {:>5.1} µs, \
         db {} µs; others {} cores  ({} requests{})",
        if layered { "layer" } else { "baseline" },
        round + 1,
        stats.rps(),
        stats.quantile_ms(0.50),
        stats.quantile_ms(0.99),
        stats.app_us(),
        opt(stats.db_us(), 1),
        opt(stats.others_cores(), 2),
        stats.requests,
        if stats.unexpected > 0 {
            format!(", {} with an unexpected status", stats.unexpected)
        } else {
            String::new()
        }
    );
    Ok(stats)
}

fn run_scenario(
    ctx: &Ctx,
    scenario: &'static Scenario,
    server_rt: &Runtime,
    client_rt: &Runtime,
) -> Result<Outcome, BoxError> {
    println!(
        "{}: layer = {}; baseline = {}",
        scenario.name, scenario.layer_side, scenario.baseline
    );
    let built = server_rt.block_on((scenario.build)(ctx))?;
    let mut result = (None::<Stats>, None::<Stats>);
    let mut run = || -> Result<(), BoxError> {
        for round in 0..ctx.args.rounds {
            // Alternate which side goes first, so a drift (a warming cache, a growing
            // table, a neighbour's build) does not favour one side.
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for layered in order.into_iter().filter(|l| ctx.args.side.runs(*l)) {
                let stats = run_side(ctx, server_rt, client_rt, &built, layered, round)?;
                let slot = if layered {
                    &mut result.0
                } else {
                    &mut result.1
                };
                match slot {
                    Some(s) => s.merge(stats),
                    None => *slot = Some(stats),
                }
            }
        }
        Ok(())
    };
    let ran = run();
    let Built { schema, owned, .. } = built;
    if let Some(schema) = schema {
        server_rt.block_on(schema.drop_schema());
    }
    // Servers the scenario started stop here.
    drop(owned);
    ran?;
    let (layer, baseline) = result;
    let unexpected = |s: &Option<Stats>| s.as_ref().map_or(0, |s| s.unexpected);
    if unexpected(&layer) + unexpected(&baseline) > 0 {
        return Err(format!(
            "{}: answers with an unexpected status (layer {}, baseline {})",
            scenario.name,
            unexpected(&layer),
            unexpected(&baseline)
        )
        .into());
    }
    let outcome = Outcome {
        scenario,
        layer,
        baseline,
    };
    if let Some(ratio) = outcome.ratio() {
        println!("  ratio {ratio:.3} (target ≥ {})", scenario.target);
    }
    Ok(outcome)
}

/// `v` with `decimals` decimals, or `–`.
fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.decimals$}"))
}

fn print_table(args: &Args, outcomes: &[Outcome]) {
    println!();
    println!(
        "{} connections, pool {}, {} s measured after {} s warm-up, {} round(s), server {} \
         threads, client {} threads, 1 KiB JSON body",
        args.connections,
        args.pool,
        args.seconds.as_secs_f64(),
        args.warmup.as_secs_f64(),
        args.rounds,
        args.server_threads,
        args.client_threads
    );
    println!();
    println!(
        "| scenario | layer req/s | layer p50 ms | layer p99 ms | baseline req/s | baseline p50 ms | baseline p99 ms | ratio | target | met |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let cells = |s: &Option<Stats>| match s {
        Some(s) => format!(
            "{:.0} | {:.3} | {:.3}",
            s.rps(),
            s.quantile_ms(0.50),
            s.quantile_ms(0.99)
        ),
        None => "– | – | –".to_owned(),
    };
    for o in outcomes {
        let (ratio, met) = match o.ratio() {
            Some(r) => (
                format!("{r:.3}"),
                if r >= o.scenario.target { "yes" } else { "no" },
            ),
            None => ("–".to_owned(), "–"),
        };
        println!(
            "| {} | {} | {} | {ratio} | ≥ {} | {met} |",
            o.scenario.name,
            cells(&o.layer),
            cells(&o.baseline),
            o.scenario.target,
        );
    }
    println!();
    println!(
        "CPU time per request (µs): app = the server process's threads, db = the pool's \
         Postgres backends; cost ratio = baseline (app + db) ÷ layer (app + db); others = what \
         the rest of the machine used meanwhile, in cores."
    );
    println!();
    println!(
        "| scenario | layer app | layer db | baseline app | baseline db | cost ratio | others (cores) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for o in outcomes {
        let cost = |s: &Stats| s.app_us() + s.db_us().unwrap_or(0.0);
        let part = |s: &Option<Stats>, f: fn(&Stats) -> Option<f64>| opt(s.as_ref().and_then(f), 1);
        let ratio = match (&o.layer, &o.baseline) {
            (Some(l), Some(b)) => format!("{:.3}", cost(b) / cost(l)),
            _ => "–".to_owned(),
        };
        let others: Vec<String> = [&o.layer, &o.baseline]
            .into_iter()
            .flatten()
            .map(|s| opt(s.others_cores(), 2))
            .collect();
        println!(
            "| {} | {} | {} | {} | {} | {ratio} | {} |",
            o.scenario.name,
            part(&o.layer, |s| Some(s.app_us())),
            part(&o.layer, Stats::db_us),
            part(&o.baseline, |s| Some(s.app_us())),
            part(&o.baseline, Stats::db_us),
            others.join(" / "),
        );
    }
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = |threads: usize, name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            .build()
            .unwrap()
    };
    let server_rt = runtime(args.server_threads, "server");
    let client_rt = runtime(args.client_threads, "client");
    let ctx = Ctx { args };
    let mut outcomes = Vec::new();
    let mut failed = false;
    for &scenario in &ctx.args.scenarios {
        match run_scenario(&ctx, scenario, &server_rt, &client_rt) {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                eprintln!("{}: failed: {e}", scenario.name);
                failed = true;
            }
        }
    }
    print_table(&ctx.args, &outcomes);
    // Stop the runtimes without waiting for stray tasks (closed connections end anyway).
    server_rt.shutdown_timeout(Duration::from_secs(1));
    client_rt.shutdown_timeout(Duration::from_secs(1));
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}
