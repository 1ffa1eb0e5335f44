//! What the benchmarks share: the request body and the handler's answer.
#![allow(dead_code)] // each benchmark uses part of it

use bytes::Bytes;

/// The size of the request body every benchmark sends (1 KiB).
pub(crate) const BODY_LEN: usize = 1024;

/// A JSON document of exactly `len` bytes (at least 32): an order with a padded note.
pub(crate) fn json_body(len: usize) -> Bytes {
    let head = r#"{"order_id":4711,"amount_cents":1999,"currency":"EUR","note":""#;
    let tail = r#""}"#;
    let pad = len.saturating_sub(head.len() + tail.len());
    let mut s = String::with_capacity(len);
    s.push_str(head);
    s.extend(std::iter::repeat_n('x', pad));
    s.push_str(tail);
    Bytes::from(s)
}

/// The handler's answer to a request whose body had `len` bytes: small JSON, as a create
/// endpoint would answer.
pub(crate) fn created_json(len: usize) -> Bytes {
    Bytes::from(format!(
        r#"{{"id":4711,"status":"created","received":{len}}}"#
    ))
}

/// A create endpoint: reads the body, answers `201` with a small JSON document
/// ([`created_json`]).
pub(crate) fn create_handler<B>() -> impl tower::Service<
    http::Request<B>,
    Response = http::Response<http_body_util::Full<Bytes>>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    use http_body_util::BodyExt;
    tower::service_fn(|req: http::Request<B>| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let mut res = http::Response::new(http_body_util::Full::new(created_json(body.len())));
        *res.status_mut() = http::StatusCode::CREATED;
        res.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        Ok::<_, std::convert::Infallible>(res)
    })
}

/// A `MemoryStore` with no limit: the figures are what the records cost, not what the
/// defaults admit.
pub(crate) fn unbounded_memory_store() -> tower_idempotency::MemoryStore {
    tower_idempotency::MemoryStore::new()
        .with_max_entries(usize::MAX)
        .with_max_bytes(usize::MAX)
}

/// Claims and completes `n` keys in `store` (`00000000-0000-4000-8000-000000000000`, …: 36
/// characters, a UUID's length), each answered `201` with `content-type: application/json`
/// and a 60-byte JSON body, built afresh for each record as the layer does. Every call of a
/// memory store is ready at once, so the whole future is too.
pub(crate) async fn fill_memory_store(store: &tower_idempotency::MemoryStore, n: usize) {
    use tower_idempotency::{ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, Store};
    let body = br#"{"id":"pay_0000000000","amount":100,"currency":"EUR","ok":0}"#;
    let ttl = std::time::Duration::from_secs(24 * 3600);
    for i in 0..n {
        let key = IdempotencyKey::parse(&format!("{i:08x}-0000-4000-8000-000000000000")).unwrap();
        let claim = ClaimRequest {
            scope: "",
            key: &key,
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: std::time::Duration::from_secs(30),
            ttl,
        };
        let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
            panic!("filling: key {i} was not new");
        };
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let answer = tower_idempotency::StoredResponse::new(
            http::StatusCode::CREATED,
            headers,
            Bytes::copy_from_slice(body),
        );
        assert!(store.complete("", &key, token, &answer, ttl).await.unwrap());
    }
}

/// The process's resident set (the `rss` field of `/proc/self/statm`), in bytes (Linux; 0
/// elsewhere).
pub(crate) fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<usize>().ok())
        .unwrap_or(0)
        * 4096
}

/// The server the Postgres benchmarks use: `DATABASE_URL`, or the local service.
#[cfg(feature = "postgres")]
pub(crate) fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Creates a schema of its own, `<prefix>_<pid>_<nanos>`. Returns a one-connection admin
/// pool (to drop the schema at the end), the schema's name, and connect options whose
/// connections work in that schema and show its name as their `application_name`.
#[cfg(feature = "postgres")]
pub(crate) async fn fresh_schema(
    prefix: &str,
) -> Result<
    (sqlx::PgPool, String, sqlx::postgres::PgConnectOptions),
    Box<dyn std::error::Error + Send + Sync>,
> {
    use std::str::FromStr;
    let url = database_url();
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect(&url)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL at {url}: {e}"))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let name = format!("{prefix}_{}_{nanos}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
        .execute(&admin)
        .await?;
    let opts = sqlx::postgres::PgConnectOptions::from_str(&url)?
        .application_name(&name)
        .options([("search_path", name.as_str())]);
    Ok((admin, name, opts))
}
