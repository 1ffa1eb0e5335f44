//! The inbox's consumer path against a real Postgres: positions (in order, stale, where to
//! resume), `Consumer::deliver` (claim, lease renewal, ordered commit, counted failures,
//! parking), and settings refused where they are given.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgConnection;
use support::PgSchema;
use tower_idempotency::ConfigError;
use tower_idempotency::inbox::{Consumer, Inbox, Message, Ordered, Outcome, Settle};

async fn setup() -> (PgSchema, Inbox) {
    let schema = PgSchema::new().await;
    let inbox = Inbox::new(schema.pool(24).await);
    inbox.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE applied (n bigserial PRIMARY KEY, key text NOT NULL, position bigint NOT NULL)",
    )
    .execute(inbox.pool())
    .await
    .unwrap();
    (schema, inbox)
}

async fn done(schema: PgSchema, inbox: Inbox) {
    inbox.pool().close().await;
    schema.drop_schema().await;
}

async fn apply(conn: &mut PgConnection, key: &str, position: i64) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO applied (key, position) VALUES ($1, $2)")
        .bind(key)
        .bind(position)
        .execute(conn)
        .await?;
    Ok(position)
}

/// The positions applied, in commit order.
async fn applied(inbox: &Inbox) -> Vec<i64> {
    sqlx::query_scalar("SELECT position FROM applied ORDER BY n")
        .fetch_all(inbox.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn positions_apply_forward_only_and_say_where_to_resume() {
    let (schema, inbox) = setup().await;
    assert_eq!(inbox.position("c", "p0").await.unwrap(), None);
    for (position, want) in [
        (1, Ordered::Applied(1)),
        (1, Ordered::Stale),
        (3, Ordered::Applied(3)),
        (2, Ordered::Stale),
        (4, Ordered::Applied(4)),
    ] {
        let got = inbox
            .process_in_order("c", "p0", position, async |c: &mut PgConnection| {
                apply(c, "p0", position).await
            })
            .await
            .unwrap();
        assert_eq!(got, want, "position {position}");
    }
    assert_eq!(applied(&inbox).await, [1, 3, 4]);
    assert_eq!(inbox.position("c", "p0").await.unwrap(), Some(4));
    // Per consumer and per key.
    assert_eq!(inbox.position("other", "p0").await.unwrap(), None);
    assert_eq!(inbox.position("c", "p1").await.unwrap(), None);
    // Failed work moves nothing.
    let failed = inbox
        .process_in_order("c", "p0", 9, async |_: &mut PgConnection| {
            Err::<(), _>("refused")
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(inbox.position("c", "p0").await.unwrap(), Some(4));
    let bad = inbox
        .process_in_order("c", "", 1, async |_: &mut PgConnection| Ok::<_, ()>(()))
        .await;
    assert!(matches!(
        bad,
        Err(tower_idempotency::inbox::InboxError::InvalidOrderKey)
    ));
    done(schema, inbox).await;
}

/// Twenty deliveries of one key race, at random positions: whatever order they commit in,
/// the positions applied only ever increase, and the last one is the highest.
#[tokio::test]
async fn racing_deliveries_of_one_key_never_apply_out_of_order() {
    let (schema, inbox) = setup().await;
    let positions: Vec<i64> = (1..=20).map(|n| (n * 7919) % 23).collect();
    let mut tasks = Vec::new();
    for position in positions.clone() {
        let inbox = inbox.clone();
        tasks.push(tokio::spawn(async move {
            // Under SERIALIZABLE the work's statements or the commit may still fail with a
            // serialization failure: nothing committed, delivered again, as a broker would.
            for _ in 0..40 {
                let done = inbox
                    .process_in_order("c", "k", position, async |c: &mut PgConnection| {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        apply(c, "k", position).await
                    })
                    .await;
                match done {
                    Ok(ordered) => return ordered,
                    Err(e) if format!("{e:?}").contains("40001") => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
            panic!("position {position} never settled");
        }));
    }
    for t in tasks {
        let _ = t.await.unwrap();
    }
    let seen = applied(&inbox).await;
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    let max = *positions.iter().max().unwrap();
    assert_eq!(seen.last(), Some(&max));
    assert_eq!(inbox.position("c", "k").await.unwrap(), Some(max));
    done(schema, inbox).await;
}

fn consumer(inbox: &Inbox) -> Consumer {
    Consumer::new(inbox.clone(), "charges")
        .unwrap()
        .with_max_failures(3)
        .unwrap()
        .with_retry_backoff(Duration::from_millis(100), Duration::from_millis(150))
}

#[tokio::test]
async fn deliver_processes_once_skips_duplicates_and_stale_without_calling_out() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox);
    let calls = AtomicUsize::new(0);
    let deliver = async |id: &str, position: i64| {
        let message = Message::new(Some(id)).ordered("acct", position);
        consumer
            .deliver(
                &message,
                async || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, sqlx::Error>(position)
                },
                async |c: &mut PgConnection, p| apply(c, "acct", p).await,
            )
            .await
    };
    assert_eq!(deliver("m1", 1).await, Outcome::Processed(1));
    assert_eq!(deliver("m2", 2).await, Outcome::Processed(2));
    // A seen ID is a duplicate, even at a stale position.
    assert_eq!(deliver("m1", 1).await, Outcome::Duplicate);
    // A new ID at an applied position is stale, and the remote work is not called.
    let before = calls.load(Ordering::SeqCst);
    assert_eq!(deliver("m3", 2).await, Outcome::Stale);
    assert_eq!(calls.load(Ordering::SeqCst), before);
    // Recorded: its redelivery is a duplicate.
    assert_eq!(deliver("m3", 2).await, Outcome::Duplicate);
    assert_eq!(applied(&inbox).await, [1, 2]);
    assert_eq!(consumer.position("acct").await.unwrap(), Some(2));
    for outcome in [Outcome::Processed(1), Outcome::Duplicate, Outcome::Stale] {
        assert_eq!(outcome.settle(), Settle::Ack);
    }
    done(schema, inbox).await;
}

#[tokio::test]
async fn failed_attempts_are_counted_backed_off_and_parked_at_the_limit() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox);
    let calls = AtomicUsize::new(0);
    let payload = br#"{"amount": 5}"#;
    let deliver = async |fail_in_db: bool| {
        let message = Message::new(Some("poison"))
            .ordered("acct", 1)
            .payload(payload);
        consumer
            .deliver(
                &message,
                async || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    if fail_in_db {
                        Ok(())
                    } else {
                        Err("the provider refused".to_owned())
                    }
                },
                async |c: &mut PgConnection, ()| {
                    apply(c, "acct", 1).await.map_err(|e| e.to_string())?;
                    Err::<(), _>("the ledger refused".to_owned())
                },
            )
            .await
    };
    let first = deliver(false).await;
    assert_eq!(
        first,
        Outcome::Failed {
            attempts: 1,
            reason: "the provider refused".into(),
            retry_after: Duration::from_millis(100)
        }
    );
    assert_eq!(first.settle(), Settle::Retry(Duration::from_millis(100)));
    assert_eq!(first.result(), "failed");
    // A failure of the database part counts too, and its writes roll back.
    let second = deliver(true).await;
    assert_eq!(
        second,
        Outcome::Failed {
            attempts: 2,
            reason: "the ledger refused".into(),
            retry_after: Duration::from_millis(150)
        }
    );
    let third = deliver(false).await;
    assert_eq!(
        third,
        Outcome::Parked {
            attempts: 3,
            reason: "the provider refused".into()
        }
    );
    assert_eq!(third.settle(), Settle::Ack);
    // Parked: never applied, never tried again.
    assert_eq!(deliver(false).await, Outcome::Duplicate);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert!(applied(&inbox).await.is_empty());
    assert_eq!(consumer.position("acct").await.unwrap(), None);
    let dead = inbox.dead_letters("charges", 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "poison");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].reason, "the provider refused");
    assert_eq!(dead[0].payload.as_deref(), Some(&payload[..]));
    assert!(inbox.dead_letters("another", 10).await.unwrap().is_empty());
    done(schema, inbox).await;
}

