//! The router: the payments service, its provider and its webhook receiver, each behind its
//! idempotency layer, and the toy authentication in front of them.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::{patch, post};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower::Layer as _;
use tower_idempotency::client::{IdempotentClient, ReplayBody};
use tower_idempotency::{ConfigError, IdempotencyLayer, Mode};

use super::*;

/// What the payments handlers share.
#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) db: Db,
    /// Where the payments handler charges.
    pub(crate) provider: Provider,
}

/// Where the payments service charges.
#[derive(Clone)]
pub(crate) enum Provider {
    /// `PROVIDER_URL` unset: the provider's router, layers included, called in process,
    /// exactly as a client calls it over HTTP under `/provider/charges`.
    InProcess(Router),
    /// `PROVIDER_URL` set: `POST {PROVIDER_URL}/provider/charges` over HTTP, through the
    /// crate's outbound client layer.
    Http(Arc<HttpProvider>),
}

/// The provider over HTTP: the client (the client layer over hyper-util's), and where to post.
pub(crate) struct HttpProvider {
    pub(crate) client: IdempotentClient<Client<HttpConnector, ReplayBody>>,
    pub(crate) charges: axum::http::Uri,
}

impl Provider {
    pub(crate) fn new(config: &Config, in_process: Router) -> Self {
        let Some((charges, layer)) = config.provider_charges.clone() else {
            return Self::InProcess(in_process);
        };
        let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
        Self::Http(Arc::new(HttpProvider {
            client: layer.layer(http),
            charges,
        }))
    }
}

/// What the provider's handlers share.
#[derive(Clone)]
pub(crate) struct ProviderState {
    pub(crate) db: Db,
    pub(crate) charge_delay: Duration,
}

/// The whole server: payments and orders, the fake provider, and the webhook receiver, each
/// behind its own idempotency layer (unless `IDEMPOTENCY=off`).
///
/// The three layers keep their keys in one place (in Postgres, one table); in Postgres the
/// provider's layer reaches it through the provider's own pool (`provider_store`). Each layer
/// gives its scopes its own prefix, so that a key of one service can never collide with a
/// key of another.
/// `payments_store` keeps the keys of the routes that only write to the database;
/// `calls_out` and `provider_store` those of the routes that call out or wait (in Postgres:
/// phased mode).
pub(crate) fn app<M: Mode, P: Mode>(
    config: &Config,
    storage: &Storage,
    payments_store: M,
    calls_out: P,
    provider_store: P,
) -> Result<Router, ConfigError> {
    // The settings from the environment, common to the layers.
    fn layer<M: Mode>(
        config: &Config,
        store: &M,
    ) -> Result<Option<IdempotencyLayer<M>>, ConfigError> {
        if !config.idempotency {
            return Ok(None);
        }
        Ok(Some(
            IdempotencyLayer::new(store.clone())
                .with_ttl(config.ttl)?
                .with_lease(config.lease)
                .with_store_timeout(config.store_timeout)
                .with_max_request_body(config.max_body_bytes)
                // Zero (the default) leaves waiting off: a duplicate gets 409 at once.
                .with_wait_for_completion(config.wait),
        ))
    }
    // The payments service's scope: its tenant.
    fn tenant_scope<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
        layer.with_scope(|parts| match tenant_of(parts) {
            "" => None, // the anonymous tenant: the shared scope
            tenant => Some(format!("tenant:{tenant}")),
        })
    }

    // The payment provider. Like Stripe with connected accounts, it scopes keys per tenant
    // (the account the call is made for), so two tenants' `k:charge` are different charges.
    let provider = protect(
        Router::new().route(
            "/provider/charges",
            post(provider_charge).get(provider_charge_count),
        ),
        layer(config, &provider_store)?
            .map(|l| l.with_scope(|parts| Some(format!("provider:{}", tenant_of(parts))))),
    )
    // `route_layer`s wrap the ones added before them: authentication runs first, so the
    // scope function sees the authenticated tenant.
    .route_layer(from_fn(authenticate))
    .with_state(ProviderState {
        db: storage.provider.clone(),
        charge_delay: config.charge_delay,
    });

    // The payments service. GET requests pass through the layer untouched. A retry that
    // rebuilt its JSON (members reordered, other whitespace) is the same request; another
    // value is still `422`.
    let payments = protect(
        Router::new().route("/payments", post(create_payment)),
        layer(config, &calls_out)?.map(|l| tenant_scope(l).pipe(json_fingerprint)),
    )
    .merge(protect(
        Router::new().route("/orders/{order_id}", patch(update_order).get(get_order)),
        layer(config, &payments_store)?.map(|l| tenant_scope(l).pipe(json_fingerprint)),
    ))
    .route_layer(from_fn(authenticate))
    .with_state(AppState {
        db: storage.payments.clone(),
        provider: Provider::new(config, provider.clone()),
    });

    // The webhook receiver. The provider names each event in a `webhook-id` header
    // (Standard Webhooks) and redelivers until it gets a 2xx; the layer turns redeliveries
    // into replays. The id names the event: a redelivery is the same event however its body
    // was serialised again, so the fingerprint leaves the body out (a body compared byte for
    // byte would answer 422 to a re-serialised redelivery, and the provider would go on
    // redelivering). A real receiver verifies the webhook's signature before this layer.
    let webhooks = protect(
        Router::new().route(
            "/webhooks/provider",
            post(receive_webhook).get(webhooks_processed),
        ),
        layer(config, &payments_store)?.map(|l| {
            l.with_header(HeaderName::from_static("webhook-id"))
                .with_scope(|_| Some("webhooks:provider".to_owned()))
                .with_fingerprint_fn(|parts, _body| {
                    tower_idempotency::fingerprint::fingerprint(parts, &[], &[])
                })
        }),
    )
    .with_state(storage.payments.clone());

    Ok(Router::new()
        .merge(payments)
        .merge(provider)
        .merge(webhooks)
        // Bounds what axum's extractors read, so `IDEMPOTENCY=off` answers 413 alike.
        .layer(DefaultBodyLimit::max(config.max_body_bytes)))
}

