//! The conformance checks, one function each: a store's claims, answers, scopes, races,
//! leases, expiry and purge, as [`check_all`](super::check_all) runs them.

use http::{HeaderMap, StatusCode};

use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken, Store};

use super::*;

/// A claim of an absent key is acquired; once completed, a claim with the same fingerprint
/// gets the stored answer, status, headers and body byte for byte.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn claim_complete_replay<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "claim_complete_replay";
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    let answer = sample_answer();
    complete(CHECK, store, &key, token, &answer).await?;
    match store.claim(claim(&key, 1)).await {
        Ok(ClaimOutcome::Completed(stored)) if stored == answer => Ok(()),
        other => fail(
            CHECK,
            format!("the replay of a completed key gave {other:?}"),
        ),
    }
}

/// While a claim holds a key, a claim with the same fingerprint is `InFlight` and one with
/// another fingerprint is `Mismatch`; once completed, another fingerprint is still
/// `Mismatch`.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn in_flight_and_mismatch<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "in_flight_and_mismatch";
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    match store.claim(claim(&key, 1)).await {
        Ok(ClaimOutcome::InFlight { .. }) => {}
        other => return fail(CHECK, format!("a duplicate of a held key gave {other:?}")),
    }
    match store.claim(claim(&key, 2)).await {
        Ok(ClaimOutcome::Mismatch) => {}
        other => {
            return fail(
                CHECK,
                format!("another payload on a held key gave {other:?}"),
            );
        }
    }
    complete(CHECK, store, &key, token, &sample_answer()).await?;
    match store.claim(claim(&key, 2)).await {
        Ok(ClaimOutcome::Mismatch) => Ok(()),
        other => fail(
            CHECK,
            format!("another payload on a completed key gave {other:?}"),
        ),
    }
}

/// The same key in two scopes is two keys.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn scopes_are_independent<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "scopes_are_independent";
    let key = fresh_key(CHECK)?;
    let a = ClaimRequest {
        scope: "tenant-a",
        ..claim(&key, 1)
    };
    let b = ClaimRequest {
        scope: "tenant-b",
        ..claim(&key, 2)
    };
    acquire(CHECK, store, a).await?;
    acquire(CHECK, store, b).await.map(|_| ())
}

/// An answer stored without its body (larger than the layer's limit) comes back without
/// one.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn answer_without_body<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "answer_without_body";
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    let answer = StoredResponse::without_body(StatusCode::CREATED, HeaderMap::new());
    complete(CHECK, store, &key, token, &answer).await?;
    match store.claim(claim(&key, 1)).await {
        Ok(ClaimOutcome::Completed(stored)) if stored.body().is_none() && stored == answer => {
            Ok(())
        }
        other => fail(CHECK, format!("the replay gave {other:?}")),
    }
}

/// A released key can be claimed again at once, and the released token no longer holds it.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn release_frees_the_key<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "release_frees_the_key";
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    match store.release("", &key, token).await {
        Ok(true) => {}
        other => return fail(CHECK, format!("release by the holder gave {other:?}")),
    }
    let again = acquire(CHECK, store, claim(&key, 1)).await?;
    if again == token {
        return fail(CHECK, "the new claim got the released token".into());
    }
    match store.complete("", &key, token, &sample_answer(), TTL).await {
        Ok(false) => Ok(()),
        other => fail(
            CHECK,
            format!("completing with the released token gave {other:?}"),
        ),
    }
}

/// 50 claims of one absent key at once, alternating between two instances: exactly one is
/// acquired; the others are `InFlight` (or `Completed`, had it completed meanwhile).
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn racing_claims_acquire_once<S: Store>(first: &S, second: &S) -> Outcome {
    const CHECK: &str = "racing_claims_acquire_once";
    let key = fresh_key(CHECK)?;
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let store = if i % 2 == 0 { first } else { second }.clone();
            let key = key.clone();
            tokio::spawn(async move { store.claim(claim(&key, 1)).await })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await {
            Ok(Ok(ClaimOutcome::Acquired { .. })) => acquired += 1,
            Ok(Ok(ClaimOutcome::InFlight { .. } | ClaimOutcome::Completed(_))) => {}
            other => return fail(CHECK, format!("a racing claim gave {other:?}")),
        }
    }
    if acquired == 1 {
        Ok(())
    } else {
        fail(
            CHECK,
            format!("{acquired} of 50 racing claims were acquired"),
        )
    }
}

