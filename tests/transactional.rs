//! Transactional mode against a real Postgres: the key and the handler's writes commit
//! together, or not at all.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::PgPool;
use support::{Answer, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresStore, body::RequestBody};

struct Fx {
    schema: PgSchema,
    store: PostgresStore,
    /// A separate pool for checks and for killing connections.
    admin: PgPool,
}

impl Fx {
    async fn new() -> Fx {
        let schema = PgSchema::new().await;
        let store = schema.store().await;
        let admin = schema.pool(4).await;
        sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY, note text NOT NULL)")
            .execute(&admin)
            .await
            .unwrap();
        Fx {
            schema,
            store,
            admin,
        }
    }

    async fn payments(&self) -> i64 {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM payments")
            .fetch_one(&self.admin)
            .await
            .unwrap();
        n
    }

    async fn keys(&self) -> i64 {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM tower_idempotency_keys")
            .fetch_one(&self.admin)
            .await
            .unwrap();
        n
    }

    /// The transactional layer over a handler that writes a payment row through the request's
    /// transaction, then does what the path says.
    fn app(
        &self,
    ) -> impl Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
    + Clone
    + use<> {
        self.app_with(|layer| layer)
    }

    /// [`Fx::app`] with the layer configured by `configure`.
    fn app_with<F>(
        &self,
        configure: F,
    ) -> impl Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
    + Clone
    + use<F>
    where
        F: FnOnce(
            IdempotencyLayer<tower_idempotency::Transactional>,
        ) -> IdempotencyLayer<tower_idempotency::Transactional>,
    {
        let admin = self.admin.clone();
        let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let admin = admin.clone();
            async move {
                let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                let path = req.uri().path().to_owned();
                let (id,): (i64,) =
                    sqlx::query_as("INSERT INTO payments (note) VALUES ($1) RETURNING id")
                        .bind(&path)
                        .fetch_one(&mut *tx.conn().await.unwrap())
                        .await
                        .unwrap();
                let status = match path.as_str() {
                    "/fail" => StatusCode::INTERNAL_SERVER_ERROR,
                    "/bad" => StatusCode::BAD_REQUEST,
                    "/limited" => StatusCode::TOO_MANY_REQUESTS,
                    "/error" => return Err(std::io::Error::other("handler error")),
                    "/panic" => panic!("handler panicked on purpose"),
                    "/slow" => {
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                        StatusCode::CREATED
                    }
                    "/kill" => {
                        // The connection dies after the write, before the layer commits.
                        let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
                            .fetch_one(&mut *tx.conn().await.unwrap())
                            .await
                            .unwrap();
                        sqlx::query("SELECT pg_terminate_backend($1)")
                            .bind(pid)
                            .execute(&admin)
                            .await
                            .unwrap();
                        StatusCode::CREATED
                    }
                    _ => StatusCode::CREATED,
                };
                let mut res = Response::new(Full::new(Bytes::from(format!("payment {id}"))));
                *res.status_mut() = status;
                let h = res.headers_mut();
                h.insert("content-type", HeaderValue::from_static("text/plain"));
                h.insert("x-payment", HeaderValue::from(id));
                Ok::<_, std::io::Error>(res)
            }
        });
        let svc = configure(IdempotencyLayer::new(self.store.transactional())).layer(handler);
        move |r| {
            let svc = svc.clone();
            Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
        }
    }

    async fn cleanup(self) {
        self.store.pool().close().await;
        self.admin.close().await;
        self.schema.drop_schema().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_and_writes_commit_together_and_repeats_replay() {
    let fx = Fx::new().await;
    let app = fx.app();
    let first = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    // The live answer keeps the headers it lent to the stored one while it committed.
    assert_eq!(first.headers["content-type"], "text/plain");
    assert!(first.headers.contains_key("x-payment"));
    for _ in 0..2 {
        let again = app(req("POST", "/pay", Some("k"), "b")).await;
        assert!(again.replayed(), "{} {}", again.status, again.text());
        assert_eq!(again.body, first.body);
        assert_eq!(again.headers["x-payment"], first.headers["x-payment"]);
    }
    app(req("POST", "/pay", Some("k"), "other"))
        .await
        .assert_problem(422, "key-reused");
    // 4xx answers commit too.
    assert_eq!(app(req("POST", "/bad", Some("k2"), "")).await.status, 400);
    assert!(app(req("POST", "/bad", Some("k2"), "")).await.replayed());
    assert_eq!(fx.payments().await, 2);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_error_handler_error_and_panic_roll_everything_back() {
    let fx = Fx::new().await;
    let app = fx.app();
    for _ in 0..2 {
        assert_eq!(app(req("POST", "/fail", Some("f"), "")).await.status, 500);
    }
    let svc_err = {
        let handler = tower::service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            sqlx::query("INSERT INTO payments (note) VALUES ('error')")
                .execute(&mut *tx.conn().await.unwrap())
                .await
                .unwrap();
            Err::<Response<Full<Bytes>>, _>(std::io::Error::other("handler error"))
        });
        IdempotencyLayer::new(fx.store.transactional()).layer(handler)
    };
    let err = svc_err.oneshot(req("POST", "/error", Some("e"), "")).await;
    assert!(err.is_err());
    let panicked = tokio::spawn(app(req("POST", "/panic", Some("p"), ""))).await;
    assert!(panicked.unwrap_err().is_panic());
    assert_eq!(
        (fx.payments().await, fx.keys().await),
        (0, 0),
        "nothing committed"
    );
    // No lease to wait for: the retry after the panic runs at once.
    let retry = app(req("POST", "/pay", Some("p"), "")).await;
    // (A different path from the panicking request: the key was never stored, so no 422.)
    assert_eq!(retry.status, 201);
    assert_eq!(fx.payments().await, 1);
    fx.cleanup().await;
}

