//! The inbox against a real Postgres: message ID and work in one transaction.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
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

/// A table with a unique key, for work that runs into a unique violation.
async fn create_orders(inbox: &Inbox) {
    sqlx::query("CREATE TABLE orders (id int PRIMARY KEY)")
        .execute(inbox.pool())
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders VALUES (1)")
        .execute(inbox.pool())
        .await
        .unwrap();
}

/// Whether `consumer` has `message_id` recorded as processed.
async fn recorded(inbox: &Inbox, consumer: &str, message_id: &str) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages
                         WHERE consumer = $1 AND message_id = $2)",
    )
    .bind(consumer)
    .bind(message_id)
    .fetch_one(inbox.pool())
    .await
    .unwrap()
}

/// The work catches a unique violation and returns `Ok`: Postgres aborted the transaction,
/// so its `COMMIT` rolls back. `process` must say so instead of reporting `Processed`.
#[tokio::test]
async fn work_that_swallows_a_failed_statement_is_an_error_and_the_redelivery_runs_again() {
    let (schema, inbox) = setup().await;
    create_orders(&inbox).await;
    let runs = AtomicUsize::new(0);
    let err = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            runs.fetch_add(1, Ordering::SeqCst);
            charge(c, "m1", 5).await?;
            let duplicate = sqlx::query("INSERT INTO orders VALUES (1)")
                .execute(&mut *c)
                .await
                .unwrap_err();
            let code = duplicate.as_database_error().unwrap().code();
            assert_eq!(code.as_deref(), Some("23505"));
            // "Already there": the work swallows the error.
            Ok::<_, sqlx::Error>(5)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, InboxError::Aborted), "{err:?}");
    assert_eq!(ledger(&inbox).await, (0, 0), "nothing was committed");
    assert!(
        !recorded(&inbox, "billing", "m1").await,
        "the ID is not recorded"
    );

    // The redelivery runs the work again (this time without the failing statement).
    let again = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            runs.fetch_add(1, Ordering::SeqCst);
            charge(c, "m1", 5).await
        })
        .await
        .unwrap();
    assert_eq!(again, Delivery::Processed(5));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(ledger(&inbox).await, (1, 5));
    assert!(recorded(&inbox, "billing", "m1").await);
    done(schema, inbox).await;
}

/// A savepoint is how work recovers from an expected failure: the transaction stays good.
#[tokio::test]
async fn work_that_recovers_through_a_savepoint_is_processed() {
    let (schema, inbox) = setup().await;
    create_orders(&inbox).await;
    let got = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            charge(&mut *c, "m1", 5).await?;
            let mut savepoint = sqlx::Connection::begin(&mut *c).await?;
            let duplicate = sqlx::query("INSERT INTO orders VALUES (1)")
                .execute(&mut *savepoint)
                .await;
            assert!(duplicate.is_err());
            savepoint.rollback().await?;
            Ok::<_, sqlx::Error>(5)
        })
        .await
        .unwrap();
    assert_eq!(got, Delivery::Processed(5));
    assert_eq!(ledger(&inbox).await, (1, 5));
    assert!(recorded(&inbox, "billing", "m1").await);
    done(schema, inbox).await;
}

/// The work ends the transaction itself (`ROLLBACK`): the ID went with it, so nothing
/// records the message as processed.
#[tokio::test]
async fn work_that_rolls_the_transaction_back_itself_is_an_error() {
    let (schema, inbox) = setup().await;
    let err = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            charge(&mut *c, "m1", 5).await?;
            sqlx::query("ROLLBACK").execute(&mut *c).await?;
            Ok::<_, sqlx::Error>(5)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, InboxError::Aborted), "{err:?}");
    assert_eq!(ledger(&inbox).await, (0, 0));
    assert!(!recorded(&inbox, "billing", "m1").await);
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

