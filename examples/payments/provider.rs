//! The fake payment provider, behind its own idempotency layer: a charge per key.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use serde_json::Number;
use tower_idempotency::Phases;

use super::*;

/// The body of `POST /provider/charges`, as the payments service sends it.
#[derive(Serialize)]
pub(crate) struct NewCharge {
    pub(crate) amount_cents: i64,
}

/// The body of `POST /provider/charges`, as received: the amount is checked by
/// [`amount_cents`].
#[derive(Deserialize)]
pub(crate) struct ChargeRequest {
    pub(crate) amount_cents: Number,
}

#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Charge {
    pub(crate) charge_id: String,
    pub(crate) amount_cents: i64,
}

/// `POST /provider/charges`: makes a charge. Slow on purpose with `CHARGE_DELAY_MS`, to show
/// what a retry sees while the first attempt still runs (`409` and `Retry-After`). In
/// Postgres the charge row commits with the provider's key (`<key>:charge`), in the last
/// (and only) phase of the provider's request, opened after the delay.
pub(crate) async fn provider_charge(
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
pub(crate) async fn provider_charge_count(
    State(provider): State<ProviderState>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let count = provider.db.charge_count().await?;
    Ok(Json(serde_json::json!({ "count": count })))
}