/// A `429` is not stored: like a `5xx` it rolls the handler's writes back and frees the key,
/// so the retry runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_answer_rolls_back_and_is_not_stored() {
    let fx = Fx::new().await;
    let app = fx.app();
    for _ in 0..2 {
        let answer = app(req("POST", "/limited", Some("k"), "b")).await;
        assert_eq!(answer.status, 429, "{}", answer.text());
        assert!(!answer.replayed());
    }
    assert_eq!(fx.payments().await, 0, "both runs' writes were rolled back");
    assert_eq!(fx.keys().await, 0, "nothing stored");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_killed_before_commit_stores_nothing_and_the_retry_runs_once() {
    let fx = Fx::new().await;
    let app = fx.app();
    let killed = app(req("POST", "/kill", Some("k"), "b")).await;
    killed.assert_problem(503, "store-unavailable");
    assert_eq!((fx.payments().await, fx.keys().await), (0, 0));
    // The retry runs at once, and once: the advisory lock went with the dead backend (which
    // Postgres ends a moment after the client sees its connection close).
    let started = std::time::Instant::now();
    loop {
        let (alive,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_backend_pid()'",
        )
        .fetch_one(&fx.admin)
        .await
        .unwrap();
        if alive == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "backend still alive"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let svc = fx.app();
    let retry = svc(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(svc(req("POST", "/pay", Some("k"), "b")).await.replayed());
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicate_gets_409_without_waiting_for_the_first() {
    let fx = Fx::new().await;
    let app = fx.app();
    let first = tokio::spawn(app(req("POST", "/slow", Some("k"), "b")));
    // Wait until the first request holds its transaction (its row is written, uncommitted).
    let started = std::time::Instant::now();
    loop {
        let (n,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
                .fetch_one(&fx.admin)
                .await
                .unwrap();
        if n > 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = app(req("POST", "/slow", Some("k"), "b")).await;
    assert!(
        !first.is_finished(),
        "the duplicate must not wait for the first"
    );
    second.assert_problem(409, "request-in-progress");
    assert!(second.headers.contains_key("retry-after"));
    assert_eq!(first.await.unwrap().status, 201);
    assert!(app(req("POST", "/slow", Some("k"), "b")).await.replayed());
    assert_eq!(fx.payments().await, 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_make_one_payment_row() {
    let fx = Fx::new().await;
    let app = fx.app();
    let tasks: Vec<_> = (0..50)
        .map(|_| tokio::spawn(app(req("POST", "/pay", Some("race"), "b"))))
        .collect();
    let mut created = 0;
    for t in tasks {
        let a = t.await.unwrap();
        match a.status.as_u16() {
            201 if a.replayed() => {}
            201 => created += 1,
            409 => a.assert_problem(409, "request-in-progress"),
            other => panic!("{other}: {}", a.text()),
        }
    }
    assert_eq!(created, 1);
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_plain_mode_claim_is_taken_over() {
    use tower_idempotency::{ClaimOutcome, ClaimRequest, IdempotencyKey, Store};
    let fx = Fx::new().await;
    let key = IdempotencyKey::parse("k").unwrap();
    let parts = Request::post("/pay").body(()).unwrap().into_parts().0;
    let claim = ClaimRequest {
        scope: "",
        key: &key,
        fingerprint: tower_idempotency::fingerprint::fingerprint(&parts, &[], b"b"),
        lease: Duration::from_millis(300),
        ttl: Duration::from_secs(60),
    };
    assert!(matches!(
        fx.store.claim(claim).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
    let app = fx.app();
    app(req("POST", "/pay", Some("k"), "b"))
        .await
        .assert_problem(409, "request-in-progress");
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(app(req("POST", "/pay", Some("k"), "b")).await.status, 201);
    assert!(app(req("POST", "/pay", Some("k"), "b")).await.replayed());
    assert_eq!(fx.payments().await, 1);
    fx.cleanup().await;
}

/// Keys and scopes travel inside the claim's and the completion's SQL text (they are sent with
/// `BEGIN` and `COMMIT` in one message). Quotes, backslashes, dollar signs and semicolons
/// must arrive as they are, and keys that differ only there must stay different records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_scopes_with_quotes_and_backslashes_are_stored_as_they_are() {
    let fx = Fx::new().await;
    let app = fx.app_with(|layer| {
        layer.with_scope(|parts: &http::request::Parts| {
            parts
                .headers
                .get("x-tenant")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        })
    });
    let keys = [
        r"a'b",
        r"a''b",
        r"a\b",
        r"a\\b",
        r"x');DROP/**/TABLE/**/payments;--",
        r"$$;COMMIT;$$",
        r"E'\x00'",
        r"\",
        r"'",
    ];
    let tenants = ["O'Brien", r"back\slash", "caf\u{e9} \u{1f4b3}", "$t$;"];
    let send = |key: &str, tenant: &str, body: &str| {
        let mut r = req("POST", "/pay", Some(key), body);
        r.headers_mut().insert(
            "x-tenant",
            http::HeaderValue::from_bytes(tenant.as_bytes()).unwrap(),
        );
        app(r)
    };
    for tenant in tenants {
        for key in keys {
            let first = send(key, tenant, "b").await;
            assert_eq!(first.status, 201, "{tenant} {key}: {}", first.text());
            assert!(!first.replayed(), "{tenant} {key}: a new record");
            let again = send(key, tenant, "b").await;
            assert!(again.replayed(), "{tenant} {key}");
            assert_eq!(again.body, first.body);
            let other = send(key, tenant, "other").await;
            assert_eq!(other.status, 422, "{tenant} {key}: {}", other.text());
            other.assert_problem(422, "key-reused");
        }
    }
    let n = i64::try_from(keys.len() * tenants.len()).unwrap();
    assert_eq!((fx.payments().await, fx.keys().await), (n, n));
    // Stored byte for byte.
    let stored: Vec<(String, String)> =
        sqlx::query_as("SELECT scope, key FROM tower_idempotency_keys")
            .fetch_all(&fx.admin)
            .await
            .unwrap();
    for tenant in tenants {
        for key in keys {
            assert!(
                stored
                    .iter()
                    .any(|(s, k)| *s == tower_idempotency::scope_digest(tenant) && k == key),
                "{tenant:?} {key:?} not stored as sent: {stored:?}"
            );
        }
    }
    fx.cleanup().await;
}

/// A scope with a NUL (which Postgres text cannot hold) works like any other: stores see its
/// digest, never its text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_with_a_nul_is_stored_as_its_digest() {
    let fx = Fx::new().await;
    let app = fx.app_with(|layer| {
        layer.with_scope(|_: &http::request::Parts| Some("tenant\0evil".to_owned()))
    });
    assert_eq!(app(req("POST", "/pay", Some("k"), "b")).await.status, 201);
    assert!(app(req("POST", "/pay", Some("k"), "b")).await.replayed());
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    fx.cleanup().await;
}

/// An expired record does not block its key: the handler runs again and its answer replaces
/// the old record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_record_is_replaced() {
    let fx = Fx::new().await;
    let app = fx.app_with(|layer| layer.with_ttl(Duration::from_millis(300)).unwrap());
    let first = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(first.status, 201);
    assert!(app(req("POST", "/pay", Some("k"), "b")).await.replayed());
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Expired: a new request, even with another payload.
    let second = app(req("POST", "/pay", Some("k"), "other")).await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(!second.replayed());
    assert_ne!(second.body, first.body);
    let again = app(req("POST", "/pay", Some("k"), "other")).await;
    assert!(again.replayed());
    assert_eq!(again.body, second.body);
    assert_eq!((fx.payments().await, fx.keys().await), (2, 1));
    fx.cleanup().await;
}

/// A purge that deletes an expired record while a request for its key waits to take it
/// over (the purge's batch holds the record's row lock between its `FOR UPDATE` and its
/// `DELETE`): when the wait ends the record is gone, and the request claims the key anew.
/// The handler runs once and the client gets its answer, not a `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_record_purged_during_its_takeover_is_claimed_anew() {
    let fx = Fx::new().await;
    let app = fx.app_with(|layer| layer.with_ttl(Duration::from_millis(300)).unwrap());
    assert_eq!(app(req("POST", "/pay", Some("k"), "b")).await.status, 201);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The purge's batch, first half: the expired record locked.
    let mut purge = fx.admin.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tower_idempotency_keys WHERE key = 'k' FOR UPDATE")
        .execute(&mut *purge)
        .await
        .unwrap();
    let retry = tokio::spawn({
        let app = app.clone();
        async move { app(req("POST", "/pay", Some("k"), "b")).await }
    });
    // Until the request's takeover waits for the purge's lock. (The claim's message is found
    // by its first statement: `pg_stat_activity` keeps a query's first 1024 bytes only.)
    let mut waited = false;
    for _ in 0..500 {
        let (waiting,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE wait_event_type = 'Lock' \
                AND query LIKE 'BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; %'",
        )
        .fetch_one(&fx.admin)
        .await
        .unwrap();
        if waiting > 0 {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waited,
        "the request's takeover waited for the purge's row lock"
    );
    // Second half: the delete, committed.
    sqlx::query("DELETE FROM tower_idempotency_keys WHERE key = 'k'")
        .execute(&mut *purge)
        .await
        .unwrap();
    purge.commit().await.unwrap();
    let retry = retry.await.unwrap();
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!((fx.payments().await, fx.keys().await), (2, 1));
    assert!(app(req("POST", "/pay", Some("k"), "b")).await.replayed());
    fx.cleanup().await;
}

/// A handler slower than the TTL: the record lives the TTL from the completion (the
/// statement's time, not the transaction's start), so a retry right after the answer replays
/// it instead of charging again; a duplicate while it runs is `409`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_the_ttl_leaves_a_record_that_lives_the_ttl() {
    let fx = Fx::new().await;
    let app = fx.app_with(|layer| layer.with_ttl(Duration::from_millis(800)).unwrap());
    let first = tokio::spawn({
        let app = app.clone();
        async move { app(req("POST", "/slow", Some("k"), "b")).await }
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    app(req("POST", "/slow", Some("k"), "b"))
        .await
        .assert_problem(409, "request-in-progress");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    let again = app(req("POST", "/slow", Some("k"), "b")).await;
    assert!(
        again.replayed(),
        "a retry right after the answer: {}",
        again.text()
    );
    assert_eq!(again.body, first.body);
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    fx.cleanup().await;
}

/// A plain-mode request on the same table that claims the key while the transactional
/// request's handler runs waits for that transaction (its record is not committed yet), then
/// sees the completed record: one payment, and the plain-mode claim gets the transactional
/// request's answer to replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_mode_claim_made_meanwhile_waits_and_replays_the_answer() {
    use tower_idempotency::{ClaimOutcome, ClaimRequest, IdempotencyKey, Store};
    let fx = Fx::new().await;
    let inside = std::sync::Arc::new(tokio::sync::Notify::new());
    let signal = inside.clone();
    let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let signal = signal.clone();
        async move {
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            sqlx::query("INSERT INTO payments (note) VALUES ('tx')")
                .execute(&mut *tx.conn().await.unwrap())
                .await
                .unwrap();
            signal.notify_one();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut res = Response::new(Full::new(Bytes::from_static(b"paid")));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, std::io::Error>(res)
        }
    });
    let svc = IdempotencyLayer::new(fx.store.transactional()).layer(handler);
    let first = tokio::spawn(svc.oneshot(req("POST", "/pay", Some("k"), "b")));
    inside.notified().await;
    // Meanwhile, a plain-mode request claims the same key on another connection.
    let key = IdempotencyKey::parse("k").unwrap();
    let parts = Request::post("/pay").body(()).unwrap().into_parts().0;
    let claimed = fx
        .store
        .claim(ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: tower_idempotency::fingerprint::fingerprint(&parts, &[], b"b"),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        })
        .await
        .unwrap();
    let answer = read(first.await.unwrap().unwrap()).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    match claimed {
        ClaimOutcome::Completed(stored) => {
            assert_eq!(stored.status(), StatusCode::CREATED);
            assert_eq!(stored.body().unwrap().as_ref(), b"paid");
        }
        other => panic!("the plain-mode claim should replay, got {other:?}"),
    }
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    fx.cleanup().await;
}

/// The axum extractor hands the handler the request's transaction.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_extractor_writes_in_the_request_transaction() {
    use axum::Router;
    use axum::routing::post;

    async fn pay(tx: IdempotentTx) -> Result<(StatusCode, String), StatusCode> {
        let mut conn = tx
            .conn()
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        let (id,): (i64,) =
            sqlx::query_as("INSERT INTO payments (note) VALUES ('axum') RETURNING id")
                .fetch_one(&mut *conn)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok((StatusCode::CREATED, format!("payment {id}")))
    }

    let fx = Fx::new().await;
    let app = Router::new()
        .route("/pay", post(pay))
        .route(
            "/plain",
            post(|tx: Option<IdempotentTx>| async move { format!("{}", tx.is_some()) }),
        )
        .layer(IdempotencyLayer::new(fx.store.transactional()).with_key_required(false));
    let send = |uri: &str, key: Option<&str>| {
        let mut b = Request::post(uri);
        if let Some(k) = key {
            b = b.header("idempotency-key", k);
        }
        app.clone()
            .oneshot(b.body(axum::body::Body::from("{}")).unwrap())
    };
    let first = read(send("/pay", Some("k")).await.unwrap()).await;
    assert_eq!(first.status, 201);
    let again = read(send("/pay", Some("k")).await.unwrap()).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    // Without a key (optional here) there is no transaction to extract.
    let plain = read(send("/plain", None).await.unwrap()).await;
    assert_eq!(plain.text(), "false");
    fx.cleanup().await;
}

/// What the handler of [`bounded_app`] does on its first call, after writing its payment row;
/// later calls write theirs and answer `201`.
#[derive(Clone, Copy)]
enum FirstCall {
    /// Never answers (a remote call without a timeout).
    Hangs,
    /// Moves its `TxConn` into a task that keeps it this long, and answers `201` at once.
    KeepsTheConnFor(Duration),
    /// Asks for a second `TxConn` while it holds one.
    AsksTwice,
}

/// The transactional layer, with `timeout` as its handler bound, over a handler that writes a
/// payment row and, on its first call, does what `first` says.
type BoundedApp = std::sync::Arc<
    dyn Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
        + Send
        + Sync,
>;

fn bounded_app(
    fx: &Fx,
    timeout: Duration,
    first: FirstCall,
) -> (BoundedApp, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            let mut conn = tx.conn().await.unwrap();
            sqlx::query("INSERT INTO payments (note) VALUES ('paid')")
                .execute(&mut *conn)
                .await
                .unwrap();
            let mut body = format!("call {n}");
            if n == 1 {
                match first {
                    FirstCall::Hangs => std::future::pending::<()>().await,
                    FirstCall::KeepsTheConnFor(hold) => {
                        drop(conn);
                        let keeper = tx.clone();
                        tokio::spawn(async move {
                            let _kept = keeper.conn().await.unwrap();
                            tokio::time::sleep(hold).await;
                        });
                        // The task has its TxConn before the handler answers.
                        while tx.conn().await.is_ok() {
                            tokio::task::yield_now().await;
                        }
                        return Ok(Response::new(Full::new(Bytes::from(body))));
                    }
                    FirstCall::AsksTwice => {
                        let second = tokio::time::timeout(Duration::from_secs(5), tx.conn()).await;
                        body = match second {
                            Ok(Err(e)) => format!("second conn: {e}"),
                            Ok(Ok(_)) => "second conn: granted".into(),
                            Err(_) => "second conn: still waiting after 5 s".into(),
                        };
                    }
                }
            }
            drop(conn);
            let mut res = Response::new(Full::new(Bytes::from(body)));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, std::io::Error>(res)
        }
    });
    let svc = IdempotencyLayer::new(fx.store.transactional().with_handler_timeout(timeout))
        .layer(handler);
    let app: BoundedApp = std::sync::Arc::new(move |r| {
        let svc = svc.clone();
        Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
    });
    (app, calls)
}

