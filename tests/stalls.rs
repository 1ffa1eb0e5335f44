//! A stalled network and an exhausted pool, against a real Postgres: the layer's pool reaches
//! the server through a proxy that the test pauses (bytes stop both ways, connections stay
//! open: packets dropped, not connections refused).
//!
//! What must hold: a request whose store call stalls is answered `503` with `Retry-After`
//! within the layer's store timeout (never after sqlx's 30 s acquire timeout, never a hang);
//! a stall while the answer is stored never leaves half an answer in the store and never runs
//! the handler twice; once the network is back, the key replays or runs exactly once.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::time::Duration;

use support::faults::{Fx, Mode, timed};
use support::{req, until_not_in_flight};

/// The layer's bound on one store call in these tests.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// A `503` must come within the store timeout and this margin (a noisy machine).
const MARGIN: Duration = Duration::from_secs(3);
/// Longer than any answer may take: a request still pending then hangs.
const HANG: Duration = Duration::from_secs(30);
/// A lease short enough to wait out: a claim that landed after the layer gave up on it holds
/// the key this long.
const LEASE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_during_the_claim_is_503_within_the_store_timeout() {
    for mode in [Mode::Plain, Mode::Transactional] {
        let fx = Fx::new(4, STORE_TIMEOUT).await;
        let app = fx.app_with_lease(mode, LEASE);
        // Warm: the pool holds live connections, through the proxy.
        let (warm, _) = timed(&app, req("POST", "/warm", Some("w"), ""), HANG).await;
        assert_eq!(warm.status, 201, "{mode:?}: {}", warm.text());

        fx.proxy.pause();
        let (answer, took) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        answer.assert_problem(503, "store-unavailable");
        assert!(answer.headers.contains_key("retry-after"), "{mode:?}");
        assert!(
            took >= STORE_TIMEOUT - Duration::from_millis(100),
            "{mode:?}: a 503 after {took:?}, before the store timeout: it was not the stall"
        );
        assert!(
            took < STORE_TIMEOUT + MARGIN,
            "{mode:?}: the 503 took {took:?}"
        );
        assert_eq!(fx.calls.get("/pay"), 0, "{mode:?}: the handler did not run");
        println!(
            "{mode:?}: stall during the claim: 503 after {took:?} (store timeout {STORE_TIMEOUT:?})"
        );
        fx.proxy.resume();

        // The claim that stalled may still reach the server once the network is back (it
        // was sent): then it holds the key for its lease, or its transaction until its
        // connection closes. Either way the retry runs the handler once, at the latest after
        // the lease.
        let first = until_not_in_flight(LEASE + Duration::from_secs(10), || async {
            timed(&app, req("POST", "/pay", Some("k"), "b"), HANG)
                .await
                .0
        })
        .await;
        assert_eq!(first.status, 201, "{mode:?}: {}", first.text());
        let (again, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        assert!(
            again.replayed(),
            "{mode:?}: {} {}",
            again.status,
            again.text()
        );
        assert_eq!(again.body, first.body);
        assert_eq!(fx.calls.get("/pay"), 1, "{mode:?}");
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_503_within_the_store_timeout_not_the_acquire_timeout() {
    for mode in [Mode::Plain, Mode::Transactional] {
        // A pool of one connection (sqlx's acquire timeout: 30 s), held by someone else.
        let fx = Fx::new(1, STORE_TIMEOUT).await;
        let app = fx.app(mode);
        let held = fx.store.pool().acquire().await.unwrap();
        let (answer, took) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        answer.assert_problem(503, "store-unavailable");
        assert!(answer.headers.contains_key("retry-after"));
        assert!(
            took < STORE_TIMEOUT + MARGIN,
            "{mode:?}: the 503 took {took:?}"
        );
        assert_eq!(fx.calls.total(), 0, "{mode:?}");
        println!("{mode:?}: exhausted pool: 503 after {took:?} (store timeout {STORE_TIMEOUT:?})");
        drop(held);
        // Nothing was claimed: the retry runs at once, once.
        let (first, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        assert_eq!(first.status, 201, "{mode:?}: {}", first.text());
        assert!(!first.replayed());
        let (again, _) = timed(&app, req("POST", "/pay", Some("k"), "b"), HANG).await;
        assert!(again.replayed(), "{mode:?}");
        assert_eq!(fx.calls.get("/pay"), 1, "{mode:?}");
        fx.cleanup().await;
    }
}

/// The size of the answers stored in the completion tests: far more than one network
/// segment or the proxy's buffer, so that a torn write would show.
const BIG: usize = 300_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_a_stall_while_the_answer_is_stored_never_stores_half_or_runs_twice() {
    let fx = Fx::new(4, STORE_TIMEOUT).await;
    let app = fx.app(Mode::Plain);
    let path = format!("/pay?gate&pad={BIG}");
    let pending = tokio::spawn({
        let (app, path) = (app.clone(), path.clone());
        async move { timed(&app, req("POST", &path, Some("k"), "b"), HANG).await }
    });
    fx.gate.reached(1).await;
    fx.proxy.pause();
    fx.gate.open();
    // The handler's work is done: the client gets its answer, whole, within the bound,
    // although it could not be stored.
    let (first, took) = pending.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(first.body.len() >= BIG);
    assert!(took < STORE_TIMEOUT + MARGIN, "the answer took {took:?}");
    assert_eq!(
        fx.record("k").await,
        Some((None, None)),
        "during the stall the key is a claim: nothing of the answer is stored"
    );
    fx.proxy.resume();
    // The completion that stalled may land late, whole; never in part.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let record = fx.record("k").await;
    match &record {
        Some((None, None)) => {}
        Some((Some(201), Some(body))) => assert_eq!(body.as_slice(), &first.body[..]),
        other => panic!("a torn record: {:?}", other.as_ref().map(|r| r.0)),
    }
    let (retry, _) = timed(&app, req("POST", &path, Some("k"), "b"), HANG).await;
    if record == Some((None, None)) {
        // Left to its lease: the retry is told to wait, and the handler does not run again.
        retry.assert_problem(409, "request-in-progress");
    } else {
        assert!(retry.replayed(), "{} {}", retry.status, retry.text());
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(fx.calls.get("/pay"), 1, "the handler ran once");
    println!(
        "plain-mode stall while storing: the late completion {}",
        if record == Some((None, None)) {
            "did not land (the key waits for its lease)"
        } else {
            "landed whole (the retry replays)"
        }
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_a_stall_during_the_commit_is_503_and_commits_once_at_most() {
    let fx = Fx::new(4, STORE_TIMEOUT).await;
    let app = fx.app(Mode::Transactional);
    let path = format!("/pay?gate&pad={BIG}");
    let pending = tokio::spawn({
        let (app, path) = (app.clone(), path.clone());
        async move { timed(&app, req("POST", &path, Some("k"), "b"), HANG).await }
    });
    fx.gate.reached(1).await;
    fx.proxy.pause();
    fx.gate.open();
    // The answer commits with the handler's writes: unknown whether it will, so 503.
    let (answer, took) = pending.await.unwrap();
    answer.assert_problem(503, "store-unavailable");
    assert!(answer.headers.contains_key("retry-after"));
    assert!(took < STORE_TIMEOUT + MARGIN, "the 503 took {took:?}");
    assert_eq!(
        (fx.payments("k").await, fx.record("k").await),
        (0, None),
        "nothing committed during the stall"
    );
    fx.proxy.resume();
    // The commit that was sent may still happen once the network is back; the retry replays
    // it if it did, and runs if it did not. Never two commits, never half an answer.
    let retry = until_not_in_flight(Duration::from_secs(15), || async {
        timed(&app, req("POST", &path, Some("k"), "b"), HANG)
            .await
            .0
    })
    .await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.body.len() >= BIG);
    assert_eq!(fx.payments("k").await, 1, "one run committed");
    let (Some(201), Some(stored)) = fx.record("k").await.unwrap() else {
        panic!("the key holds no answer");
    };
    assert_eq!(
        stored.as_slice(),
        &retry.body[..],
        "the whole answer is stored"
    );
    let id: i64 = sqlx::query_scalar("SELECT id FROM payments WHERE key = 'k'")
        .fetch_one(&fx.admin)
        .await
        .unwrap();
    assert!(retry.text().starts_with(&format!("payment {id} ")));
    if retry.replayed() {
        assert_eq!(
            fx.calls.get("/pay"),
            1,
            "committed late: replayed, not run again"
        );
    } else {
        assert_eq!(
            fx.calls.get("/pay"),
            2,
            "rolled back: the retry ran (and committed)"
        );
    }
    println!(
        "transactional stall during the commit: the commit {}",
        if retry.replayed() {
            "happened late (the retry replays)"
        } else {
            "never happened (the retry ran)"
        }
    );
    fx.cleanup().await;
}

/// The handler answers a `5xx` while the network is stalled: the layer must roll its
/// transaction back, which it cannot reach. The client still gets the handler's answer
/// within the store timeout (not when the stalled connection finally dies), and nothing
/// commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_a_stall_before_the_rollback_of_a_5xx_still_answers_within_the_bound() {
    let fx = Fx::new(4, STORE_TIMEOUT).await;
    let app = fx.app(Mode::Transactional);
    let pending = tokio::spawn({
        let app = app.clone();
        async move {
            timed(
                &app,
                req("POST", "/pay?gate&status=500", Some("k"), "b"),
                HANG,
            )
            .await
        }
    });
    fx.gate.reached(1).await;
    fx.proxy.pause();
    fx.gate.open();
    let (answer, took) = pending.await.unwrap();
    fx.proxy.resume();
    assert_eq!(answer.status, 500, "{}", answer.text());
    assert!(took < STORE_TIMEOUT + MARGIN, "the answer took {took:?}");
    let retry = until_not_in_flight(Duration::from_secs(15), || async {
        timed(&app, req("POST", "/pay", Some("k"), "b"), HANG)
            .await
            .0
    })
    .await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(
        fx.payments("k").await,
        1,
        "the 5xx run rolled back; the retry committed"
    );
    fx.cleanup().await;
}
