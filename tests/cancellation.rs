//! A request dropped after its handler finished must not let a retry run the handler again.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use support::{Calls, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_request_while_the_answer_is_stored_keeps_the_answer() {
    let calls = Calls::default();
    let svc = IdempotencyLayer::new({
        let store = support::Faulty::default();
        store.complete_delay_ms.store(300, Ordering::SeqCst);
        store
    })
    .layer(support::handler(calls.clone()));
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    while calls.get("/pay") == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The handler ran; the answer is being stored. The client goes away.
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The key must not have been released: a retry is a 409, then a replay, never a rerun.
    let answer = support::until_not_in_flight(Duration::from_secs(5), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert!(answer.replayed(), "{}", answer.text());
    assert_eq!(answer.status, 201);
    assert_eq!(calls.get("/pay"), 1, "the handler ran once");
}

// ---------------------------------------------------------------------------------------------
// A request whose client goes away while its handler runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tower_idempotency::Lease;
use tower_idempotency::body::RequestBody;

/// What a gated handler did: how often it started and how often it reached its end.
#[derive(Clone)]
struct Probe {
    started: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
    /// The handler waits for a permit between its start and its end.
    gate: Arc<Semaphore>,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            started: Arc::default(),
            ended: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }
    fn ended(&self) -> usize {
        self.ended.load(Ordering::SeqCst)
    }
    fn open(&self) {
        self.gate.add_permits(1000);
    }
    async fn wait_for(&self, what: &str, done: impl Fn(&Probe) -> bool) {
        let started = tokio::time::Instant::now();
        while !done(self) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A handler that counts its start, waits at the gate, counts its end and answers `201` with
/// the number of its call.
fn gated(
    probe: Probe,
) -> impl tower::Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
        let probe = probe.clone();
        async move {
            let n = probe.started.fetch_add(1, Ordering::SeqCst) + 1;
            let _permit = probe.gate.acquire().await.unwrap();
            probe.ended.fetch_add(1, Ordering::SeqCst);
            let mut res = Response::new(Full::new(Bytes::from(format!("done #{n}"))));
            *res.status_mut() = StatusCode::CREATED;
            Ok(res)
        }
    })
}

