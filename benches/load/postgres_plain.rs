//! The Postgres scenarios in plain mode: `pg-plain-new` (a new key per request) and
//! `pg-replay` (completed keys requested again), each once per `ClaimStrategy` and with
//! prepared statements, against baselines that send the store's own SQL by hand.

use axum::Router;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use sqlx::{PgPool, Row};
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{
    ClaimStrategy, Fingerprint, IdempotencyLayer, PostgresStore, StoredResponse,
};

use crate::pg_schema::PgSchema;
use crate::scenario::{
    Built, Ctx, KeyPlan, PATH, Scenario, complete_replay_keys, create, key_of, problem,
};
use crate::{BoxError, common};

/// The plain-mode Postgres scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "pg-plain-new",
        layer_side: "PostgresStore (ClaimStrategy::Adaptive, the default), new key per request",
        baseline: "fingerprint + the store's INSERT … ON CONFLICT DO NOTHING RETURNING, then its \
                   COMPLETE UPDATE (by hand)",
        target: 0.95,
        build: |ctx| {
            Box::pin(build_pg_plain_new(
                ctx,
                (ClaimStrategy::Adaptive, false),
                HAND_CLAIM,
            ))
        },
    },
    Scenario {
        name: "pg-plain-new-same-sql",
        layer_side: "PostgresStore (ClaimStrategy::Combined), new key per request",
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
                (ClaimStrategy::Adaptive, true),
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
        layer_side: "PostgresStore (ClaimStrategy::Adaptive, the default), completed keys \
                     requested again",
        baseline: "fingerprint + the store's plain SELECT of the record (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::Adaptive, false))),
    },
    Scenario {
        name: "pg-replay-prepared",
        layer_side: "as pg-replay, with_prepared_statements(true) (direct connections only)",
        baseline: "as pg-replay",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::Adaptive, true))),
    },
    Scenario {
        name: "pg-replay-combined",
        layer_side: "PostgresStore (ClaimStrategy::Combined), completed keys requested again",
        baseline: "as pg-replay",
        target: 0.95,
        build: |ctx| Box::pin(build_pg_replay(ctx, (ClaimStrategy::Combined, false))),
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
];

// --- pg-plain-new ----------------------------------------------------------------------

// The hand-written SQL is the store's own (src/store/postgres.rs), copied verbatim: the
// baselines send the statements the store sends on its cheapest path, with none of the
// layer's code around them.

/// The claim of a new key, by hand: the store's `INSERT` statement (what
/// `ClaimStrategy::InsertFirst` and `ReadFirst` send to claim; `Combined` sends it inside its
/// one claim statement).
pub(crate) const HAND_CLAIM: &str = "
INSERT INTO tower_idempotency_keys AS k
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
VALUES ($1, $2, $3, nextval('tower_idempotency_lease_token_seq'),
        now() + $4::float8 * interval '1 millisecond',
        now() + $5::float8 * interval '1 millisecond')
ON CONFLICT (scope, key) DO NOTHING
RETURNING k.lease_token AS inserted";

/// The claim of `ClaimStrategy::Combined`, by hand, as one prepared statement (for the
/// `pg-plain-new-same-sql` baseline): the record read by its key, and for an absent key the
/// insert function called, as the store's claim function (`tower_idempotency_plain_claim`)
/// does in PL/pgSQL.
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
pub(crate) const HAND_COMPLETE: &str = "
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
    let Some(token) = hand_claim(pool, hand.claim, key, &fp).await? else {
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
    hand_complete(pool, key, token, &stored).await?;
    Ok((status, headers, answer).into_response())
}

/// Claims `key` (shared scope) with `claim` ([`HAND_CLAIM`] or [`HAND_COMBINED_CLAIM`]), by
/// hand: the new record's token, or `None` when the key has a record.
pub(crate) async fn hand_claim(
    pool: &PgPool,
    claim: &'static str,
    key: &str,
    fp: &Fingerprint,
) -> Result<Option<i64>, BoxError> {
    // The insert returns no row on a conflict; Combined's claim returns a row with a NULL
    // token.
    Ok(sqlx::query_scalar::<_, Option<i64>>(claim)
        .bind("")
        .bind(key)
        .bind(&fp.as_bytes()[..])
        .bind(LEASE_MS)
        .bind(TTL_MS)
        .fetch_optional(pool)
        .await?
        .flatten())
}

/// Completes the record that `token` holds with `stored`, by hand ([`HAND_COMPLETE`]).
pub(crate) async fn hand_complete(
    pool: &PgPool,
    key: &str,
    token: i64,
    stored: &StoredResponse,
) -> Result<(), BoxError> {
    sqlx::query(HAND_COMPLETE)
        .bind("")
        .bind(key)
        .bind(token)
        .bind(TTL_MS)
        .bind(i16::try_from(stored.status().as_u16())?)
        .bind(stored.encode_headers())
        .bind(stored.body().map_or(&[][..], |b| &b[..]))
        .execute(pool)
        .await?;
    Ok(())
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
        baseline_keys: None,
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
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}
