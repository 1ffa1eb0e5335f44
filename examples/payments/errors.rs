//! Request bodies and errors: JSON read within its limits, and every error as problem+json.

use axum::body::Bytes;
use axum::extract::{FromRequest as _, Request};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Reads the body as JSON, whatever its `Content-Type` says (`curl -d` sends a form type).
/// Honours `DefaultBodyLimit`.
pub(crate) async fn read_json<T: DeserializeOwned>(request: Request) -> Result<T, ApiError> {
    let body = Bytes::from_request(request, &())
        .await
        .map_err(|rejection| ApiError::new(rejection.status(), rejection.body_text()))?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// An error answer of the example's own: an RFC 9457 `application/problem+json` document,
/// like the layer's.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) detail: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            detail: detail.into(),
        }
    }

    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, detail)
    }

    pub(crate) fn unprocessable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, detail)
    }

    pub(crate) fn bad_gateway(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, detail)
    }

    pub(crate) fn internal(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, detail)
    }

    /// `503`, answered with `Retry-After`: nothing was done, try again later.
    pub(crate) fn unavailable(detail: impl Into<String>) -> Self {
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
pub(crate) fn is_transient(error: &sqlx::Error) -> bool {
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
pub(crate) struct Problem<'a> {
    #[serde(rename = "type")]
    pub(crate) kind: &'a str,
    pub(crate) title: &'a str,
    pub(crate) status: u16,
    pub(crate) detail: &'a str,
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
