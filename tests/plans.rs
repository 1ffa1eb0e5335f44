//! The store finds a record by its primary key whatever the table's statistics say.
//!
//! A table analyzed while it was empty (right after the migration, or on a server where
//! autovacuum is off or has not come round yet) tells the planner it has no rows. The
//! store's statements run inside PL/pgSQL functions, which keep each statement's plan for the
//! life of the connection; a plan made on such statistics is a sequential scan, and kept, it
//! reads the whole table on every request once the table has grown. These tests make the
//! functions plan on an empty table's statistics, grow the table behind the planner's back,
//! and then count, in Postgres's own statistics for the table, the sequential scans the
//! store's statements make: none.
//!
//! A purge deletes expired records a batch at a time. Found by a sequential scan (the
//! cheaper plan for a bare `LIMIT` when many records have expired), or deleted through a hash
//! join over the table, each batch reads again the pages of the rows the batches before it
//! deleted, which stay until a `VACUUM`: a backlog of a million expired records then takes
//! quadratic time, and one batch can outlast the store's statement timeout. The purges walk
//! the expiry index, oldest first, and delete by row address: no sequential scan either.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use sqlx::PgPool;
use support::{PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::inbox::Inbox;
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, IdempotencyLayer, PostgresStore,
    Store, StoredResponse, body::RequestBody,
};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

/// Rows added behind the planner's back: enough that a sequential scan costs hundreds of
/// pages.
const GROWN: u32 = 20_000;

fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([7; 32])
}

fn answer() -> StoredResponse {
    StoredResponse::new(
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        bytes::Bytes::from_static(b"{}"),
    )
}

async fn claim(store: &PostgresStore, key: &IdempotencyKey) -> ClaimOutcome {
    store
        .claim(ClaimRequest {
            scope: "",
            key,
            fingerprint: fingerprint(),
            lease: LEASE,
            ttl: TTL,
        })
        .await
        .unwrap()
}

/// A first request (claim, complete) and a replay of `key`.
async fn first_and_replay(store: &PostgresStore, key: &str) {
    let key = IdempotencyKey::parse(key).unwrap();
    let ClaimOutcome::Acquired { token, .. } = claim(store, &key).await else {
        panic!("a new key is acquired");
    };
    assert!(
        store
            .complete("", &key, token, &answer(), TTL)
            .await
            .unwrap()
    );
    assert!(matches!(
        claim(store, &key).await,
        ClaimOutcome::Completed(_)
    ));
}

const KEYS: &str = "tower_idempotency_keys";

