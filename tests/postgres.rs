//! Postgres-only behaviour: migrations, schema errors, an unreachable database.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use support::{Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    ClaimRequest, ClaimStrategy, Fingerprint, IdempotencyKey, IdempotencyLayer, PostgresStore,
    Store, StoreError,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_to_run_concurrently() {
    let schema = PgSchema::new().await;
    let pool = schema.pool(8).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let store = PostgresStore::new(pool.clone());
        tasks.push(tokio::spawn(async move { store.migrate().await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    let (versions,): (i64,) = sqlx::query_as("SELECT count(*) FROM tower_idempotency_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    // One version per file in migrations/.
    let shipped = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension() == Some("sql".as_ref()))
        .count();
    assert_eq!(versions, i64::try_from(shipped).unwrap());
    // The crate's history lives in its own table, not in sqlx's `_sqlx_migrations`.
    let (sqlx_table,): (Option<String>,) =
        sqlx::query_as("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(sqlx_table, None);
    pool.close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_changed_migration_is_reported_not_reapplied() {
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("UPDATE tower_idempotency_migrations SET checksum = '\\x00'")
        .execute(&pool)
        .await
        .unwrap();
    let err = store.migrate().await.unwrap_err();
    assert!(matches!(err, StoreError::Schema(_)), "{err:?}");
    pool.close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn missing_schema_is_a_schema_error_and_a_503() {
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    let store = PostgresStore::new(pool.clone()); // migrate() not run
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(store.clone()).layer(support::handler(calls.clone()));
    let a = read(
        svc.oneshot(req("POST", "/pay", Some("k"), ""))
            .await
            .unwrap(),
    )
    .await;
    a.assert_problem(503, "store-unavailable");
    let retry_after: u64 = a.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(
        calls.total(),
        0,
        "fail closed: the handler must not run unprotected"
    );
    let err = store.purge_expired(10).await.unwrap_err();
    match err {
        StoreError::Schema(msg) => assert!(msg.contains("migrate"), "{msg}"),
        other => panic!("{other:?}"),
    }
    pool.close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_missing_claim_function_is_a_schema_error() {
    // A schema migrated by an older version of the crate: the tables, not the claim function
    // (which `ClaimStrategy::Combined` calls).
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    let store = PostgresStore::new(pool.clone()).with_claim_strategy(ClaimStrategy::Combined);
    store.migrate().await.unwrap();
    sqlx::query("DROP FUNCTION tower_idempotency_plain_claim")
        .execute(&pool)
        .await
        .unwrap();
    let key = IdempotencyKey::parse("k").unwrap();
    let err = store
        .claim(ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: Fingerprint::from_bytes([0; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        })
        .await
        .unwrap_err();
    match err {
        StoreError::Schema(msg) => assert!(msg.contains("migrate"), "{msg}"),
        other => panic!("{other:?}"),
    }
    pool.close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn unreachable_database_is_a_503_and_the_handler_does_not_run() {
    // Nothing listens on port 1.
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/postgres")
        .unwrap();
    let calls = Calls::default();
    let svc =
        IdempotencyLayer::new(PostgresStore::new(pool)).layer(support::handler(calls.clone()));
    let a = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), ""))
            .await
            .unwrap(),
    )
    .await;
    a.assert_problem(503, "store-unavailable");
    assert_eq!(calls.total(), 0);
    // Requests the layer does not cover never touch the store.
    let get = read(
        svc.oneshot(req("GET", "/pay", Some("k"), ""))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(get.status, 201);
    assert_eq!(calls.total(), 1);
}

#[tokio::test]
async fn records_store_headers_and_times_from_the_database_clock() {
    let schema = PgSchema::new().await;
    let store = schema.store().await;
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_ttl(Duration::from_secs(3600))
        .unwrap()
        .layer(support::handler(calls.clone()));
    let a = read(
        svc.oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status, 201);
    let (status, ttl_ok, lease): (i16, bool, Option<i64>) = sqlx::query_as(
        "SELECT response_status,
                expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes',
                lease_token
           FROM tower_idempotency_keys WHERE key = 'k'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!((status, ttl_ok, lease), (201, true, None));
    store.pool().close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn paced_purge_still_deletes_every_expired_record() {
    use tower_idempotency::{ClaimOutcome, ClaimRequest, IdempotencyKey, fingerprint::fingerprint};
    let schema = PgSchema::new().await;
    let store = schema.store().await.with_purge_duty_cycle(0.5);
    let parts = http::Request::post("/p").body(()).unwrap().into_parts().0;
    for i in 0..5 {
        let key = IdempotencyKey::parse(&format!("k{i}")).unwrap();
        let claim = ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: fingerprint(&parts, &[], b""),
            // An in-progress record lives as long as its lease at least: both are short.
            lease: Duration::from_millis(100),
            ttl: Duration::from_millis(100),
        };
        assert!(matches!(
            store.claim(claim).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.purge_expired(2).await.unwrap(), 5);
    store.pool().close().await;
    schema.drop_schema().await;
}

/// The store's functions resolve names in their own schema, whatever the caller's
/// `search_path`: an application schema ahead on it, with a table named like the store's and
/// its own `now()` named before `pg_catalog`, changes neither where a record goes nor its
/// times. (Names in the caller's own statements are the caller's to resolve: the store's
/// schema must be on its path.)
#[tokio::test]
async fn functions_ignore_an_application_schema_ahead_on_the_search_path() {
    use std::str::FromStr;
    let schema = PgSchema::new().await;
    let setup = schema.pool(2).await;
    PostgresStore::new(setup.clone()).migrate().await.unwrap();
    let app = format!("{}_app", schema.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {app};
         CREATE TABLE {app}.tower_idempotency_keys
             (LIKE {s}.tower_idempotency_keys INCLUDING ALL);
         CREATE FUNCTION {app}.now() RETURNS timestamptz LANGUAGE sql STABLE
             AS $$ SELECT timestamptz '2100-01-01 00:00:00+00' $$;
         CREATE FUNCTION {app}.never(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE
             AS $$ SELECT false $$;
         CREATE OPERATOR {app}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {app}.never);",
        s = schema.name
    )))
    .execute(&setup)
    .await
    .unwrap();
    let opts = sqlx::postgres::PgConnectOptions::from_str(&support::database_url())
        .unwrap()
        .options([(
            "search_path",
            format!("{app}, pg_catalog, {}", schema.name).as_str(),
        )]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(opts)
        .await
        .unwrap();
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(PostgresStore::new(pool.clone()))
        .layer(support::handler(calls.clone()));
    let first = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = read(
        svc.oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert!(again.replayed(), "{}", again.text());
    assert_eq!(calls.get("/pay"), 1);

    let count = |table: String| {
        let setup = setup.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {table}"
            )))
            .fetch_one(&setup)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        count(format!("{app}.tower_idempotency_keys")).await,
        0,
        "the application's table of the same name was written"
    );
    assert_eq!(
        count(format!("{}.tower_idempotency_keys", schema.name)).await,
        1
    );
    let (from_now,): (f64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM expires_at - pg_catalog.now())::float8
           FROM {}.tower_idempotency_keys",
        schema.name
    )))
    .fetch_one(&setup)
    .await
    .unwrap();
    let ttl = 24.0 * 3600.0;
    assert!(
        (from_now - ttl).abs() < 60.0,
        "the record expires {from_now} s from now, not after the TTL on the database's clock"
    );
    // The purge deletes the store's expired records, never the application's rows of the
    // table of the same name.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {app}.tower_idempotency_keys SELECT * FROM {s}.tower_idempotency_keys;
         UPDATE {app}.tower_idempotency_keys SET expires_at = now() - interval '1 day';",
        s = schema.name
    )))
    .execute(&setup)
    .await
    .unwrap();
    let purged = PostgresStore::new(pool.clone())
        .purge_expired(100)
        .await
        .unwrap();
    assert_eq!(purged, 0);
    assert_eq!(
        count(format!("{app}.tower_idempotency_keys")).await,
        1,
        "the purge deleted the application's row"
    );
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {app} CASCADE")))
        .execute(&setup)
        .await
        .unwrap();
    setup.close().await;
    schema.drop_schema().await;
}
