//! The statements of phased mode (`crate::phased`) and the encoding of its recovery points.
//!
//! Every statement on the key's record is fenced by the claim's lease token: it changes the
//! record only while that token holds it, and inside a phase's transaction it raises
//! [`NOT_HELD`] otherwise (the functions `tower_idempotency_phase_record` and
//! `tower_idempotency_phase_complete`), so the phase's writes cannot commit without it.
//!
//! A phase's transaction begins with `BEGIN` (the first one of a layer with [`begin_batch`],
//! which finds the connections' default level) and nothing that takes a snapshot. The layer
//! pauses the lease's renewals from before the `BEGIN` until the phase ends, so under
//! `REPEATABLE READ` no renewal commits between the phase's snapshot and its update of the
//! record. Under `SERIALIZABLE` the phase begins with [`fence_batch`] instead, which finds the
//! record's row id outside the phase's transaction: a lookup through the primary key inside
//! it would predicate-lock an index page, and the phases of other keys whose records share
//! that page would then fail with serialization failures.

use std::time::Duration;

use bytes::Bytes;

use crate::error::StoreError;
use crate::response::StoredResponse;
use crate::store::postgres::{millis, status_column};
use crate::store::sql::{Lit, fill, push_bounds};

/// The most a key's recorded phases (names and states, encoded) may take.
pub(crate) const MAX_PHASES_BYTES: usize = 64 * 1024;

/// The phases a key's record holds, oldest first: each name with its state.
pub(crate) type Recorded = Vec<(String, Bytes)>;

/// Encodes recorded phases: for each, the name's length (2 bytes, big-endian), the name, the
/// state's length (4 bytes) and the state.
pub(crate) fn encode(phases: &[(String, Bytes)]) -> Result<Vec<u8>, StoreError> {
    let len: usize = phases.iter().map(|(n, s)| 6 + n.len() + s.len()).sum();
    if len > MAX_PHASES_BYTES {
        return Err(StoreError::Corrupt(format!(
            "the recorded phases would take {len} bytes, more than the {MAX_PHASES_BYTES} allowed"
        )));
    }
    let mut out = Vec::with_capacity(len);
    for (name, state) in phases {
        let n = u16::try_from(name.len())
            .map_err(|_| StoreError::Corrupt("a phase name is too long".into()))?;
        let s = u32::try_from(state.len())
            .map_err(|_| StoreError::Corrupt("a phase state is too long".into()))?;
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&s.to_be_bytes());
        out.extend_from_slice(state);
    }
    Ok(out)
}

/// Decodes what [`encode`] wrote; anything else is [`StoreError::Corrupt`].
pub(crate) fn decode(mut bytes: &[u8]) -> Result<Recorded, StoreError> {
    let corrupt =
        || StoreError::Corrupt("the recorded phases are not in the crate's encoding".into());
    let mut phases = Vec::new();
    while !bytes.is_empty() {
        let (n, rest) = bytes.split_first_chunk::<2>().ok_or_else(corrupt)?;
        let n = usize::from(u16::from_be_bytes(*n));
        let (name, rest) = rest.split_at_checked(n).ok_or_else(corrupt)?;
        let name = std::str::from_utf8(name).map_err(|_| corrupt())?;
        let (s, rest) = rest.split_first_chunk::<4>().ok_or_else(corrupt)?;
        let s = usize::try_from(u32::from_be_bytes(*s)).map_err(|_| corrupt())?;
        let (state, rest) = rest.split_at_checked(s).ok_or_else(corrupt)?;
        phases.push((name.to_owned(), Bytes::copy_from_slice(state)));
        bytes = rest;
    }
    Ok(phases)
}

/// Where the phase functions find the record: by key (`NULL`), or by the row id that
/// [`fence_batch`] kept.
fn row_arg(fenced: bool) -> &'static str {
    if fenced {
        "pg_catalog.current_setting('tower_idempotency.row')::tid"
    } else {
        "NULL"
    }
}

