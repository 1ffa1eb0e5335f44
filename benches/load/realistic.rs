//! The realistic handler: what a payment endpoint does, with and without the layer, in plain
//! and transactional mode. The figure users care about.
//!
//! The handler reads the order (`SELECT`), charges it at a payment provider (an HTTP call
//! over loopback to a server in this process that answers after 2 ms, carrying the derived
//! key `<key>:charge`), records the payment (`INSERT`) and marks the order paid (`UPDATE`),
//! in one transaction:
//!
//! | scenario | layer side | baseline |
//! |---|---|---|
//! | `realistic-plain` | `PostgresStore`, plain mode, around the handler (its own transaction) | the handler alone |
//! | `realistic-tx` | `PostgresStore::transactional()`: the handler's statements in the layer's transaction, committed with the key | the handler alone, in its own transaction |
//! | `realistic-phased` | `PostgresStore::phased()`: the key claimed first; the handler reads the order, calls the provider with no transaction open, and writes the payment and the order in its last phase, committed with the answer | the handler alone, in its own transaction |
//! | `realistic-plain-by-hand` (reference, no layer) | the handler in its own transaction between the plain store's cheapest statements sent by hand as prepared statements (its `INSERT … ON CONFLICT DO NOTHING` claim before, its completing `UPDATE` after, each in its own transaction): the least a plain-mode design costs | the handler alone |
//! | `realistic-phased-by-hand` (reference, no layer) | the least a phased design costs: the claim's `INSERT … ON CONFLICT DO NOTHING` committed on its own (one simple-protocol message, as the layer sends it), the order read, the provider called with no transaction open, then the payment, the order and the key's completing `UPDATE` in one transaction | the handler alone, in its own transaction |
//! | `realistic-phased-by-hand-async-claim` (reference, no layer) | the same, the claim's commit not waiting for its WAL flush (`SET LOCAL synchronous_commit = off`): what the claim's own durability costs | the handler alone, in its own transaction |
//! | `realistic-tx-record-only` (reference, no layer) | the handler in its own transaction, which also inserts the key's completed record before it commits (in the `COMMIT`'s message): no claim at all, the least that storing the answer with the handler's writes can cost | the handler alone |

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sqlx::PgPool;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{IdempotencyLayer, IdempotentTx, Phases, PostgresStore, StoredResponse};

use crate::BoxError;
use crate::pg_schema::PgSchema;
use crate::postgres_plain::{HAND_CLAIM, HAND_COMPLETE, hand_claim, hand_complete};
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, fnv1a, key_of, problem};
use crate::transactional::{
    PAYMENTS_DDL, commit_with_answer, payment_created, push_hex, push_text,
};

/// The realistic scenarios, in the order they run (first: their figure leads BENCHMARKS.md).
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "realistic-plain",
        layer_side: "plain mode (PostgresStore) around a payment handler: SELECT, a 2 ms \
                     provider call over loopback HTTP, INSERT, UPDATE, in its own transaction",
        baseline: "the same handler alone",
        target: 0.95,
        build: |ctx| Box::pin(build(ctx, Side::Plain)),
    },
    Scenario {
        name: "realistic-tx",
        layer_side: "transactional mode: the same handler's statements in the layer's \
                     transaction, committed with the key",
        baseline: "the same handler alone, in its own transaction",
        target: 0.95,
        build: |ctx| Box::pin(build(ctx, Side::Transactional)),
    },
    Scenario {
        name: "realistic-phased",
        layer_side: "phased mode: the key claimed first; SELECT, the 2 ms provider call with \
                     no transaction open, then INSERT and UPDATE in the last phase, committed \
                     with the answer",
        baseline: "the same handler alone, in its own transaction",
        target: 0.80,
        build: |ctx| Box::pin(build(ctx, Side::Phased)),
    },
    Scenario {
        name: "realistic-phased-by-hand",
        layer_side: "reference, no layer: the claim INSERT committed alone, SELECT, the 2 ms \
                     call with no transaction open, then INSERT, UPDATE and the key's \
                     completing UPDATE in one transaction: the floor of phased mode",
        baseline: "the same handler alone, in its own transaction",
        target: 0.80,
        build: |ctx| Box::pin(build(ctx, Side::PhasedByHand { async_claim: false })),
    },
    Scenario {
        name: "realistic-phased-by-hand-async-claim",
        layer_side: "reference, no layer: realistic-phased-by-hand with the claim's commit \
                     not waiting for its WAL flush",
        baseline: "the same handler alone, in its own transaction",
        target: 0.80,
        build: |ctx| Box::pin(build(ctx, Side::PhasedByHand { async_claim: true })),
    },
    Scenario {
        name: "realistic-plain-by-hand",
        layer_side: "reference, no layer: the same handler between the plain store's \
                     cheapest claim and completion, by hand and prepared: the ceiling of \
                     plain mode",
        baseline: "the same handler alone",
        target: 0.95,
        build: |ctx| Box::pin(build(ctx, Side::PlainByHand)),
    },
    Scenario {
        name: "realistic-tx-record-only",
        layer_side: "reference, no layer: the same handler in its own transaction, which \
                     also inserts the key's completed record (no claim): the ceiling of \
                     transactional mode",
        baseline: "the same handler alone, in its own transaction",
        target: 0.95,
        build: |ctx| Box::pin(build(ctx, Side::RecordOnly)),
    },
];