/// 20 deliveries of one message race, on a pool whose sessions run with
/// `default_transaction_isolation = isolation`: the work runs once, every delivery is
/// `Processed` or `Duplicate`, none fails.
///
/// Under `repeatable read` and `serializable` a delivery whose snapshot predates the
/// winner's commit gets a serialization failure (40001) from its insert of the ID instead of
/// a conflict: that too is a duplicate.
async fn concurrent_deliveries_process_once(isolation: &str) {
    const DELIVERIES: usize = 20;
    let schema = PgSchema::new().await;
    let options = PgConnectOptions::from_str(&support::database_url())
        .unwrap()
        .options([
            ("search_path", schema.name.as_str()),
            ("default_transaction_isolation", isolation),
        ]);
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(DELIVERIES).unwrap())
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap();
    let inbox = Inbox::new(pool);
    inbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE ledger (message_id text NOT NULL, amount bigint NOT NULL)")
        .execute(inbox.pool())
        .await
        .unwrap();

    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(DELIVERIES));
    let tasks: Vec<_> = (0..DELIVERIES)
        .map(|_| {
            let inbox = inbox.clone();
            let runs = runs.clone();
            let start = start.clone();
            let isolation = isolation.to_owned();
            tokio::spawn(async move {
                start.wait().await;
                inbox
                    .process("billing", "m1", async |c: &mut PgConnection| {
                        let level: String = sqlx::query_scalar("SHOW transaction_isolation")
                            .fetch_one(&mut *c)
                            .await?;
                        assert_eq!(level, isolation, "the pool's isolation level applies");
                        runs.fetch_add(1, Ordering::SeqCst);
                        // Hold the ID while the other deliveries arrive.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        charge(c, "m1", 5).await
                    })
                    .await
            })
        })
        .collect();
    let mut processed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(Delivery::Processed(5)) => processed += 1,
            Ok(Delivery::Duplicate) => {}
            other => panic!("{isolation}: a delivery failed: {other:?}"),
        }
    }
    assert_eq!(processed, 1, "{isolation}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "{isolation}: the work ran once"
    );
    assert_eq!(ledger(&inbox).await, (1, 5), "{isolation}");
    done(schema, inbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_deliveries_process_once() {
    concurrent_deliveries_process_once("read committed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_deliveries_process_once_under_repeatable_read() {
    concurrent_deliveries_process_once("repeatable read").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_deliveries_process_once_under_serializable() {
    concurrent_deliveries_process_once("serializable").await;
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

/// A redelivery that arrives while the first delivery's work is still running waits for it
/// no longer than the inbox's lock timeout: it fails (nothing committed, not to be
/// acknowledged) instead of holding a connection for as long as the first runs; once the first
/// committed, the next redelivery is a `Duplicate`. The first's work ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_during_the_first_waits_at_most_the_lock_timeout() {
    let (schema, inbox) = setup().await;
    let inbox = inbox.with_lock_timeout(Duration::from_millis(200));
    let runs = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let inbox = inbox.clone();
        let runs = runs.clone();
        tokio::spawn(async move {
            inbox
                .process("billing", "m1", async move |c: &mut PgConnection| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let amount = charge(c, "m1", 5).await?;
                    entered_tx.send(()).unwrap();
                    finish_rx.await.unwrap();
                    Ok::<_, sqlx::Error>(amount)
                })
                .await
        })
    };
    entered_rx.await.unwrap();

    let started = std::time::Instant::now();
    let second = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            runs.fetch_add(1, Ordering::SeqCst);
            charge(c, "m1", 5).await
        })
        .await;
    assert!(matches!(second, Err(InboxError::Store(_))), "{second:?}");
    // The bound is 200 ms; the margin is for a loaded machine (without the bound the
    // redelivery waits for the first, here until told to finish).
    assert!(started.elapsed() < Duration::from_secs(4));

    finish_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Delivery::Processed(5));
    let third = inbox
        .process("billing", "m1", async |c: &mut PgConnection| {
            runs.fetch_add(1, Ordering::SeqCst);
            charge(c, "m1", 5).await
        })
        .await
        .unwrap();
    assert_eq!(third, Delivery::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(ledger(&inbox).await, (1, 5));
    done(schema, inbox).await;
}