/// Opens a phase's transaction when the connections' default level is not known yet: `BEGIN`,
/// then one look that says the transaction's level (a connection whose default turns out to
/// be `SERIALIZABLE` is rolled back and fenced instead) and whether the token still holds the
/// record (`held`). Under `REPEATABLE READ` the look takes the transaction's snapshot; no
/// renewal runs until the phase ends, so the record it saw is the one the phase updates.
/// Once the level is known, a phase below `SERIALIZABLE` opens with a bare `BEGIN`.
pub(crate) fn begin_batch(
    begin: &str,
    (scope, key, token): (&str, &str, i64),
) -> Result<String, StoreError> {
    let mut sql = String::with_capacity(300 + scope.len() + key.len());
    sql.push_str(begin);
    let look = fill(
        "; SELECT pg_catalog.current_setting('transaction_isolation') AS transaction_isolation, \
         tower_idempotency_phase_held($1, $2, $3) AS held",
        &[Lit::Text(scope), Lit::Text(key), Lit::Int(token)],
    )?;
    sql.push_str(&look);
    Ok(sql)
}

/// The record's condition: the key, held by the token.
const HELD: &str = "scope = $1 AND key = $2 AND lease_token = $3";

/// The record's condition inside a phase's transaction: [`HELD`], and found by its row id,
/// which the fence keeps in the setting `tower_idempotency.row`. A `SERIALIZABLE`
/// transaction that looks a row up through an index takes a predicate lock on the index
/// page; another request's phase that writes a record on that page then counts as a
/// conflict, and requests with different keys would fail each other. Found by its row id,
/// the record is locked alone.
const HELD_ROW: &str = "ctid = pg_catalog.current_setting('tower_idempotency.row')::tid \
     AND scope = $1 AND key = $2 AND lease_token = $3";

/// Opens a phase's transaction (one message): `BEGIN` at `begin`'s isolation level, then the
/// fence — the record, while the token holds it, gets its lease extended to `lease` from now
/// (and its life to at least that) and is row-locked until the transaction ends; it returns
/// a row `held` only then. The store's bounds hold for the fence alone: the settings before
/// it are put back for the handler's statements.
///
/// The record is found by its row id, looked up first in a `READ COMMITTED` transaction of
/// its own (in the same message), so that no index page is predicate-locked under
/// `SERIALIZABLE` ([`HELD_ROW`]); the fence keeps the new row id for the statements after it.
/// The look's setting is the session's (it must outlive its transaction): it only ever holds
/// a row id, and every fence writes it before it reads it.
pub(crate) fn fence_batch(
    begin: &str,
    (scope, key, token): (&str, &str, i64),
    lease: Duration,
    (statement_timeout, lock_timeout): (Duration, Duration),
) -> Result<String, StoreError> {
    let mut sql = String::with_capacity(1200 + 2 * (scope.len() + key.len()));
    let look = fill(
        &format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; \
             SELECT pg_catalog.set_config('tower_idempotency.row', \
                    coalesce((SELECT ctid::text FROM tower_idempotency_keys WHERE {HELD}), \
                             '(0,0)'), false); \
             COMMIT; "
        ),
        &[Lit::Text(scope), Lit::Text(key), Lit::Int(token)],
    )?;
    sql.push_str(&look);
    sql.push_str(begin);
    sql.push_str(
        "; SELECT set_config('tower_idempotency.statement_timeout', \
         current_setting('statement_timeout'), true), \
         set_config('tower_idempotency.lock_timeout', current_setting('lock_timeout'), true); ",
    );
    push_bounds(&mut sql, statement_timeout, lock_timeout);
    let fence = fill(
        &format!(
            "WITH fence AS (UPDATE tower_idempotency_keys \
                SET lease_expires_at = tower_idempotency_now() + $4::float8 * interval '1 millisecond', \
                    expires_at = GREATEST(expires_at, \
                        tower_idempotency_now() + $4::float8 * interval '1 millisecond') \
              WHERE {HELD_ROW} RETURNING ctid) \
             SELECT true AS held, \
                    pg_catalog.set_config('tower_idempotency.row', ctid::text, true) AS fenced_row \
               FROM fence"
        ),
        &[
            Lit::Text(scope),
            Lit::Text(key),
            Lit::Int(token),
            Lit::Int(millis(lease)),
        ],
    )?;
    sql.push_str(&fence);
    sql.push_str(
        "; SELECT set_config('statement_timeout', \
         current_setting('tower_idempotency.statement_timeout'), true), \
         set_config('lock_timeout', current_setting('tower_idempotency.lock_timeout'), true)",
    );
    Ok(sql)
}