/// What a realistic scenario's layer side is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Plain,
    PlainByHand,
    Transactional,
    Phased,
    PhasedByHand { async_claim: bool },
    RecordOnly,
}

/// How long the payment provider takes to answer.
const PROVIDER_DELAY: Duration = Duration::from_millis(2);
/// Orders the requests pay (picked by a hash of the key).
const ORDERS: u64 = 1000;

const ORDERS_DDL: &str = "
CREATE TABLE orders (
    id           bigint PRIMARY KEY,
    amount_cents bigint NOT NULL,
    status       text   NOT NULL
)";

/// The payment provider's side: answers a charge after [`PROVIDER_DELAY`].
async fn charge(headers: HeaderMap) -> Response {
    tokio::time::sleep(PROVIDER_DELAY).await;
    if !headers.contains_key("idempotency-key") {
        return problem(StatusCode::BAD_REQUEST);
    }
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"charge":"ch_1","status":"succeeded"}"#,
    )
        .into_response()
}

/// The provider, served in this process until dropped.
struct Provider(tokio::task::AbortHandle);

impl Drop for Provider {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn start_provider() -> Result<(Provider, SocketAddr), BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = Router::new().route("/charges", post(charge));
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("provider: {e}");
        }
    });
    Ok((Provider(task.abort_handle()), addr))
}

/// What the handler needs: the pool (for its own transaction) and the provider's client.
#[derive(Clone)]
struct Payments {
    pool: PgPool,
    provider: Client<HttpConnector, Full<Bytes>>,
    charges: Arc<str>,
}

/// The order a key pays: an FNV-1a hash of the key.
fn order_of(key: &str) -> i64 {
    i64::try_from(fnv1a(key) % ORDERS).unwrap_or(0) + 1
}

/// The handler's work on `conn` (a transaction's connection): three statements around the
/// provider's charge.
async fn pay(
    payments: &Payments,
    conn: &mut sqlx::PgConnection,
    key: &str,
) -> Result<i64, BoxError> {
    let order = order_of(key);
    let amount = read_amount(&mut *conn, order).await?;
    charge_at_provider(payments, key, amount).await?;
    record_payment(conn, order, amount).await
}

/// The order's amount.
async fn read_amount<'c, E: sqlx::PgExecutor<'c>>(db: E, order: i64) -> Result<i64, BoxError> {
    Ok(
        sqlx::query_scalar("SELECT amount_cents FROM orders WHERE id = $1")
            .bind(order)
            .fetch_one(db)
            .await?,
    )
}

