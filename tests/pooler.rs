//! Behind a connection pooler in transaction pooling mode (PgBouncer): many clients, few
//! server connections, and a client's statements landing on whichever server connection is
//! free. These tests need `TI_PGBOUNCER_URL` (a PgBouncer in transaction mode in front of
//! `DATABASE_URL`'s server; see `tests/support`), so they are ignored by default;
//! `scripts/test.sh` starts a PgBouncer and runs them with `--include-ignored`.
//!
//! The stores, inboxes and layers here reach Postgres only through the pooler; the tests'
//! own checks go straight to the server.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::{PgConnection, PgPool, Row as _};
use support::{Answer, Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::inbox::{Delivery, Inbox};
use tower_idempotency::{
    ClaimStrategy, IdempotencyKey, IdempotencyLayer, IdempotentTx, PostgresStore, Store,
    body::RequestBody,
};

const NEEDS_POOLER: &str = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL";

/// App instances, each with a pool of [`CLIENTS_PER_INSTANCE`]: together far more clients than
/// the pooler has server connections per database and user (`scripts/test.sh` gives it 20).
const INSTANCES: usize = 4;
const CLIENTS_PER_INSTANCE: u32 = 16;
const CLIENTS: usize = INSTANCES * CLIENTS_PER_INSTANCE as usize;

/// Fails the test, saying what to do, when no pooler is configured.
fn require_pooler() {
    assert!(
        support::pooler_url().is_some(),
        "this test {NEEDS_POOLER}: run ./scripts/test.sh, which starts one, or set \
         TI_PGBOUNCER_URL (e.g. postgres://postgres@127.0.0.1:6432/postgres)"
    );
}

/// A schema reached through the pooler, with a direct pool for the test's own checks.
struct Fx {
    schema: PgSchema,
    direct: PgPool,
}

impl Fx {
    async fn new() -> Fx {
        require_pooler();
        let schema = PgSchema::new().await;
        let direct = schema.direct_pool(2).await;
        Fx { schema, direct }
    }

    /// `INSTANCES` stores, each on a pool of its own through the pooler, with the claim
    /// strategies mixed, migrated all at once.
    async fn stores(&self) -> Vec<PostgresStore> {
        let strategies = [
            ClaimStrategy::Adaptive,
            ClaimStrategy::Combined,
            ClaimStrategy::ReadFirst,
            ClaimStrategy::InsertFirst,
        ];
        let mut stores = Vec::new();
        for i in 0..INSTANCES {
            let pool = self.schema.pool(CLIENTS_PER_INSTANCE).await;
            stores.push(
                PostgresStore::new(pool).with_claim_strategy(strategies[i % strategies.len()]),
            );
        }
        let migrations: Vec<_> = stores
            .iter()
            .map(|s| {
                let s = s.clone();
                tokio::spawn(async move { s.migrate().await })
            })
            .collect();
        for m in migrations {
            m.await.unwrap().expect("migrate() through the pooler");
        }
        stores
    }

    /// One number from the server, asked directly.
    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.direct)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    async fn cleanup(self, stores: Vec<PostgresStore>) {
        for s in stores {
            s.pool().close().await;
        }
        self.direct.close().await;
        self.schema.drop_schema().await;
    }
}

type App = Arc<
    dyn Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
        + Send
        + Sync,
>;

/// The plain-mode layer over the counting test handler, on `store`.
fn plain_app(store: PostgresStore, calls: &Calls) -> App {
    let svc = IdempotencyLayer::new(store).layer(support::handler(calls.clone()));
    Arc::new(move |r| {
        let svc = svc.clone();
        Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
    })
}

