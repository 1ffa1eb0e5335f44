//! The application every contender protects: `POST /orders` (and `POST /slow-orders`, the
//! same handler after a 200 ms sleep), behind a bearer-token authentication layer, served on
//! the server runtime.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The only bearer token the authentication layer accepts.
pub const TOKEN: &str = "bench";

/// How long the `/slow-orders` handler sleeps before answering.
pub const SLOW_HANDLER: Duration = Duration::from_millis(200);

/// Handler runs, read by the load (runs per request) and by the checks.
#[derive(Clone, Default)]
pub struct Counters {
    pub orders: Arc<AtomicU64>,
    pub slow_orders: Arc<AtomicU64>,
}

impl Counters {
    pub fn orders(&self) -> u64 {
        self.orders.load(Ordering::SeqCst)
    }

    pub fn slow_orders(&self) -> u64 {
        self.slow_orders.load(Ordering::SeqCst)
    }
}

#[derive(Deserialize)]
struct Order {
    #[allow(dead_code)]
    item: String,
    #[allow(dead_code)]
    qty: u32,
}

#[derive(Serialize)]
struct Created {
    id: u64,
    status: &'static str,
}

async fn create_order(State(counters): State<Counters>, Json(_order): Json<Order>) -> Response {
    let id = counters.orders.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        Json(Created {
            id,
            status: "created",
        }),
    )
        .into_response()
}

async fn create_order_slowly(
    State(counters): State<Counters>,
    Json(_order): Json<Order>,
) -> Response {
    let id = counters.slow_orders.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(SLOW_HANDLER).await;
    (
        StatusCode::CREATED,
        Json(Created {
            id,
            status: "created",
        }),
    )
        .into_response()
}

/// The routes, with their state: what each contender wraps in its layer.
pub fn routes(counters: Counters) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/slow-orders", post(create_order_slowly))
        .with_state(counters)
}

/// The authenticated principal, set by [`authenticate`] for the layers inside it.
#[derive(Clone)]
pub struct Principal(pub Arc<str>);

/// `Authorization: Bearer bench` is the principal `bench`; anything else is `401`. Applied
/// outside every contender (the baseline included), so all of them pay for it.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if token != Some(TOKEN) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    request.extensions_mut().insert(Principal(Arc::from(TOKEN)));
    next.run(request).await
}

/// A contender's router behind the authentication layer.
pub fn with_auth(router: Router) -> Router {
    router.layer(from_fn(authenticate))
}

/// A server running on the current (server) runtime.
pub struct Server {
    pub addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Serves `router` on a free port of 127.0.0.1, with `TCP_NODELAY` on every connection.
    pub async fn start(router: Router) -> Result<Self> {
        use axum::serve::ListenerExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a port on 127.0.0.1")?;
        let addr = listener.local_addr()?;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Self { addr, stop, task })
    }

    /// Stops accepting, and waits (up to 5 s) for the open connections to finish.
    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        match tokio::time::timeout(Duration::from_secs(5), self.task).await {
            Ok(joined) => joined
                .context("the server task panicked")?
                .context("the server failed"),
            Err(_) => Ok(()),
        }
    }
}
