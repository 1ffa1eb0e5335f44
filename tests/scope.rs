//! Scopes: stores keep a fixed-size digest of each scope, never its text; a scope of any
//! length works; a layer can require one.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::PgPool;
use support::{Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::body::RequestBody;
use tower_idempotency::{IdempotencyLayer, IdempotentTx, MemoryStore};

/// A scope far over Postgres's btree row limit (about 2.7 KB, after compression: so the
/// characters do not repeat), with characters that SQL constants escape.
fn long_scope() -> String {
    let mut scope = String::from("tenant-O'Brien\\");
    let mut x: u32 = 12345;
    while scope.len() < 3000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        scope.push(char::from(b'!' + u8::try_from((x >> 16) % 94).unwrap()));
    }
    scope
}

/// The scope every request gets (the layer's scope function).
fn scoped<St>(layer: IdempotencyLayer<St>, scope: String) -> IdempotencyLayer<St> {
    layer.with_scope(move |_| Some(scope.clone()))
}

/// Asserts that each stored scope is 64 lowercase hex characters and holds no part of
/// `raw`.
async fn assert_scopes_are_digests(pool: &PgPool, raw: &str, records: usize) {
    let scopes: Vec<(String,)> = sqlx::query_as("SELECT scope FROM tower_idempotency_keys")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(scopes.len(), records);
    for (scope,) in scopes {
        assert_eq!(scope.len(), 64, "the scope is stored as it is");
        assert!(
            scope
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{scope}"
        );
        assert!(!scope.contains("tenant") && !raw.contains(&scope));
        assert_eq!(scope, tower_idempotency::scope_digest(raw));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_3000_character_scope_works_in_plain_postgres_mode() {
    let schema = PgSchema::new().await;
    let store = schema.store().await;
    let calls = Calls::default();
    let svc = scoped(IdempotencyLayer::new(store.clone()), long_scope())
        .layer(support::handler(calls.clone()));
    let first = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let again = read(
        svc.oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(again.body, first.body);
    assert_eq!(calls.get("/pay"), 1);
    assert_scopes_are_digests(store.pool(), &long_scope(), 1).await;
    store.pool().close().await;
    schema.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_3000_character_scope_works_in_transactional_mode() {
    let schema = PgSchema::new().await;
    let store = schema.store().await;
    let admin = schema.pool(2).await;
    sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY)")
        .execute(&admin)
        .await
        .unwrap();
    let handler = tower::service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
        let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
        let (id,): (i64,) = sqlx::query_as("INSERT INTO payments DEFAULT VALUES RETURNING id")
            .fetch_one(&mut *tx.conn().await.unwrap())
            .await
            .unwrap();
        let mut res = Response::new(Full::new(Bytes::from(format!("payment {id}"))));
        *res.status_mut() = StatusCode::CREATED;
        Ok::<_, std::io::Error>(res)
    });
    let svc = scoped(IdempotencyLayer::new(store.transactional()), long_scope()).layer(handler);
    let first = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    for _ in 0..2 {
        let again = read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await;
        assert!(again.replayed(), "{} {}", again.status, again.text());
        assert_eq!(again.body, first.body);
    }
    let (payments,): (i64,) = sqlx::query_as("SELECT count(*) FROM payments")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(payments, 1, "the handler ran once");
    assert_scopes_are_digests(&admin, &long_scope(), 1).await;
    store.pool().close().await;
    admin.close().await;
    schema.drop_schema().await;
}

/// Two scopes that differ keep their keys apart, also in the memory store; the empty scope
/// is the shared one.
#[tokio::test]
async fn digested_scopes_keep_keys_apart() {
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .with_scope(|parts| {
            parts
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .layer(support::handler(calls.clone()));
    let send = |tenant: Option<&str>| {
        let mut r = req("POST", "/pay", Some("k"), "b");
        if let Some(t) = tenant {
            r.headers_mut().insert("x-tenant", t.parse().unwrap());
        }
        let svc = svc.clone();
        async move { read(svc.oneshot(r).await.unwrap()).await }
    };
    for tenant in [Some("a"), Some("b"), None, Some("")] {
        send(tenant).await;
    }
    // "a", "b" and the shared scope ("" is the shared scope too).
    assert_eq!(calls.get("/pay"), 3);
    assert!(send(Some("a")).await.replayed());
}

/// With a scope required, a keyed request whose scope function finds no principal (or an
/// empty one) is answered `401` before its handler runs or its key is claimed.
#[tokio::test]
async fn a_request_without_a_scope_is_401_when_a_scope_is_required() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let svc = IdempotencyLayer::new(store.clone())
        .with_scope(|parts| {
            parts
                .headers
                .get("x-principal")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .with_scope_required(true)
        .layer(support::handler(calls.clone()));
    let send = |principal: Option<&str>| {
        let mut r = req("POST", "/pay", Some("k"), "b");
        if let Some(p) = principal {
            r.headers_mut().insert("x-principal", p.parse().unwrap());
        }
        let svc = svc.clone();
        async move { read(svc.oneshot(r).await.unwrap()).await }
    };
    for principal in [None, Some("")] {
        let rejected = send(principal).await;
        rejected.assert_problem(401, "missing-scope");
        assert!(rejected.headers.get("www-authenticate").is_none());
    }
    assert_eq!(calls.get("/pay"), 0, "the handler did not run");
    assert!(store.is_empty(), "no key was claimed");
    assert_eq!(send(Some("acct-1")).await.status, StatusCode::CREATED);
    assert!(send(Some("acct-1")).await.replayed());
    // Requests without a key, and methods not covered, are not the layer's to reject.
    let mut get = req("GET", "/pay", None, "");
    get.headers_mut().remove("x-principal");
    let got = read(svc.clone().oneshot(get).await.unwrap()).await;
    assert_eq!(got.status, StatusCode::CREATED);
    // Without a scope function, every keyed request is rejected.
    let unscoped = IdempotencyLayer::new(MemoryStore::new())
        .with_scope_required(true)
        .layer(support::handler(calls.clone()));
    read(
        unscoped
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await
    .assert_problem(401, "missing-scope");
    assert_eq!(calls.get("/pay"), 2, "the keyed POST and the GET");
}

/// The digest is what stores see: the same for the same scope, and 64 hex characters.
#[test]
fn the_scope_digest_is_fixed_size_hex() {
    use tower_idempotency::scope_digest;
    assert_eq!(scope_digest(""), "");
    let d = scope_digest("account-1");
    assert_eq!(d.len(), 64);
    assert_eq!(d, scope_digest("account-1"));
    assert_ne!(d, scope_digest("account-2"));
    assert!(
        d.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(scope_digest(&long_scope()).len(), 64);
}
