//! The span `Consumer::deliver` opens for each delivery: OpenTelemetry's messaging attribute
//! names, and the result recorded on it.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sqlx::PgConnection;
use support::PgSchema;
use tower_idempotency::inbox::{Consumer, Inbox, Message};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A span's name and fields.
type Seen = (String, HashMap<String, String>);

/// Every span's name and fields, in the order they were opened.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Seen>>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut spans = self.0.lock().unwrap();
        fields.insert("#id".into(), format!("{}", id.into_u64()));
        spans.push((attrs.metadata().name().to_owned(), fields));
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut spans = self.0.lock().unwrap();
        let key = format!("{}", id.into_u64());
        if let Some((_, fields)) = spans.iter_mut().rev().find(|(_, f)| f["#id"] == key) {
            values.record(&mut Fields(fields));
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn each_delivery_has_a_process_span_with_the_messaging_attributes_and_its_result() {
    let spans = Spans::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));
    let schema = PgSchema::new().await;
    let inbox = Inbox::new(schema.pool(4).await);
    inbox.migrate().await.unwrap();
    let consumer = Consumer::new(inbox.clone(), "charges")
        .unwrap()
        .with_messaging_system("nats");
    for _ in 0..2 {
        let message = Message::new(Some("m-1"))
            .destination("charges.acme")
            .redelivered(false);
        let _ = consumer
            .deliver(
                &message,
                async || Ok::<_, sqlx::Error>(()),
                async |_: &mut PgConnection, ()| Ok(()),
            )
            .await;
    }
    let seen: Vec<_> = spans
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, _)| name == "process")
        .map(|(_, f)| f.clone())
        .collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (fields, result) in seen.iter().zip(["processed", "duplicate"]) {
        for (name, value) in [
            ("messaging.system", "nats"),
            ("messaging.operation.type", "process"),
            ("messaging.consumer.group.name", "charges"),
            ("messaging.destination.name", "charges.acme"),
            ("messaging.message.id", "m-1"),
            ("tower_idempotency.result", result),
        ] {
            assert_eq!(
                fields.get(name).map(String::as_str),
                Some(value),
                "{name}: {fields:?}"
            );
        }
    }
    inbox.pool().close().await;
    schema.drop_schema().await;
}