/// Remote work three times longer than the lease: renewed, so a redelivery meanwhile is
/// told the message is in progress, and the work commits once.
#[tokio::test]
async fn a_lease_is_renewed_while_remote_work_outlasts_it() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox)
        .with_lease(Duration::from_millis(300))
        .unwrap();
    let message = Message::new(Some("slow")).ordered("acct", 1);
    let started = Arc::new(tokio::sync::Notify::new());
    let first = {
        let consumer = consumer.clone();
        let started = started.clone();
        tokio::spawn(async move {
            let message = Message::new(Some("slow")).ordered("acct", 1);
            consumer
                .deliver(
                    &message,
                    async || {
                        started.notify_one();
                        tokio::time::sleep(Duration::from_millis(900)).await;
                        Ok::<_, sqlx::Error>(())
                    },
                    async |c: &mut PgConnection, ()| apply(c, "acct", 1).await,
                )
                .await
        })
    };
    started.notified().await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let again = consumer
            .deliver(
                &message,
                async || Ok::<_, sqlx::Error>(()),
                async |c: &mut PgConnection, ()| apply(c, "acct", 1).await,
            )
            .await;
        assert!(
            matches!(again, Outcome::InProgress { .. } | Outcome::Duplicate),
            "{again:?}"
        );
    }
    assert_eq!(first.await.unwrap(), Outcome::Processed(1));
    assert_eq!(applied(&inbox).await, [1]);
    done(schema, inbox).await;
}