/// Fingerprints the JSON bodies of `POST /payments` and `PATCH /orders/{id}` by their
/// meaning ([`JsonFingerprint`](tower_idempotency::JsonFingerprint), RFC 8785's canonical
/// form): the handlers read JSON whatever the `Content-Type` (`curl -d` sends a form type),
/// so every body is read as JSON, and one that is not JSON is compared by its bytes.
#[cfg(feature = "json")]
pub(crate) fn json_fingerprint<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
    layer.with_json_fingerprint(tower_idempotency::JsonFingerprint::new().with_any_content_type())
}

/// Built without the crate's `json` feature: the same semantics through a fingerprint
/// function of the example's own, over `serde_json`'s reading of the body (members sorted,
/// whitespace gone; numbers as `serde_json` keeps them, which is exact for the example's
/// whole-number amounts and ids).
#[cfg(not(feature = "json"))]
pub(crate) fn json_fingerprint<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
    layer.with_fingerprint_fn(|parts, body| {
        // Tagged, so that a JSON body and a non-JSON one never share an input.
        let tagged = match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(value) => [b"json:".as_slice(), sorted(&value).to_string().as_bytes()].concat(),
            Err(_) => [b"raw:".as_slice(), body].concat(),
        };
        tower_idempotency::fingerprint::fingerprint(parts, &[], &tagged)
    })
}

/// `value` with every object's members in order of their names.
#[cfg(not(feature = "json"))]
pub(crate) fn sorted(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            members.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                members
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// `x.pipe(f)` is `f(x)`, to keep a builder chain in one expression.
pub(crate) trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}

impl<T> Pipe for T {}

/// Puts `layer` (if any) around the routes of `router`. `route_layer`, not `layer`: unknown
/// paths stay `404` instead of going through the layer (which would demand a key).
pub(crate) fn protect<S, M>(router: Router<S>, layer: Option<IdempotencyLayer<M>>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    M: Mode,
{
    match layer {
        Some(layer) => router.route_layer(layer),
        None => router,
    }
}

/// The authenticated tenant; `""` is the anonymous tenant.
#[derive(Clone, Debug)]
pub(crate) struct Tenant(pub(crate) Arc<str>);

/// The longest tenant name a bearer token may carry.
pub(crate) const MAX_TENANT_LEN: usize = 128;

/// `Authorization: Bearer <tenant>` names the tenant; no header, the anonymous tenant. Any
/// other `Authorization`, and a token that is no tenant name ([`is_tenant`]), is refused with
/// `401`, before the idempotency layer sees the request: nothing is claimed or stored for a
/// request that is refused here.
///
/// `401`, not `400`, for a malformed or over-long token: it is a bad credential (RFC 6750's
/// `invalid_token`), and a client answers a `401` by fixing its credentials, not by retrying
/// the same request.
pub(crate) async fn authenticate(mut request: Request, next: Next) -> Response {
    let tenant = match request.headers().get(AUTHORIZATION) {
        None => String::new(),
        Some(value) => match bearer_token(value) {
            Some(token) if is_tenant(token) => token.to_owned(),
            Some(_) => {
                return unauthorized(
                    format!(
                        "the bearer token names the tenant: 1 to {MAX_TENANT_LEN} characters \
                         of A-Z a-z 0-9 - . _ ~ + /, then any number of ="
                    ),
                    r#"Bearer error="invalid_token""#,
                );
            }
            None => {
                return unauthorized("expected `Authorization: Bearer <tenant>`", "Bearer");
            }
        },
    };
    request.extensions_mut().insert(Tenant(tenant.into()));
    next.run(request).await
}

/// A `401` problem with a `WWW-Authenticate` challenge.
pub(crate) fn unauthorized(detail: impl Into<String>, challenge: &'static str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, detail).into_response();
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    response
}

/// Whether `token` is a tenant name: RFC 6750's token syntax (`b64token`), at most
/// [`MAX_TENANT_LEN`] characters. The bound keeps the keys' scopes (`tenant:<name>`) small:
/// in Postgres a scope of a few thousand characters would not fit the keys' index.
pub(crate) fn is_tenant(token: &str) -> bool {
    let name = token.trim_end_matches('=');
    token.len() <= MAX_TENANT_LEN
        && !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// The token of `Bearer <token>` (the scheme is case-insensitive).
pub(crate) fn bearer_token(value: &HeaderValue) -> Option<&str> {
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The tenant that [`authenticate`] found, for the layers' scope functions.
pub(crate) fn tenant_of(parts: &Parts) -> &str {
    // `authenticate` runs before every layer that asks, so the tenant is always there.
    parts.extensions.get::<Tenant>().map_or("", |t| &t.0)
}
