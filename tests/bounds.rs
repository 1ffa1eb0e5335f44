//! Bounded waits on Postgres: the store's own `lock_timeout` and `statement_timeout`, and
//! statements that a pooler in transaction mode can carry (no prepared statement outlives
//! the message that made it).
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, Row};
use support::{Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::inbox::{Delivery, Inbox};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, ClaimStrategy, Fingerprint, IdempotencyKey, IdempotencyLayer, Mode,
    PostgresStore, Store, StoreError,
};

/// A direct connection into the test's schema (not from the store's pool).
async fn direct(schema: &PgSchema) -> PgConnection {
    let mut conn = PgConnection::connect(&support::database_url())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET search_path = {}",
        schema.name
    )))
    .execute(&mut conn)
    .await
    .unwrap();
    conn
}

/// Completes key `k` with a TTL of 1 ms and waits until it has expired: its next claim is
/// a takeover, an `UPDATE` of the row.
async fn expired_record(store: &PostgresStore) {
    let svc = IdempotencyLayer::new(store.clone())
        .with_ttl(Duration::from_millis(1))
        .unwrap()
        .layer(support::handler(Calls::default()));
    let first = read(
        svc.oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 201);
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Another transaction holds the key's expired record's row (as a transactional-mode request
/// on the same key does while its handler runs, or a purge's batch that is about to delete
/// it): a claim, in either mode, waits for the row no longer than the store's lock timeout,
/// then answers "in flight" (`409` with `Retry-After`, never `503`) without running the
/// handler, and runs once when the row is free.
async fn blocked_claim_answers_409_after_the_lock_timeout<M: Mode>(
    mode: impl FnOnce(&PostgresStore) -> M,
) {
    let schema = PgSchema::new().await;
    let store = schema
        .store()
        .await
        .with_lock_timeout(Duration::from_millis(200));
    expired_record(&store).await;

    let mut holder = direct(&schema).await;
    sqlx::raw_sql("BEGIN; SELECT * FROM tower_idempotency_keys WHERE key = 'k' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();

    let calls = Calls::default();
    let svc = IdempotencyLayer::new(mode(&store)).layer(support::handler(calls.clone()));
    let send = || svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"));
    let started = Instant::now();
    let blocked = read(send().await.unwrap()).await;
    blocked.assert_problem(409, "request-in-progress");
    assert!(blocked.headers.contains_key("retry-after"));
    let waited = started.elapsed();
    // The bound is 200 ms; the margin is for a loaded 2-core machine. Without a lock
    // timeout the claim waits for the holder (here: forever).
    assert!(waited < Duration::from_secs(4), "waited {waited:?}");
    assert_eq!(calls.total(), 0);

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let after = read(send().await.unwrap()).await;
    assert_eq!(after.status, 201, "{}", after.text());
    assert_eq!(calls.get("/pay"), 1);
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_claim_blocked_on_the_keys_row_answers_409_after_the_lock_timeout() {
    blocked_claim_answers_409_after_the_lock_timeout(PostgresStore::clone).await;
}

#[tokio::test]
async fn a_transactional_claim_blocked_on_the_keys_row_answers_409_after_the_lock_timeout() {
    blocked_claim_answers_409_after_the_lock_timeout(PostgresStore::transactional).await;
}

/// With no lock timeout, the store's statement timeout still bounds the wait: the claim
/// fails with [`StoreError::Timeout`] (the layer answers `503`).
#[tokio::test]
async fn a_store_statement_past_its_statement_timeout_is_a_timeout_error() {
    let schema = PgSchema::new().await;
    let store = schema
        .store()
        .await
        .with_lock_timeout(Duration::ZERO)
        .with_statement_timeout(Duration::from_millis(200));
    expired_record(&store).await;

    let mut holder = direct(&schema).await;
    sqlx::raw_sql("BEGIN; SELECT * FROM tower_idempotency_keys WHERE key = 'k' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let key = IdempotencyKey::parse("k").unwrap();
    let started = Instant::now();
    // The fingerprint of the layer's request above does not matter: an expired record is
    // taken over whatever it held.
    let err = store
        .claim(ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(4));

    // The bound is the store's own: the application's statements on the same pool keep the
    // session's setting (none).
    let setting: String = sqlx::raw_sql("SHOW statement_timeout")
        .fetch_one(store.pool())
        .await
        .unwrap()
        .get(0);
    assert_eq!(setting, "0");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    schema.drop_schema().await;
}

/// In transactional mode the store's bounds hold for its own statements and not for the
/// handler's: inside the request's transaction the handler sees the session's settings.
#[tokio::test]
async fn transactional_handlers_keep_their_own_timeouts() {
    let schema = PgSchema::new().await;
    let store = schema
        .store()
        .await
        .with_statement_timeout(Duration::from_millis(300))
        .with_lock_timeout(Duration::from_millis(100));
    let svc = IdempotencyLayer::new(store.transactional()).layer(tower::service_fn(
        |req: http::Request<tower_idempotency::body::RequestBody<_>>| async move {
            let tx = req
                .extensions()
                .get::<tower_idempotency::IdempotentTx>()
                .unwrap()
                .clone();
            let mut conn = tx.conn().await.unwrap();
            // Longer than the store's statement timeout: the handler's own work is not cut.
            sqlx::raw_sql("SELECT pg_sleep(0.5)")
                .execute(&mut *conn)
                .await
                .unwrap();
            let row = sqlx::raw_sql(
                "SELECT current_setting('statement_timeout') || ' ' || \
                 current_setting('lock_timeout')",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            let settings: String = row.get(0);
            let _ = req.into_body();
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from(settings),
            )))
        },
    ));
    let answer = read(
        svc.oneshot(support::req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.text(), "0 0", "the handler saw the store's bounds");
    schema.drop_schema().await;
}

/// The name a statement prepared by the store stands for: `tower_idempotency_` and the FNV-1a
/// digest (64 bits) of its parameter types and its text, each ended by a NUL byte.
fn name_of(types: &[&str], body: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in types.iter().copied().chain([body]) {
        for &b in part.as_bytes().iter().chain(b"\0") {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("tower_idempotency_{hash:016x}")
}

/// Every statement the crate sends — migrate, the claim, replay, mismatch, complete, release,
/// renew, purge, transactional mode, the inbox — leaves on the connection no prepared
/// statement but the store's own, made with SQL `PREPARE` under a name that stands for its
/// text. (A prepared statement outlives the transaction: behind a pooler in transaction mode,
/// the next client on that server connection meets it. A name of the protocol's kind,
/// `sqlx_s_1`, would there run another client's statement; a name that is a digest of the
/// text runs the statement its caller means.)
#[tokio::test]
async fn the_crate_prepares_statements_only_under_names_that_stand_for_their_text() {
    let schema = PgSchema::new().await;
    // One connection: every statement below runs on it.
    let pool = schema.pool(1).await;
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();

    let calls = Calls::default();
    for (scope, strategy) in [
        ("adaptive", ClaimStrategy::Adaptive),
        ("combined", ClaimStrategy::Combined),
        ("read-first", ClaimStrategy::ReadFirst),
        ("insert-first", ClaimStrategy::InsertFirst),
    ] {
        let plain = IdempotencyLayer::new(store.clone().with_claim_strategy(strategy))
            .with_lease(Duration::from_millis(300))
            .with_scope(move |_| Some(scope.to_owned()))
            .layer(support::handler(calls.clone()));
        for (uri, key, body) in [
            ("/pay", "a", "x"),
            ("/pay", "a", "x"),         // replay
            ("/pay", "a", "other"),     // mismatch
            ("/fail", "b", "x"),        // 5xx: released
            ("/slow?ms=400", "c", "x"), // renewed
        ] {
            let _ = read(
                plain
                    .clone()
                    .oneshot(req("POST", uri, Some(key), body))
                    .await
                    .unwrap(),
            )
            .await;
        }
    }
    store.purge_expired(10).await.unwrap();
    let tx = IdempotencyLayer::new(store.transactional()).layer(support::handler(calls.clone()));
    for key in ["t", "t"] {
        let _ = read(
            tx.clone()
                .oneshot(req("POST", "/pay", Some(key), "x"))
                .await
                .unwrap(),
        )
        .await;
    }
    let phased = IdempotencyLayer::new(store.phased())
        .with_scope(|_| Some("phased".to_owned()))
        .layer(support::handler(calls.clone()));
    for key in ["p", "p"] {
        let _ = read(
            phased
                .clone()
                .oneshot(req("POST", "/pay", Some(key), "x"))
                .await
                .unwrap(),
        )
        .await;
    }
    let inbox = Inbox::new(pool.clone());
    for _ in 0..2 {
        let _ = inbox
            .process("c", "m1", async |_conn: &mut PgConnection| {
                Ok::<_, std::io::Error>(())
            })
            .await
            .unwrap();
    }
    assert!(matches!(
        inbox
            .process("c", "m1", async |_conn: &mut PgConnection| Ok::<
                _,
                std::io::Error,
            >(()))
            .await
            .unwrap(),
        Delivery::Duplicate
    ));
    inbox
        .purge_older_than(Duration::from_secs(3600), 10)
        .await
        .unwrap();

    let prepared = sqlx::raw_sql(
        "SELECT name, statement, from_sql, parameter_types::text[] FROM pg_prepared_statements",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        prepared.len(),
        3,
        "the read, the insert (of a plain and of a phased claim: one text) and the \
         completion run prepared; the calls of the store's functions are sent as text"
    );
    for row in &prepared {
        let name: String = row.get(0);
        let statement: String = row.get(1);
        let from_sql: bool = row.get(2);
        let types: Vec<String> = row.get(3);
        assert!(from_sql, "{name}: prepared over the protocol");
        // `statement` is the whole message that prepared it: the store's settings, then
        // `PREPARE name(types) AS body; EXECUTE name(values)`.
        let body = statement
            .split_once(&format!("PREPARE {name}"))
            .and_then(|(_, rest)| rest.split_once(" AS "))
            .and_then(|(_, rest)| rest.split_once(&format!("; EXECUTE {name}")))
            .map(|(body, _)| body)
            .unwrap_or_else(|| panic!("{statement}"));
        let types: Vec<&str> = types.iter().map(String::as_str).collect();
        assert_eq!(name, name_of(&types, body), "{statement}");
    }
    assert_eq!(
        calls.get("/pay"),
        6,
        "one plain first request per strategy, one transactional, one phased"
    );
    pool.close().await;
    schema.drop_schema().await;
}

/// Two stores of two schemas sharing one server connection (as two applications' clients of
/// one pooler do) run the same statements, each in its own schema: each statement names its
/// store's schema in its text, and so in the name it is prepared under. The connection's own
/// path does not matter once a store knows its schema.
#[tokio::test]
async fn stores_of_two_schemas_on_one_server_connection_each_use_their_own() {
    let a = PgSchema::new().await;
    let b = PgSchema::new().await;
    a.store().await;
    b.store().await;
    // One connection, straight to the server: every statement below runs on it.
    let pool = a.direct_pool(1).await;
    let path = |schema: &str| {
        let pool = pool.clone();
        let sql = format!("SET search_path = {schema}");
        async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    // The claim in two statements: both sent prepared by name.
    let store = || {
        PostgresStore::new(pool.clone())
            .with_notifications(false)
            .with_claim_strategy(ClaimStrategy::ReadFirst)
    };
    let (store_a, store_b) = (store(), store());
    let key = IdempotencyKey::parse("k").unwrap();
    let claim = |store: &PostgresStore, fingerprint: u8| {
        let store = store.clone();
        let key = key.clone();
        async move {
            store
                .claim(ClaimRequest {
                    scope: "s",
                    key: &key,
                    fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(3600),
                })
                .await
                .unwrap()
        }
    };

    // Each store learns its schema from the path at its first statement.
    path(&a.name).await;
    assert!(matches!(
        claim(&store_a, 1).await,
        ClaimOutcome::Acquired { .. }
    ));
    path(&b.name).await;
    assert!(
        matches!(claim(&store_b, 2).await, ClaimOutcome::Acquired { .. }),
        "the statements {} prepared claim the key in {}",
        a.name,
        b.name
    );
    // The connection's path names b: each store still works in its own schema.
    assert!(matches!(claim(&store_a, 2).await, ClaimOutcome::Mismatch));
    assert!(matches!(claim(&store_b, 1).await, ClaimOutcome::Mismatch));
    assert!(matches!(
        claim(&store_a, 1).await,
        ClaimOutcome::InFlight { .. }
    ));
    pool.close().await;
    a.drop_schema().await;
    b.drop_schema().await;
}

/// A statement dropped from the server connection behind the store's back (`DEALLOCATE ALL`,
/// as a pooler's reset query or another client may send) is prepared again at its next use.
#[tokio::test]
async fn a_statement_deallocated_behind_the_stores_back_is_prepared_again() {
    let schema = PgSchema::new().await;
    schema.store().await;
    let pool = schema.direct_pool(1).await;
    // The claim in two statements, both sent prepared.
    let store = PostgresStore::new(pool.clone())
        .with_notifications(false)
        .with_claim_strategy(ClaimStrategy::ReadFirst);
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(store).layer(support::handler(calls.clone()));
    for (key, deallocate) in [("a", false), ("a", true), ("b", true), ("b", false)] {
        if deallocate {
            sqlx::raw_sql("DEALLOCATE ALL")
                .execute(&pool)
                .await
                .unwrap();
        }
        let answer = read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some(key), "x"))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(answer.status, 201, "{key}: {}", answer.text());
    }
    assert_eq!(calls.get("/pay"), 2, "one run per key");
    pool.close().await;
    schema.drop_schema().await;
}