/// The remote work is polled while a renewal runs: a renewal held up by the database (here
/// its row locked by another transaction for 3 s) does not freeze the remote call (its
/// stream unread, its heartbeats unanswered) for as long, and it is bounded by a third of the
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_work_goes_on_while_a_renewal_waits_for_the_database() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox)
        .with_lease(Duration::from_millis(1500))
        .unwrap();
    let claimed = Arc::new(tokio::sync::Notify::new());
    let locked = Arc::new(tokio::sync::Notify::new());
    let delivery = {
        let consumer = consumer.clone();
        let (claimed, locked) = (claimed.clone(), locked.clone());
        tokio::spawn(async move {
            let message = Message::new(Some("heartbeat"));
            consumer
                .deliver(
                    &message,
                    async move || {
                        claimed.notify_one();
                        locked.notified().await;
                        // A remote call that must be polled every 50 ms: the longest gap
                        // between two of its ticks is the longest it was left unpolled.
                        let mut ticks = tokio::time::interval(Duration::from_millis(50));
                        let mut last = tokio::time::Instant::now();
                        let mut gap = Duration::ZERO;
                        for _ in 0..80 {
                            ticks.tick().await;
                            gap = gap.max(last.elapsed());
                            last = tokio::time::Instant::now();
                        }
                        Ok::<_, sqlx::Error>(gap)
                    },
                    async |c: &mut PgConnection, gap: Duration| {
                        apply(c, "hb", 1).await.map(|_| gap)
                    },
                )
                .await
        })
    };
    claimed.notified().await;
    // Another transaction holds the message's row: the renewals wait for its lock.
    let mut blocker = inbox.pool().begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM tower_idempotency_processed_messages WHERE message_id = 'heartbeat' \
         FOR UPDATE",
    )
    .execute(&mut *blocker)
    .await
    .unwrap();
    locked.notify_one();
    tokio::time::sleep(Duration::from_secs(3)).await;
    blocker.rollback().await.unwrap();
    let outcome = delivery.await.unwrap();
    let Outcome::Processed(gap) = outcome else {
        panic!("{outcome:?}");
    };
    assert!(
        gap < Duration::from_millis(1500),
        "the remote work was left unpolled for {gap:?} while a renewal waited"
    );
    done(schema, inbox).await;
}