/// Records the phases (all of them, encoded) on the record, and `request` when given (see
/// [`crate::phased::Phased::with_resumable_requests`]), extends the lease and commits (one
/// message). Returns the message and how many statements it has, the `COMMIT` last.
pub(crate) fn record_batch(
    (scope, key, token): (&str, &str, i64),
    phases: &[u8],
    request: Option<&[u8]>,
    lease: Duration,
    fenced: bool,
    (statement_timeout, lock_timeout): (Duration, Duration),
) -> Result<(String, usize), StoreError> {
    let mut sql = String::with_capacity(300 + 2 * phases.len() + scope.len() + key.len());
    let bounds = push_bounds(&mut sql, statement_timeout, lock_timeout);
    let record = fill(
        &format!(
            "SELECT tower_idempotency_phase_record($1, $2, $3, $4, $5, {}, $6)",
            row_arg(fenced)
        ),
        &[
            Lit::Text(scope),
            Lit::Text(key),
            Lit::Int(token),
            Lit::Bytes(phases),
            Lit::Int(millis(lease)),
            Lit::MaybeBytes(request),
        ],
    )?;
    sql.push_str(&record);
    sql.push_str("; COMMIT");
    Ok((sql, bounds + 2))
}

/// Stores the answer on the record while the token holds it: the record becomes completed
/// (its phases dropped), living `ttl` from now, and wakes the waiters of `wake` (a key's
/// hash); raises [`NOT_HELD`] otherwise. `fenced`: in a phase's transaction opened by
/// [`fence_batch`].
pub(crate) fn complete_statement(
    (scope, key, token): (&str, &str, i64),
    ttl: Duration,
    stored: &StoredResponse,
    fenced: bool,
    wake: Option<i64>,
) -> Result<String, StoreError> {
    let status = status_column(stored)?;
    let headers = stored.encode_headers();
    fill(
        &format!(
            "SELECT tower_idempotency_phase_complete($1, $2, $3, $4, $5::smallint, $6, $7, {}, {})",
            row_arg(fenced),
            wake.map_or_else(|| "NULL".to_owned(), |hash| format!("({hash})"))
        ),
        &[
            Lit::Text(scope),
            Lit::Text(key),
            Lit::Int(token),
            Lit::Int(millis(ttl)),
            Lit::Int(i64::from(status)),
            Lit::Bytes(&headers),
            Lit::MaybeBytes(stored.body().map(|b| &b[..])),
        ],
    )
}

/// Ends the claim but keeps its phases, so that the next request with the key resumes them:
/// the lease runs out now (the token stays, so only a request with the same fingerprint takes
/// the record over). Returns the rows changed (`changed`).
pub(crate) fn yield_statement(
    (scope, key, token): (&str, &str, i64),
) -> Result<String, StoreError> {
    fill(
        &format!(
            "WITH done AS (UPDATE tower_idempotency_keys \
                SET lease_expires_at = tower_idempotency_now() \
              WHERE {HELD} RETURNING 1) \
             SELECT count(*) AS changed FROM done"
        ),
        &[Lit::Text(scope), Lit::Text(key), Lit::Int(token)],
    )
}

