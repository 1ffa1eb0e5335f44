//! Phased mode against a real Postgres: the claim commits first, steps commit with their
//! recovery points, remote calls run with no transaction open, the last phase commits with
//! the answer, and a retry resumes after the last committed step.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::PgPool;
use support::{Answer, PgSchema, read, req};
use tokio::sync::Notify;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};
use tower_idempotency::body::RequestBody;
use tower_idempotency::phased::CompleterRun;
use tower_idempotency::{
    IdempotencyLayer, IsolationLevel, PhaseError, Phased, Phases, PostgresStore, Store,
};

/// A provider that deduplicates by key, as a payment provider does: a repeated key gets the
/// first charge back. It counts the calls and the charges it made.
#[derive(Clone, Default)]
struct Provider {
    charges: Arc<Mutex<HashMap<String, String>>>,
    calls: Arc<Mutex<usize>>,
}

impl Provider {
    fn charge(&self, key: &str) -> String {
        *self.calls.lock().unwrap() += 1;
        let mut charges = self.charges.lock().unwrap();
        let n = charges.len();
        charges
            .entry(key.to_owned())
            .or_insert_with(|| format!("ch_{n}"))
            .clone()
    }
    fn charges(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
    fn calls(&self) -> usize {
        *self.calls.lock().unwrap()
    }
}

/// What the handler does after its first step, by path.
#[derive(Clone, Default)]
struct Script {
    /// Checked during the remote call: connections the store's pool has lent out, and
    /// backends of the test's application idle in a transaction.
    seen_during_call: Arc<Mutex<Vec<(u32, i64)>>>,
    /// `/hold` waits for this before its last phase.
    release: Arc<Notify>,
    /// `/hold` reports here that its first step committed.
    holding: Arc<Notify>,
    /// What `/hold` got from its last phase.
    held_outcome: Arc<Mutex<Option<String>>>,
    /// `/kill-in-step` killed its step's connection (once).
    killed: Arc<std::sync::atomic::AtomicBool>,
    /// Every request's credential has expired: the handler answers `401` before any phase.
    expired: Arc<std::sync::atomic::AtomicBool>,
}

struct Fx {
    schema: PgSchema,
    store: PostgresStore,
    admin: PgPool,
    app_name: String,
    provider: Provider,
    script: Script,
}

impl Fx {
    async fn new() -> Fx {
        let schema = PgSchema::new().await;
        let app_name = format!("phased_{}", support::unique());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect_with(schema.connect_options().application_name(&app_name))
            .await
            .unwrap();
        let store = PostgresStore::new(pool);
        store.migrate().await.unwrap();
        let admin = schema.direct_pool(4).await;
        sqlx::raw_sql(
            "CREATE TABLE payments (id bigserial PRIMARY KEY, status text NOT NULL, \
             charge text, amount bigint NOT NULL)",
        )
        .execute(&admin)
        .await
        .unwrap();
        Fx {
            schema,
            store,
            admin,
            app_name,
            provider: Provider::default(),
            script: Script::default(),
        }
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.admin)
            .await
            .unwrap()
    }

    fn app(
        &self,
        mode: Phased,
        lease: Duration,
    ) -> impl Fn(Request<Full<Bytes>>) -> std::pin::Pin<Box<dyn Future<Output = Answer> + Send>>
    + Clone
    + use<> {
        let svc = self.service(mode, lease);
        move |r| {
            let svc = svc.clone();
            Box::pin(async move { read(svc.oneshot(r).await.unwrap()).await })
        }
    }

    /// The layer in `mode` over the test's payment handler, as a service.
    fn service(&self, mode: Phased, lease: Duration) -> Svc {
        self.service_with(IdempotencyLayer::new(mode).with_lease(lease))
    }

