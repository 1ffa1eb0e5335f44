//! The inbox against a real Postgres: message ID and work in one transaction.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgConnection;
use support::PgSchema;
use tower_idempotency::inbox::{Delivery, Inbox, InboxError};

async fn setup() -> (PgSchema, Inbox) {
    let schema = PgSchema::new().await;
    let inbox = Inbox::new(schema.pool(8).await);
    inbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE ledger (message_id text NOT NULL, amount bigint NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();
    (schema, inbox)
}

async fn ledger(inbox: &Inbox) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), coalesce(sum(amount), 0)::bigint FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .unwrap()
}

async fn charge(conn: &mut PgConnection, id: &str, amount: i64) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO ledger VALUES ($1, $2)")
        .bind(id)
        .bind(amount)
        .execute(conn)
        .await?;
    Ok(amount)
}

async fn done(schema: PgSchema, inbox: Inbox) {
    inbox.pool().close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_message_is_processed_once_per_consumer() {
    let (schema, inbox) = setup().await;
    let runs = AtomicUsize::new(0);
    for expected in [
        Delivery::Processed(5),
        Delivery::Duplicate,
        Delivery::Duplicate,
    ] {
        let got = inbox
            .process("billing", "m1", async |c: &mut PgConnection| {
                runs.fetch_add(1, Ordering::SeqCst);
                charge(c, "m1", 5).await
            })
            .await
            .unwrap();
        assert_eq!(got, expected);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Another consumer group processes the same message independently.
    let other = inbox
        .process("audit", "m1", async |_c: &mut PgConnection| {
            Ok::<_, sqlx::Error>(())
        })
        .await
        .unwrap();
    assert_eq!(other, Delivery::Processed(()));
    assert_eq!(ledger(&inbox).await, (1, 5));
    done(schema, inbox).await;
}

#[tokio::test]
async fn failed_work_rolls_back_the_id_and_the_redelivery_runs_again() {
    let (schema, inbox) = setup().await;
    let err = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            charge(c, "m1", 5).await?;
            Err::<(), _>(sqlx::Error::Protocol("work failed".into()))
        })
        .await
        .unwrap_err();
    assert!(matches!(err, InboxError::Work(_)), "{err:?}");
    assert_eq!(
        ledger(&inbox).await,
        (0, 0),
        "the half-done work was rolled back"
    );
    let again = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            charge(c, "m1", 5).await
        })
        .await
        .unwrap();
    assert_eq!(again, Delivery::Processed(5));
    assert_eq!(ledger(&inbox).await, (1, 5));
    done(schema, inbox).await;
}

#[tokio::test]
async fn invalid_message_ids_are_errors() {
    let (schema, inbox) = setup().await;
    for id in [String::new(), "x".repeat(1025)] {
        let err = inbox
            .process("c", &id, async |_c: &mut PgConnection| {
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap_err();
        assert!(matches!(err, InboxError::InvalidMessageId));
    }
    done(schema, inbox).await;
}

/// Consumer A holds the message's transaction open (slow work) while consumer B gets the
/// same message; B must wait for A's outcome.
async fn race(a_fails: bool) -> (Delivery<i64>, (i64, i64)) {
    let (schema, inbox) = setup().await;
    let a_started = Arc::new(tokio::sync::Notify::new());
    let a = {
        let inbox = inbox.clone();
        let a_started = a_started.clone();
        tokio::spawn(async move {
            inbox
                .process("billing", "m1", async |c: &mut PgConnection| {
                    charge(c, "m1", 5).await?;
                    a_started.notify_one();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if a_fails {
                        return Err(sqlx::Error::Protocol("a failed".into()));
                    }
                    Ok(5)
                })
                .await
        })
    };
    a_started.notified().await;
    let b = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            charge(c, "m1", 7).await
        })
        .await
        .unwrap();
    assert_eq!(a.await.unwrap().is_ok(), !a_fails);
    let totals = ledger(&inbox).await;
    done(schema, inbox).await;
    (b, totals)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_consumer_sees_duplicate_after_the_first_commits() {
    let (b, totals) = race(false).await;
    assert_eq!(b, Delivery::Duplicate);
    assert_eq!(totals, (1, 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_consumer_does_the_work_if_the_first_rolls_back() {
    let (b, totals) = race(true).await;
    assert_eq!(b, Delivery::Processed(7));
    assert_eq!(totals, (1, 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_deliveries_process_once() {
    let (schema, inbox) = setup().await;
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                inbox
                    .process("billing", "m1", async |c: &mut PgConnection| {
                        charge(c, "m1", 5).await
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut processed = 0;
    for t in tasks {
        if let Delivery::Processed(_) = t.await.unwrap() {
            processed += 1;
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(ledger(&inbox).await, (1, 5));
    done(schema, inbox).await;
}

#[tokio::test]
async fn purge_deletes_old_ids_in_batches() {
    let (schema, inbox) = setup().await;
    for i in 0..7 {
        let id = format!("old{i}");
        let _ = inbox
            .process("c", &id, async |_c: &mut PgConnection| {
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = inbox
        .process("c", "new", async |_c: &mut PgConnection| {
            Ok::<_, sqlx::Error>(())
        })
        .await
        .unwrap();
    assert_eq!(
        inbox
            .purge_older_than(Duration::from_millis(200), 3)
            .await
            .unwrap(),
        7
    );
    // The recent one stays: its redelivery is still a duplicate.
    let again = inbox
        .process("c", "new", async |_c: &mut PgConnection| {
            Ok::<_, sqlx::Error>(())
        })
        .await
        .unwrap();
    assert_eq!(again, Delivery::Duplicate);
    done(schema, inbox).await;
}