/// A delivery whose commit the server refuses with a serialization failure (here raised once
/// by a trigger on the finish of the claim) committed nothing, for sure: its claim is given
/// back, and the redelivery right after is processed, not `InProgress` until the lease runs
/// out.
#[tokio::test]
async fn a_commit_refused_by_a_serialization_failure_gives_the_claim_back() {
    let (schema, inbox) = setup().await;
    sqlx::raw_sql(
        "CREATE SEQUENCE refusals; -- a sequence: its count survives the rollback it causes
         CREATE FUNCTION refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.lease_token IS NOT NULL AND NEW.lease_token IS NULL
                AND nextval('refusals') = 1 THEN
                 RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_finish BEFORE UPDATE ON tower_idempotency_processed_messages
             FOR EACH ROW EXECUTE FUNCTION refuse_finish();",
    )
    .execute(inbox.pool())
    .await
    .unwrap();
    let consumer = consumer(&inbox)
        .with_lease(Duration::from_secs(60))
        .unwrap();
    let message = Message::new(Some("refused"));
    let deliver = || {
        consumer.deliver(
            &message,
            async || Ok::<_, sqlx::Error>(()),
            async |c: &mut PgConnection, ()| apply(c, "r", 1).await,
        )
    };
    let first = deliver().await;
    assert!(
        matches!(first, Outcome::Failed { attempts: 0, .. }),
        "{first:?}"
    );
    let again = deliver().await;
    assert_eq!(again, Outcome::Processed(1));
    assert_eq!(applied(&inbox).await, [1]);
    done(schema, inbox).await;
}

#[tokio::test]
async fn unusable_deliveries_are_rejected_and_settings_refused() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox);
    let long = "k".repeat(1025);
    for message in [
        Message::new(None),
        Message::new(Some("")),
        Message::new(Some(&long)),
        Message::new(Some("m")).ordered(&long, 1),
        Message::new(Some("m")).ordered("", 1),
    ] {
        let outcome = consumer
            .deliver(
                &message,
                async || Ok::<_, sqlx::Error>(()),
                async |_: &mut PgConnection, ()| Ok(()),
            )
            .await;
        assert!(matches!(outcome, Outcome::Rejected { .. }), "{outcome:?}");
        assert_eq!(outcome.settle(), Settle::Reject);
    }
    let refused: Outcome<()> = consumer.reject(&Message::new(Some("m")), "not JSON");
    assert_eq!(refused.result(), "rejected");
    assert_eq!(
        Consumer::new(inbox.clone(), "").unwrap_err(),
        ConfigError::InvalidConsumerName
    );
    assert_eq!(
        Consumer::new(inbox.clone(), "c".repeat(201)).unwrap_err(),
        ConfigError::InvalidConsumerName
    );
    assert_eq!(
        consumer.clone().with_lease(Duration::ZERO).unwrap_err(),
        ConfigError::ZeroLease
    );
    assert_eq!(
        consumer.clone().with_max_failures(0).unwrap_err(),
        ConfigError::ZeroMaxFailures
    );
    done(schema, inbox).await;
}

/// The database down: a failure that is not the work's, not counted, retried.
#[tokio::test]
async fn a_database_failure_is_retried_and_not_counted() {
    let (schema, inbox) = setup().await;
    // The pool closed: every statement fails at once.
    let closed = Inbox::new(inbox.pool().clone());
    closed.pool().close().await;
    let broken = Consumer::new(closed, "charges").unwrap();
    let outcome = broken
        .deliver(
            &Message::new(Some("m")),
            async || Ok::<_, sqlx::Error>(()),
            async |_: &mut PgConnection, ()| Ok(()),
        )
        .await;
    let Outcome::Failed { attempts, .. } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(attempts, 0);
    let fresh = schema.pool(1).await;
    let failures: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tower_idempotency_message_failures")
            .fetch_one(&fresh)
            .await
            .unwrap();
    assert_eq!(failures, 0);
    fresh.close().await;
    schema.drop_schema().await;
}

