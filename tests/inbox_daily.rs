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
    // Settings that would make thousands of partitions, or days the calendar cannot name,
    // are refused where they are given.
    for retention in [Duration::MAX, Duration::from_secs(3661 * 86_400)] {
        assert_eq!(
            DailyInbox::new(inbox.pool().clone(), retention).unwrap_err(),
            ConfigError::RetentionTooLong { max_days: 3660 }
        );
    }
    assert!(DailyInbox::new(inbox.pool().clone(), Duration::from_secs(3660 * 86_400)).is_ok());
    assert_eq!(
        DailyInbox::new(inbox.pool().clone(), Duration::from_secs(DAY))
            .unwrap()
            .with_days_ahead(u32::MAX)
            .unwrap_err(),
        ConfigError::TooManyDaysAhead { max: 31 }
    );
    assert!(
        DailyInbox::new(inbox.pool().clone(), Duration::from_secs(DAY))
            .unwrap()
            .with_days_ahead(31)
            .is_ok()
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

/// The partitions' days, oldest first, as their names say (`YYYYMMDD`).
async fn days(inbox: &DailyInbox) -> Vec<String> {
    let mut days: Vec<String> = sqlx::query_scalar(
        "SELECT right(c.relname::text, 8)
           FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'tower_idempotency_processed_messages_daily'::regclass",
    )
    .fetch_all(inbox.pool())
    .await
    .unwrap();
    days.sort();
    days
}

/// A day once dropped keeps its messages refused when the retention is raised: the longer
/// retention must not make the dropped day again, empty, where a redelivery (a dead-letter
/// replay, say) would be applied a second time.
#[tokio::test]
async fn a_dropped_day_stays_refused_when_the_retention_is_raised() {
    let (schema, short) = setup(2).await;
    short.maintain().await.unwrap();
    let sent = at(NOON);
    assert!(matches!(
        apply(&short, "m1", sent).await.unwrap(),
        Delivery::Processed(())
    ));
    set_clock(&short, NOON + 3 * DAY).await;
    let dropped = short.maintain().await.unwrap();
    assert!(dropped.dropped.iter().any(|p| p.ends_with("20261205")));
    // The operator raises the retention to 10 days.
    let long = DailyInbox::new(short.pool().clone(), Duration::from_secs(10 * DAY)).unwrap();
    let raised = long.maintain().await.unwrap();
    assert!(raised.created.is_empty(), "{raised:?}");
    assert_eq!(
        days(&long).await.first().map(String::as_str),
        Some("20261207")
    );
    assert!(matches!(
        apply(&long, "m1", sent).await,
        Err(InboxError::OutsideRetention)
    ));
    // A message of a day that was dropped, never seen before: refused all the same, since
    // nothing says it was not seen.
    assert!(matches!(
        apply(&long, "m2", at(NOON + DAY)).await,
        Err(InboxError::OutsideRetention)
    ));
    assert_eq!(ledger(&long).await, 1);
    // The retention grows from there on: days are kept longer, none comes back.
    set_clock(&long, NOON + 6 * DAY).await;
    let later = long.maintain().await.unwrap();
    assert!(later.dropped.is_empty(), "{later:?}");
    assert_eq!(
        days(&long).await.first().map(String::as_str),
        Some("20261207")
    );
    done(schema, short).await;
}

/// Two instances with different retentions (a rolling deploy, a mistake): whichever runs
/// `maintain` after the other, a day the shorter one dropped is never made again by the
/// longer one, and its messages are refused through both.
#[tokio::test]
async fn two_instances_with_different_retentions_never_bring_a_dropped_day_back() {
    let (schema, short) = setup(2).await;
    let long = DailyInbox::new(short.pool().clone(), Duration::from_secs(10 * DAY)).unwrap();
    long.maintain().await.unwrap();
    short.maintain().await.unwrap();
    long.maintain().await.unwrap();
    // The shorter one dropped the days past its retention, and the longer one did not make
    // them again.
    assert_eq!(
        days(&long).await.first().map(String::as_str),
        Some("20261204")
    );
    let sent = at(NOON);
    assert!(matches!(
        apply(&short, "m1", sent).await.unwrap(),
        Delivery::Processed(())
    ));
    set_clock(&short, NOON + 3 * DAY).await;
    // The longer one first: the message's day is still kept, a redelivery is a duplicate.
    long.maintain().await.unwrap();
    assert!(matches!(
        apply(&long, "m1", sent).await.unwrap(),
        Delivery::Duplicate
    ));
    // Then the shorter one drops it, and the longer one's next run does not bring it back.
    let dropped = short.maintain().await.unwrap();
    assert!(dropped.dropped.iter().any(|p| p.ends_with("20261205")));
    let again = long.maintain().await.unwrap();
    assert!(again.created.is_empty(), "{again:?}");
    for inbox in [&long, &short] {
        assert!(matches!(
            apply(inbox, "m1", sent).await,
            Err(InboxError::OutsideRetention)
        ));
    }
    assert_eq!(ledger(&long).await, 1);
    done(schema, short).await;
}

/// The database's clock jumps ahead (a bad NTP step, a VM restored) and back: the days the
/// jump dropped stay dropped, and their messages refused. (Messages of today are refused too
/// until the clock is past the jump's retention again: refused, never applied twice.)
#[tokio::test]
async fn a_clock_that_jumps_ahead_and_back_brings_no_dropped_day_back() {
    let (schema, inbox) = setup(3).await;
    inbox.maintain().await.unwrap();
    let sent = at(NOON);
    assert!(matches!(
        apply(&inbox, "m1", sent).await.unwrap(),
        Delivery::Processed(())
    ));
    set_clock(&inbox, NOON + 10 * DAY).await;
    inbox.maintain().await.unwrap();
    set_clock(&inbox, NOON).await;
    let back = inbox.maintain().await.unwrap();
    assert!(
        back.created
            .iter()
            .all(|p| p.as_str() >= "tower_idempotency_processed_messages_daily_20261213"),
        "{back:?}"
    );
    assert!(matches!(
        apply(&inbox, "m1", sent).await,
        Err(InboxError::OutsideRetention)
    ));
    assert_eq!(ledger(&inbox).await, 1);
    done(schema, inbox).await;
}

/// A schema whose partitions were made and dropped by a build without the floor: upgraded,
/// its first partition's day is the floor, so a longer retention set with the upgrade does
/// not make the days before it again.
#[tokio::test]
async fn an_upgraded_schema_takes_its_first_partition_as_the_floor() {
    let (schema, short) = setup(2).await;
    short.maintain().await.unwrap();
    assert_eq!(
        days(&short).await.first().map(String::as_str),
        Some("20261204")
    );
    // As a build without the floor left it: the partitions, no floor, no record of it.
    sqlx::raw_sql(
        "DROP TABLE tower_idempotency_daily_floor;
         DELETE FROM tower_idempotency_migrations WHERE version = 3",
    )
    .execute(short.pool())
    .await
    .unwrap();
    short.migrate().await.unwrap();
    let long = DailyInbox::new(short.pool().clone(), Duration::from_secs(10 * DAY)).unwrap();
    let upgraded = long.maintain().await.unwrap();
    assert!(upgraded.created.is_empty(), "{upgraded:?}");
    assert!(matches!(
        apply(&long, "m1", at(NOON - 3 * DAY)).await,
        Err(InboxError::OutsideRetention)
    ));
    assert!(matches!(
        apply(&long, "m2", at(NOON - DAY)).await,
        Ok(Delivery::Processed(()))
    ));
    done(schema, short).await;
}
