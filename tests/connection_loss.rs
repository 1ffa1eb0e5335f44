//! Connection loss against a real Postgres: the layer's connections are terminated
//! (`pg_terminate_backend`) while it claims, while the handler runs and while it commits, and
//! a server is restarted (`pg_ctl restart -m immediate`) under load.
//!
//! What must hold every time: the handler's work is never done twice (counted), a client
//! whose outcome is unknown gets a fast `503` (never a `500`, never a hang), a retry replays
//! when the work committed and runs when it did not, and the pool recovers by itself: the
//! next requests succeed with no help.
//!
//! The layer's connections are found in `pg_stat_activity` by the `application_name` of its
//! pool. The ambiguous commits (the connection lost after `COMMIT` was sent) are made slow
//! with a deferred constraint trigger that sleeps at commit time, so that the test can strike
//! while the commit runs: terminate the backend (the commit never happens), or stall the
//! network in front of it with a proxy, let the commit finish, and cut the connection (it
//! happened, and the client never heard).
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use support::cluster::Cluster;
use support::faults::{
    Fx, Gate, Mode, PAYMENTS_TABLE, app, backends, eventually, named_pool, plain_handler,
    terminate, timed, tx_handler, wait_for_backend,
};
use support::{Calls, req};
use tower::Layer as _;
use tower_idempotency::{IdempotencyLayer, PostgresStore};

/// The layer's bound on one store call in these tests.
const STORE_TIMEOUT: Duration = Duration::from_secs(3);
/// A `503` must come within the store timeout and this margin (a noisy machine).
const MARGIN: Duration = Duration::from_secs(3);
/// Longer than any answer may take: a request still pending then hangs.
const HANG: Duration = Duration::from_secs(30);

