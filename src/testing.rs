//! The store conformance suite (feature `testing`): the checks every store of this crate
//! passes, as public functions, so that the author of another store (DynamoDB, SQLite, a
//! team's own Postgres schema) can run them from their own tests. And [`duplicates`]: a
//! duplicate-injection kit for your own consumers and handlers.
//!
//! Each check works on keys of its own (a fresh prefix per run), so one store instance can
//! run them all, in any order, beside other data. The checks that model two app instances
//! take two store values that share one backend (two pools on one database, say); give the
//! same store twice if your store has no such notion. Time-based checks wait real time (a
//! few hundred milliseconds each), measured by the store's own clock.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tower_idempotency::{MemoryStore, testing};
//!
//! let store = MemoryStore::new();
//! let report = testing::check_all(store.clone(), store).await;
//! assert!(report.is_ok(), "{report:?}");
//! # }
//! ```
//!
//! In a test of your own store, run [`check_all`] (or the checks one by one, to see each
//! in the test report) and unwrap the result: a [`Failure`] names the check and what the
//! store did instead.

mod checks;
pub mod duplicates;

pub use checks::{
    answer_without_body, claim_complete_replay, completed_record_expires_after_its_ttl,
    in_flight_and_mismatch, purge_removes_expired_records, racing_claims_acquire_once,
    release_frees_the_key, renewal_keeps_the_key, scopes_are_independent,
    takeover_fences_the_old_token, tokens_are_never_reused,
};

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken, Store};

/// A check that the store (or, in [`duplicates`], your code) did not pass: which one, and
/// what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The check's name (its function's).
    pub check: &'static str,
    /// What happened instead of what the check expects.
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "check `{}` failed: {}", self.check, self.detail)
    }
}

impl std::error::Error for Failure {}

/// The result of one check.
pub type Outcome = Result<(), Failure>;

/// Runs every check, in order, and stops at the first failure. Returns the names of the
/// checks passed.
///
/// # Errors
///
/// The first [`Failure`].
pub async fn check_all<S: Store>(first: S, second: S) -> Result<Vec<&'static str>, Failure> {
    let mut passed = Vec::new();
    claim_complete_replay(&first).await?;
    passed.push("claim_complete_replay");
    in_flight_and_mismatch(&first).await?;
    passed.push("in_flight_and_mismatch");
    scopes_are_independent(&first).await?;
    passed.push("scopes_are_independent");
    answer_without_body(&first).await?;
    passed.push("answer_without_body");
    release_frees_the_key(&first).await?;
    passed.push("release_frees_the_key");
    racing_claims_acquire_once(&first, &second).await?;
    passed.push("racing_claims_acquire_once");
    takeover_fences_the_old_token(&first, &second).await?;
    passed.push("takeover_fences_the_old_token");
    renewal_keeps_the_key(&first).await?;
    passed.push("renewal_keeps_the_key");
    completed_record_expires_after_its_ttl(&first).await?;
    passed.push("completed_record_expires_after_its_ttl");
    tokens_are_never_reused(&first).await?;
    passed.push("tokens_are_never_reused");
    purge_removes_expired_records(&first).await?;
    passed.push("purge_removes_expired_records");
    watch_wakes_on_complete_and_release(&first, &second).await?;
    passed.push("watch_wakes_on_complete_and_release");
    Ok(passed)
}

/// The lease and TTL of the checks' claims, and the short lease or TTL of the time-based
/// checks (waited three times over, so a store's clock granularity does not matter).
const TTL: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(150);

fn fail(check: &'static str, detail: String) -> Outcome {
    Err(Failure { check, detail })
}

/// A key no other run uses: the check's name, the time and a counter.
fn fresh_key(check: &'static str) -> Result<IdempotencyKey, Failure> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    IdempotencyKey::parse(&format!("conformance-{check}-{nanos}-{n}")).map_err(|e| Failure {
        check,
        detail: format!("could not make a key: {e}"),
    })
}

/// A claim of `key` in the empty scope with fingerprint number `fp`.
fn claim(key: &IdempotencyKey, fp: u8) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: "",
        key,
        fingerprint: Fingerprint::from_bytes([fp; 32]),
        lease: TTL,
        ttl: TTL,
    }
}

/// A store that offers [`Store::watch`] (for waiting duplicates) keeps its word: a watch
/// made on one instance finishes when the other instance completes the key, and when it
/// releases it. A store without watches (`None`, the default) passes.
///
/// # Errors
///
/// A [`Failure`] when a watch does not finish within 10 s of the change.
pub async fn watch_wakes_on_complete_and_release<S: Store>(first: &S, second: &S) -> Outcome {
    const CHECK: &str = "watch_wakes_on_complete_and_release";
    for release in [false, true] {
        let key = fresh_key(CHECK)?;
        let token = acquire(CHECK, first, claim(&key, 1)).await?;
        let watch = match second.watch("", &key).await {
            Ok(Some(watch)) => watch,
            Ok(None) => return Ok(()),
            Err(e) => return fail(CHECK, format!("watch gave {e:?}")),
        };
        if release {
            match first.release("", &key, token).await {
                Ok(true) => {}
                other => return fail(CHECK, format!("release by the holder gave {other:?}")),
            }
        } else {
            complete(CHECK, first, &key, token, &sample_answer()).await?;
        }
        let what = if release { "release" } else { "completion" };
        if tokio::time::timeout(Duration::from_secs(10), watch)
            .await
            .is_err()
        {
            return fail(
                CHECK,
                format!("a watch on the other instance did not finish within 10 s of a {what}"),
            );
        }
    }
    Ok(())
}

async fn acquire<S: Store>(
    check: &'static str,
    store: &S,
    req: ClaimRequest<'_>,
) -> Result<LeaseToken, Failure> {
    match store.claim(req).await {
        Ok(ClaimOutcome::Acquired { token, .. }) => Ok(token),
        other => Err(Failure {
            check,
            detail: format!("claiming an absent key gave {other:?}"),
        }),
    }
}

async fn complete<S: Store>(
    check: &'static str,
    store: &S,
    key: &IdempotencyKey,
    token: LeaseToken,
    answer: &StoredResponse,
) -> Outcome {
    match store.complete("", key, token, answer, TTL).await {
        Ok(true) => Ok(()),
        other => fail(
            check,
            format!("completing with the holder's token gave {other:?}"),
        ),
    }
}

/// An answer with a status, two values of one header, a binary header value and a body.
fn sample_answer() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.append("x-multi", HeaderValue::from_static("1"));
    headers.append("x-multi", HeaderValue::from_static("2"));
    if let Ok(binary) = HeaderValue::from_bytes(b"\xff\x80ok") {
        headers.insert("x-bin", binary);
    }
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from_static(b"{\"id\":\"pay_1\",\"amount\":100}"),
    )
}