/// `table`'s sequential and index scans so far, as the server's statistics hold them once
/// this connection's pending counts are flushed.
async fn table_scans(pool: &PgPool, table: &str) -> (i64, i64) {
    // The flush happens when the connection goes idle after this statement.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query_as(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables \
          WHERE schemaname = current_schema() AND relname = $1",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Asserts that since `before` (a [`table_scans`] reading) `table` was read `at_least` times,
/// all of them through an index: `what` never scanned the whole table.
async fn assert_no_table_scan(
    pool: &PgPool,
    table: &str,
    before: (i64, i64),
    at_least: i64,
    what: &str,
) {
    let (seq_after, idx_after) = table_scans(pool, table).await;
    let (seq, idx) = (seq_after - before.0, idx_after - before.1);
    assert!(
        seq + idx >= at_least,
        "the statistics saw {what} ({seq} sequential and {idx} index scans)"
    );
    assert_eq!(
        seq, 0,
        "{what} scanned the whole table of {table} {seq} times ({idx} index scans)"
    );
}

/// A store on one connection (every statement of a test, the store's and the test's, runs
/// on the one backend whose plans and statistics are looked at), migrated, its table analyzed
/// empty, autovacuum off for it so that nothing refreshes the statistics while the test runs.
async fn analyzed_empty(schema: &PgSchema) -> (PgPool, PostgresStore) {
    let pool = schema.direct_pool(1).await;
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    for sql in [
        "ALTER TABLE tower_idempotency_keys SET (autovacuum_enabled = false)",
        "VACUUM ANALYZE tower_idempotency_keys",
    ] {
        sqlx::raw_sql(sql).execute(&pool).await.unwrap();
    }
    (pool, store)
}

/// Adds [`GROWN`] completed records (`grown-1` …) without telling the planner.
async fn grow(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO tower_idempotency_keys
                (scope, key, fingerprint, expires_at, completed_at, response_status,
                 response_headers, response_body)
         SELECT '', 'grown-' || i, decode(repeat('07', 32), 'hex'), now() + interval '1 hour', now(), 201,
                '\\x'::bytea, '\\x7b7d'::bytea
           FROM generate_series(1, $1) AS i",
    )
    .bind(i64::from(GROWN))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn lookups_use_the_primary_key_after_the_table_was_analyzed_empty() {
    let schema = PgSchema::new().await;
    let (pool, store) = analyzed_empty(&schema).await;
    // Ten runs of each statement: PL/pgSQL switches to a plan it keeps after five.
    for i in 0..10 {
        first_and_replay(&store, &format!("warm-{i}")).await;
    }
    grow(&pool).await;

    let before = table_scans(&pool, KEYS).await;
    for i in 0..5 {
        first_and_replay(&store, &format!("measured-{i}")).await;
    }
    // A replay of a key the table grew by, and a release.
    let grown = IdempotencyKey::parse("grown-4711").unwrap();
    assert!(matches!(
        claim(&store, &grown).await,
        ClaimOutcome::Completed(_)
    ));
    let key = IdempotencyKey::parse("released").unwrap();
    let ClaimOutcome::Acquired { token, .. } = claim(&store, &key).await else {
        panic!("a new key is acquired");
    };
    assert!(store.release("", &key, token).await.unwrap());
    // Eighteen lookups by key: three per first request and replay, two for the release, one
    // for the replay of a grown key.
    assert_no_table_scan(&pool, KEYS, before, 18, "the store's statements").await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn transactional_lookups_use_the_primary_key_after_the_table_was_analyzed_empty() {
    let schema = PgSchema::new().await;
    let (pool, store) = analyzed_empty(&schema).await;
    let handler = tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
        let mut res = Response::new(Full::new(Bytes::from_static(b"paid")));
        *res.status_mut() = http::StatusCode::CREATED;
        Ok::<_, std::io::Error>(res)
    });
    let svc = IdempotencyLayer::new(store.transactional()).layer(handler);
    let pay = |key: String| {
        let svc = svc.clone();
        async move {
            for replayed in [false, true] {
                let answer = read(
                    svc.clone()
                        .oneshot(req("POST", "/pay", Some(&key), "{}"))
                        .await
                        .unwrap(),
                )
                .await;
                assert_eq!(
                    (answer.status.as_u16(), answer.replayed()),
                    (201, replayed),
                    "{key}"
                );
            }
        }
    };
    for i in 0..10 {
        pay(format!("warm-{i}")).await;
    }
    grow(&pool).await;

    let before = table_scans(&pool, KEYS).await;
    for i in 0..5 {
        pay(format!("measured-{i}")).await;
    }
    // At least a lookup per request: the claim of each first request and of each replay.
    assert_no_table_scan(&pool, KEYS, before, 10, "transactional mode").await;
    store.pool().close().await;
    schema.drop_schema().await;
}

/// `GROWN` rows of `table` (`columns`, then the values `values` for `i` in
/// `1..=2 * GROWN`) written over time: the first half long ago, the second half now.
async fn written_over_time(pool: &PgPool, table: &str, columns: &str, values: &str) {
    let sql = format!(
        "INSERT INTO {table} ({columns}) SELECT {values} FROM generate_series(1, 2 * $1) AS i"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(i64::from(GROWN))
        .execute(pool)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_purge_walks_the_expiry_index_not_the_table() {
    let schema = PgSchema::new().await;
    let (pool, store) = analyzed_empty(&schema).await;
    written_over_time(
        &pool,
        "tower_idempotency_keys",
        "scope, key, fingerprint, expires_at, completed_at, response_status, \
         response_headers, response_body",
        "'', 'k-' || i, '\\x00'::bytea, \
         now() + CASE WHEN i <= $1 THEN interval '-1 hour' ELSE interval '1 hour' END, \
         now(), 201, '\\x'::bytea, '\\x7b7d'::bytea",
    )
    .await;

    let before = table_scans(&pool, KEYS).await;
    assert_eq!(store.purge_expired(1000).await.unwrap(), u64::from(GROWN));
    // 21 batches, the last one empty.
    assert_no_table_scan(&pool, KEYS, before, 21, "the purge's batches").await;
    let (left,): (i64,) = sqlx::query_as("SELECT count(*) FROM tower_idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, i64::from(GROWN), "the live records stay");
    schema.drop_schema().await;
}

#[tokio::test]
async fn an_inbox_purge_walks_the_age_index_not_the_table() {
    let schema = PgSchema::new().await;
    let (pool, _store) = analyzed_empty(&schema).await;
    let table = "tower_idempotency_processed_messages";
    written_over_time(
        &pool,
        table,
        "consumer, message_id, processed_at",
        "'c', 'm-' || i, \
         now() - CASE WHEN i <= $1 THEN interval '2 hours' ELSE interval '0' END",
    )
    .await;

    let before = table_scans(&pool, table).await;
    let inbox = Inbox::new(pool.clone());
    let purged = inbox
        .purge_older_than(Duration::from_secs(3600), 1000)
        .await
        .unwrap();
    assert_eq!(purged, u64::from(GROWN));
    assert_no_table_scan(&pool, table, before, 21, "the inbox purge's batches").await;
    schema.drop_schema().await;
}