/// The layer's backend that is running the commit of an answer, asleep in the trigger.
const IN_COMMIT: &str = "wait_event = 'PgSleep'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_terminated_mid_claim_is_a_fast_503_and_the_retry_runs_once() {
    for mode in [Mode::Plain, Mode::Transactional] {
        let fx = Fx::new(8, STORE_TIMEOUT).await;
        let app = fx.app(mode);
        // Hold the keys' table, so that the claim waits on the lock: it is in flight.
        let mut lock = fx.admin.begin().await.unwrap();
        sqlx::query("LOCK TABLE tower_idempotency_keys IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *lock)
            .await
            .unwrap();
        let pending = tokio::spawn({
            let app = app.clone();
            async move { timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await }
        });
        wait_for_backend(
            &fx.admin,
            &fx.name,
            "wait_event_type = 'Lock'",
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(
            terminate(&fx.admin, &fx.name, "wait_event_type = 'Lock'").await,
            1
        );
        let (answer, took) = pending.await.unwrap();
        answer.assert_problem(503, "store-unavailable");
        assert!(answer.headers.contains_key("retry-after"), "{mode:?}");
        assert!(
            took < STORE_TIMEOUT + MARGIN,
            "{mode:?}: the 503 took {took:?}"
        );
        assert_eq!(fx.calls.total(), 0, "{mode:?}: the handler did not run");
        lock.rollback().await.unwrap();

        // The claim never committed: the retry runs at once (the pool replaced the dead
        // connection by itself), once, and its answer is replayed.
        let (first, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        assert_eq!(first.status, 201, "{mode:?}: {}", first.text());
        assert!(!first.replayed());
        let (again, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        assert!(
            again.replayed(),
            "{mode:?}: {} {}",
            again.status,
            again.text()
        );
        assert_eq!(again.body, first.body);
        assert_eq!(fx.calls.get("/pay"), 1, "{mode:?}");
        if mode == Mode::Transactional {
            assert_eq!(fx.payments("k").await, 1);
        }
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_connections_terminated_while_the_handler_runs_are_replaced_and_the_answer_stored()
 {
    let fx = Fx::new(8, STORE_TIMEOUT).await;
    let app = fx.app(Mode::Plain);
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/pay?gate", Some("k"), "b"), HANG).await }
    });
    fx.gate.reached(1).await;
    // In plain mode the claim's connection went back to the pool: kill every connection of
    // the layer's pool while the handler runs.
    assert!(terminate(&fx.admin, &fx.name, "true").await >= 1);
    support::faults::wait_for_no_backend(&fx.admin, &fx.name, Duration::from_secs(10)).await;
    fx.gate.open();
    let (first, _) = pending.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.text(), "/pay #1");
    // The answer was stored through a new connection: the retry replays it.
    let (again, _) = timed(&app, req("POST", "/pay?gate", Some("k"), "b"), HANG).await;
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(again.body, first.body);
    assert_eq!(fx.calls.total(), 1);
    assert!(backends(&fx.admin, &fx.name, "true").await >= 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_connection_terminated_while_the_handler_runs_is_503_and_the_retry_runs_once()
{
    let fx = Fx::new(8, STORE_TIMEOUT).await;
    let app = fx.app(Mode::Transactional);
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/pay?gate", Some("k"), "b"), HANG).await }
    });
    fx.gate.reached(1).await;
    // The request's transaction (its row written, uncommitted) loses its connection.
    assert_eq!(
        terminate(&fx.admin, &fx.name, "state = 'idle in transaction'").await,
        1
    );
    fx.gate.open();
    let (answer, took) = pending.await.unwrap();
    answer.assert_problem(503, "store-unavailable");
    assert!(took < STORE_TIMEOUT + MARGIN, "the 503 took {took:?}");
    assert_eq!(fx.payments("k").await, 0, "nothing committed");
    assert_eq!(fx.record("k").await, None);

    // Nothing committed, so the retry runs (the key's lock went with the dead backend), and
    // commits once.
    let (retry, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    let (again, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(fx.payments("k").await, 1, "one run committed");
    fx.cleanup().await;
}

/// The ambiguous commit in transactional mode: the connection is lost after `COMMIT` was
/// sent. If the commit did not happen (the backend died in it), the client gets `503` and
/// the retry runs; if it happened (the answer was lost on the way back), the client gets
/// `503` and the retry replays what committed. Never both runs committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_lost_commit_replays_if_it_committed_and_runs_if_it_did_not() {
    let fx = Fx::new(8, STORE_TIMEOUT).await;
    fx.slow_commits("payments", "true", 1.0).await;
    let app = fx.app(Mode::Transactional);

    // 1. The backend dies inside COMMIT: nothing committed.
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/pay", Some("lost"), "b"), HANG).await }
    });
    wait_for_backend(&fx.admin, &fx.name, IN_COMMIT, Duration::from_secs(10)).await;
    assert_eq!(terminate(&fx.admin, &fx.name, IN_COMMIT).await, 1);
    let (answer, took) = pending.await.unwrap();
    answer.assert_problem(503, "store-unavailable");
    assert!(took < STORE_TIMEOUT + MARGIN, "the 503 took {took:?}");
    assert_eq!(
        (fx.payments("lost").await, fx.record("lost").await),
        (0, None)
    );
    let (retry, _) = timed(&app, req("POST", "/pay", Some("lost"), "b"), HANG).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed(), "nothing had committed: the retry runs");
    assert_eq!(fx.payments("lost").await, 1);

    // 2. The commit happens, and its answer never comes back: the network stalls while the
    // commit runs, then the connection is cut.
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/pay", Some("done"), "b"), HANG).await }
    });
    wait_for_backend(&fx.admin, &fx.name, IN_COMMIT, Duration::from_secs(10)).await;
    fx.proxy.pause();
    eventually(Duration::from_secs(10), "the commit", || async {
        fx.payments("done").await == 1
    })
    .await;
    fx.proxy.cut_all();
    let (answer, took) = pending.await.unwrap();
    answer.assert_problem(503, "store-unavailable");
    assert!(took < STORE_TIMEOUT + MARGIN, "the 503 took {took:?}");
    fx.proxy.resume();
    let calls = fx.calls.get("/pay");
    let (retry, _) = timed(&app, req("POST", "/pay", Some("done"), "b"), HANG).await;
    assert!(
        retry.replayed(),
        "it committed: the retry replays ({} {})",
        retry.status,
        retry.text()
    );
    let id: i64 = sqlx::query_scalar("SELECT id FROM payments WHERE key = 'done'")
        .fetch_one(&fx.admin)
        .await
        .unwrap();
    assert_eq!(retry.text(), format!("payment {id}"));
    assert_eq!(fx.calls.get("/pay"), calls, "the handler did not run again");
    assert_eq!(fx.payments("done").await, 1);
    fx.cleanup().await;
}