/// A handler that never answers is stopped at the handler bound: the client gets `503`
/// `handler-timed-out` with `Retry-After`, its write is rolled back, its pooled connection
/// goes back to the pool, and the key is free: the retry runs the handler and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_is_stopped_at_the_handler_timeout_and_its_key_freed() {
    let fx = Fx::new().await;
    let (app, calls) = bounded_app(&fx, Duration::from_millis(300), FirstCall::Hangs);
    let started = std::time::Instant::now();
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        app(req("POST", "/pay", Some("k"), "b")),
    )
    .await
    .expect("a hung handler must not hold its request forever");
    first.assert_problem(503, "handler-timed-out");
    assert!(first.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        fx.payments().await,
        0,
        "the hung handler's write was rolled back"
    );
    assert_eq!(fx.keys().await, 0, "the key is free");
    // A connection given back goes to the pool's idle list in a task (after a ping): wait
    // for it, a bounded while.
    let pool = fx.store.pool();
    for _ in 0..100 {
        if pool.size() as usize == pool.num_idle() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pool.size() as usize,
        pool.num_idle(),
        "every connection back in the pool"
    );

    let retry = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(retry.text(), "call 2");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(fx.payments().await, 1);
    fx.cleanup().await;
}

/// `IdempotentTx::conn` while a `TxConn` of the same transaction is held is an immediate
/// error, never a wait that could not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_a_second_conn_while_one_is_held_is_an_immediate_error() {
    let fx = Fx::new().await;
    let (app, _) = bounded_app(&fx, Duration::from_secs(30), FirstCall::AsksTwice);
    let first = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(
        first.text(),
        "second conn: the idempotent request's transaction is in use: a TxConn of it is still held"
    );
    fx.cleanup().await;
}

