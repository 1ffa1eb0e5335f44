//! Transactional mode at every isolation level, with hostile session settings, and with
//! handlers that leave their transaction aborted: the handler runs once per key, and the
//! client gets the handler's answer or a 503 that is safe to retry — never a second run.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::{Answer, PgSchema, database_url, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, IsolationLevel, PostgresStore, body::RequestBody,
};

const LEVELS: [&str; 3] = ["read committed", "repeatable read", "serializable"];

/// A pool on `schema` whose connections default to `isolation`, with `search_path` set to
/// `search_path` and any more startup `settings`.
async fn pool_with(
    search_path: &str,
    isolation: &str,
    settings: &[(&str, &str)],
    max: u32,
) -> PgPool {
    let mut opts = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .options([
            ("search_path", search_path),
            ("default_transaction_isolation", isolation),
        ]);
    for &(name, value) in settings {
        opts = opts.options([(name, value)]);
    }
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts)
        .await
        .unwrap()
}

/// A fresh schema with the store's tables, and a small pool on it for setup and checks.
async fn migrated() -> (PgSchema, PgPool) {
    let schema = PgSchema::new().await;
    let setup = schema.pool(2).await;
    PostgresStore::new(setup.clone()).migrate().await.unwrap();
    (schema, setup)
}

async fn done(schema: PgSchema, setup: PgPool) {
    setup.close().await;
    schema.drop_schema().await;
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

type App = Arc<
    dyn Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
        + Send
        + Sync,
>;

/// The transactional layer on `store` over a handler that inserts one payment row through the
/// request's transaction (sleeping `ms` from the query string first), counted in `calls`.
fn payments_app(
    store: &PostgresStore,
    level: Option<IsolationLevel>,
    calls: Arc<AtomicUsize>,
) -> App {
    let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let ms: u64 = req
                .uri()
                .query()
                .and_then(|q| q.strip_prefix("ms="))
                .map_or(0, |v| v.parse().unwrap());
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            let id: i64 =
                sqlx::query_scalar("INSERT INTO payments (note) VALUES ('p') RETURNING id")
                    .fetch_one(&mut *tx.conn().await.unwrap())
                    .await
                    .unwrap();
            let mut res = Response::new(Full::new(Bytes::from(format!("payment {id}"))));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, std::io::Error>(res)
        }
    });
    let mut tx_mode = store.transactional();
    if let Some(level) = level {
        tx_mode = tx_mode.with_isolation(level);
    }
    let svc = IdempotencyLayer::new(tx_mode).layer(handler);
    Arc::new(move |r| {
        let svc = svc.clone();
        Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
    })
}

const PAYMENTS_DDL: &str = "CREATE TABLE payments (id bigserial PRIMARY KEY, note text NOT NULL)";