/// A claim whose lease ran out is taken over (from the other instance) with a new token;
/// the old token can then neither complete, renew nor release the key, and the new one
/// can complete it.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn takeover_fences_the_old_token<S: Store>(first: &S, second: &S) -> Outcome {
    const CHECK: &str = "takeover_fences_the_old_token";
    let key = fresh_key(CHECK)?;
    let short = ClaimRequest {
        lease: SHORT,
        ..claim(&key, 1)
    };
    let old = acquire(CHECK, first, short).await?;
    tokio::time::sleep(SHORT * 3).await;
    let new = match second.claim(claim(&key, 1)).await {
        Ok(ClaimOutcome::Acquired {
            token,
            takeover: true,
        }) => token,
        other => {
            return fail(
                CHECK,
                format!("claiming after the lease ran out gave {other:?}"),
            );
        }
    };
    if new == old {
        return fail(CHECK, "the takeover reused the old token".into());
    }
    let answer = sample_answer();
    if !matches!(first.complete("", &key, old, &answer, TTL).await, Ok(false)) {
        return fail(
            CHECK,
            "the old token completed the key after a takeover".into(),
        );
    }
    if !matches!(first.renew("", &key, old, TTL).await, Ok(false)) {
        return fail(
            CHECK,
            "the old token renewed the key after a takeover".into(),
        );
    }
    if !matches!(first.release("", &key, old).await, Ok(false)) {
        return fail(
            CHECK,
            "the old token released the key after a takeover".into(),
        );
    }
    complete(CHECK, second, &key, new, &answer).await
}

/// A renewed claim is not taken over when its first lease would have run out.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn renewal_keeps_the_key<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "renewal_keeps_the_key";
    let key = fresh_key(CHECK)?;
    let lease = SHORT * 3;
    let token = acquire(
        CHECK,
        store,
        ClaimRequest {
            lease,
            ..claim(&key, 1)
        },
    )
    .await?;
    tokio::time::sleep(lease / 2).await;
    match store.renew("", &key, token, lease).await {
        Ok(true) => {}
        other => return fail(CHECK, format!("renewing a held key gave {other:?}")),
    }
    tokio::time::sleep(lease * 3 / 4).await;
    match store.claim(claim(&key, 1)).await {
        Ok(ClaimOutcome::InFlight { .. }) => Ok(()),
        other => fail(
            CHECK,
            format!("a claim within the renewed lease gave {other:?}"),
        ),
    }
}

/// A completed record lives its TTL from its completion; after it the key is new again (an
/// acquired claim that is not a takeover), even with another fingerprint.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn completed_record_expires_after_its_ttl<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "completed_record_expires_after_its_ttl";
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    match store
        .complete("", &key, token, &sample_answer(), SHORT)
        .await
    {
        Ok(true) => {}
        other => return fail(CHECK, format!("completing gave {other:?}")),
    }
    tokio::time::sleep(SHORT * 3).await;
    match store.claim(claim(&key, 2)).await {
        Ok(ClaimOutcome::Acquired {
            takeover: false, ..
        }) => Ok(()),
        other => fail(CHECK, format!("a claim after the TTL gave {other:?}")),
    }
}

/// Twenty claims of keys released in between get twenty different tokens.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn tokens_are_never_reused<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "tokens_are_never_reused";
    let key = fresh_key(CHECK)?;
    let mut seen: Vec<LeaseToken> = Vec::new();
    for _ in 0..20 {
        let token = acquire(CHECK, store, claim(&key, 1)).await?;
        if seen.contains(&token) {
            return fail(CHECK, format!("token {token:?} was given twice"));
        }
        seen.push(token);
        if !matches!(store.release("", &key, token).await, Ok(true)) {
            return fail(CHECK, "releasing a held key failed".into());
        }
    }
    Ok(())
}

/// `purge_expired` deletes an expired record, and the key is new afterwards; a record that
/// has not expired (completed, and in flight) is kept, its answer replayed and its claim
/// still held.
///
/// # Errors
///
/// A [`Failure`] when the store does otherwise.
pub async fn purge_removes_expired_records<S: Store>(store: &S) -> Outcome {
    const CHECK: &str = "purge_removes_expired_records";
    let live = fresh_key(CHECK)?;
    let live_token = acquire(CHECK, store, claim(&live, 1)).await?;
    complete(CHECK, store, &live, live_token, &sample_answer()).await?;
    let running = fresh_key(CHECK)?;
    acquire(CHECK, store, claim(&running, 1)).await?;
    let key = fresh_key(CHECK)?;
    let token = acquire(CHECK, store, claim(&key, 1)).await?;
    if !matches!(
        store
            .complete("", &key, token, &sample_answer(), SHORT)
            .await,
        Ok(true)
    ) {
        return fail(CHECK, "completing failed".into());
    }
    tokio::time::sleep(SHORT * 3).await;
    // Other checks' (and other users') expired records may be purged too; a store may also
    // have removed this one by itself already (the memory store sweeps as it is used).
    if let Err(e) = store.purge_expired(1000).await {
        return fail(CHECK, format!("purge_expired failed: {e}"));
    }
    match store.claim(claim(&key, 2)).await {
        Ok(ClaimOutcome::Acquired {
            takeover: false, ..
        }) => {}
        other => return fail(CHECK, format!("a claim after the purge gave {other:?}")),
    }
    match store.claim(claim(&live, 1)).await {
        Ok(ClaimOutcome::Completed(stored)) if stored == sample_answer() => {}
        other => {
            return fail(
                CHECK,
                format!("the purge took a record within its TTL: its replay gave {other:?}"),
            );
        }
    }
    match store.claim(claim(&running, 1)).await {
        Ok(ClaimOutcome::InFlight { .. }) => Ok(()),
        other => fail(
            CHECK,
            format!("the purge took a claim within its lease: a duplicate gave {other:?}"),
        ),
    }
}
