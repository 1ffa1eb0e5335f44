//! The inbox in daily partitions against a real Postgres: duplicates caught whatever day they
//! are processed on, partitions made ahead and dropped past the retention, messages outside
//! them refused, concurrent deliveries at each isolation level. The database's clock is the
//! schema's clock hook, moved by the tests.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{AssertSqlSafe, PgConnection};
use support::PgSchema;
use tower_idempotency::ConfigError;
use tower_idempotency::inbox::{DailyInbox, Delivery, InboxError};

const DAY: u64 = 86_400;
/// 2026-12-05T12:00:00Z.
const NOON: u64 = 20_792 * DAY + DAY / 2;

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

async fn setup(retention_days: u64) -> (PgSchema, DailyInbox) {
    let schema = PgSchema::new().await;
    let pool = schema.pool(24).await;
    let inbox = DailyInbox::new(pool.clone(), Duration::from_secs(retention_days * DAY)).unwrap();
    inbox.migrate().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE ti_clock (t timestamptz NOT NULL);
         INSERT INTO ti_clock VALUES (to_timestamp({NOON}));
         CREATE OR REPLACE FUNCTION {s}.tower_idempotency_now() RETURNS timestamptz
             LANGUAGE sql STABLE AS $$ SELECT t FROM {s}.ti_clock $$;
         CREATE TABLE ledger (message_id text NOT NULL);",
        s = schema.name
    )))
    .execute(&pool)
    .await
    .unwrap();
    (schema, inbox)
}

async fn set_clock(inbox: &DailyInbox, secs: u64) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE ti_clock SET t = to_timestamp({secs})"
    )))
    .execute(inbox.pool())
    .await
    .unwrap();
}

async fn apply(
    inbox: &DailyInbox,
    id: &str,
    sent_at: SystemTime,
) -> Result<Delivery<()>, InboxError<sqlx::Error>> {
    inbox
        .process("c", id, sent_at, async |c: &mut PgConnection| {
            sqlx::query("INSERT INTO ledger VALUES ($1)")
                .bind(id)
                .execute(c)
                .await
                .map(drop)
        })
        .await
}

async fn ledger(inbox: &DailyInbox) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .unwrap()
}

async fn done(schema: PgSchema, inbox: DailyInbox) {
    inbox.pool().close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn partitions_are_made_ahead_and_dropped_past_the_retention() {
    let (schema, inbox) = setup(3).await;
    let first = inbox.maintain().await.unwrap();
    // The retention's 3 days (today and the 2 before) and 3 ahead.
    assert_eq!(
        first.created,
        (3..=8)
            .map(|d| format!("tower_idempotency_processed_messages_daily_202612{d:02}"))
            .collect::<Vec<_>>()
    );
    assert!(first.dropped.is_empty());
    assert_eq!(inbox.maintain().await.unwrap(), Default::default());
    // Two days on: the two oldest days are past the retention.
    set_clock(&inbox, NOON + 2 * DAY).await;
    let later = inbox.maintain().await.unwrap();
    assert_eq!(later.dropped.len(), 2, "{later:?}");
    assert!(later.dropped.iter().any(|p| p.ends_with("20261203")));
    assert!(later.dropped.iter().any(|p| p.ends_with("20261204")));
    assert_eq!(
        later.created,
        [
            "tower_idempotency_processed_messages_daily_20261209",
            "tower_idempotency_processed_messages_daily_20261210"
        ]
    );
    assert_eq!(
        DailyInbox::new(inbox.pool().clone(), Duration::ZERO).unwrap_err(),
        ConfigError::ZeroRetention
    );
    done(schema, inbox).await;
}

/// The day is the message's, not the processing's: a redelivery processed days later, after
/// midnight and after other days' partitions were made and dropped, is still a duplicate.
#[tokio::test]
async fn a_redelivery_on_a_later_day_is_a_duplicate_and_one_past_the_retention_is_refused() {
    let (schema, inbox) = setup(3).await;
    inbox.maintain().await.unwrap();
    let sent = at(NOON - 3600);
    assert!(matches!(
        apply(&inbox, "m1", sent).await.unwrap(),
        Delivery::Processed(())
    ));
    set_clock(&inbox, NOON + DAY + 60).await;
    inbox.maintain().await.unwrap();
    assert!(matches!(
        apply(&inbox, "m1", sent).await.unwrap(),
        Delivery::Duplicate
    ));
    // Past the retention its partition is dropped: refused, never applied again.
    set_clock(&inbox, NOON + 3 * DAY).await;
    let maintained = inbox.maintain().await.unwrap();
    assert!(maintained.dropped.iter().any(|p| p.ends_with("20261205")));
    assert!(matches!(
        apply(&inbox, "m1", sent).await,
        Err(InboxError::OutsideRetention)
    ));
    // And a producer's clock further ahead than the partitions made.
    assert!(matches!(
        apply(&inbox, "m2", at(NOON + 30 * DAY)).await,
        Err(InboxError::OutsideRetention)
    ));
    assert_eq!(ledger(&inbox).await, 1);
    done(schema, inbox).await;
}

#[tokio::test]
async fn twenty_concurrent_deliveries_apply_once() {
    let (schema, inbox) = setup(3).await;
    inbox.maintain().await.unwrap();
    let processed = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (inbox, processed) = (inbox.clone(), processed.clone());
        tasks.push(tokio::spawn(async move {
            match apply(&inbox, "race", at(NOON)).await.unwrap() {
                Delivery::Processed(()) => {
                    processed.fetch_add(1, Ordering::SeqCst);
                }
                Delivery::Duplicate => {}
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(processed.load(Ordering::SeqCst), 1);
    assert_eq!(ledger(&inbox).await, 1);
    done(schema, inbox).await;
}

/// Dropping old days never stalls deliveries: while a delivery's transaction stays open
/// (which the drop must wait for), new deliveries go on. (A plain `DROP TABLE` of a partition
/// would queue an exclusive lock on the whole table, and every new delivery behind it.)
#[tokio::test]
async fn deliveries_go_on_while_old_days_are_dropped() {
    let (schema, inbox) = setup(2).await;
    inbox.maintain().await.unwrap();
    for n in 0..200 {
        let _ = apply(&inbox, &format!("old-{n}"), at(NOON - DAY))
            .await
            .unwrap();
    }
    set_clock(&inbox, NOON + 2 * DAY).await;
    // A delivery in progress: its transaction holds the table.
    let mut open = inbox.pool().begin().await.unwrap();
    sqlx::query(
        "INSERT INTO tower_idempotency_processed_messages_daily (consumer, message_id, day)
         VALUES ('c', 'open', DATE '2026-12-07')",
    )
    .execute(&mut *open)
    .await
    .unwrap();
    let maintenance = {
        let inbox = inbox.clone();
        tokio::spawn(async move { inbox.maintain().await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New deliveries complete while the maintenance waits for the open transaction.
    tokio::time::timeout(Duration::from_secs(5), async {
        for n in 0..20 {
            let _ = apply(&inbox, &format!("new-{n}"), at(NOON + 2 * DAY))
                .await
                .unwrap();
        }
    })
    .await
    .expect("deliveries stalled behind the drop of an old day");
    open.commit().await.unwrap();
    let maintained = maintenance.await.unwrap();
    assert!(maintained.dropped.iter().any(|p| p.ends_with("20261204")));
    assert_eq!(ledger(&inbox).await, 220);
    done(schema, inbox).await;
}