/// A record committed between a claim's snapshot and its lock, made certain: the second
/// request's transaction takes its snapshot, then the first request commits its record, then
/// the second takes the key's lock. (A function in a schema ahead of the store's on the search
/// path stands in for the transactional claim and sleeps before calling it.) At every level
/// the second request replays the first's answer; the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_committed_between_snapshot_and_lock_is_replayed_at_every_level() {
    for level in LEVELS {
        let (schema, setup) = migrated().await;
        sqlx::query(PAYMENTS_DDL).execute(&setup).await.unwrap();
        let slow = format!("{}_slow", schema.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {slow};
             CREATE FUNCTION {slow}.tower_idempotency_claim_tx(
                 p_lock bigint, p_scope text, p_key text, p_fingerprint bytea)
             RETURNS TABLE (outcome text, claimed_row text, fingerprint bytea,
                            lease_token bigint, lease_left_ms bigint, response_status smallint,
                            response_headers bytea, response_body bytea)
             LANGUAGE sql VOLATILE AS $$
                 SELECT pg_sleep(1.0);
                 SELECT * FROM {schema}.tower_idempotency_claim_tx(
                     p_lock, p_scope, p_key, p_fingerprint) $$",
            schema = schema.name
        )))
        .execute(&setup)
        .await
        .unwrap();
        let pool = pool_with(&format!("{slow}, {}", schema.name), level, &[], 8).await;
        let store = PostgresStore::new(pool.clone());
        let calls = Arc::new(AtomicUsize::new(0));
        let app = payments_app(&store, None, calls.clone());

        // The first: its claim sleeps 1 s before the lock, its handler 0.1 s; it commits at
        // about 1.1 s. The second starts at 0.5 s: its look sees nothing yet, its claim's
        // snapshot dates from before the first commit, its lock (at about 1.5 s) after it.
        let first = tokio::spawn({
            let app = app.clone();
            async move { app(req("POST", "/pay?ms=100", Some("k"), "b")).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let second = app(req("POST", "/pay?ms=100", Some("k"), "b")).await;
        let first = first.await.unwrap();

        assert_eq!(first.status, 201, "{level}: {}", first.text());
        assert!(!first.replayed(), "{level}");
        assert_eq!(second.status, 201, "{level}: {}", second.text());
        assert!(second.replayed(), "{level}: the second must replay");
        assert_eq!(second.body, first.body, "{level}");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{level}: handler ran once");
        assert_eq!(
            count(&setup, "SELECT count(*) FROM payments").await,
            1,
            "{level}"
        );
        pool.close().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {slow} CASCADE")))
            .execute(&setup)
            .await
            .unwrap();
        done(schema, setup).await;
    }
}

/// Under SERIALIZABLE, fifty concurrent requests with distinct keys all succeed: the layer's
/// own statements (the look, the claim, the completion) make no request fail another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_distinct_keys_under_serializable_see_no_serialization_failure() {
    for (default, chosen) in [
        ("serializable", None),
        ("read committed", Some(IsolationLevel::Serializable)),
    ] {
        let (schema, setup) = migrated().await;
        sqlx::query(PAYMENTS_DDL).execute(&setup).await.unwrap();
        // Keys already there, as in a live table: new ones land in the same index pages.
        let old = payments_app(&PostgresStore::new(setup.clone()), None, Arc::default());
        for i in 0..4 {
            assert_eq!(
                old(req("POST", "/pay", Some(&format!("old-{i}")), "b"))
                    .await
                    .status,
                201
            );
        }
        let pool = pool_with(&schema.name, default, &[], 50).await;
        let store = PostgresStore::new(pool.clone());
        let calls = Arc::new(AtomicUsize::new(0));
        let app = payments_app(&store, chosen, calls.clone());
        for round in 0..3 {
            let barrier = Arc::new(tokio::sync::Barrier::new(50));
            let tasks: Vec<_> = (0..50)
                .map(|i| {
                    let (app, barrier) = (app.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        app(req(
                            "POST",
                            "/pay?ms=20",
                            Some(&format!("r{round}-{i}")),
                            "b",
                        ))
                        .await
                    })
                })
                .collect();
            for task in tasks {
                let answer = task.await.unwrap();
                assert_eq!(
                    answer.status,
                    201,
                    "{default}/{chosen:?}: {}",
                    answer.text()
                );
            }
        }
        assert_eq!(calls.load(Ordering::SeqCst), 150);
        assert_eq!(count(&setup, "SELECT count(*) FROM payments").await, 154);
        assert_eq!(
            count(&setup, "SELECT count(*) FROM tower_idempotency_keys").await,
            154
        );
        pool.close().await;
        done(schema, setup).await;
    }
}

