//! The tracing span of a keyed request: made when a subscriber wants DEBUG, with the request's
//! outcome recorded in it.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

use std::convert::Infallible;
use std::fmt;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Collects `<span name>.<field>=<value>` for the fields of every span, at creation and when
/// recorded later.
#[derive(Clone, Default)]
struct Fields(Arc<Mutex<Vec<String>>>);

struct Collect<'a> {
    span: &'a str,
    out: &'a Fields,
}

impl Visit for Collect<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field, &format!("{value:?}"));
    }
}

impl Collect<'_> {
    fn push(&self, field: &Field, value: &str) {
        let entry = format!("{}.{}={value}", self.span, field.name());
        self.out.0.lock().unwrap().push(entry);
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Fields {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let span = attrs.metadata().name();
        attrs.record(&mut Collect { span, out: self });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        values.record(&mut Collect {
            span: span.name(),
            out: self,
        });
    }
}

fn post(key: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

#[tokio::test]
async fn the_outcome_is_recorded_in_the_request_span() {
    let fields = Fields::default();
    let subscriber = tracing_subscriber::registry()
        .with(fields.clone())
        .with(LevelFilter::DEBUG);
    let _guard = tracing::subscriber::set_default(subscriber);

    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(tower::service_fn(
        |_req: Request<_>| async {
            let mut res = Response::new(Full::new(Bytes::from_static(b"made")));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        },
    ));
    for _ in 0..2 {
        let res = svc.clone().oneshot(post("k-1")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
    }

    let fields = fields.0.lock().unwrap().clone();
    let spans = fields.iter().filter(|f| f.starts_with("idempotency.key="));
    assert_eq!(spans.count(), 2, "{fields:?}");
    assert!(
        fields.contains(&"idempotency.outcome=executed".to_owned()),
        "{fields:?}"
    );
    assert!(
        fields.contains(&"idempotency.outcome=replayed".to_owned()),
        "{fields:?}"
    );
}

/// Collects the messages of `WARN` events.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == Level::WARN {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }
}

fn handler() -> impl tower::Service<
    Request<tower_idempotency::body::RequestBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(|_req| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) })
}

/// A layer built without a scope warns once (not per service it wraps, nor per request);
/// a scoped layer, and one that opted into the shared scope, do not.
#[tokio::test]
async fn a_layer_without_a_scope_warns_once() {
    let warnings = Warnings::default();
    let subscriber = tracing_subscriber::registry().with(warnings.clone());
    let _guard = tracing::subscriber::set_default(subscriber);
    let taken = || std::mem::take(&mut *warnings.0.lock().unwrap());

    let unscoped = IdempotencyLayer::new(MemoryStore::new());
    let svc = unscoped.layer(handler());
    let _second = unscoped.clone().layer(handler()); // e.g. axum applies it per route
    for key in ["k-1", "k-2"] {
        svc.clone().oneshot(post(key)).await.unwrap();
    }
    let warned = taken();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("without a scope"), "{warned:?}");

    IdempotencyLayer::new(MemoryStore::new())
        .with_scope(|_| Some("tenant".to_owned()))
        .layer(handler());
    IdempotencyLayer::new(MemoryStore::new())
        .with_shared_scope()
        .layer(handler());
    assert_eq!(taken(), Vec::<String>::new());
}