/// The provider's charge, with the derived key.
async fn charge_at_provider(payments: &Payments, key: &str, amount: i64) -> Result<(), BoxError> {
    let request = http::Request::post(&*payments.charges)
        .header("idempotency-key", format!("{key}:charge"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(format!(r#"{{"amount":{amount}}}"#))))?;
    let charged = payments.provider.request(request).await?;
    if charged.status() != StatusCode::CREATED {
        return Err(format!("provider answered {}", charged.status()).into());
    }
    charged.into_body().collect().await?;
    Ok(())
}

/// The payment's row and the order's new status.
async fn record_payment(
    conn: &mut sqlx::PgConnection,
    order: i64,
    amount: i64,
) -> Result<i64, BoxError> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (order_id, amount_cents, currency) VALUES ($1, $2, 'EUR') \
         RETURNING id",
    )
    .bind(order)
    .bind(amount)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(order)
        .execute(&mut *conn)
        .await?;
    Ok(id)
}

/// The handler in a transaction of its own: the baseline, and the plain layer's handler.
async fn pay_own_tx(State(payments): State<Payments>, parts: Parts, body: Bytes) -> Response {
    let key = key_of(&parts.headers).unwrap_or("none").to_owned();
    let paid = async {
        let mut tx = payments.pool.begin().await?;
        let id = pay(&payments, &mut tx, &key).await?;
        tx.commit().await?;
        Ok::<_, BoxError>(id)
    };
    match paid.await {
        Ok(id) => payment_created(id, body.len()),
        Err(e) => {
            eprintln!("handler: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// The handler in the layer's transaction (transactional mode).
async fn pay_layer_tx(
    State(payments): State<Payments>,
    Extension(tx): Extension<IdempotentTx>,
    parts: Parts,
    body: Bytes,
) -> Response {
    let key = key_of(&parts.headers).unwrap_or("none").to_owned();
    let paid = async {
        let mut conn = tx.conn().await?;
        pay(&payments, &mut conn, &key).await
    };
    match paid.await {
        Ok(id) => payment_created(id, body.len()),
        Err(e) => {
            eprintln!("layer handler: {e}");
            problem(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// The handler in phased mode: the order read on its own, the provider called with no
/// transaction open, the payment and the order written in the last phase.
async fn pay_phased(
    State(payments): State<Payments>,
    Extension(phases): Extension<Phases>,
    parts: Parts,
    body: Bytes,
) -> Response {
    let key = key_of(&parts.headers).unwrap_or("none").to_owned();
    let paid = async {
        let order = order_of(&key);
        let amount = read_amount(&payments.pool, order).await?;
        charge_at_provider(&payments, &key, amount).await?;
        let mut conn = phases.tx().await?;
        record_payment(&mut conn, order, amount).await
    };
    match paid.await {
        Ok(id) => payment_created(id, body.len()),
        Err(e) => {
            eprintln!("phased handler: {e}");
            problem(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// The least a phased design costs, by hand (`realistic-phased-by-hand`): the claim committed
/// alone, the provider called with no transaction open, the payment, the order and the key's
/// completion in one transaction.
async fn pay_phased_by_hand(
    State((payments, async_claim)): State<(Payments, bool)>,
    parts: Parts,
    body: Bytes,
) -> Response {
    let Some(key) = key_of(&parts.headers).map(str::to_owned) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let paid = async {
        let pool = &payments.pool;
        let mut claim = String::with_capacity(400);
        if async_claim {
            claim.push_str("SET LOCAL synchronous_commit = off; ");
        }
        claim.push_str(
            "INSERT INTO tower_idempotency_keys AS k \
             (scope, key, fingerprint, lease_token, lease_expires_at, expires_at) \
             VALUES ('', ",
        );
        push_text(&mut claim, &key);
        claim.push_str(", ");
        push_hex(&mut claim, &fp.as_bytes()[..]);
        claim.push_str(
            ", nextval('tower_idempotency_lease_token_seq'), now() + interval '30 seconds', \
             now() + interval '1 day') ON CONFLICT (scope, key) DO NOTHING \
             RETURNING k.lease_token AS inserted",
        );
        let claimed = sqlx::raw_sql(sqlx::AssertSqlSafe(claim))
            .fetch_optional(pool)
            .await?
            .ok_or("the claim of a new key found a record")?;
        let token: i64 = sqlx::Row::try_get(&claimed, "inserted")?;
        let order = order_of(&key);
        let amount = read_amount(pool, order).await?;
        charge_at_provider(&payments, &key, amount).await?;
        let mut tx = pool.begin().await?;
        let id = record_payment(&mut tx, order, amount).await?;
        let (head, res_body) = payment_created(id, body.len()).into_parts();
        let res_body = axum::body::to_bytes(res_body, usize::MAX).await?;
        let stored = StoredResponse::new(head.status, head.headers.clone(), res_body.clone());
        sqlx::query(HAND_COMPLETE)
            .bind("")
            .bind(&key)
            .bind(token)
            .bind(86_400_000_i64)
            .bind(i16::try_from(stored.status().as_u16())?)
            .bind(stored.encode_headers())
            .bind(stored.body().map_or(&[][..], |b| &b[..]))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok::<_, BoxError>(Response::from_parts(head, axum::body::Body::from(res_body)))
    };
    match paid.await {
        Ok(res) => res,
        Err(e) => {
            eprintln!("phased by hand: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// The handler between the plain store's claim and completion, by hand
/// (`realistic-plain-by-hand`).
async fn pay_plain_by_hand(
    State(payments): State<Payments>,
    parts: Parts,
    body: Bytes,
) -> Response {
    let Some(key) = key_of(&parts.headers).map(str::to_owned) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let paid = async {
        let pool = &payments.pool;
        let token = hand_claim(pool, HAND_CLAIM, &key, &fp)
            .await?
            .ok_or("the claim of a new key found a record")?;
        let mut tx = pool.begin().await?;
        let id = pay(&payments, &mut tx, &key).await?;
        tx.commit().await?;
        let (head, res_body) = payment_created(id, body.len()).into_parts();
        let res_body = axum::body::to_bytes(res_body, usize::MAX).await?;
        hand_complete(
            pool,
            &key,
            token,
            &StoredResponse::new(head.status, head.headers.clone(), res_body.clone()),
        )
        .await?;
        Ok::<_, BoxError>(Response::from_parts(head, axum::body::Body::from(res_body)))
    };
    match paid.await {
        Ok(res) => res,
        Err(e) => {
            eprintln!("plain by hand: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// The handler in its own transaction that also stores the key's completed record before it
/// commits, with no claim (`realistic-tx-record-only`).
async fn pay_record_only(State(payments): State<Payments>, parts: Parts, body: Bytes) -> Response {
    let Some(key) = key_of(&parts.headers).map(str::to_owned) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let mut conn = match payments.pool.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("record only: {e}");
            return problem(StatusCode::SERVICE_UNAVAILABLE);
        }
    };
    let paid = async {
        sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
        let id = pay(&payments, &mut conn, &key).await?;
        commit_with_answer(&mut conn, &key, &fp, None, payment_created(id, body.len())).await
    };
    match paid.await {
        Ok(res) => res,
        Err(e) => {
            // The transaction may still be open: close the connection rather than return it
            // to the pool.
            conn.close_on_drop();
            eprintln!("record only: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

async fn build(ctx: &Ctx, side: Side) -> Result<Built, BoxError> {
    let mut schema = PgSchema::new(ctx.args.pool).await?;
    let store = PostgresStore::new(schema.pool.clone());
    store.migrate().await?;
    sqlx::query(PAYMENTS_DDL).execute(&schema.pool).await?;
    sqlx::query(ORDERS_DDL).execute(&schema.pool).await?;
    sqlx::query(
        "INSERT INTO orders SELECT i, 1000 + i, 'open' FROM generate_series(1, $1::bigint) AS i",
    )
    .bind(i64::try_from(ORDERS)?)
    .execute(&schema.pool)
    .await?;
    // Emptied between sides; the orders stay.
    schema.tables.push("payments");
    let (provider, addr) = start_provider().await?;
    let payments = Payments {
        pool: schema.pool.clone(),
        provider: Client::builder(TokioExecutor::new()).build_http(),
        charges: format!("http://{addr}/charges").into(),
    };
    let baseline = Router::new()
        .route(PATH, post(pay_own_tx))
        .with_state(payments.clone());
    let layer = match side {
        Side::Transactional => Router::new()
            .route(PATH, post(pay_layer_tx))
            .with_state(payments)
            .layer(IdempotencyLayer::new(store.transactional())),
        Side::Phased => Router::new()
            .route(PATH, post(pay_phased))
            .with_state(payments)
            .layer(IdempotencyLayer::new(store.phased())),
        Side::PhasedByHand { async_claim } => Router::new()
            .route(PATH, post(pay_phased_by_hand))
            .with_state((payments, async_claim)),
        Side::Plain => Router::new()
            .route(PATH, post(pay_own_tx))
            .with_state(payments)
            .layer(IdempotencyLayer::new(store)),
        Side::PlainByHand => Router::new()
            .route(PATH, post(pay_plain_by_hand))
            .with_state(payments),
        Side::RecordOnly => Router::new()
            .route(PATH, post(pay_record_only))
            .with_state(payments),
    };
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: Some(Box::new(provider)),
    })
}