/// Under SERIALIZABLE, two requests whose handlers read what the other writes (write skew):
/// one commits; the other's commit fails with a serialization failure, which the layer
/// answers `503` with `Retry-After`, having stored nothing — its retry runs and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_of_the_handlers_work_is_503_and_stores_nothing() {
    let (schema, setup) = migrated().await;
    sqlx::query("CREATE TABLE shifts (doctor text NOT NULL, on_call boolean NOT NULL)")
        .execute(&setup)
        .await
        .unwrap();
    let pool = pool_with(&schema.name, "serializable", &[], 4).await;
    let store = PostgresStore::new(pool.clone());
    let calls = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let handler = {
        let (calls, barrier) = (calls.clone(), barrier.clone());
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let (calls, barrier) = (calls.clone(), barrier.clone());
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                let doctor = req.uri().path().trim_start_matches('/').to_owned();
                let on_call: i64 = sqlx::query_scalar("SELECT count(*) FROM shifts WHERE on_call")
                    .fetch_one(&mut *tx.conn().await.unwrap())
                    .await
                    .unwrap();
                // The first two requests both read before either writes.
                if n < 2 {
                    barrier.wait().await;
                }
                sqlx::query("INSERT INTO shifts VALUES ($1, $2)")
                    .bind(&doctor)
                    .bind(on_call == 0)
                    .execute(&mut *tx.conn().await.unwrap())
                    .await
                    .unwrap();
                if n < 2 {
                    barrier.wait().await;
                }
                Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from("on call"))))
            }
        })
    };
    let svc = IdempotencyLayer::new(store.transactional()).layer(handler);
    let send = |path: &'static str, key: &'static str| {
        let svc = svc.clone();
        tokio::spawn(async move {
            read(
                svc.oneshot(req("POST", path, Some(key), "b"))
                    .await
                    .unwrap(),
            )
            .await
        })
    };
    let (a, b) = (send("/alice", "ka"), send("/bob", "kb"));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let mut statuses = [a.status.as_u16(), b.status.as_u16()];
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 503], "{} / {}", a.text(), b.text());
    let (failed, key, path) = if a.status == 503 {
        (&a, "ka", "/alice")
    } else {
        (&b, "kb", "/bob")
    };
    failed.assert_problem(503, "store-unavailable");
    assert!(failed.headers.contains_key("retry-after"));
    assert_eq!(count(&setup, "SELECT count(*) FROM shifts").await, 1);
    assert_eq!(
        count(&setup, "SELECT count(*) FROM tower_idempotency_keys").await,
        1
    );
    // The retry runs the handler again (nothing of the first attempt was stored) and succeeds.
    let retry = read(
        svc.clone()
            .oneshot(req("POST", path, Some(key), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        count(&setup, "SELECT count(*) FROM tower_idempotency_keys").await,
        2
    );
    pool.close().await;
    done(schema, setup).await;
}

/// Connections whose session settings application code changed — a client encoding whose
/// multibyte characters can hold the byte of a backslash or a quote, backslashes that escape
/// quotes, non-standard strings — meet scopes and keys with quotes, backslashes and non-ASCII
/// text: the handler runs once and the retry replays. Nothing user-supplied reaches the SQL
/// text in a form that depends on those settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_session_settings_change_nothing() {
    let (schema, setup) = migrated().await;
    sqlx::query(PAYMENTS_DDL).execute(&setup).await.unwrap();
    for encoding in ["SJIS", "BIG5", "GBK", "UTF8"] {
        let hostile = [
            ("backslash_quote", "on"),
            ("standard_conforming_strings", "off"),
            ("escape_string_warning", "off"),
        ];
        let pool = pool_with(&schema.name, "read committed", &hostile, 2).await;
        // sqlx insists on UTF-8 when it connects; application code changes it afterwards.
        let opts_pool = pool.clone();
        let store = PostgresStore::new(opts_pool);
        let mut conns = Vec::new();
        for _ in 0..2 {
            let mut c = pool.acquire().await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "SET client_encoding = '{encoding}'"
            )))
            .execute(&mut *c)
            .await
            .unwrap();
            conns.push(c);
        }
        drop(conns);
        let calls = Arc::new(AtomicUsize::new(0));
        let handler = {
            let calls = calls.clone();
            tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
                let calls = calls.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                    // The request's transaction runs on a connection with the hostile settings.
                    let settings: (String, String) = sqlx::query_as(
                        "SELECT current_setting('client_encoding'), current_setting('backslash_quote')",
                    )
                    .fetch_one(&mut *tx.conn().await.unwrap())
                    .await
                    .unwrap();
                    assert_eq!(settings, (encoding.to_owned(), "on".to_owned()));
                    sqlx::raw_sql("INSERT INTO payments (note) VALUES ('p')")
                        .execute(&mut *tx.conn().await.unwrap())
                        .await
                        .unwrap();
                    Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from("ok"))))
                }
            })
        };
        // The scope a tenant header names: in SJIS, 0x5C is the second byte of 表.
        let svc = IdempotencyLayer::new(store.transactional())
            .with_scope(|parts| {
                parts
                    .headers
                    .get("x-tenant")
                    .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
                    .map(str::to_owned)
            })
            .layer(handler);
        for (tenant, key) in [
            ("表\\'; DROP TABLE payments; --", r#"k'\"#),
            ("ü'é\\", "k2"),
            ("plain", r"\'"),
        ] {
            let key = format!("{encoding}-{key}");
            let send = || {
                let mut r = req("POST", "/pay", Some(&key), "b");
                r.headers_mut().insert(
                    "x-tenant",
                    http::HeaderValue::from_bytes(tenant.as_bytes()).unwrap(),
                );
                svc.clone().oneshot(r)
            };
            let first = read(send().await.unwrap()).await;
            assert_eq!(first.status, 200, "{encoding} {tenant}: {}", first.text());
            let again = read(send().await.unwrap()).await;
            assert_eq!(again.status, 200, "{encoding} {tenant}: {}", again.text());
            assert!(again.replayed(), "{encoding} {tenant}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3, "{encoding}");
        pool.close().await;
    }
    assert_eq!(count(&setup, "SELECT count(*) FROM payments").await, 12);
    done(schema, setup).await;
}

/// A handler that catches a failed statement leaves its transaction aborted: nothing it wrote
/// can commit. The client gets the handler's own answer (here its own `409` and, for a
/// handler that answers `201` all the same, that `201`), never a `503`; the handler's writes
/// are rolled back and its answer is stored with the key, so a retry replays it and the
/// handler runs once. A handler that rolls back to a savepoint of its own keeps its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_catches_a_failed_statement_gets_its_answer_stored() {
    for level in LEVELS {
        let (schema, setup) = migrated().await;
        sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY)")
            .execute(&setup)
            .await
            .unwrap();
        sqlx::query("INSERT INTO orders VALUES (1)")
            .execute(&setup)
            .await
            .unwrap();
        let pool = pool_with(&schema.name, level, &[], 4).await;
        let store = PostgresStore::new(pool.clone());
        let calls = Arc::new(AtomicUsize::new(0));
        let handler = {
            let calls = calls.clone();
            tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
                let calls = calls.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                    let mut conn = tx.conn().await.unwrap();
                    let path = req.uri().path().to_owned();
                    let id: i64 = path.rsplit('/').next().unwrap().parse().unwrap();
                    sqlx::query("INSERT INTO orders VALUES ($1)")
                        .bind(id + 1000)
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                    let savepoint = path.starts_with("/savepoint");
                    if savepoint {
                        sqlx::raw_sql("SAVEPOINT mine")
                            .execute(&mut *conn)
                            .await
                            .unwrap();
                    }
                    // Order 1 exists: a unique violation, caught.
                    let dup = sqlx::query("INSERT INTO orders VALUES (1)")
                        .execute(&mut *conn)
                        .await
                        .unwrap_err();
                    assert!(dup.as_database_error().unwrap().is_unique_violation());
                    if savepoint {
                        sqlx::raw_sql("ROLLBACK TO SAVEPOINT mine")
                            .execute(&mut *conn)
                            .await
                            .unwrap();
                    }
                    let (status, text) = if path.starts_with("/conflict") {
                        (StatusCode::CONFLICT, "order 1 exists")
                    } else {
                        (StatusCode::CREATED, "created anyway")
                    };
                    let mut res = Response::new(Full::new(Bytes::from(text)));
                    *res.status_mut() = status;
                    Ok::<_, std::io::Error>(res)
                }
            })
        };
        let svc = IdempotencyLayer::new(store.transactional()).layer(handler);
        let send = |path: &'static str| {
            let svc = svc.clone();
            async move {
                read(
                    svc.oneshot(req("POST", path, Some(path), "b"))
                        .await
                        .unwrap(),
                )
                .await
            }
        };
        for (path, status, kept) in [
            ("/conflict/2", 409, 0),
            ("/created/3", 201, 0),
            ("/savepoint/4", 201, 1),
        ] {
            let first = send(path).await;
            assert_eq!(first.status, status, "{level} {path}: {}", first.text());
            assert!(
                !first.headers.contains_key("content-type"),
                "the handler's own answer"
            );
            let again = send(path).await;
            assert_eq!(again.status, status, "{level} {path}: {}", again.text());
            assert!(again.replayed(), "{level} {path}");
            assert_eq!(again.body, first.body);
            let id = path.rsplit('/').next().unwrap().parse::<i64>().unwrap() + 1000;
            let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE id = $1")
                .bind(id)
                .fetch_one(&setup)
                .await
                .unwrap();
            assert_eq!(orders, kept, "{level} {path}: the handler's writes");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            3,
            "{level}: each handler ran once"
        );
        pool.close().await;
        done(schema, setup).await;
    }
}