    /// The test's payment handler behind `layer`, as a service.
    fn service_with(&self, layer: IdempotencyLayer<Phased>) -> Svc {
        let provider = self.provider.clone();
        let script = self.script.clone();
        let pool = self.store.pool().clone();
        let admin = self.admin.clone();
        let app_name = self.app_name.clone();
        let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let provider = provider.clone();
            let script = script.clone();
            let pool = pool.clone();
            let admin = admin.clone();
            let app_name = app_name.clone();
            async move {
                let phases = req.extensions().get::<Phases>().unwrap().clone();
                let path = req.uri().path().to_owned();
                let answer = |status: StatusCode, body: String| {
                    let mut res = Response::new(Full::new(Bytes::from(body)));
                    *res.status_mut() = status;
                    Ok::<_, std::io::Error>(res)
                };
                if script.expired.load(std::sync::atomic::Ordering::SeqCst) {
                    return answer(StatusCode::UNAUTHORIZED, "credential expired".into());
                }
                if path == "/bare" {
                    // The layer's own statements alone: a step, a remote call, a last phase.
                    let step = phases
                        .step("bare", async |conn| {
                            sqlx::query_scalar::<_, i64>("SELECT 1::bigint")
                                .fetch_one(conn)
                                .await
                        })
                        .await;
                    if let Err(e) = step {
                        return answer(StatusCode::SERVICE_UNAVAILABLE, format!("step: {e:?}"));
                    }
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    if let Err(e) = phases.tx().await {
                        return answer(StatusCode::SERVICE_UNAVAILABLE, format!("last: {e:?}"));
                    }
                    return answer(StatusCode::CREATED, String::new());
                }
                if path == "/late-step" && phases.recovery_point().is_none() {
                    // Claimed; the test moves the clock before the first step.
                    script.holding.notify_one();
                    script.release.notified().await;
                }
                let long = path == "/long-step" && phases.recovery_point().is_none();
                let kill = path == "/kill-in-step"
                    && !script
                        .killed
                        .swap(true, std::sync::atomic::Ordering::SeqCst);
                let id: i64 = match phases
                    .step("pending", async |conn| {
                        if long {
                            // Work that outlasts the lease several times over.
                            tokio::time::sleep(LONG_STEP).await;
                        }
                        let id = sqlx::query_scalar(
                            "INSERT INTO payments (status, amount) VALUES ('pending', 500) \
                             RETURNING id",
                        )
                        .fetch_one(&mut *conn)
                        .await?;
                        if kill {
                            // The step's connection dies before its commit is answered.
                            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                                .fetch_one(&mut *conn)
                                .await?;
                            sqlx::query("SELECT pg_terminate_backend($1)")
                                .bind(pid)
                                .execute(&admin)
                                .await?;
                        }
                        Ok::<i64, sqlx::Error>(id)
                    })
                    .await
                {
                    Ok(id) => id,
                    Err(PhaseError::LeaseLost) => {
                        return answer(StatusCode::CONFLICT, "lease lost".into());
                    }
                    Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
                // The remote call: no transaction open, no pooled connection lent out. (A
                // connection given back goes to the pool's idle list in a task: wait for it.)
                let mut lent = 0usize;
                for _ in 0..40 {
                    lent = (pool.size() as usize).saturating_sub(pool.num_idle());
                    if lent == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let idle_in_tx: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                     AND state LIKE 'idle in transaction%'",
                )
                .bind(&app_name)
                .fetch_one(&admin)
                .await
                .unwrap();
                script
                    .seen_during_call
                    .lock()
                    .unwrap()
                    .push((u32::try_from(lent).unwrap(), idle_in_tx));
                if (path == "/hold" || path == "/late-step") && phases.recovery_point().is_none() {
                    script.holding.notify_one();
                    script.release.notified().await;
                }
                if path == "/slow" {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                let charge = provider.charge(&format!("{}:charge", phases.key().as_str()));
                if path == "/fail-after-charge" && phases.recovery_point().is_none() {
                    return answer(StatusCode::BAD_GATEWAY, "provider answer lost".into());
                }
                let last = async {
                    let mut tx = phases.tx().await?;
                    sqlx::query(
                        "UPDATE payments SET status = 'charged', charge = $1 WHERE id = $2",
                    )
                    .bind(&charge)
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| PhaseError::Store(e.into()))?;
                    if path == "/hang-last" && phases.recovery_point().is_none() {
                        // Hangs in its last phase, its transaction open.
                        std::future::pending::<()>().await;
                    }
                    if path == "/abort-last" {
                        // A statement fails and the handler answers its own 409 anyway.
                        let _ = sqlx::query("SELECT 1/0").execute(&mut *tx).await;
                        return Ok::<_, PhaseError>(StatusCode::CONFLICT);
                    }
                    Ok(StatusCode::CREATED)
                };
                match last.await {
                    Ok(status) => {
                        *script.held_outcome.lock().unwrap() = Some("committed".into());
                        answer(
                            status,
                            format!("{{\"payment\":{id},\"charge\":\"{charge}\"}}"),
                        )
                    }
                    Err(e) => {
                        *script.held_outcome.lock().unwrap() = Some(format!("{e:?}"));
                        answer(StatusCode::CONFLICT, e.to_string())
                    }
                }
            }
        });
        BoxCloneService::new(layer.layer(handler))
    }

    async fn cleanup(self) {
        self.store.pool().close().await;
        self.admin.close().await;
        self.schema.drop_schema().await;
    }
}

