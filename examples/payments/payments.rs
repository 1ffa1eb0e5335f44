//! Payments and orders: the handlers of `POST /payments` (in phased mode with Postgres, the
//! provider called between its phases) and of the orders.

use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use serde_json::Number;
use tower::ServiceExt as _;
use tower_idempotency::{IDEMPOTENCY_KEY, IdempotencyKey, IdempotentTx, PhaseError, Phases};

use super::*;

/// The body of `POST /payments`. The numbers are kept as sent and checked by [`order_id`]
/// and [`amount_cents`], so that a number out of range is a `422` that says so.
#[derive(Deserialize)]
pub(crate) struct NewPayment {
    pub(crate) order_id: Number,
    pub(crate) amount_cents: Number,
}

/// The largest amount of one payment, and of one charge: 10 million in currency units.
/// Amounts are whole numbers of cents from 1 to this; others are refused with `422`.
pub(crate) const MAX_AMOUNT_CENTS: i64 = 1_000_000_000;

/// A checked `amount_cents`: a whole number from 1 to [`MAX_AMOUNT_CENTS`].
pub(crate) fn amount_cents(amount: &Number) -> Result<i64, ApiError> {
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
pub(crate) fn order_id(id: &Number) -> Result<i64, ApiError> {
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
pub(crate) fn path_order_id(id: Result<Path<String>, PathRejection>) -> Result<i64, ApiError> {
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
pub(crate) struct Payment {
    pub(crate) payment_id: String,
    pub(crate) order_id: i64,
    pub(crate) amount_cents: i64,
    pub(crate) charge_id: String,
}

#[derive(Deserialize)]
pub(crate) struct OrderUpdate {
    pub(crate) shipping_address: String,
}

#[derive(Serialize, Debug)]
pub(crate) struct Order {
    pub(crate) order_id: i64,
    /// The sum charged for the order. An `i128`, which no sum of `i64` amounts overflows in
    /// practice (it would take 2^64 payments of `i64::MAX`); with amounts bounded by
    /// [`MAX_AMOUNT_CENTS`] it stays below 2^93.
    pub(crate) total_cents: i128,
    /// The number of payments.
    pub(crate) payments: i64,
    pub(crate) shipping_address: Option<String>,
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
pub(crate) async fn create_payment(
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
pub(crate) async fn pay_in_phases(
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
pub(crate) fn phase_error<E: Into<ApiError> + std::error::Error + 'static>(
    error: PhaseError<E>,
) -> ApiError {
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
pub(crate) async fn charge_at_provider(
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
pub(crate) const PROVIDER_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// `PATCH /orders/{order_id}`: sets the shipping address, creating the order if needed. In
/// Postgres the new address commits with the key.
pub(crate) async fn update_order(
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
pub(crate) async fn get_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    order_id: Result<Path<String>, PathRejection>,
) -> Result<Json<Order>, ApiError> {
    let order_id = path_order_id(order_id)?;
    Ok(Json(state.db.order(&tenant.0, order_id).await?))
}