/// The ambiguous completion in plain mode: the handler's work is done, so the client gets its
/// answer whatever happens to the write that stores it. If that write was lost, the key stays
/// claimed (a retry within the lease gets `409`, never a second run, and never a half
/// answer); if it committed, the retry replays it byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_lost_completion_answers_and_never_runs_twice_or_stores_half() {
    let fx = Fx::new(8, STORE_TIMEOUT).await;
    fx.slow_commits(
        "tower_idempotency_keys",
        "NEW.response_status IS NOT NULL",
        1.0,
    )
    .await;
    let app = fx.app(Mode::Plain);

    // 1. The backend dies inside the completion's commit: the record stays a claim.
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/lost", Some("lost"), "b"), HANG).await }
    });
    wait_for_backend(&fx.admin, &fx.name, IN_COMMIT, Duration::from_secs(10)).await;
    assert_eq!(terminate(&fx.admin, &fx.name, IN_COMMIT).await, 1);
    let (first, took) = pending.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.text(), "/lost #1");
    assert!(took < STORE_TIMEOUT + MARGIN, "the answer took {took:?}");
    assert_eq!(fx.record("lost").await, Some((None, None)), "still a claim");
    let (retry, _) = timed(&app, req("POST", "/lost", Some("lost"), "b"), HANG).await;
    retry.assert_problem(409, "request-in-progress");
    assert_eq!(fx.calls.get("/lost"), 1);

    // 2. The completion commits, and its answer is lost on the way back.
    let pending = tokio::spawn({
        let app = app.clone();
        async move { timed(&app, req("POST", "/done", Some("done"), "b"), HANG).await }
    });
    wait_for_backend(&fx.admin, &fx.name, IN_COMMIT, Duration::from_secs(10)).await;
    fx.proxy.pause();
    eventually(Duration::from_secs(10), "the completion", || async {
        matches!(fx.record("done").await, Some((Some(_), _)))
    })
    .await;
    fx.proxy.cut_all();
    let (first, took) = pending.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(took < STORE_TIMEOUT + MARGIN, "the answer took {took:?}");
    fx.proxy.resume();
    let (retry, _) = timed(&app, req("POST", "/done", Some("done"), "b"), HANG).await;
    assert!(retry.replayed(), "{} {}", retry.status, retry.text());
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(fx.calls.get("/done"), 1);
    fx.cleanup().await;
}