/// A handler that answers while a task of its still holds a `TxConn`: nothing was committed,
/// so the client gets `503`; the key stays held (a retry gets `409`) until the task drops its
/// `TxConn`, then the transaction is rolled back, the connection goes back to the pool, and a
/// retry runs the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txconn_kept_past_the_answer_is_rolled_back_when_it_is_dropped() {
    let fx = Fx::new().await;
    let (app, calls) = bounded_app(
        &fx,
        Duration::from_secs(30),
        FirstCall::KeepsTheConnFor(Duration::from_millis(700)),
    );
    let first = app(req("POST", "/pay", Some("k"), "b")).await;
    first.assert_problem(503, "store-unavailable");
    let meanwhile = app(req("POST", "/pay", Some("k"), "b")).await;
    meanwhile.assert_problem(409, "request-in-progress");
    let pool = fx.store.pool().clone();
    let mut freed = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        if pool.size() as usize == pool.num_idle() {
            freed = true;
            break;
        }
    }
    assert!(
        freed,
        "the connection went back to the pool once the TxConn was dropped"
    );
    assert_eq!(
        fx.payments().await,
        0,
        "the kept transaction was rolled back"
    );
    let retry = app(req("POST", "/pay", Some("k"), "b")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(fx.payments().await, 1);
    fx.cleanup().await;
}