/// Sends `make(i)` for `i` in `0..n` all at once (released together), to the apps in turn.
async fn burst(
    apps: &[App],
    n: usize,
    make: impl Fn(usize) -> Request<Full<Bytes>>,
) -> Vec<Answer> {
    let start = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let app = apps[i % apps.len()].clone();
            let r = make(i);
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                app(r).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

/// Proves the setup the other tests rely on: connections through the pooler share server
/// connections (far fewer server backends than clients: pooling, not a direct connection), a
/// client's statements move between server backends (transaction mode, not session mode),
/// and the schema's role carries its `search_path` and the default isolation level.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn clients_share_few_server_connections_and_keep_their_settings() {
    let fx = Fx::new().await;
    let pool = fx.schema.pool(u32::try_from(CLIENTS).unwrap()).await;
    let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let pool = pool.clone();
            let start = start.clone();
            tokio::spawn(async move {
                // Each task holds a client connection of its own for all its statements.
                let mut conn = pool.acquire().await.unwrap();
                start.wait().await;
                let mut pids = Vec::new();
                let mut settings = HashSet::new();
                for _ in 0..10 {
                    let row = sqlx::raw_sql(
                        "SELECT pg_backend_pid(), current_setting('search_path'),
                                current_setting('default_transaction_isolation')",
                    )
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
                    pids.push(row.try_get::<i32, _>(0).unwrap());
                    settings.insert((
                        row.try_get::<String, _>(1).unwrap(),
                        row.try_get::<String, _>(2).unwrap(),
                    ));
                    tokio::task::yield_now().await;
                }
                (pids, settings)
            })
        })
        .collect();
    let mut backends = HashSet::new();
    let mut moved = 0;
    let mut settings = HashSet::new();
    for t in tasks {
        let (pids, s) = t.await.unwrap();
        if pids.iter().collect::<HashSet<_>>().len() > 1 {
            moved += 1;
        }
        backends.extend(pids);
        settings.extend(s);
    }
    assert!(
        backends.len() < CLIENTS,
        "{CLIENTS} clients used {} server backends: the pooler does not pool",
        backends.len()
    );
    assert!(
        moved > 0,
        "no client's statements moved between server backends: not transaction pooling"
    );
    let level = support::isolation().unwrap_or("read committed");
    assert_eq!(
        settings,
        HashSet::from([(fx.schema.name.clone(), level.to_owned())]),
        "every server connection of the role has the schema's search_path and the isolation level"
    );
    pool.close().await;
    fx.cleanup(Vec::new()).await;
}

/// `migrate()` from many instances at once, each on its own pool through the pooler, on a
/// fresh schema: every call succeeds, the tables are there once, and running it again is a
/// no-op. The inbox's `migrate()` (the same migrations) joins the race.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn many_instances_migrate_at_once() {
    let fx = Fx::new().await;
    let mut pools = Vec::new();
    for _ in 0..8 {
        pools.push(fx.schema.pool(2).await);
    }
    let start = Arc::new(tokio::sync::Barrier::new(pools.len()));
    let tasks: Vec<_> = pools
        .iter()
        .enumerate()
        .map(|(i, pool)| {
            let pool = pool.clone();
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                if i % 2 == 0 {
                    PostgresStore::new(pool).migrate().await
                } else {
                    Inbox::new(pool).migrate().await
                }
            })
        })
        .collect();
    for t in tasks {
        t.await
            .unwrap()
            .expect("a concurrent migrate() through the pooler");
    }
    let tables = fx
        .count(
            "SELECT count(*) FROM pg_tables
              WHERE schemaname = current_schema()
                AND tablename IN ('tower_idempotency_keys', 'tower_idempotency_processed_messages')",
        )
        .await;
    assert_eq!(tables, 2);
    // Again, from every instance: nothing to do, nothing fails.
    for pool in &pools {
        PostgresStore::new(pool.clone()).migrate().await.unwrap();
    }
    // And the store works through the pooler.
    let calls = Calls::default();
    let app = plain_app(PostgresStore::new(pools[0].clone()), &calls);
    let first = app(req("POST", "/pay", Some("after-migrate"), "b")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let again = plain_app(PostgresStore::new(pools[1].clone()), &calls)(req(
        "POST",
        "/pay",
        Some("after-migrate"),
        "b",
    ))
    .await;
    assert!(again.replayed() && again.body == first.body);
    assert_eq!(calls.total(), 1);
    for pool in pools {
        pool.close().await;
    }
    fx.cleanup(Vec::new()).await;
}