/// `Consumer::process`: the same outcomes in one commit (no lease), for work that stays in
/// the database.
#[tokio::test]
async fn process_applies_in_one_commit_with_the_same_outcomes() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox);
    let process = async |id: &str, position: i64, fail: bool| {
        consumer
            .process(
                &Message::new(Some(id))
                    .ordered("acct", position)
                    .payload(b"p"),
                async |c: &mut PgConnection| {
                    let applied = apply(c, "acct", position)
                        .await
                        .map_err(|e| e.to_string())?;
                    if fail {
                        return Err("the ledger refused".to_owned());
                    }
                    Ok(applied)
                },
            )
            .await
    };
    assert_eq!(process("m1", 1, false).await, Outcome::Processed(1));
    assert_eq!(process("m1", 1, false).await, Outcome::Duplicate);
    assert_eq!(process("m2", 1, false).await, Outcome::Stale);
    assert_eq!(process("m2", 1, false).await, Outcome::Duplicate);
    for attempts in 1..=2 {
        let failed = process("bad", 5, true).await;
        assert!(
            matches!(failed, Outcome::Failed { attempts: a, .. } if a == attempts),
            "{failed:?}"
        );
    }
    assert_eq!(
        process("bad", 5, true).await,
        Outcome::Parked {
            attempts: 3,
            reason: "the ledger refused".into()
        }
    );
    assert_eq!(process("bad", 5, false).await, Outcome::Duplicate);
    assert_eq!(applied(&inbox).await, [1]);
    assert_eq!(consumer.position("acct").await.unwrap(), Some(1));
    assert_eq!(inbox.dead_letters("charges", 10).await.unwrap().len(), 1);

    // Ten at once: one applies, the others wait for its commit and are duplicates.
    let outcomes = futures_util::future::join_all((0..10).map(|_| process("m3", 2, false))).await;
    let processed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Processed(_)))
        .count();
    assert_eq!(processed, 1, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Processed(_) | Outcome::Duplicate)),
        "{outcomes:?}"
    );
    assert_eq!(applied(&inbox).await, [1, 2]);
    done(schema, inbox).await;
}

/// A purge drops the failure counts of messages not parked, and keeps the dead letters.
#[tokio::test]
async fn a_purge_drops_old_failure_counts_and_keeps_dead_letters() {
    let (schema, inbox) = setup().await;
    let consumer = consumer(&inbox);
    let fail = async |id: &str| {
        consumer
            .process(&Message::new(Some(id)), async |_: &mut PgConnection| {
                Err::<(), _>("refused")
            })
            .await
    };
    let _ = fail("transient").await;
    for _ in 0..3 {
        let _ = fail("poison").await;
    }
    let counts = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM tower_idempotency_message_failures")
            .fetch_one(inbox.pool())
            .await
            .unwrap()
    };
    assert_eq!(counts().await, 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    inbox.purge_older_than(Duration::ZERO, 1).await.unwrap();
    assert_eq!(counts().await, 1);
    let dead = inbox.dead_letters("charges", 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "poison");
    done(schema, inbox).await;
}