/// Plain mode, two first requests racing: the second's claim statement takes its snapshot,
/// then the first's insert commits, then the second inserts. (A function in a schema ahead of
/// the store's on the search path stands in for the claim's insert function and sleeps before
/// calling it.) Under REPEATABLE READ and SERIALIZABLE the second insert fails with a
/// serialization failure; the store claims again, sees the first's record and answers `409` —
/// never `503` — and the handler runs once, at every level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_racing_first_requests_get_409_never_503_at_every_level() {
    use support::{Calls, handler};
    for level in LEVELS {
        let (schema, setup) = migrated().await;
        let slow = format!("{}_slow", schema.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {slow};
             CREATE FUNCTION {slow}.tower_idempotency_insert_key(
                 p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint)
             RETURNS bigint LANGUAGE sql VOLATILE AS $$
                 SELECT pg_sleep(0.8);
                 SELECT {schema}.tower_idempotency_insert_key(
                     p_scope, p_key, p_fingerprint, p_lease_ms, p_ttl_ms) $$",
            schema = schema.name
        )))
        .execute(&setup)
        .await
        .unwrap();
        let pool = pool_with(&format!("{slow}, {}", schema.name), level, &[], 4).await;
        let calls = Calls::default();
        let svc =
            IdempotencyLayer::new(PostgresStore::new(pool.clone())).layer(handler(calls.clone()));
        let send = || {
            let svc = svc.clone();
            async move {
                read(
                    svc.oneshot(req("POST", "/slow?ms=1500", Some("k"), "b"))
                        .await
                        .unwrap(),
                )
                .await
            }
        };
        // The first inserts (and commits) at about 0.8 s; the second's statement starts at
        // 0.3 s and inserts at about 1.1 s, while the first's handler still runs (1.5 s).
        let first = tokio::spawn(send());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = send().await;
        second.assert_problem(409, "request-in-progress");
        let first = first.await.unwrap();
        assert_eq!(first.status, 201, "{level}: {}", first.text());
        assert_eq!(calls.get("/slow"), 1, "{level}");
        pool.close().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {slow} CASCADE")))
            .execute(&setup)
            .await
            .unwrap();
        done(schema, setup).await;
    }
}