// ---------------------------------------------------------------------------------------------
// Leased claims (`Inbox::claim`), for work that calls out
// ---------------------------------------------------------------------------------------------

use tower_idempotency::inbox::Claim;

const LEASE: Duration = Duration::from_secs(30);

/// Expires every lease of the inbox, as if its worker died long ago.
async fn expire_leases(inbox: &Inbox) {
    sqlx::query(
        "UPDATE tower_idempotency_processed_messages \
            SET lease_expires_at = now() - interval '1 second' WHERE lease_token IS NOT NULL",
    )
    .execute(inbox.pool())
    .await
    .unwrap();
}

fn acquired(claim: Claim) -> tower_idempotency::inbox::MessageLease {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_message_is_in_progress_for_redeliveries_then_processed_once() {
    let (schema, inbox) = setup().await;
    let lease = acquired(inbox.claim::<()>("charges", "m1", LEASE).await.unwrap());
    // The remote call runs now: no connection is held, and a redelivery is told to wait.
    // (A connection given back reaches the pool's idle list in a task: wait for it.)
    let mut lent = usize::MAX;
    for _ in 0..40 {
        lent = inbox.pool().size() as usize - inbox.pool().num_idle();
        if lent == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(lent, 0, "a connection is held while the message is claimed");
    match inbox.claim::<()>("charges", "m1", LEASE).await.unwrap() {
        Claim::InProgress { retry_after } => {
            assert!(retry_after > Duration::from_secs(25) && retry_after <= LEASE);
        }
        other => panic!("{other:?}"),
    }
    match inbox
        .process("charges", "m1", async |c: &mut PgConnection| {
            charge(c, "m1", 1).await
        })
        .await
    {
        Err(InboxError::InProgress { .. }) => {}
        other => panic!("process while claimed: {other:?}"),
    }
    assert!(lease.renew().await.unwrap());
    let charged = lease
        .commit(async |c: &mut PgConnection| charge(c, "m1", 700).await)
        .await
        .unwrap();
    assert_eq!(charged, 700);
    assert!(matches!(
        inbox.claim::<()>("charges", "m1", LEASE).await.unwrap(),
        Claim::Duplicate
    ));
    let again = inbox
        .process("charges", "m1", async |c: &mut PgConnection| {
            charge(c, "m1", 1).await
        })
        .await
        .unwrap();
    assert_eq!(again, Delivery::Duplicate);
    assert_eq!(ledger(&inbox).await, (1, 700));
    schema.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_over_after_it_ran_out_commits_nothing() {
    let (schema, inbox) = setup().await;
    let first = acquired(inbox.claim::<()>("charges", "m2", LEASE).await.unwrap());
    // The first worker stalls past its lease; the redelivery takes the message over.
    expire_leases(&inbox).await;
    let second = acquired(inbox.claim::<()>("charges", "m2", LEASE).await.unwrap());
    assert!(!first.renew().await.unwrap(), "the first lease is lost");
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let lost = first
        .commit(async move |c: &mut PgConnection| {
            counted.fetch_add(1, Ordering::SeqCst);
            charge(c, "m2", 5).await
        })
        .await;
    assert!(matches!(lost, Err(InboxError::LeaseLost)), "{lost:?}");
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the lost lease's work never ran"
    );
    second
        .commit(async |c: &mut PgConnection| charge(c, "m2", 6).await)
        .await
        .unwrap();
    assert_eq!(ledger(&inbox).await, (1, 6));
    schema.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_failed_or_dropped_claim_frees_the_message_at_once() {
    let (schema, inbox) = setup().await;
    acquired(inbox.claim::<()>("c", "released", LEASE).await.unwrap())
        .release()
        .await
        .unwrap();
    let failed = acquired(inbox.claim::<()>("c", "released", LEASE).await.unwrap())
        .commit(async |_: &mut PgConnection| Err::<(), _>("provider down"))
        .await;
    assert!(matches!(failed, Err(InboxError::Work("provider down"))));
    drop(acquired(
        inbox.claim::<()>("c", "dropped", LEASE).await.unwrap(),
    ));
    // Released in the background after a failure or a drop.
    for id in ["released", "dropped"] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match inbox.claim::<()>("c", id, LEASE).await.unwrap() {
                Claim::Acquired(lease) => {
                    lease
                        .commit(async |c: &mut PgConnection| charge(c, id, 1).await)
                        .await
                        .unwrap();
                    break;
                }
                Claim::InProgress { .. } if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("{id}: {other:?}"),
            }
        }
    }
    assert_eq!(ledger(&inbox).await, (2, 2));
    schema.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_takes_over_a_claim_whose_worker_died() {
    let (schema, inbox) = setup().await;
    let dead = acquired(inbox.claim::<()>("c", "m3", LEASE).await.unwrap());
    expire_leases(&inbox).await;
    let done = inbox
        .process("c", "m3", async |c: &mut PgConnection| {
            charge(c, "m3", 9).await
        })
        .await
        .unwrap();
    assert_eq!(done, Delivery::Processed(9));
    assert!(matches!(
        dead.commit(async |c: &mut PgConnection| charge(c, "m3", 1).await)
            .await,
        Err(InboxError::LeaseLost)
    ));
    assert_eq!(ledger(&inbox).await, (1, 9));
    schema.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_claims_acquire_once() {
    let (schema, inbox) = setup().await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let inbox = inbox.clone();
        tasks.push(tokio::spawn(async move {
            match inbox.claim::<()>("c", "race", LEASE).await.unwrap() {
                Claim::Acquired(lease) => {
                    lease
                        .commit(async |c: &mut PgConnection| charge(c, "race", 1).await)
                        .await
                        .unwrap();
                    "acquired"
                }
                Claim::InProgress { .. } => "in progress",
                Claim::Duplicate => "duplicate",
            }
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    assert_eq!(
        outcomes.iter().filter(|&&o| o == "acquired").count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(ledger(&inbox).await, (1, 1));
    let too_long = "x".repeat(1025);
    assert!(matches!(
        inbox.claim::<()>("c", &too_long, LEASE).await,
        Err(InboxError::InvalidMessageId)
    ));
    schema.drop_schema().await;
}

/// The lease's work ends the transaction itself (`ROLLBACK`, or `sqlx::Connection::begin` on
/// its connection, whose end ends the inbox's transaction) and returns `Ok`. The claim's row
/// is committed since the claim, so a check that only asks whether the row exists would say
/// yes and the commit would answer `Ok` for work that never committed: the message would be
/// acknowledged and lost. It must be `Aborted`, and the redelivery must do the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_commit_whose_work_rolled_the_transaction_back_is_an_error() {
    let (schema, inbox) = setup().await;
    let lease = acquired(inbox.claim::<()>("charges", "m1", LEASE).await.unwrap());
    let rolled_back = lease
        .commit(async |c: &mut PgConnection| {
            charge(&mut *c, "m1", 5).await?;
            sqlx::query("ROLLBACK").execute(&mut *c).await?;
            Ok::<_, sqlx::Error>(5)
        })
        .await;
    assert!(
        matches!(rolled_back, Err(InboxError::Aborted)),
        "{rolled_back:?}"
    );
    assert_eq!(ledger(&inbox).await, (0, 0), "nothing was committed");

    // The same through an ordered commit (the statement that finishes the claim also moves
    // the key's position).
    let lease = acquired(inbox.claim::<()>("charges", "m2", LEASE).await.unwrap());
    let rolled_back = lease
        .commit_in_order("acct", 1, async |c: &mut PgConnection| {
            charge(&mut *c, "m2", 7).await?;
            sqlx::query("ROLLBACK").execute(&mut *c).await?;
            Ok::<_, sqlx::Error>(7)
        })
        .await;
    assert!(
        matches!(rolled_back, Err(InboxError::Aborted)),
        "{rolled_back:?}"
    );
    assert_eq!(ledger(&inbox).await, (0, 0));

    // The work rolled back, then (still inside it) the lease ran out and another worker took
    // the message over and committed its own work: the message is processed, but not by this
    // work, whose result must not be reported as committed.
    let first = acquired(inbox.claim::<()>("charges", "m3", LEASE).await.unwrap());
    let other = inbox.clone();
    let rolled_back = first
        .commit(async move |c: &mut PgConnection| {
            charge(&mut *c, "m3", 9).await?;
            sqlx::query("ROLLBACK").execute(&mut *c).await?;
            expire_leases(&other).await;
            acquired(other.claim::<()>("charges", "m3", LEASE).await.unwrap())
                .commit(async |c: &mut PgConnection| charge(c, "m3", 1).await)
                .await
                .unwrap();
            Ok::<_, sqlx::Error>(9)
        })
        .await;
    assert!(
        matches!(rolled_back, Err(InboxError::Aborted)),
        "{rolled_back:?}"
    );
    assert_eq!(ledger(&inbox).await, (1, 1), "only the other worker's work");

    // Work that commits the transaction itself commits the finish of the claim with it: that
    // is a commit, and it says so.
    let lease = acquired(inbox.claim::<()>("charges", "m4", LEASE).await.unwrap());
    let committed = lease
        .commit(async |c: &mut PgConnection| {
            charge(&mut *c, "m4", 2).await?;
            sqlx::query("COMMIT").execute(&mut *c).await?;
            Ok::<_, sqlx::Error>(2)
        })
        .await
        .unwrap();
    assert_eq!(committed, 2);
    assert_eq!(ledger(&inbox).await, (2, 3));

    // The redeliveries of the first two messages do the work (the failed commits' leases
    // are released in the background).
    for (id, amount) in [("m1", 5), ("m2", 7)] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match inbox.claim::<()>("charges", id, LEASE).await.unwrap() {
                Claim::Acquired(lease) => {
                    let got = lease
                        .commit(async |c: &mut PgConnection| charge(c, id, amount).await)
                        .await
                        .unwrap();
                    assert_eq!(got, amount);
                    break;
                }
                Claim::InProgress { .. } if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("{id}: {other:?}"),
            }
        }
    }
    assert_eq!(ledger(&inbox).await, (4, 15));
    for id in ["m1", "m2", "m3", "m4"] {
        assert!(matches!(
            inbox.claim::<()>("charges", id, LEASE).await.unwrap(),
            Claim::Duplicate
        ));
    }
    schema.drop_schema().await;
}

/// `process` took over a claim whose worker died (its row committed, with the dead worker's
/// token) and its work rolled the transaction back: the takeover went with it, the row is
/// the dead claim again, and the delivery must be `Aborted`, not `Processed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_that_took_over_a_claim_and_whose_work_rolled_back_is_an_error() {
    let (schema, inbox) = setup().await;
    let dead = acquired(inbox.claim::<()>("c", "m4", LEASE).await.unwrap());
    expire_leases(&inbox).await;
    let rolled_back = inbox
        .process("c", "m4", async |c: &mut PgConnection| {
            charge(&mut *c, "m4", 3).await?;
            sqlx::query("ROLLBACK").execute(&mut *c).await?;
            Ok::<_, sqlx::Error>(3)
        })
        .await;
    assert!(
        matches!(rolled_back, Err(InboxError::Aborted)),
        "{rolled_back:?}"
    );
    assert_eq!(ledger(&inbox).await, (0, 0));
    let again = inbox
        .process("c", "m4", async |c: &mut PgConnection| {
            charge(c, "m4", 3).await
        })
        .await
        .unwrap();
    assert_eq!(again, Delivery::Processed(3));
    assert_eq!(ledger(&inbox).await, (1, 3));
    drop(dead);
    schema.drop_schema().await;
}
