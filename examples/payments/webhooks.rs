//! The webhook receiver: each provider event processed once, deduplicated on its `webhook-id`.

use axum::extract::{Request, State};
use axum::{Extension, Json};
use tower_idempotency::{IdempotencyKey, IdempotentTx};

use super::*;

/// `POST /webhooks/provider`: applies an event (any JSON) once per `webhook-id`.
///
/// In Postgres the event row commits with the key. Recording is unique per event id as well:
/// an event id names one event forever, so even a redelivery after the layer forgot the key
/// (after the TTL) is not applied twice.
pub(crate) async fn receive_webhook(
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
pub(crate) async fn webhooks_processed(
    State(db): State<Db>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let processed = db.webhooks_processed().await?;
    Ok(Json(serde_json::json!({ "processed": processed })))
}
