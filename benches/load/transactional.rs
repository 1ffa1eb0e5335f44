//! The transactional Postgres scenarios: `pg-tx` (the layer's transaction around a handler
//! that inserts a payment row) against the same insert in a transaction without idempotency,
//! and its two references without the layer, `pg-tx-by-hand` and `pg-tx-record-only`, which
//! send the layer's transactional SQL by hand (with the claim, and without it). The
//! `payments` table and the layer side's handler serve `pg-tx-notify` (`waiting.rs`) too.

use axum::Extension;
use axum::Router;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use sqlx::{PgPool, Row};
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, IdempotentTx, PostgresStore, StoredResponse,
};

use crate::BoxError;
use crate::pg_schema::PgSchema;
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, fnv1a, key_of, problem};

/// The transactional scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[
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
];

// --- pg-tx -----------------------------------------------------------------------------

/// The table the `pg-tx` handlers write to: what a payments endpoint records.
pub(crate) const PAYMENTS_DDL: &str = "
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
pub(crate) fn payment_created(id: i64, len: usize) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(r#"{{"payment_id":{id},"status":"created","received":{len}}}"#),
    )
        .into_response()
}

/// The layer side's handler: the payment row goes into the layer's transaction, which the
/// layer commits together with the key after this answers.
pub(crate) async fn pay_in_layer_tx(
    Extension(tx): Extension<IdempotentTx>,
    body: Bytes,
) -> Response {
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
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}

// --- pg-tx-by-hand, pg-tx-record-only ---------------------------------------------------

/// References for `pg-tx` (not the layer): its handler with the layer's transactional SQL
/// sent by hand on one pooled connection, the claim included or left out. With the claim,
/// the messages are the layer's own (`src/store/postgres/transactional/batches.rs`, `claim_batch` and
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

/// The record's columns the layer's look returns (`RECORD_COLUMNS` in `src/store/postgres/transactional/batches.rs`).
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
            let lock = fnv1a(key);
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
        let answer = payment_created(id, body.len());
        commit_with_answer(&mut conn, key, &fp, placeholder.as_deref(), answer).await
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

/// Stores `answer` as the completed record of `key` (shared scope, a 24 h TTL) in the
/// transaction open on `conn`, then commits, in one message: the layer's completion of the
/// `placeholder` claimed by hand, or (`None`) an `INSERT` of the record, all that storing the
/// answer in the handler's transaction costs with no claim. Returns the answer, read in full.
pub(crate) async fn commit_with_answer(
    conn: &mut sqlx::PgConnection,
    key: &str,
    fp: &Fingerprint,
    placeholder: Option<&str>,
    answer: Response,
) -> Result<Response, BoxError> {
    let (head, res_body) = answer.into_parts();
    let res_body = axum::body::to_bytes(res_body, usize::MAX).await?;
    let stored = StoredResponse::new(head.status, head.headers.clone(), res_body.clone());
    let mut sql = String::with_capacity(512 + 2 * res_body.len());
    match placeholder {
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
            sql.push(')');
        }
        None => push_record_insert(&mut sql, key, fp, &stored),
    }
    sql.push_str("; COMMIT");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(conn)
        .await?;
    Ok(Response::from_parts(head, axum::body::Body::from(res_body)))
}

/// Appends the `INSERT` of the completed record of `key` (shared scope, a 24 h TTL) with
/// `answer`.
fn push_record_insert(sql: &mut String, key: &str, fp: &Fingerprint, answer: &StoredResponse) {
    sql.push_str(
        "INSERT INTO tower_idempotency_keys (scope, key, fingerprint, expires_at, completed_at, \
         response_status, response_headers, response_body) VALUES (E'',",
    );
    push_text(sql, key);
    sql.push(',');
    push_hex(sql, fp.as_bytes());
    sql.push_str(",now()+86400000*interval '1 millisecond',now(),");
    sql.push_str(answer.status().as_str());
    sql.push(',');
    push_hex(sql, &answer.encode_headers());
    sql.push(',');
    push_hex(sql, answer.body().map_or(&[][..], |b| &b[..]));
    sql.push(')');
}

/// Appends `text` as an `E'…'` constant, quotes and backslashes doubled, as the layer does.
pub(crate) fn push_text(sql: &mut String, text: &str) {
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
pub(crate) fn push_hex(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.push_str("decode('");
    for b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 15)]));
    }
    sql.push_str("','hex')");
}