/// Reads the phases of the record the token holds (after a takeover).
pub(crate) fn read_statement((scope, key, token): (&str, &str, i64)) -> Result<String, StoreError> {
    fill(
        &format!("SELECT phases FROM tower_idempotency_keys WHERE {HELD}"),
        &[Lit::Text(scope), Lit::Text(key), Lit::Int(token)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_and_refuse_what_they_did_not_write() {
        let phases = vec![
            ("pending".to_owned(), Bytes::from_static(b"42")),
            ("".to_owned(), Bytes::new()),
            ("é".to_owned(), Bytes::from(vec![0u8; 300])),
        ];
        let bytes = encode(&phases).unwrap();
        assert_eq!(decode(&bytes).unwrap(), phases);
        assert!(decode(&[]).unwrap().is_empty());
        for cut in 1..bytes.len() {
            // A truncated encoding decodes only where a phase ends, into the phases before.
            if let Ok(decoded) = decode(&bytes[..cut]) {
                assert!(phases.starts_with(&decoded), "{cut}: {decoded:?}");
            }
        }
        assert!(
            decode(&[0, 1, 0xff, 0, 0, 0, 0]).is_err(),
            "a name that is not UTF-8"
        );
        let big = vec![("x".to_owned(), Bytes::from(vec![0u8; MAX_PHASES_BYTES]))];
        assert!(encode(&big).is_err());
    }

    #[test]
    fn every_statement_is_fenced_by_the_token() {
        let held = ("s", "k", 7);
        let bounds = (Duration::from_secs(5), Duration::from_secs(1));
        let lease = Duration::from_secs(30);
        let fence = fence_batch("BEGIN", held, lease, bounds).unwrap();
        assert!(fence.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; SELECT"));
        assert!(
            fence.contains(
                "; COMMIT; BEGIN; SELECT set_config('tower_idempotency.statement_timeout'"
            )
        );
        assert!(fence.contains("SET LOCAL statement_timeout = 5000; SET LOCAL lock_timeout = 1000; WITH fence AS (UPDATE"));
        assert!(
            fence.contains("AND scope = E's' AND key = E'k' AND lease_token = 7 RETURNING ctid)")
        );
        let begin = begin_batch("BEGIN", held).unwrap();
        assert_eq!(
            begin,
            "BEGIN; SELECT pg_catalog.current_setting('transaction_isolation') AS transaction_isolation, \
             tower_idempotency_phase_held(E's', E'k', 7) AS held"
        );
        let (record, statements) = record_batch(held, b"\x01", None, lease, false, bounds).unwrap();
        assert_eq!(statements, 4);
        assert_eq!(
            record,
            "SET LOCAL statement_timeout = 5000; SET LOCAL lock_timeout = 1000; \
             SELECT tower_idempotency_phase_record(E's', E'k', 7, pg_catalog.decode('01','hex'), 30000, NULL, NULL); COMMIT"
        );
        let (fenced, _) = record_batch(held, b"", None, lease, true, bounds).unwrap();
        assert!(fenced.contains("current_setting('tower_idempotency.row')::tid, NULL)"));
        let ok = StoredResponse::new(http::StatusCode::OK, http::HeaderMap::new(), Bytes::new());
        let done = complete_statement(held, Duration::from_secs(1), &ok, false, Some(-3)).unwrap();
        assert!(done.ends_with(", NULL, (-3))"), "{done}");
        assert!(
            done.starts_with(
                "SELECT tower_idempotency_phase_complete(E's', E'k', 7, 1000, 200::smallint"
            ),
            "{done}"
        );
        for statement in [
            yield_statement(held).unwrap(),
            read_statement(held).unwrap(),
        ] {
            assert!(statement.contains("lease_token = 7"), "{statement}");
        }
    }
}