/// Twenty messages of one key, each with an ID of its own, at positions in random order, sent
/// at once through `send(consumer, id, position)`; each delivery is repeated while it is
/// `Failed` by a serialization failure (under `SERIALIZABLE` the work's own statements may
/// fail so; the consumer counts none of them) or `InProgress`, as a broker would deliver it
/// again. Every message ends `Processed` or `Stale` (never `Parked`), and the positions applied
/// only ever increase.
async fn race_on_one_key<F>(send: F)
where
    F: AsyncFn(Consumer, String, i64) -> Outcome<i64>,
{
    let (schema, inbox) = setup().await;
    // The default limit of failures: a serialization failure of the work says nothing about
    // the message, so it is never counted, and no message is parked however often it loses.
    let consumer = Consumer::new(inbox.clone(), "charges").unwrap();
    let positions: Vec<i64> = (1..=20).map(|n| (n * 7919) % 23).collect();
    let outcomes = futures_util::future::join_all(positions.iter().map(|&position| {
        let (consumer, send) = (consumer.clone(), &send);
        async move {
            let id = format!("m-{position}");
            // A broker redelivers until the message settles: the race decides the order in
            // which they do, not whether (a generous bound, so that a busy machine, where
            // each lost race takes longer, does not read as a message that never settles).
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while std::time::Instant::now() < deadline {
                let outcome = send(consumer.clone(), id.clone(), position).await;
                match &outcome {
                    Outcome::Failed { reason, .. } if reason.contains("could not serialize") => {}
                    Outcome::InProgress { .. } => {}
                    _ => return outcome,
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("{id} never settled");
        }
    }))
    .await;
    for outcome in &outcomes {
        assert!(
            matches!(outcome, Outcome::Processed(_) | Outcome::Stale),
            "{outcome:?}"
        );
    }
    let seen = applied(&inbox).await;
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!(seen.last(), positions.iter().max());
    done(schema, inbox).await;
}

/// The race through `Consumer::process` (the ID and the position recorded in one call).
#[tokio::test]
async fn racing_messages_of_one_key_through_process_never_apply_out_of_order() {
    race_on_one_key(async |consumer: Consumer, id: String, position: i64| {
        consumer
            .process(
                &Message::new(Some(&id)).ordered("k", position),
                async |c: &mut PgConnection| apply(c, "k", position).await,
            )
            .await
    })
    .await;
}

/// The race through `Consumer::deliver` (leased claims, the position moved in the statement
/// that finishes the claim).
#[tokio::test]
async fn racing_messages_of_one_key_through_deliver_never_apply_out_of_order() {
    race_on_one_key(async |consumer: Consumer, id: String, position: i64| {
        consumer
            .deliver(
                &Message::new(Some(&id)).ordered("k", position),
                async || Ok::<_, sqlx::Error>(()),
                async |c: &mut PgConnection, ()| apply(c, "k", position).await,
            )
            .await
    })
    .await;
}

/// How one attempt of the work fails, in the database, the way contention and failovers make
/// statements fail: a serialization failure, a deadlock, the connection's server process
/// terminated (a failover, `pg_terminate_backend`), or a lock not granted in time.
async fn fail_as(c: &mut PgConnection, how: &str) -> Result<(), sqlx::Error> {
    let sql = match how {
        "terminated" => "SELECT pg_terminate_backend(pg_backend_pid())".to_owned(),
        code => format!("DO $$ BEGIN RAISE EXCEPTION 'as told' USING ERRCODE = '{code}'; END $$"),
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(c)
        .await
        .map(drop)
}

/// An application's error that keeps the database's as its source.
#[derive(Debug)]
struct LedgerError(sqlx::Error);

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the ledger failed")
    }
}

impl std::error::Error for LedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The default consumer (parked after 5 counted failures): work whose statements fail more
/// often than that, each time in a way that says nothing about the message, is delivered
/// again each time and applied in the end, through `process` and through `deliver`. A
/// failure of the work's own is still counted.
#[tokio::test]
async fn transient_database_failures_of_the_work_are_retried_and_not_counted() {
    let (schema, inbox) = setup().await;
    let consumer = Consumer::new(inbox.clone(), "charges").unwrap();
    // Six in a row, past the default limit of five; one wrapped in the application's error.
    let failures = ["40001", "40P01", "terminated", "40001", "55P03", "wrapped"];
    let attempt = async |c: &mut PgConnection, n: usize, position: i64| -> Result<i64, BoxError> {
        match failures.get(n) {
            Some(&"wrapped") => Err(LedgerError(fail_as(c, "40001").await.unwrap_err()).into()),
            Some(how) => Err(fail_as(c, how).await.unwrap_err().into()),
            None => Ok(apply(c, "acct", position).await?),
        }
    };
    for (n, _) in failures.iter().enumerate() {
        let processed = consumer
            .process(
                &Message::new(Some("m-process")).ordered("acct", 1),
                async |c: &mut PgConnection| attempt(c, n, 1).await,
            )
            .await;
        let delivered = consumer
            .deliver(
                &Message::new(Some("m-deliver")).ordered("acct", 2),
                async || Ok::<_, BoxError>(()),
                async |c: &mut PgConnection, ()| attempt(c, n, 2).await,
            )
            .await;
        for outcome in [processed, delivered] {
            assert!(
                matches!(outcome, Outcome::Failed { attempts: 0, .. }),
                "{}: {outcome:?}",
                failures[n]
            );
            assert!(matches!(outcome.settle(), Settle::Retry(_)));
        }
    }
    let failure_rows = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM tower_idempotency_message_failures")
            .fetch_one(inbox.pool())
            .await
            .unwrap()
    };
    assert_eq!(failure_rows().await, 0, "no failure was counted");
    let n = failures.len();
    let processed = consumer
        .process(
            &Message::new(Some("m-process")).ordered("acct", 1),
            async |c: &mut PgConnection| attempt(c, n, 1).await,
        )
        .await;
    assert_eq!(processed, Outcome::Processed(1));
    let delivered = consumer
        .deliver(
            &Message::new(Some("m-deliver")).ordered("acct", 2),
            async || Ok::<_, BoxError>(()),
            async |c: &mut PgConnection, ()| attempt(c, n, 2).await,
        )
        .await;
    assert_eq!(delivered, Outcome::Processed(2));
    assert_eq!(applied(&inbox).await, [1, 2]);
    assert!(inbox.dead_letters("charges", 10).await.unwrap().is_empty());

    // A failure that is the work's own (a constraint, here) is counted as before.
    let counted = consumer
        .process(
            &Message::new(Some("m-bad")),
            async |c: &mut PgConnection| fail_as(c, "23505").await.map_err(BoxError::from),
        )
        .await;
    assert!(
        matches!(counted, Outcome::Failed { attempts: 1, .. }),
        "{counted:?}"
    );
    assert_eq!(failure_rows().await, 1);
    done(schema, inbox).await;
}