/// Drops a keyed request while its handler runs: the handler runs to its end, a retry
/// meanwhile gets `409`, and one after it the stored answer.
async fn dropped_request_runs_its_handler_to_the_end<St: Store>(store: St) {
    let probe = Probe::new();
    let svc = IdempotencyLayer::new(store).layer(gated(probe.clone()));
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    probe
        .wait_for("the handler to start", |p| p.started() == 1)
        .await;
    first.abort(); // the client went away
    assert!(first.await.unwrap_err().is_cancelled());

    // (Were the key released, this retry would run the handler again and wait at the gate.)
    let during = tokio::time::timeout(
        Duration::from_secs(10),
        svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")),
    )
    .await
    .expect("a retry ran the handler again");
    read(during.unwrap())
        .await
        .assert_problem(409, "request-in-progress");

    probe.open();
    probe
        .wait_for("the handler to end", |p| p.ended() == 1)
        .await;
    let after = support::until_not_in_flight(Duration::from_secs(10), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert!(after.replayed(), "{}", after.text());
    assert_eq!(
        (after.status, after.text().as_str()),
        (StatusCode::CREATED, "done #1")
    );
    assert_eq!(
        (probe.started(), probe.ended()),
        (1, 1),
        "the handler ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_request_runs_its_handler_to_the_end_memory() {
    dropped_request_runs_its_handler_to_the_end(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_request_runs_its_handler_to_the_end_postgres() {
    let schema = support::PgSchema::new().await;
    let store = schema.store().await;
    dropped_request_runs_its_handler_to_the_end(store.clone()).await;
    let scopes: Vec<(String,)> = sqlx::query_as("SELECT key FROM tower_idempotency_keys")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(scopes, [("k".to_owned(),)], "one completed record");
    store.pool().close().await;
    schema.drop_schema().await;
}

/// A request dropped while its claim is on the way back leaves no key locked for a lease:
/// the claimed request runs, and a retry gets its answer long before the lease (30 s) ends.
#[tokio::test(start_paused = true)]
async fn dropped_during_the_claim_leaves_no_key_locked_for_a_lease() {
    let calls = Calls::default();
    let svc = IdempotencyLayer::new({
        let store = support::Faulty::default();
        store.claim_delay_ms.store(200, Ordering::SeqCst);
        store
    })
    .layer(support::handler(calls.clone()));
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    tokio::time::sleep(Duration::from_millis(50)).await; // the claim is made, its answer not back
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    let answer = support::until_not_in_flight(Duration::from_secs(20), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert!(answer.replayed(), "{}", answer.text());
    assert_eq!(answer.status, 201);
    assert_eq!(calls.get("/pay"), 1, "the handler ran once");
}

// ---------------------------------------------------------------------------------------------
// A handler that outlives its lease.

/// The store cannot be reached for renewals; the lease (300 ms) runs out, and a retry takes
/// the key over. When the store is back, the first request's renewal finds the key taken: no
/// panic, the first client gets its (stale) answer, and the new owner's answer stays stored.
#[tokio::test(start_paused = true)]
async fn a_handler_that_outlives_its_lease_is_not_cut_and_its_answer_not_stored() {
    let store = support::Faulty::default();
    store.renew_fails.store(true, Ordering::SeqCst);
    let calls = Arc::new(AtomicUsize::new(0));
    // When the first handler learned that its lease was lost, and whether it still was at
    // its end.
    let lost_at = Arc::new(std::sync::Mutex::new(None));
    let lost_at_end = Arc::new(AtomicBool::new(false));
    let t0 = tokio::time::Instant::now();
    let handler = {
        let (calls, lost_at, lost_at_end) = (calls.clone(), lost_at.clone(), lost_at_end.clone());
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let lease = req.extensions().get::<Lease>().cloned().expect("a lease");
            let (lost_at, lost_at_end) = (lost_at.clone(), lost_at_end.clone());
            async move {
                let body = if n == 1 {
                    assert!(!lease.is_lost());
                    let watch = {
                        let lease = lease.clone();
                        async move {
                            lease.lost().await;
                            *lost_at.lock().unwrap() = Some(t0.elapsed());
                        }
                    };
                    // The stale owner: slow, and still working (waiting now and then) when
                    // its renewal finds the key taken over.
                    let work = async {
                        for _ in 0..10 {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    };
                    tokio::join!(watch, work);
                    lost_at_end.store(lease.is_lost(), Ordering::SeqCst);
                    "stale"
                } else {
                    assert!(!lease.is_lost());
                    "fresh"
                };
                let mut res = Response::new(Full::new(Bytes::from(body)));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, std::io::Error>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .layer(handler);
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (second.status.as_u16(), second.text().as_str()),
        (201, "fresh")
    );
    store.renew_fails.store(false, Ordering::SeqCst);

    let first = read(first.await.expect("the first request panicked").unwrap()).await;
    assert_eq!(
        (first.status.as_u16(), first.text().as_str()),
        (201, "stale")
    );
    let again = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(
        again.text(),
        "fresh",
        "the stale answer was stored over the new owner's"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // The handler learned it no later than the lease (300 ms, not renewed) ran out, which is
    // when another request could take the key over; and it stayed lost.
    let lost_at = lost_at
        .lock()
        .unwrap()
        .expect("the handler never saw its lease lost");
    assert!(lost_at <= Duration::from_millis(300), "{lost_at:?}");
    assert!(lost_at_end.load(Ordering::SeqCst));
}

/// A renewal that the store answers "this claim no longer holds the key" (another instance
/// took the key over, after this process stalled past its lease, say): the handler's lease is
/// lost at that renewal — the store's own word, while the renewals before it succeeded — and
/// the handler sees it within a renewal period, not when its own work ends.
#[tokio::test(start_paused = true)]
async fn a_handler_learns_when_the_store_says_its_claim_is_gone() {
    let lost = Arc::new(AtomicBool::new(false));
    let handler = {
        let lost = lost.clone();
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let lease = req.extensions().get::<Lease>().cloned().expect("a lease");
            let lost = lost.clone();
            async move {
                let seen = tokio::time::timeout(Duration::from_secs(5), lease.lost()).await;
                lost.store(seen.is_ok(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, std::io::Error>(Response::new(Full::new(Bytes::from("late"))))
            }
        })
    };
    let store = support::Faulty::default();
    let svc = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .layer(handler);
    let started = tokio::time::Instant::now();
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    // Two renewals (at 100 and 200 ms) succeed; the next ones are disowned.
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(!lost.load(Ordering::SeqCst));
    store.renew_disowned.store(true, Ordering::SeqCst);
    let answer = read(first.await.unwrap().unwrap()).await;
    assert_eq!(answer.text(), "late");
    assert!(
        lost.load(Ordering::SeqCst),
        "the handler never saw its lease lost"
    );
    // Found at the renewal at 300 ms, not after the 5 s the handler would wait.
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Transactional mode: a request dropped while its handler runs still commits the handler's
/// write together with its key; a retry meanwhile gets `409`, and one after it the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_request_commits_its_transaction() {
    use tower_idempotency::IdempotentTx;
    let schema = support::PgSchema::new().await;
    let store = schema.store().await;
    let admin = schema.pool(2).await;
    sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY, note text NOT NULL)")
        .execute(&admin)
        .await
        .unwrap();
    let probe = Probe::new();
    let handler = {
        let probe = probe.clone();
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let probe = probe.clone();
            async move {
                let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                let (id,): (i64,) =
                    sqlx::query_as("INSERT INTO payments (note) VALUES ('paid') RETURNING id")
                        .fetch_one(&mut *tx.conn().await.unwrap())
                        .await
                        .unwrap();
                probe.started.fetch_add(1, Ordering::SeqCst);
                let _permit = probe.gate.acquire().await.unwrap();
                probe.ended.fetch_add(1, Ordering::SeqCst);
                let mut res = Response::new(Full::new(Bytes::from(format!("payment {id}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, std::io::Error>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(store.transactional()).layer(handler);
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    probe
        .wait_for("the handler to write", |p| p.started() == 1)
        .await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    let during = tokio::time::timeout(
        Duration::from_secs(10),
        svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")),
    )
    .await
    .expect("a retry ran the handler again");
    read(during.unwrap())
        .await
        .assert_problem(409, "request-in-progress");

    probe.open();
    probe
        .wait_for("the handler to end", |p| p.ended() == 1)
        .await;
    let after = support::until_not_in_flight(Duration::from_secs(10), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert!(after.replayed(), "{}", after.text());
    assert_eq!(after.status, StatusCode::CREATED);
    let counts: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM tower_idempotency_keys)",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(counts, (1, 1), "the write and the key committed, once");
    let (id,): (i64,) = sqlx::query_as("SELECT id FROM payments")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(after.text(), format!("payment {id}"));
    assert_eq!((probe.started(), probe.ended()), (1, 1));
    store.pool().close().await;
    admin.close().await;
    schema.drop_schema().await;
}

// ---------------------------------------------------------------------------------------------
// With `with_cancel_on_disconnect(true)`: the handler is cut where it waits, as before.

/// A dropped request's handler stops where it waits and the key is released: a retry runs
/// the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cancel_on_disconnect_a_dropped_request_is_cut_and_its_key_released() {
    let probe = Probe::new();
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .with_cancel_on_disconnect(true)
        .layer(gated(probe.clone()));
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    probe
        .wait_for("the handler to start", |p| p.started() == 1)
        .await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    probe.open();
    let retry = support::until_not_in_flight(Duration::from_secs(10), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.text(), "done #2");
    assert_eq!(
        (probe.started(), probe.ended()),
        (2, 1),
        "the first was cut"
    );
}

/// A panicking handler releases its key and the panic reaches the caller, with either
/// setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_releases_the_key_and_reaches_the_caller_with_either_setting() {
    for cancel in [false, true] {
        let calls = Calls::default();
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .with_cancel_on_disconnect(cancel)
            .layer(support::handler(calls.clone()));
        let send = || tokio::spawn(svc.clone().oneshot(req("POST", "/panic", Some("k"), "")));
        let payload = send().await.unwrap_err().into_panic();
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"handler panicked on purpose"),
            "cancel on disconnect: {cancel}"
        );
        // The release runs in the background; then a retry runs the handler again.
        let started = std::time::Instant::now();
        loop {
            let retry = send().await;
            if calls.get("/panic") == 2 {
                assert!(retry.unwrap_err().is_panic());
                break;
            }
            read(retry.unwrap().unwrap())
                .await
                .assert_problem(409, "request-in-progress");
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "key stayed locked"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Transactional mode with the option: a dropped request rolls back; the retry runs again
/// and commits alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cancel_on_disconnect_a_dropped_transactional_request_rolls_back() {
    use tower_idempotency::IdempotentTx;
    let schema = support::PgSchema::new().await;
    let store = schema.store().await;
    let admin = schema.pool(2).await;
    sqlx::query("CREATE TABLE payments (id bigserial PRIMARY KEY)")
        .execute(&admin)
        .await
        .unwrap();
    let probe = Probe::new();
    let handler = {
        let probe = probe.clone();
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let probe = probe.clone();
            async move {
                let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                sqlx::query("INSERT INTO payments DEFAULT VALUES")
                    .execute(&mut *tx.conn().await.unwrap())
                    .await
                    .unwrap();
                let n = probe.started.fetch_add(1, Ordering::SeqCst) + 1;
                let _permit = probe.gate.acquire().await.unwrap();
                probe.ended.fetch_add(1, Ordering::SeqCst);
                let mut res = Response::new(Full::new(Bytes::from(format!("done #{n}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, std::io::Error>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(store.transactional())
        .with_cancel_on_disconnect(true)
        .layer(handler);
    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
    probe
        .wait_for("the handler to write", |p| p.started() == 1)
        .await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    probe.open();
    let retry = support::until_not_in_flight(Duration::from_secs(10), || async {
        read(
            svc.clone()
                .oneshot(req("POST", "/pay", Some("k"), "b"))
                .await
                .unwrap(),
        )
        .await
    })
    .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(retry.text(), "done #2");
    let counts: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM tower_idempotency_keys)",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(counts, (1, 1), "only the retry committed");
    assert_eq!((probe.started(), probe.ended()), (2, 1));
    store.pool().close().await;
    admin.close().await;
    schema.drop_schema().await;
}

/// Outside a Tokio runtime a keyed request runs inline (a handler that answers at once, on
/// the memory store, needs no runtime).
#[test]
fn outside_a_tokio_runtime_a_keyed_request_runs_inline() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(tower::service_fn({
        let calls = calls.clone();
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let body = Full::new(Bytes::from(format!("call #{n}")));
            std::future::ready(Ok::<_, std::io::Error>(Response::new(body)))
        }
    }));
    let first = block_on(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"))).unwrap();
    let again = block_on(svc.oneshot(req("POST", "/pay", Some("k"), "b"))).unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A future that is pending once (waking itself) and then ready: a handler or a store call
/// that really waits, as one on another executor would.
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await;
}

/// The memory store, with every call pending once before it answers.
#[derive(Clone, Default)]
struct Waits(MemoryStore);

impl Store for Waits {
    async fn claim(
        &self,
        request: tower_idempotency::ClaimRequest<'_>,
    ) -> Result<tower_idempotency::ClaimOutcome, tower_idempotency::StoreError> {
        yield_once().await;
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
        response: &tower_idempotency::StoredResponse,
        ttl: Duration,
    ) -> Result<bool, tower_idempotency::StoreError> {
        yield_once().await;
        self.0.complete(scope, key, token, response, ttl).await
    }
    async fn release(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
    ) -> Result<bool, tower_idempotency::StoreError> {
        yield_once().await;
        self.0.release(scope, key, token).await
    }
    async fn renew(
        &self,
        scope: &str,
        key: &tower_idempotency::IdempotencyKey,
        token: tower_idempotency::LeaseToken,
        lease: Duration,
    ) -> Result<bool, tower_idempotency::StoreError> {
        yield_once().await;
        self.0.renew(scope, key, token, lease).await
    }
    async fn purge_expired(&self, batch_size: usize) -> Result<u64, tower_idempotency::StoreError> {
        self.0.purge_expired(batch_size).await
    }
}

/// Outside a Tokio runtime (a keyed request polled by another executor) every path of plain
/// mode runs inline, never a panic: a handler that waits (no lease renewal timer is armed:
/// there is no timer), a store whose claim and completion wait (the completion is awaited in
/// place, not spawned; the store calls run unbounded), a failed answer's release. The retry
/// replays; the failed key runs again.
#[test]
fn outside_a_tokio_runtime_waiting_handlers_and_stores_run_inline() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = IdempotencyLayer::new(Waits::default()).layer(tower::service_fn({
        let calls = calls.clone();
        move |req: Request<RequestBody<Full<Bytes>>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                yield_once().await;
                let mut res = Response::new(Full::new(Bytes::from(format!("call #{n}"))));
                if req.uri().path() == "/fail" {
                    *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                }
                Ok::<_, std::io::Error>(res)
            }
        }
    }));
    let first = block_on(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"))).unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let again = block_on(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b"))).unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let failed = block_on(svc.clone().oneshot(req("POST", "/fail", Some("f"), "b"))).unwrap();
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let retried = block_on(svc.oneshot(req("POST", "/fail", Some("f"), "b"))).unwrap();
    assert_eq!(retried.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "the released key ran again"
    );
}

/// Polls a future to its end on this thread, without a runtime.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}

/// A body that sends its one chunk when the gate opens, and says when it was first asked.
struct GatedBody {
    wait: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    asked: Arc<AtomicBool>,
    sent: bool,
}

impl http_body::Body for GatedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.asked.store(true, Ordering::SeqCst);
        if self.sent {
            return std::task::Poll::Ready(None);
        }
        std::task::ready!(self.wait.as_mut().poll(cx));
        self.sent = true;
        let chunk = http_body::Frame::data(Bytes::from_static(b"streamed answer"));
        std::task::Poll::Ready(Some(Ok(chunk)))
    }
}

/// The handler answered, and the layer reads its body when the request is dropped: the
/// handler's work is done, so its answer is stored (never the key released for a rerun), with
/// either setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_while_the_answer_is_read_the_answer_is_stored() {
    for cancel in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let asked = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(Semaphore::new(0));
        let handler = {
            let (calls, asked, gate) = (calls.clone(), asked.clone(), gate.clone());
            tower::service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
                calls.fetch_add(1, Ordering::SeqCst);
                let gate = gate.clone();
                let body = GatedBody {
                    wait: Box::pin(async move {
                        let _ = gate.acquire().await.unwrap();
                    }),
                    asked: asked.clone(),
                    sent: false,
                };
                std::future::ready(Ok::<_, std::io::Error>(Response::new(body)))
            })
        };
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .with_cancel_on_disconnect(cancel)
            .layer(handler);
        let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "b")));
        let started = tokio::time::Instant::now();
        while !asked.load(Ordering::SeqCst) {
            assert!(started.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        gate.add_permits(1000);
        let started = tokio::time::Instant::now();
        loop {
            let a = read(
                svc.clone()
                    .oneshot(req("POST", "/pay", Some("k"), "b"))
                    .await
                    .unwrap(),
            )
            .await;
            if a.replayed() {
                assert_eq!(a.text(), "streamed answer");
                break;
            }
            assert_eq!(
                a.status,
                409,
                "cancel on disconnect: {cancel}: {}",
                a.text()
            );
            assert!(started.elapsed() < Duration::from_secs(10), "never stored");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "cancel on disconnect: {cancel}"
        );
    }
}