/// Plain mode, 64 distinct new keys at once, three rounds, at each default isolation level:
/// every request is a first request and must run (`201`) — never a `409` (a claim that lost
/// serialization conflicts to *other* keys' claims is not "in flight") and never a `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_distinct_keys_at_once_all_run_at_every_level() {
    use support::{Calls, handler};
    for level in LEVELS {
        let (schema, setup) = migrated().await;
        let pool = pool_with(&schema.name, level, &[], 16).await;
        let calls = Calls::default();
        let svc =
            IdempotencyLayer::new(PostgresStore::new(pool.clone())).layer(handler(calls.clone()));
        for round in 0..3 {
            let tasks: Vec<_> = (0..64)
                .map(|i| {
                    let svc = svc.clone();
                    tokio::spawn(async move {
                        let key = format!("r{round}-k{i}");
                        read(
                            svc.oneshot(req("POST", "/pay", Some(&key), "b"))
                                .await
                                .unwrap(),
                        )
                        .await
                    })
                })
                .collect();
            for task in tasks {
                let answer = task.await.unwrap();
                assert_eq!(answer.status, 201, "{level}: {}", answer.text());
            }
        }
        assert_eq!(calls.get("/pay"), 192, "{level}");
        pool.close().await;
        done(schema, setup).await;
    }
}