/// The provider answers "busy" (a failure that says nothing about the message) more often
/// than the limit: a consumer told so by its classifier retries it uncounted and applies the
/// message in the end; the default classifier counts it and parks the message.
#[tokio::test]
async fn with_transient_classifies_the_applications_own_failures() {
    #[derive(Debug)]
    struct ProviderBusy;
    impl std::fmt::Display for ProviderBusy {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the provider is busy")
        }
    }
    impl std::error::Error for ProviderBusy {}

    let (schema, inbox) = setup().await;
    let told = Consumer::new(inbox.clone(), "told")
        .unwrap()
        .with_transient(|e| {
            e.downcast_ref::<ProviderBusy>().is_some()
                || tower_idempotency::inbox::is_transient_database_error(e)
        });
    let default = Consumer::new(inbox.clone(), "default").unwrap();
    let deliver = async |consumer: &Consumer, busy: bool| {
        consumer
            .deliver(
                &Message::new(Some("m")),
                async || {
                    if busy {
                        return Err(BoxError::from(ProviderBusy));
                    }
                    Ok(())
                },
                async |c: &mut PgConnection, ()| {
                    apply(c, consumer.name(), 1).await?;
                    // The classifier replaces the default one; this one keeps it.
                    Ok::<_, BoxError>(())
                },
            )
            .await
    };
    for _ in 0..6 {
        let outcome = deliver(&told, true).await;
        assert!(
            matches!(&outcome, Outcome::Failed { attempts: 0, reason, .. } if reason == "the provider is busy"),
            "{outcome:?}"
        );
    }
    assert_eq!(deliver(&told, false).await, Outcome::Processed(()));
    for attempts in 1..5 {
        let outcome = deliver(&default, true).await;
        assert!(
            matches!(outcome, Outcome::Failed { attempts: a, .. } if a == attempts),
            "{outcome:?}"
        );
    }
    assert!(matches!(
        deliver(&default, true).await,
        Outcome::Parked { attempts: 5, .. }
    ));
    let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM applied ORDER BY n")
        .fetch_all(inbox.pool())
        .await
        .unwrap();
    assert_eq!(keys, ["told"]);
    done(schema, inbox).await;
}
