//! The layer without axum: a plain hyper server over a `tower::Service`. The key is in the
//! request's extensions. `cargo run --example hyper`, then:
//!
//! ```sh
//! curl -i -X POST localhost:3000/orders -H 'Idempotency-Key: o1' -d 'two coffees'
//! ```
use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tower::{Layer, service_fn};
use tower_idempotency::body::RequestBody;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};

/// Any `tower::Service<http::Request<_>>`: it runs once per key.
async fn place_order(
    req: Request<RequestBody<hyper::body::Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let key = req
        .extensions()
        .get::<IdempotencyKey>()
        .map(ToString::to_string);
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Ok(answer(StatusCode::BAD_REQUEST, "unreadable body".into())),
    };
    let text = format!(
        "order placed for key {}: {}\n",
        key.unwrap_or_default(),
        String::from_utf8_lossy(&body)
    );
    Ok(answer(StatusCode::CREATED, text))
}

fn answer(status: StatusCode, text: String) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from(text)));
    *res.status_mut() = status;
    res
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let service = IdempotencyLayer::new(MemoryStore::new())
        .with_shared_scope()
        .layer(service_fn(place_order));
    let addr = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let served = Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                eprintln!("connection error: {e}");
            }
        });
    }
}