/// Many clients racing one key through a pool with fewer server connections than clients:
/// the handler runs once per key, every other answer is `409` or a byte-for-byte replay.
/// Then as many distinct keys at once: each runs once, and replays from another instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn many_clients_race_through_a_small_pool() {
    let fx = Fx::new().await;
    let stores = fx.stores().await;
    for round in 0..3 {
        let calls = Calls::default();
        let apps: Vec<App> = stores
            .iter()
            .map(|s| plain_app(s.clone(), &calls))
            .collect();
        let key = format!("race-{round}");
        let answers = burst(&apps, CLIENTS, |_| {
            req("POST", "/slow?ms=300", Some(&key), "same body")
        })
        .await;
        let ran: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
            .collect();
        assert_eq!(ran.len(), 1, "round {round}: exactly one ran: {answers:#?}");
        assert_eq!(calls.get("/slow"), 1, "round {round}");
        let original = ran[0].body.clone();
        for a in &answers {
            match a.status {
                StatusCode::CREATED => assert_eq!(a.body, original, "round {round}"),
                StatusCode::CONFLICT => a.assert_problem(409, "request-in-progress"),
                other => panic!("round {round}: {other}: {}", a.text()),
            }
        }
        // Every instance replays it now.
        for app in &apps {
            let a = app(req("POST", "/slow?ms=300", Some(&key), "same body")).await;
            assert!(a.replayed(), "round {round}: {}", a.text());
            assert_eq!(a.body, original);
        }
        assert_eq!(calls.get("/slow"), 1, "round {round}");
    }

    let calls = Calls::default();
    let apps: Vec<App> = stores
        .iter()
        .map(|s| plain_app(s.clone(), &calls))
        .collect();
    let answers = burst(&apps, CLIENTS, |i| {
        req("POST", &format!("/k{i}"), Some(&format!("k{i}")), "b")
    })
    .await;
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(a.status, StatusCode::CREATED, "k{i}: {}", a.text());
        assert!(!a.replayed());
    }
    assert_eq!(calls.total(), CLIENTS);
    // Each key replays, from the instance that ran it and from another one.
    let replays = burst(&apps, CLIENTS, |i| {
        req("POST", &format!("/k{i}"), Some(&format!("k{i}")), "b")
    })
    .await;
    // `burst` sends request i to app i % INSTANCES both times; shift by one instance.
    let shifted: Vec<App> = (0..INSTANCES)
        .map(|i| apps[(i + 1) % INSTANCES].clone())
        .collect();
    let replays_elsewhere = burst(&shifted, CLIENTS, |i| {
        req("POST", &format!("/k{i}"), Some(&format!("k{i}")), "b")
    })
    .await;
    for (i, a) in replays.iter().chain(&replays_elsewhere).enumerate() {
        assert!(a.replayed(), "k{}: {}", i % CLIENTS, a.text());
        assert_eq!(a.body, answers[i % CLIENTS].body);
    }
    assert_eq!(calls.total(), CLIENTS, "no key ran twice");
    assert_eq!(
        fx.count("SELECT count(*) FROM tower_idempotency_keys")
            .await,
        i64::try_from(CLIENTS + 3).unwrap()
    );
    fx.cleanup(stores).await;
}

