//! How the layer runs a keyed request: plain mode on any [`Store`], or (feature `postgres`)
//! transactional mode on [`Transactional`](crate::Transactional).

use std::future::Future;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::error::BoxError;
use crate::plain::run_plain;
use crate::request::Keyed;
use crate::store::Store;

/// What an [`IdempotencyLayer`](crate::IdempotencyLayer) keeps its keys in, and so how it
/// runs a keyed request.
///
/// - Every [`Store`] runs in **plain mode**: claim the key, run the handler, store its answer.
///   The handler's own writes and the key's record are committed separately, so a crash
///   between the two is covered by the lease (the handler may run again after it).
/// - [`Transactional`](crate::Transactional) (from
///   [`PostgresStore::transactional`](crate::PostgresStore::transactional)) runs in
///   **transactional mode**: the key's record and the handler's writes commit in one
///   Postgres transaction.
///
/// This trait is sealed; implement [`Store`] to bring your own storage.
pub trait Mode: Sealed + Clone + Send + Sync + 'static {}

impl<St: Store> Mode for St {}

pub(crate) use private::Sealed;

// The sealed-trait pattern: `Sealed` is public in name only, so no other crate can implement
// `Mode`, and its method can use the crate's private types.
#[allow(unreachable_pub, private_interfaces)]
mod private {
    use super::*;

    pub trait Sealed {
        fn execute<S, ReqBody, ResBody>(
            self,
            keyed: Keyed,
            inner: S,
            req: Request<ReqBody>,
        ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>> + Send
        where
            S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
                + Send
                + 'static,
            S::Future: Send + 'static,
            S::Error: Send + 'static,
            ReqBody: Body<Data = Bytes> + Send + 'static,
            ReqBody::Error: Into<BoxError>,
            ResBody: Body<Data = Bytes> + Send + 'static,
            ResBody::Error: Send + 'static;
    }

    impl<St: Store> Sealed for St {
        fn execute<S, ReqBody, ResBody>(
            self,
            keyed: Keyed,
            inner: S,
            req: Request<ReqBody>,
        ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>> + Send
        where
            S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
                + Send
                + 'static,
            S::Future: Send + 'static,
            S::Error: Send + 'static,
            ReqBody: Body<Data = Bytes> + Send + 'static,
            ReqBody::Error: Into<BoxError>,
            ResBody: Body<Data = Bytes> + Send + 'static,
            ResBody::Error: Send + 'static,
        {
            run_plain(self, keyed, inner, req)
        }
    }
}