/// A `TxConn` kept by a task past the handler bound and never let go: the layer ends the
/// transaction from another connection, so the key is free again after about twice the
/// bound, and a retry runs the handler and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_txconn_kept_forever_is_ended_from_outside_after_the_handler_timeout() {
    let fx = Fx::new().await;
    let (app, calls) = bounded_app(
        &fx,
        Duration::from_millis(300),
        // Far past the bound; not longer, so that the pool can close at the end.
        FirstCall::KeepsTheConnFor(Duration::from_secs(5)),
    );
    let first = app(req("POST", "/pay", Some("k"), "b")).await;
    let answered = std::time::Instant::now();
    first.assert_problem(503, "store-unavailable");
    let mut retry = None;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let answer = app(req("POST", "/pay", Some("k"), "b")).await;
        if answer.status != 409 {
            retry = Some(answer);
            break;
        }
    }
    let retry = retry.expect("the key was freed before the TxConn was let go");
    assert!(answered.elapsed() < Duration::from_secs(4));
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(fx.payments().await, 1, "only the retry's write committed");
    fx.cleanup().await;
}

/// A gRPC answer in transactional mode: its trailers (`grpc-status`) commit with the key and
/// the handler's writes and are replayed after the body; a call that failed with
/// `UNAVAILABLE` (`503`'s code) rolls back and is not stored, like a `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_trailers_commit_with_the_answer_and_unavailable_rolls_back() {
    use http_body_util::BodyExt;
    use support::WithTrailers;
    let fx = Fx::new().await;
    let handler = tower::service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
        let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
        sqlx::query("INSERT INTO payments (note) VALUES ('grpc')")
            .execute(&mut *tx.conn().await.unwrap())
            .await
            .unwrap();
        let code = if req.uri().path() == "/unavailable" {
            "14"
        } else {
            "0"
        };
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static(code));
        let body = WithTrailers {
            data: Some(Bytes::from_static(b"\0\0\0\0\x01x")),
            trailers: Some(trailers),
        };
        let mut res = Response::new(body);
        res.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        Ok::<_, std::io::Error>(res)
    });
    let svc = IdempotencyLayer::new(fx.store.transactional())
        .with_shared_scope()
        .layer(handler);
    let send = |path: &'static str| {
        let svc = svc.clone();
        async move {
            let res = svc
                .oneshot(req("POST", path, Some(path), "m"))
                .await
                .unwrap();
            let (parts, body) = res.into_parts();
            let collected = body.collect().await.unwrap();
            let trailers = collected.trailers().cloned();
            (parts.headers, trailers, collected.to_bytes())
        }
    };
    let (_, first_trailers, first_body) = send("/ok").await;
    assert_eq!(first_trailers.as_ref().unwrap()["grpc-status"], "0");
    let (headers, trailers, body) = send("/ok").await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(trailers, first_trailers);
    assert_eq!(body, first_body);
    assert_eq!((fx.payments().await, fx.keys().await), (1, 1));
    for _ in 0..2 {
        let (headers, trailers, _) = send("/unavailable").await;
        assert!(!headers.contains_key("idempotent-replayed"));
        assert_eq!(trailers.unwrap()["grpc-status"], "14");
    }
    assert_eq!(
        (fx.payments().await, fx.keys().await),
        (1, 1),
        "the UNAVAILABLE calls were rolled back and not stored"
    );
    fx.cleanup().await;
}