/// Transactional mode through the pooler, from several instances: the handler's write and the
/// key commit together (one row per key, however many raced it), and a `5xx` leaves neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn transactional_mode_commits_writes_with_keys_from_many_clients() {
    let fx = Fx::new().await;
    sqlx::raw_sql("CREATE TABLE payments (id bigserial PRIMARY KEY, note text NOT NULL)")
        .execute(&fx.direct)
        .await
        .unwrap();
    let stores = fx.stores().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let apps: Vec<App> = stores
        .iter()
        .map(|store| {
            let runs = runs.clone();
            let handler = tower::service_fn(move |r: Request<RequestBody<Full<Bytes>>>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let tx = r.extensions().get::<IdempotentTx>().unwrap().clone();
                    let path = r.uri().path().to_owned();
                    let mut conn = tx.conn().await.unwrap();
                    let id: i64 =
                        sqlx::query_scalar("INSERT INTO payments (note) VALUES ($1) RETURNING id")
                            .bind(&path)
                            .persistent(false)
                            .fetch_one(&mut *conn)
                            .await
                            .unwrap();
                    drop(conn);
                    // Hold the transaction (and its server connection) a while.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let status = if path.starts_with("/fail") {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::CREATED
                    };
                    let mut res = Response::new(Full::new(Bytes::from(format!("payment {id}"))));
                    *res.status_mut() = status;
                    Ok::<_, std::io::Error>(res)
                }
            });
            let svc = IdempotencyLayer::new(store.transactional()).layer(handler);
            let app: App = Arc::new(move |r| {
                let svc = svc.clone();
                Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
            });
            app
        })
        .collect();

    // One key raced by every client.
    let answers = burst(&apps, CLIENTS, |_| req("POST", "/pay", Some("one"), "b")).await;
    let ran = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .count();
    assert_eq!(ran, 1, "{answers:#?}");
    for a in &answers {
        if a.status != StatusCode::CREATED {
            a.assert_problem(409, "request-in-progress");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(fx.count("SELECT count(*) FROM payments").await, 1);

    // Distinct keys at once, a quarter of them failing with a 5xx.
    let answers = burst(&apps, CLIENTS, |i| {
        let path = if i % 4 == 0 { "/fail" } else { "/pay" };
        req("POST", &format!("{path}/{i}"), Some(&format!("k{i}")), "b")
    })
    .await;
    for (i, a) in answers.iter().enumerate() {
        let expected = if i % 4 == 0 { 500 } else { 201 };
        assert_eq!(a.status, expected, "k{i}: {}", a.text());
    }
    let committed = i64::try_from(CLIENTS - CLIENTS.div_ceil(4)).unwrap();
    assert_eq!(
        fx.count("SELECT count(*) FROM payments").await,
        1 + committed,
        "a row for each 2xx, none for a 5xx"
    );
    assert_eq!(
        fx.count("SELECT count(*) FROM tower_idempotency_keys")
            .await,
        1 + committed,
        "a key for each 2xx, none for a 5xx"
    );
    // The 2xx replay from another instance; the 5xx run again.
    let before = runs.load(Ordering::SeqCst);
    let shifted: Vec<App> = (0..INSTANCES)
        .map(|i| apps[(i + 1) % INSTANCES].clone())
        .collect();
    let again = burst(&shifted, CLIENTS, |i| {
        let path = if i % 4 == 0 { "/fail" } else { "/pay" };
        req("POST", &format!("{path}/{i}"), Some(&format!("k{i}")), "b")
    })
    .await;
    for (i, a) in again.iter().enumerate() {
        if i % 4 == 0 {
            assert_eq!(a.status, 500, "k{i}: {}", a.text());
            assert!(!a.replayed());
        } else {
            assert!(a.replayed(), "k{i}: {}", a.text());
            assert_eq!(a.body, answers[i].body);
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst) - before,
        CLIENTS.div_ceil(4),
        "only the 5xx ran again"
    );
    assert_eq!(
        fx.count("SELECT count(*) FROM payments").await,
        1 + committed
    );
    fx.cleanup(stores).await;
}

/// The inbox through the pooler: deliveries of one message from many clients at once (more
/// than the pooler's server connections) process it once; distinct messages each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn the_inbox_processes_each_message_once_from_many_clients() {
    let fx = Fx::new().await;
    sqlx::raw_sql("CREATE TABLE ledger (message_id text NOT NULL, amount bigint NOT NULL)")
        .execute(&fx.direct)
        .await
        .unwrap();
    let mut inboxes = Vec::new();
    for _ in 0..INSTANCES {
        inboxes.push(Inbox::new(fx.schema.pool(CLIENTS_PER_INSTANCE).await));
    }
    inboxes[0].migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));

    let deliver = |n: usize, id: Arc<dyn Fn(usize) -> String + Send + Sync>| {
        let start = Arc::new(tokio::sync::Barrier::new(n));
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let inbox = inboxes[i % INSTANCES].clone();
                let runs = runs.clone();
                let start = start.clone();
                let id = id(i);
                tokio::spawn(async move {
                    start.wait().await;
                    inbox
                        .process("billing", &id, async |c: &mut PgConnection| {
                            runs.fetch_add(1, Ordering::SeqCst);
                            sqlx::query("INSERT INTO ledger VALUES ($1, 5)")
                                .bind(&id)
                                .persistent(false)
                                .execute(&mut *c)
                                .await?;
                            // Hold the ID while the other deliveries arrive.
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            Ok::<_, sqlx::Error>(())
                        })
                        .await
                })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };

    let outcomes = deliver(CLIENTS, Arc::new(|_| "m1".to_owned())).await;
    let mut processed = 0;
    for o in outcomes {
        match o {
            Ok(Delivery::Processed(())) => processed += 1,
            Ok(Delivery::Duplicate) => {}
            other => panic!("a delivery failed: {other:?}"),
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");

    let outcomes = deliver(CLIENTS, Arc::new(|i| format!("m-{}", i / 2))).await;
    let processed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Delivery::Processed(()))))
        .count();
    for o in &outcomes {
        assert!(o.is_ok(), "a delivery failed: {o:?}");
    }
    assert_eq!(processed, CLIENTS / 2, "each of the messages once");
    assert_eq!(
        fx.count("SELECT count(*) FROM ledger").await,
        i64::try_from(1 + CLIENTS / 2).unwrap()
    );
    assert_eq!(
        fx.count("SELECT count(DISTINCT message_id) FROM ledger")
            .await,
        i64::try_from(1 + CLIENTS / 2).unwrap()
    );
    for inbox in inboxes {
        inbox.pool().close().await;
    }
    fx.cleanup(Vec::new()).await;
}

