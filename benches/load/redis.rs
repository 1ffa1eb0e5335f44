//! The Redis scenarios (feature `redis`): `RedisStore` against the least a Redis-backed
//! idempotency check must send, by hand, to the same server (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`). Every run uses key prefixes of its own, left to expire within
//! four minutes (records live two, and fences two more: the store's grace is set to two
//! minutes too, so a shared server is not left holding them for the default TTL and grace).
//!
//! | scenario | layer side | baseline |
//! |---|---|---|
//! | `redis-new` | `RedisStore`, a new key per request (claim and completion scripts) | fingerprint + `SET NX PX` of the claim, then `SET PX` of the answer |
//! | `redis-replay` | `RedisStore`, completed keys requested again | fingerprint + `GET` of the stored answer, compared and sent back |
//! | `redis-wait` | `RedisStore::with_wait_replicas(1, 100 ms)`, new keys | the same store without `WAIT` |
//!
//! `redis-wait` starts a master and its replica of its own (`redis-server` on free loopback
//! ports), so that it never attaches a replica to a server it does not own.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use tower_idempotency::fingerprint::fingerprint;
use tower_idempotency::{IdempotencyLayer, RedisStore};

use crate::scenario::{
    Built, Ctx, KeyPlan, PATH, Scenario, complete_replay_keys, create, created, key_of, problem,
};
use crate::{BoxError, common};

/// The Redis scenarios, in the order they run.
pub(crate) const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "redis-new",
        layer_side: "RedisStore, new key per request (its claim and completion scripts)",
        baseline: "fingerprint + SET NX PX of the claim, then SET PX of the answer (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(build_redis_new(ctx)),
    },
    Scenario {
        name: "redis-replay",
        layer_side: "RedisStore, completed keys requested again",
        baseline: "fingerprint + GET of the stored answer (by hand)",
        target: 0.95,
        build: |ctx| Box::pin(build_redis_replay(ctx)),
    },
    Scenario {
        name: "redis-wait",
        layer_side: "RedisStore with_wait_replicas(1, 100 ms), new key per request, on a master with one replica",
        baseline: "the same RedisStore without WAIT, on the same master",
        target: 0.80,
        build: |ctx| Box::pin(build_redis_wait(ctx)),
    },
];

/// How long the scenarios' records live.
const KEEP: Duration = Duration::from_secs(120);
const KEEP_MS: u64 = 120_000;

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A prefix no earlier run used.
fn run_prefix(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("bench:{what}:{}:{nanos}:", std::process::id())
}

async fn connect() -> Result<ConnectionManager, BoxError> {
    let client = redis::Client::open(redis_url())?;
    Ok(ConnectionManager::new(client).await?)
}

/// What the baselines share: the connection and their own key prefix.
#[derive(Clone)]
struct Hand {
    conn: ConnectionManager,
    prefix: Arc<str>,
}

/// The baseline of `redis-new`: the claim as `SET NX PX`, the handler's work, the answer
/// (fingerprint and body) as `SET PX`.
async fn new_baseline(State(hand): State<Hand>, parts: Parts, body: Bytes) -> Response {
    let Some(key) = key_of(&parts.headers) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let name = format!("{}{key}", hand.prefix);
    let mut conn = hand.conn.clone();
    let claimed: Result<Option<String>, _> = redis::cmd("SET")
        .arg(&name)
        .arg(&fp.as_bytes()[..])
        .arg("NX")
        .arg("PX")
        .arg(KEEP_MS)
        .query_async(&mut conn)
        .await;
    match claimed {
        Ok(Some(_)) => {}
        Ok(None) => return problem(StatusCode::CONFLICT),
        Err(e) => {
            eprintln!("baseline: {e}");
            return problem(StatusCode::SERVICE_UNAVAILABLE);
        }
    }
    let answer = created(body.len());
    let mut stored = fp.as_bytes().to_vec();
    stored.extend_from_slice(&common::created_json(body.len()));
    let set: Result<(), _> = conn.pset_ex(&name, stored, KEEP_MS).await;
    if let Err(e) = set {
        eprintln!("baseline: {e}");
    }
    answer
}