const LEASE: Duration = Duration::from_secs(30);
/// How long `/long-step`'s step works.
const LONG_STEP: Duration = Duration::from_millis(3500);

type Svc = BoxCloneService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::body::ResponseBody<Full<Bytes>>>,
    std::io::Error,
>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_commit_alone_the_remote_call_holds_nothing_and_the_answer_commits_last() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let first = app(req("POST", "/pay", Some("k"), "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(
        *fx.script.seen_during_call.lock().unwrap(),
        vec![(0, 0)],
        "during the remote call: no pooled connection lent out, no backend idle in a transaction"
    );
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    // The completed record keeps the answer, not the phases.
    assert_eq!(
        fx.scalar(
            "SELECT count(*) FROM tower_idempotency_keys WHERE phases IS NULL \
             AND lease_token IS NULL AND response_status = 201"
        )
        .await,
        1
    );
    for _ in 0..2 {
        let again = app(req("POST", "/pay", Some("k"), "{}")).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    app(req("POST", "/pay", Some("k"), "{\"other\":1}"))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!((fx.provider.calls(), fx.provider.charges()), (1, 1));
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_failure_between_phases_resumes_after_the_last_step() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    // The first attempt commits its first step, charges, then answers 502 (its provider's
    // answer was lost, say): nothing is stored, and the step is kept.
    let first = app(req("POST", "/fail-after-charge", Some("r"), "{}")).await;
    assert_eq!(first.status, 502);
    assert_eq!(
        fx.scalar("SELECT count(*) FROM tower_idempotency_keys WHERE phases IS NOT NULL")
            .await,
        1
    );
    // The retry runs at once (no lease to wait for), skips the step, charges with the same
    // derived key (the provider replays its charge) and completes.
    let retry = app(req("POST", "/fail-after-charge", Some("r"), "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments").await,
        1,
        "one payment row"
    );
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    assert_eq!((fx.provider.calls(), fx.provider.charges()), (2, 1));
    // Its answer equals what a run without the failure gives.
    let clean = app(req("POST", "/pay", Some("clean"), "{}")).await;
    assert_eq!(clean.status, 201);
    let body = |a: &Answer| a.json()["charge"].as_str().unwrap().to_owned();
    assert_eq!(body(&retry), "ch_0");
    assert_eq!(body(&clean), "ch_1");
    assert!(
        app(req("POST", "/fail-after-charge", Some("r"), "{}"))
            .await
            .replayed()
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_mid_phase_commits_nothing_more() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let first = tokio::spawn(app(req("POST", "/hold", Some("l"), "{}")));
    fx.script.holding.notified().await;
    // The first request's process stalls past its lease (forced here by moving the lease's
    // end into the past); the retry takes the key over and resumes after its step.
    sqlx::query("UPDATE tower_idempotency_keys SET lease_expires_at = now() - interval '1 second'")
        .execute(&fx.admin)
        .await
        .unwrap();
    let retry = app(req("POST", "/pay", Some("l"), "{}")).await;
    assert_eq!(retry.status, 422, "another path is another payload");
    // The retry resumes after the first one's step and completes.
    let retry = app(req("POST", "/hold", Some("l"), "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    // The first one goes on and commits nothing: its last phase is refused when its answer
    // is stored (503), or, under SERIALIZABLE, where a phase opens with a fence, as soon as
    // it asks for its transaction (the handler answers 409 on `LeaseLost`).
    fx.script.release.notify_one();
    let first = first.await.unwrap();
    if first.status == 409 {
        assert_eq!(
            fx.script.held_outcome.lock().unwrap().as_deref(),
            Some("LeaseLost")
        );
    } else {
        first.assert_problem(503, "store-unavailable");
    }
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    let replay = app(req("POST", "/hold", Some("l"), "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_get_409_and_the_handler_runs_once() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(tokio::spawn(app(req("POST", "/slow", Some("d"), "{}"))));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().status.as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 201).count(),
        1,
        "{statuses:?}"
    );
    assert!(
        statuses.iter().all(|&s| s == 201 || s == 409),
        "{statuses:?}"
    );
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(fx.provider.calls(), 1);
    fx.cleanup().await;
}

/// Every isolation level, with renewals committing between the phases (a short lease, a
/// slow remote call) and many keys at once: no phase fails on the layer's own statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_isolation_level_commits_phases_between_renewals() {
    let fx = Fx::new().await;
    for level in [
        IsolationLevel::ReadCommitted,
        IsolationLevel::RepeatableRead,
        IsolationLevel::Serializable,
    ] {
        let app = fx.app(
            fx.store.phased().with_isolation(level),
            Duration::from_millis(150),
        );
        let mut tasks = Vec::new();
        for i in 0..12 {
            tasks.push(tokio::spawn(app(req(
                "POST",
                "/bare",
                Some(&format!("{level:?}-{i}")),
                "{}",
            ))));
        }
        for t in tasks {
            let done = t.await.unwrap();
            assert_eq!(done.status, 201, "{level:?}: {}", done.text());
        }
    }
    assert_eq!(
        fx.scalar("SELECT count(*) FROM tower_idempotency_keys WHERE response_status = 201")
            .await,
        36
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_last_phase_stores_the_handlers_answer_alone() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let first = app(req("POST", "/abort-last", Some("a"), "{}")).await;
    assert_eq!(first.status, 409);
    // The last phase's write was rolled back; the first step's stayed.
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'pending'")
            .await,
        1
    );
    let again = app(req("POST", "/abort-last", Some("a"), "{}")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_refuse_bad_names_oversized_states_and_steps_after_the_last_phase() {
    let fx = Fx::new().await;
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let seen = outcomes.clone();
    let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let seen = seen.clone();
        async move {
            let phases = req.extensions().get::<Phases>().unwrap().clone();
            let mut out = seen.lock().unwrap().clone();
            let noop = async |_: &mut sqlx::PgConnection| Ok::<(), std::io::Error>(());
            out.push(format!("{:?}", phases.step("", noop).await.err()));
            let big = async |_: &mut sqlx::PgConnection| Ok::<_, std::io::Error>(vec![0u8; 70_000]);
            out.push(format!("{:?}", phases.step("big", big).await.err()));
            out.push(format!("{:?}", phases.step("once", noop).await.err()));
            // The same name again gives the recorded state back without running the work.
            let never = async |_: &mut sqlx::PgConnection| -> Result<(), std::io::Error> {
                panic!("a committed step ran again")
            };
            out.push(format!("{:?}", phases.step("once", never).await.err()));
            out.push(format!(
                "{:?}",
                phases
                    .step("once", async |_: &mut sqlx::PgConnection| Ok::<
                        _,
                        std::io::Error,
                    >(
                        7i64
                    ))
                    .await
                    .err()
            ));
            drop(phases.tx().await.unwrap());
            out.push(format!("{:?}", phases.step("late", noop).await.err()));
            *seen.lock().unwrap() = out;
            Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    });
    let svc = IdempotencyLayer::new(fx.store.phased()).layer(handler);
    let done = read(svc.oneshot(req("POST", "/x", Some("m"), "")).await.unwrap()).await;
    assert_eq!(done.status, 200);
    let outcomes = outcomes.lock().unwrap().clone();
    assert!(outcomes[0].starts_with("Some(Misuse("), "{outcomes:?}");
    assert_eq!(outcomes[1], "Some(StateTooLarge)");
    assert_eq!(outcomes[2], "None");
    assert_eq!(outcomes[3], "None");
    assert!(
        outcomes[4].starts_with("Some(Misuse("),
        "a state read as another type"
    );
    assert!(
        outcomes[5].starts_with("Some(Misuse("),
        "a step after the last phase"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_record_is_a_new_request_that_resumes_nothing() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let first = app(req("POST", "/fail-after-charge", Some("x"), "{}")).await;
    assert_eq!(first.status, 502);
    // The record outlives its TTL with its phase, and no retry came.
    sqlx::query(
        "UPDATE tower_idempotency_keys SET expires_at = now() - interval '1 second', \
         lease_expires_at = now() - interval '1 second'",
    )
    .execute(&fx.admin)
    .await
    .unwrap();
    let again = app(req("POST", "/pay", Some("x"), "{}")).await;
    assert_eq!(again.status, 201, "{}", again.text());
    // A new request: its first step ran (a second payment row), nothing was resumed.
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 2);
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    fx.cleanup().await;
}

/// The completer runs again the request of a key abandoned after a step (no retry came): it
/// resumes after the step and stores the answer, which the client's late retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_drives_an_abandoned_key_to_its_answer() {
    let fx = Fx::new().await;
    let phased = fx.store.phased().with_resumable_requests(64 * 1024);
    let mut svc = fx.service(phased.clone(), LEASE);
    let app = fx.app(phased.clone(), LEASE);
    // Abandoned after its step (a 5xx ends the claim at once; a crash would after its lease).
    let first = app(req("POST", "/fail-after-charge", Some("c"), "{\"n\":1}")).await;
    assert_eq!(first.status, 502);
    // Without kept requests, a key is not the completer's.
    let unkept = fx.store.phased();
    let other = fx.app(unkept.clone(), LEASE);
    assert_eq!(
        other(req("POST", "/fail-after-charge", Some("u"), "{}"))
            .await
            .status,
        502
    );
    // A grace longer than the time since the claim ended: nothing to do yet.
    let early = phased
        .complete_abandoned(&mut svc, Duration::from_secs(60), 10)
        .await
        .unwrap();
    assert_eq!(early.found, 0);
    let run = phased
        .complete_abandoned(&mut svc, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!((run.found, run.completed, run.failed), (1, 1, 0), "{run:?}");
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments").await,
        2,
        "c's and u's"
    );
    assert_eq!(
        fx.scalar("SELECT count(*) FROM tower_idempotency_keys WHERE request IS NOT NULL")
            .await,
        0,
        "the kept request is dropped with the completion"
    );
    // The client's late retry replays what the completer stored.
    let late = app(req("POST", "/fail-after-charge", Some("c"), "{\"n\":1}")).await;
    assert!(late.replayed(), "{} {}", late.status, late.text());
    assert_eq!(late.status, 201);
    assert_eq!(fx.provider.charges(), 2, "c's charge once, u's once");
    // Nothing left for the next pass.
    let again = phased
        .complete_abandoned(&mut svc, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!(again.found, 0);
    fx.cleanup().await;
}

/// A record past its TTL is no one's to resume: the completer leaves it, and a request
/// with its key is a new one. (Taken up as new, the re-run would run every committed step
/// again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_leaves_a_record_past_its_ttl() {
    let fx = Fx::new().await;
    let phased = fx.store.phased().with_resumable_requests(64 * 1024);
    let mut svc = fx.service(phased.clone(), LEASE);
    let app = fx.app(phased.clone(), LEASE);
    let first = app(req("POST", "/fail-after-charge", Some("e"), "{}")).await;
    assert_eq!(first.status, 502);
    sqlx::query(
        "UPDATE tower_idempotency_keys SET expires_at = now() - interval '1 second', \
         lease_expires_at = now() - interval '1 second'",
    )
    .execute(&fx.admin)
    .await
    .unwrap();
    let run = phased
        .complete_abandoned(&mut svc, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!(run, CompleterRun::default(), "{run:?}");
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(fx.provider.charges(), 1);
    fx.cleanup().await;
}

/// The completer's re-run resumes the record it found or nothing: through an application
/// whose scope comes out otherwise, or one that answers before the layer (a credential
/// expired), nothing runs and the pass counts it failed, not completed; the record's phases
/// stay, and the right application completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_runs_a_request_only_against_the_record_it_found() {
    let fx = Fx::new().await;
    let phased = fx.store.phased().with_resumable_requests(64 * 1024);
    let app = fx.app(phased.clone(), LEASE);
    let first = app(req("POST", "/fail-after-charge", Some("r"), "{}")).await;
    assert_eq!(first.status, 502);
    let mut other_scope = fx.service_with(
        IdempotencyLayer::new(phased.clone())
            .with_lease(LEASE)
            .with_scope(|_| Some("another-tenant".to_owned())),
    );
    let run = phased
        .complete_abandoned(&mut other_scope, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!((run.found, run.completed, run.failed), (1, 0, 1), "{run:?}");
    let mut refused = tower::service_fn(|_: Request<Full<Bytes>>| async {
        let mut res = Response::new(Full::new(Bytes::new()));
        *res.status_mut() = StatusCode::UNAUTHORIZED;
        Ok::<_, std::io::Error>(res)
    });
    let run = phased
        .complete_abandoned(&mut refused, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!((run.found, run.completed, run.failed), (1, 0, 1), "{run:?}");
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    let mut svc = fx.service(phased.clone(), LEASE);
    let run = phased
        .complete_abandoned(&mut svc, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!((run.found, run.completed, run.failed), (1, 1, 0), "{run:?}");
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(fx.provider.charges(), 1);
    fx.cleanup().await;
}

/// A re-run that the handler answers with a `4xx` (the kept request's credential expired)
/// stores nothing over the committed steps: the client's retry, with a fresh credential,
/// resumes them and gets the payment's answer, not a `401` replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completer_rerun_answered_4xx_stores_nothing_over_the_committed_steps() {
    let fx = Fx::new().await;
    let phased = fx.store.phased().with_resumable_requests(64 * 1024);
    let mut svc = fx.service(phased.clone(), LEASE);
    let app = fx.app(phased.clone(), LEASE);
    let first = app(req("POST", "/fail-after-charge", Some("a"), "{}")).await;
    assert_eq!(first.status, 502);
    fx.script
        .expired
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let run = phased
        .complete_abandoned(&mut svc, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!((run.found, run.completed, run.failed), (1, 0, 1), "{run:?}");
    assert_eq!(
        fx.scalar("SELECT count(*) FROM tower_idempotency_keys WHERE phases IS NOT NULL")
            .await,
        1,
        "the committed steps stay"
    );
    fx.script
        .expired
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let retry = app(req("POST", "/fail-after-charge", Some("a"), "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(fx.provider.charges(), 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_completer_finishes_abandoned_keys_on_its_own() {
    let fx = Fx::new().await;
    let phased = fx.store.phased().with_resumable_requests(64 * 1024);
    let app = fx.app(phased.clone(), LEASE);
    assert_eq!(
        app(req("POST", "/fail-after-charge", Some("s"), "{}"))
            .await
            .status,
        502
    );
    assert!(
        tower_idempotency::phased::spawn_completer(
            &phased,
            fx.service(phased.clone(), LEASE),
            Duration::ZERO
        )
        .is_err()
    );
    let task = tower_idempotency::phased::spawn_completer(
        &phased,
        fx.service(phased.clone(), LEASE),
        Duration::from_millis(50),
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fx
        .scalar("SELECT count(*) FROM tower_idempotency_keys WHERE response_status = 201")
        .await
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the completer never finished the key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    assert!(
        app(req("POST", "/fail-after-charge", Some("s"), "{}"))
            .await
            .replayed()
    );
    fx.cleanup().await;
}

/// A step whose connection dies around its commit may or may not have committed: the claim
/// is not released with it (a release would let a retry run the step a second time, were it
/// committed); it ends, and the retry takes the key over and finds out from the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_commit_is_uncertain_keeps_its_claim_for_the_retry() {
    let fx = Fx::new().await;
    let app = fx.app(fx.store.phased(), LEASE);
    let first = app(req("POST", "/kill-in-step", Some("u"), "{}")).await;
    assert_eq!(first.status, 503, "{}", first.text());
    assert_eq!(
        fx.scalar("SELECT count(*) FROM tower_idempotency_keys WHERE lease_token IS NOT NULL")
            .await,
        1,
        "the claim is kept (its lease ended)"
    );
    let retry = app(req("POST", "/kill-in-step", Some("u"), "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    // The killed step never committed: the retry ran it, once.
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    fx.cleanup().await;
}

/// A handler that hangs in its last phase is stopped at its bound: `503` with
/// `handler-timed-out`, its last phase rolled back (the record unlocked), its step kept; the
/// retry resumes after the step and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_bound_is_stopped_and_the_retry_resumes() {
    let fx = Fx::new().await;
    let app = fx.app(
        fx.store
            .phased()
            .with_handler_timeout(Duration::from_millis(800)),
        LEASE,
    );
    let first = tokio::time::timeout(
        Duration::from_secs(20),
        app(req("POST", "/hang-last", Some("h"), "{}")),
    )
    .await
    .expect("the hung handler was never stopped");
    first.assert_problem(503, "handler-timed-out");
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        0,
        "the last phase rolled back"
    );
    let mut retry = app(req("POST", "/hang-last", Some("h"), "{}")).await;
    for _ in 0..20 {
        if retry.status != 409 {
            break;
        }
        // The stopped phase's connection is closed; the server may take a moment to end
        // its transaction and its lock on the record.
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = app(req("POST", "/hang-last", Some("h"), "{}")).await;
    }
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(
        fx.scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
            .await,
        1
    );
    fx.cleanup().await;
}

/// A record must not count as expired while its lease holds: a step's commit extends the
/// lease and the record's life with it. (A TTL shorter than the handler's run: the step
/// commits past the claim's first lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_keeps_its_record_alive_as_long_as_its_lease() {
    let fx = Fx::new().await;
    fx.schema.controlled_clock().await;
    let svc = fx.service_with(
        IdempotencyLayer::new(fx.store.phased())
            .with_lease(LEASE)
            .with_ttl(Duration::from_secs(1))
            .unwrap(),
    );
    let first = tokio::spawn(
        svc.clone()
            .oneshot(req("POST", "/late-step", Some("t"), "{}")),
    );
    // Claimed: the record lives as long as its lease (30 s).
    fx.script.holding.notified().await;
    fx.schema.advance_clock(Duration::from_secs(20)).await;
    fx.script.release.notify_one();
    // The step committed 20 s in: its lease runs to 50 s.
    fx.script.holding.notified().await;
    fx.schema.advance_clock(Duration::from_secs(15)).await;
    // A duplicate that took the key over as new would run the handler, and wait at its hold.
    let dup = tokio::time::timeout(
        Duration::from_secs(10),
        svc.clone()
            .oneshot(req("POST", "/late-step", Some("t"), "{}")),
    )
    .await
    .expect("the duplicate ran the handler: the record had expired while its lease held")
    .unwrap();
    read(dup).await.assert_problem(409, "request-in-progress");
    assert_eq!(fx.store.purge_expired(10).await.unwrap(), 0);
    fx.script.release.notify_one();
    let first = read(first.await.unwrap().unwrap()).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    fx.cleanup().await;
}

/// A step that works longer than the lease keeps the lease: at `READ COMMITTED` the renewals
/// go on while it works (nothing locks the record), above it the phase's fence locks the
/// record. A duplicate meanwhile gets `409`, and the owner's answer is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_longer_than_the_lease_keeps_the_key() {
    let fx = Fx::new().await;
    let lease = Duration::from_millis(1500);
    let app = fx.app(fx.store.phased(), lease);
    let first = tokio::spawn(app(req("POST", "/long-step", Some("l"), "{}")));
    tokio::time::sleep(LONG_STEP - Duration::from_millis(1000)).await;
    let dup = app(req("POST", "/long-step", Some("l"), "{}")).await;
    assert_eq!(dup.status, 409, "{}", dup.text());
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(
        app(req("POST", "/long-step", Some("l"), "{}"))
            .await
            .replayed()
    );
    assert_eq!(fx.scalar("SELECT count(*) FROM payments").await, 1);
    fx.cleanup().await;
}