/// Waiting duplicates register their keys through the pooler. Each registration travels in
/// one flight: a statement parsed in one flight and bound in the next can reach another
/// server connection, where the unnamed statement does not exist. So every watch, from many
/// clients at once, registers, and duplicates waiting on instances across the pooler get the
/// first answer, woken by the listener on a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a PgBouncer in transaction mode at TI_PGBOUNCER_URL"]
async fn waiters_register_and_are_woken_through_the_pooler() {
    let fx = Fx::new().await;
    let listener = sqlx::postgres::PgConnectOptions::from_str(&support::database_url())
        .unwrap()
        .options([("search_path", fx.schema.name.as_str())]);
    let stores: Vec<PostgresStore> = fx
        .stores()
        .await
        .into_iter()
        .map(|s| s.with_listener_options(listener.clone()))
        .collect();

    // Registrations from every client at once, round after round.
    let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let store = stores[i % INSTANCES].clone();
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                let key = IdempotencyKey::parse(&format!("watched-{i}")).unwrap();
                let mut failures = Vec::new();
                for _ in 0..10 {
                    match store.watch("", &key).await {
                        Ok(Some(_)) => {}
                        Ok(None) => failures.push("no watch: the listener did not listen".into()),
                        Err(e) => failures.push(e.to_string()),
                    }
                }
                failures
            })
        })
        .collect();
    let mut failures = Vec::new();
    for t in tasks {
        failures.extend(t.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} of {} registrations failed through the pooler, e.g. {:?}",
        failures.len(),
        CLIENTS * 10,
        failures.first()
    );

    // Duplicates on every instance wait for the first request of their key and get its answer.
    let calls = Calls::default();
    let apps: Vec<App> = stores
        .iter()
        .map(|store| {
            let svc = IdempotencyLayer::new(store.clone())
                .with_wait_for_completion(Duration::from_secs(20))
                .layer(support::handler(calls.clone()));
            let app: App = Arc::new(move |r| {
                let svc = svc.clone();
                Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
            });
            app
        })
        .collect();
    const KEYS: usize = 8;
    let firsts: Vec<_> = (0..KEYS)
        .map(|k| {
            let app = apps[k % INSTANCES].clone();
            tokio::spawn(async move {
                app(req(
                    "POST",
                    "/slow?ms=1500",
                    Some(&format!("waited-{k}")),
                    "b",
                ))
                .await
            })
        })
        .collect();
    // The first requests hold their keys; their duplicates come while they run.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answers = burst(&apps, CLIENTS, |i| {
        req(
            "POST",
            "/slow?ms=1500",
            Some(&format!("waited-{}", i % KEYS)),
            "b",
        )
    })
    .await;
    let mut first_bodies = Vec::new();
    for f in firsts {
        let first = f.await.unwrap();
        assert_eq!(first.status, 201, "{}", first.text());
        first_bodies.push(first.body);
    }
    for (i, a) in answers.iter().enumerate() {
        assert_eq!(a.status, 201, "duplicate {i}: {}", a.text());
        assert!(a.replayed(), "duplicate {i} got the first answer replayed");
        assert_eq!(a.body, first_bodies[i % KEYS], "duplicate {i}");
    }
    assert_eq!(calls.get("/slow"), KEYS, "each key's handler ran once");
    fx.cleanup(stores).await;
}