/// The baseline of `redis-replay`: `GET` of the answer, its fingerprint compared.
async fn replay_baseline(State(hand): State<Hand>, parts: Parts, body: Bytes) -> Response {
    let Some(key) = key_of(&parts.headers) else {
        return problem(StatusCode::BAD_REQUEST);
    };
    let fp = fingerprint(&parts, &[], &body);
    let mut conn = hand.conn.clone();
    let got: Result<Option<Vec<u8>>, _> = conn.get(format!("{}{key}", hand.prefix)).await;
    match got {
        Ok(Some(stored)) if stored.len() >= 32 && stored[..32] == fp.as_bytes()[..] => (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            Bytes::copy_from_slice(&stored[32..]),
        )
            .into_response(),
        Ok(Some(_)) => problem(StatusCode::UNPROCESSABLE_ENTITY),
        Ok(None) => problem(StatusCode::NOT_FOUND),
        Err(e) => {
            eprintln!("baseline: {e}");
            problem(StatusCode::SERVICE_UNAVAILABLE)
        }
    }
}

/// The layer on a `RedisStore` and the by-hand connection, each with a prefix of its own.
async fn sides() -> Result<(Router, Hand), BoxError> {
    let conn = connect().await?;
    let store = RedisStore::new(conn.clone())
        .with_prefix(run_prefix("layer"))
        .with_grace(KEEP);
    let layer = Router::new()
        .route(PATH, post(create))
        .layer(IdempotencyLayer::new(store).with_ttl(KEEP).unwrap());
    let hand = Hand {
        conn,
        prefix: run_prefix("hand").into(),
    };
    Ok((layer, hand))
}

async fn build_redis_new(_ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, hand) = sides().await?;
    let baseline = Router::new()
        .route(PATH, post(new_baseline))
        .with_state(hand);
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: None,
        owned: None,
    })
}

async fn build_redis_replay(ctx: &Ctx) -> Result<Built, BoxError> {
    let (layer, hand) = sides().await?;
    let new = Router::new()
        .route(PATH, post(new_baseline))
        .with_state(hand.clone());
    let baseline = Router::new()
        .route(PATH, post(replay_baseline))
        .with_state(hand);
    // Complete every key once on both sides (in process), so both replay them.
    let count = ctx.args.replay_keys;
    complete_replay_keys(&layer, count).await?;
    complete_replay_keys(&new, count).await?;
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::Replay { count },
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: None,
        owned: None,
    })
}

/// A `redis-server` the scenario started (not daemonized) and its working directory, both
/// gone on drop.
struct OwnedServer {
    child: std::process::Child,
    dir: std::path::PathBuf,
}

impl Drop for OwnedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts `redis-server` on a free loopback port with `args`; waits until it answers.
async fn start_server(args: &[&str]) -> Result<(OwnedServer, u16), BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    // A replica writes the master's copy to `dump.rdb` in its directory whatever `--save`
    // says: each server gets a directory of its own, not the working directory.
    let dir = std::env::temp_dir().join(format!("ti-load-redis-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--logfile", ""])
        .arg("--dir")
        .arg(&dir)
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .map_err(|e| {
            let _ = std::fs::remove_dir_all(&dir);
            format!("redis-wait needs redis-server on PATH: {e}")
        })?;
    let server = OwnedServer { child, dir };
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    for _ in 0..200 {
        if let Ok(mut c) = client.get_multiplexed_async_connection().await {
            let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
            if pong.is_ok() {
                return Ok((server, port));
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Err(format!("redis-server on port {port} did not start").into())
}

async fn build_redis_wait(_ctx: &Ctx) -> Result<Built, BoxError> {
    // The first sync starts at once (by default a master waits 5 s for more replicas).
    let (master, port) = start_server(&["--repl-diskless-sync-delay", "0"]).await?;
    let (replica, _) = start_server(&["--replicaof", "127.0.0.1", &port.to_string()]).await?;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let conn = ConnectionManager::new(client).await?;
    // Until its replica is in sync every WAIT times out: measure nothing rather than that.
    let mut admin = conn.clone();
    let mut attached = false;
    for _ in 0..400 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut admin)
            .await?;
        // Attached and in sync (`online`), not still loading its first copy.
        attached = info.contains("state=online");
        if attached {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if !attached {
        return Err(format!("redis-wait: the replica never attached to port {port}").into());
    }
    let router = |store: RedisStore| {
        Router::new()
            .route(PATH, post(create))
            .layer(IdempotencyLayer::new(store).with_ttl(KEEP).unwrap())
    };
    let layer = router(
        RedisStore::new(conn.clone())
            .with_prefix(run_prefix("wait"))
            .with_grace(KEEP)
            .with_wait_replicas(1, Duration::from_millis(100)),
    );
    let baseline = router(
        RedisStore::new(conn)
            .with_prefix(run_prefix("nowait"))
            .with_grace(KEEP),
    );
    Ok(Built {
        layer,
        baseline,
        keys: KeyPlan::New,
        baseline_keys: None,
        expect: StatusCode::CREATED,
        schema: None,
        fresh: None,
        owned: Some(Box::new((replica, master))),
    })
}
