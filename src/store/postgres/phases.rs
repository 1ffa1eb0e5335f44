//! The statements of phased mode (`crate::phased`) and the encoding of its recovery points.
//!
//! Every statement is fenced by the claim's lease token: it changes the key's record only
//! while that token holds it. A phase's transaction starts with [`fence_batch`], whose
//! `UPDATE` of the record is its first statement: it checks the token, extends the lease, and
//! takes the record's row lock for the rest of the transaction. Taken first, the lock also
//! gives the transaction's snapshot (under `REPEATABLE READ` and `SERIALIZABLE`) a record no
//! lease renewal can change before the phase commits: a renewal committed after the snapshot
//! would make the phase's later update of the record a serialization failure.

use std::time::Duration;

use bytes::Bytes;

use crate::error::StoreError;
use crate::response::StoredResponse;
use crate::store::postgres::{millis, status_column};
use crate::store::sql::{Lit, fill, push_bounds};

/// The most a key's recorded phases (names and states, encoded) may take.
pub(crate) const MAX_PHASES_BYTES: usize = 64 * 1024;

/// The name of the savepoint set right after the last phase's fence: a handler that leaves
/// that transaction aborted still has its answer stored with the key.
pub(crate) const LAST_SAVEPOINT: &str = "tower_idempotency_handler";

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

/// SQLSTATE `division_by_zero`: what a fenced statement inside a phase's transaction raises
/// when the token no longer holds the record (`1 / count(*)` of the rows it changed), so that
/// the transaction cannot commit the phase's writes without the record's change.
pub(crate) const NOT_HELD: &str = "22012";

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
/// it are put back for the handler's statements. `savepoint`: end with the savepoint of the
/// last phase.
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
    savepoint: bool,
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
    if savepoint {
        sql.push_str("; SAVEPOINT ");
        sql.push_str(LAST_SAVEPOINT);
    }
    Ok(sql)
}

/// Records the phases (all of them, encoded) on the record and commits (one message).
pub(crate) fn record_batch(
    (scope, key, token): (&str, &str, i64),
    phases: &[u8],
    (statement_timeout, lock_timeout): (Duration, Duration),
) -> Result<String, StoreError> {
    let mut sql = String::with_capacity(200 + 2 * phases.len() + scope.len() + key.len());
    push_bounds(&mut sql, statement_timeout, lock_timeout);
    let record = fill(
        &format!(
            "WITH done AS (UPDATE tower_idempotency_keys SET phases = $4 WHERE {HELD_ROW} \
             RETURNING 1) SELECT 1 / count(*) AS changed FROM done"
        ),
        &[
            Lit::Text(scope),
            Lit::Text(key),
            Lit::Int(token),
            Lit::Bytes(phases),
        ],
    )?;
    sql.push_str(&record);
    sql.push_str("; COMMIT");
    Ok(sql)
}

/// Stores the answer on the record while the token holds it: the record becomes completed
/// (its phases dropped), living `ttl` from now. Returns the rows changed (`changed`); or,
/// `strict` (in a phase's transaction, after its fence), finds the record by its row id and
/// fails with [`NOT_HELD`] when there is none.
pub(crate) fn complete_statement(
    (scope, key, token): (&str, &str, i64),
    ttl: Duration,
    stored: &StoredResponse,
    strict: bool,
) -> Result<String, StoreError> {
    let status = status_column(stored)?;
    let headers = stored.encode_headers();
    fill(
        &format!(
            "WITH done AS (UPDATE tower_idempotency_keys \
                SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, \
                    completed_at = tower_idempotency_now(), \
                    expires_at = tower_idempotency_now() + $4::float8 * interval '1 millisecond', \
                    response_status = $5::smallint, response_headers = $6, response_body = $7 \
              WHERE {} RETURNING 1) \
             SELECT {} AS changed FROM done",
            if strict { HELD_ROW } else { HELD },
            if strict { "1 / count(*)" } else { "count(*)" }
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
            // A truncated encoding never decodes into other phases silently.
            if let Ok(decoded) = decode(&bytes[..cut]) {
                panic!("{cut}: {decoded:?}");
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
        let fence = fence_batch("BEGIN", held, Duration::from_secs(30), bounds, true).unwrap();
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
        assert!(fence.ends_with("; SAVEPOINT tower_idempotency_handler"));
        let record = record_batch(held, b"\x01", bounds).unwrap();
        assert!(record.contains("SET phases = decode('01','hex') WHERE scope = E's' AND key = E'k' AND lease_token = 7 RETURNING 1) SELECT 1 / count(*)"), "{record}");
        assert!(record.ends_with("; COMMIT"));
        for statement in [
            yield_statement(held).unwrap(),
            read_statement(held).unwrap(),
            complete_statement(
                held,
                Duration::from_secs(1),
                &StoredResponse::new(http::StatusCode::OK, http::HeaderMap::new(), Bytes::new()),
                true,
            )
            .unwrap(),
        ] {
            assert!(statement.contains("lease_token = 7"), "{statement}");
        }
    }
}