/// Above `READ COMMITTED` the waiters are woken after the commit, in a statement of its own in
/// the completion's message. When that wake-up fails, the request's answer stands and nothing
/// stays open on the connection: the pool's next user runs its statements (no `25P02`).
/// Transactional mode's completion and phased mode's last phase alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_that_fails_after_the_commit_leaves_the_pooled_connection_usable() {
    let schema = PgSchema::new().await;
    let admin = schema.direct_pool(2).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            schema
                .connect_options()
                .options([("default_transaction_isolation", "repeatable read")]),
        )
        .await
        .unwrap();
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE payments (id bigserial PRIMARY KEY, note text NOT NULL); \
         CREATE OR REPLACE FUNCTION tower_idempotency_wake(p_hash bigint) RETURNS void \
         LANGUAGE plpgsql AS $$ BEGIN IF p_hash IS NOT NULL THEN \
         RAISE EXCEPTION 'the wake-up fails'; END IF; END $$",
    )
    .execute(&admin)
    .await
    .unwrap();
    let transactional = IdempotencyLayer::new(store.transactional()).layer(tower::service_fn(
        |req: Request<RequestBody<Full<Bytes>>>| async move {
            let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
            sqlx::query("INSERT INTO payments (note) VALUES ('transactional')")
                .execute(&mut *tx.conn().await.unwrap())
                .await
                .unwrap();
            Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::new())))
        },
    ));
    let phased = IdempotencyLayer::new(store.phased()).layer(tower::service_fn(
        |req: Request<RequestBody<Full<Bytes>>>| async move {
            let phases = req
                .extensions()
                .get::<tower_idempotency::Phases>()
                .unwrap()
                .clone();
            sqlx::query("INSERT INTO payments (note) VALUES ('phased')")
                .execute(&mut *phases.tx().await.unwrap())
                .await
                .unwrap();
            Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::new())))
        },
    ));
    let first = read(
        transactional
            .oneshot(req("POST", "/pay", Some("w-1"), "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    tower_idempotency::Store::purge_expired(&store, 1)
        .await
        .unwrap();
    let second = read(
        phased
            .oneshot(req("POST", "/pay", Some("w-2"), "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(second.status, 200, "{}", second.text());
    tower_idempotency::Store::purge_expired(&store, 1)
        .await
        .unwrap();
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);
    pool.close().await;
    admin.close().await;
    schema.drop_schema().await;
}
