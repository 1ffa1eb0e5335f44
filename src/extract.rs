//! The axum extractor for [`IdempotencyKey`] (feature `axum`).

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::key::IdempotencyKey;

/// Rejection of the [`IdempotencyKey`] extractor: the request did not pass through an
/// [`IdempotencyLayer`](crate::IdempotencyLayer) that found a key.
///
/// This is a server bug (a handler that needs the key on a route the layer does not cover),
/// so it answers `500`. Extract `Option<IdempotencyKey>` where the key is optional.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no idempotency key in request extensions: is the route behind IdempotencyLayer?")]
pub struct MissingIdempotencyKey;

impl IntoResponse for MissingIdempotencyKey {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = MissingIdempotencyKey;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or(MissingIdempotencyKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}

#[cfg(feature = "postgres")]
mod tx {
    use super::*;
    use crate::transactional::IdempotentTx;

    /// Rejection of the [`IdempotentTx`] extractor: the route is not behind a transactional
    /// [`IdempotencyLayer`](crate::IdempotencyLayer), or the request had no key. A server bug,
    /// so it answers `500`.
    #[derive(Debug, Clone, Copy, thiserror::Error)]
    #[error(
        "no idempotent transaction: is the route behind IdempotencyLayer::new(store.transactional())?"
    )]
    pub struct MissingIdempotentTx;

    impl IntoResponse for MissingIdempotentTx {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotentTx {
        type Rejection = MissingIdempotentTx;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<IdempotentTx>()
                .cloned()
                .ok_or(MissingIdempotentTx)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotentTx {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotentTx>().cloned())
        }
    }
}

#[cfg(feature = "postgres")]
pub use tx::MissingIdempotentTx;

#[cfg(feature = "postgres")]
mod phases {
    use super::*;
    use crate::phased::Phases;

    /// Rejection of the [`Phases`] extractor: the route is not behind a phased
    /// [`IdempotencyLayer`](crate::IdempotencyLayer), or the request had no key. A server bug,
    /// so it answers `500`.
    #[derive(Debug, Clone, Copy, thiserror::Error)]
    #[error("no idempotent phases: is the route behind IdempotencyLayer::new(store.phased())?")]
    pub struct MissingPhases;

    impl IntoResponse for MissingPhases {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for Phases {
        type Rejection = MissingPhases;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<Phases>()
                .cloned()
                .ok_or(MissingPhases)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for Phases {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Phases>().cloned())
        }
    }
}

#[cfg(feature = "postgres")]
pub use phases::MissingPhases;
