//! The waiting scenarios: what turning on waiting for completion
//! (`with_wait_for_completion`) costs first requests, each against the same layer without it
//! (no duplicates arrive: every key is new). `memory-new-wait` on a `MemoryStore`;
//! `pg-plain-new-notify` and `pg-tx-notify` on a `PostgresStore`, whose completions also
//! look for waiters to NOTIFY.

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tower_idempotency::{IdempotencyLayer, PostgresStore};

use crate::pg_schema::PgSchema;
use crate::scenario::{Built, Ctx, KeyPlan, PATH, Scenario, create};
use crate::transactional::{PAYMENTS_DDL, pay_in_layer_tx};
use crate::{BoxError, common};

/// The waiting scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "memory-new-wait",
        layer_side: "as memory-new, with_wait_for_completion(10 s) (no duplicates: what turning \
                     waiting on costs every first request)",
        baseline: "the layer as memory-new (waiting off)",
        target: 0.97,
        build: |ctx| Box::pin(build_memory_new_wait(ctx)),
    },
    Scenario {
        name: "pg-plain-new-notify",
        layer_side: "as pg-plain-new, with_wait_for_completion(10 s), notifications on (the \
                     default): each completion also looks for waiters to NOTIFY",
        baseline: "the layer as pg-plain-new, with_notifications(false)",
        target: 0.97,
        build: |ctx| Box::pin(build_notify(ctx, false)),
    },
    Scenario {
        name: "pg-tx-notify",
        layer_side: "as pg-tx, with_wait_for_completion(10 s), notifications on (the default): \
                     each commit also looks for waiters to NOTIFY",
        baseline: "the layer as pg-tx, with_notifications(false)",
        target: 0.97,
        build: |ctx| Box::pin(build_notify(ctx, true)),
    },
];

/// How long duplicates may wait in the `*-wait` / `*-notify` scenarios (none arrive: every
/// key is new; what is measured is the first requests' cost of the setting).
const WAIT: Duration = Duration::from_secs(10);

fn memory_wait_routers() -> (Router, Router) {
    let layer = Router::new().route(PATH, post(create)).layer(
        IdempotencyLayer::new(common::unbounded_memory_store()).with_wait_for_completion(WAIT),
    );
    let baseline = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(common::unbounded_memory_store()));
    (layer, baseline)
}

async fn build_memory_new_wait(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, baseline) = memory_wait_routers();
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: Some(memory_wait_routers),
        owned: None,
    })
}

/// The layer with notifications and waiting on, against the same layer without, on one
/// schema (plain mode, or transactional with `pg-tx`'s handler).
async fn build_notify(ctx: &Ctx, transactional: bool) -> Result<Built, BoxError> {
    let mut schema = PgSchema::new(ctx.args.pool).await?;
    let plain = PostgresStore::new(schema.pool.clone()).with_notifications(false);
    plain.migrate().await?;
    let notifying = plain.clone().with_notifications(true);
    let (layer, baseline) = if transactional {
        sqlx::query(PAYMENTS_DDL).execute(&schema.pool).await?;
        schema.tables.push("payments");
        (
            Router::new().route(PATH, post(pay_in_layer_tx)).layer(
                IdempotencyLayer::new(notifying.transactional()).with_wait_for_completion(WAIT),
            ),
            Router::new()
                .route(PATH, post(pay_in_layer_tx))
                .layer(IdempotencyLayer::new(plain.transactional())),
        )
    } else {
        (
            Router::new()
                .route(PATH, post(create))
                .layer(IdempotencyLayer::new(notifying).with_wait_for_completion(WAIT)),
            Router::new()
                .route(PATH, post(create))
                .layer(IdempotencyLayer::new(plain)),
        )
    };
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: Some(schema),
        fresh: None,
        owned: None,
    })
}