/// `pg_ctl restart -m immediate` of a private server while clients pay with keys, in both
/// modes, each client retrying a key until it gets an answer that is not `503` or `409`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_under_load_runs_nothing_twice_and_the_pool_recovers() {
    let cluster = Arc::new(Cluster::primary(false));
    cluster.psql("CREATE SCHEMA plain; CREATE SCHEMA tx;");
    let url = cluster.url("postgres");
    let calls = Calls::default();
    let gate = Gate::new();
    let mut apps = Vec::new();
    let mut admins = Vec::new();
    for (mode, schema) in [(Mode::Plain, "plain"), (Mode::Transactional, "tx")] {
        let pool = named_pool(&url, None, schema, &format!("ti_{schema}"), 8).await;
        let store = PostgresStore::new(pool.clone());
        store.migrate().await.unwrap();
        sqlx::raw_sql(PAYMENTS_TABLE).execute(&pool).await.unwrap();
        let app = match mode {
            // A lease longer than the test: a completion lost in the restart leaves its key
            // claimed (409) rather than run again.
            Mode::Plain => app(IdempotencyLayer::new(store)
                .with_lease(Duration::from_secs(60))
                .with_store_timeout(STORE_TIMEOUT)
                .layer(plain_handler(calls.clone(), gate.clone()))),
            Mode::Transactional => app(IdempotencyLayer::new(store.transactional())
                .with_store_timeout(STORE_TIMEOUT)
                .layer(tx_handler(calls.clone(), gate.clone()))),
        };
        apps.push((mode, app));
        admins.push(pool);
    }

    let statuses = Arc::new(std::sync::Mutex::new(HashMap::<u16, usize>::new()));
    let max_503 = Arc::new(std::sync::Mutex::new(Duration::ZERO));
    // Clients pay until a second after the server is back.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for (mode, app) in &apps {
        for client in 0..6 {
            let (mode, app) = (*mode, app.clone());
            let (statuses, max_503) = (statuses.clone(), max_503.clone());
            let stop = stop.clone();
            clients.push(tokio::spawn(async move {
                let mut finals = Vec::new();
                for n in 0.. {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("{mode:?}-{client}-{n}");
                    let path = format!("/pay/{key}?ms=60");
                    let deadline = std::time::Instant::now() + Duration::from_secs(40);
                    let answer = loop {
                        let (a, took) =
                            timed(&app, req("POST", &path, Some(&key), "b"), HANG).await;
                        *statuses
                            .lock()
                            .unwrap()
                            .entry(a.status.as_u16())
                            .or_default() += 1;
                        match a.status.as_u16() {
                            201 => break a,
                            503 => {
                                let mut max = max_503.lock().unwrap();
                                *max = (*max).max(took);
                            }
                            409 => {}
                            other => panic!("{key}: unexpected {other}: {}", a.text()),
                        }
                        assert!(std::time::Instant::now() < deadline, "{key}: no answer");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    };
                    finals.push((key, path, answer));
                }
                (mode, finals)
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let restart = cluster.clone();
    tokio::task::spawn_blocking(move || restart.restart_immediate())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut results = Vec::new();
    for c in clients {
        results.push(c.await.unwrap());
    }

    // Every key ran its handler once, and every answer a client got is what the key holds.
    let mut completion_lost = 0;
    for (mode, finals) in results {
        let app = &apps.iter().find(|(m, _)| *m == mode).unwrap().1;
        for (key, path, answer) in finals {
            let (replay, _) = timed(app, req("POST", &path, Some(&key), "b"), HANG).await;
            match mode {
                Mode::Plain => {
                    assert_eq!(calls.get(path.split('?').next().unwrap()), 1, "{key}");
                    if replay.status == 409 {
                        // The answer reached the client, its storing was lost in the restart.
                        completion_lost += 1;
                    } else {
                        assert!(
                            replay.replayed(),
                            "{key}: {} {}",
                            replay.status,
                            replay.text()
                        );
                        assert_eq!(replay.body, answer.body, "{key}");
                    }
                }
                Mode::Transactional => {
                    assert!(
                        replay.replayed(),
                        "{key}: {} {}",
                        replay.status,
                        replay.text()
                    );
                    assert_eq!(replay.body, answer.body, "{key}");
                    let rows: i64 =
                        sqlx::query_scalar("SELECT count(*) FROM payments WHERE key = $1")
                            .bind(&key)
                            .fetch_one(&admins[1])
                            .await
                            .unwrap();
                    assert_eq!(rows, 1, "{key}: one committed run");
                }
            }
        }
    }
    let statuses = statuses.lock().unwrap().clone();
    let max_503 = *max_503.lock().unwrap();
    println!(
        "restart under load: answers {statuses:?}, slowest 503 {max_503:?}, plain-mode \
         completions lost (key left to its lease) {completion_lost}"
    );
    assert!(max_503 < STORE_TIMEOUT + MARGIN, "a 503 took {max_503:?}");
    assert!(
        statuses.get(&503).copied().unwrap_or(0) > 0,
        "the restart turned no request away: it did not happen under load"
    );
    for pool in admins {
        pool.close().await;
    }
}
