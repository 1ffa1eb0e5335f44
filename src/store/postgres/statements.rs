//! The store's statements: its functions' calls, and the statements written out in SQL that
//! run prepared by name.

use crate::error::StoreError;
use crate::store::sql::prepared_name;

/// The claim, in one statement: the function `tower_idempotency_plain_claim` reads the
/// record by its key and, only when the key is absent, inserts it. For a replay, an in-flight
/// key or a mismatch it costs the database the read alone; it returns one row whether or not
/// the key was there. (An `INSERT` written into the statement, as a data-modifying CTE, is set
/// up by the executor on every execution even when it inserts nothing: a replay through such a
/// statement took about 1.6 times the plain read's backend CPU in pgbench.)
///
/// Under READ COMMITTED the insert takes a fresh snapshot. When a concurrent request inserted
/// the key after the read's snapshot, the insert conflicts: the function returns neither an
/// inserted token nor a record, and the caller runs it again with a fresh snapshot. A record
/// that is expired, or whose lease ran out, comes back `claimable` and is taken over by
/// [`TAKEOVER`], a second statement that only this rare path pays for.
///
/// Arguments of every claim statement: `$1` scope, `$2` key, `$3` fingerprint, `$4` lease
/// (ms), `$5` time to live (ms), `$6` lock timeout (ms).
pub(super) const CLAIM: &str =
    "SELECT * FROM tower_idempotency_plain_claim($1, $2, $3, $4, $5, $6)";

/// The schema of the store's functions as the connection's `search_path` finds them (where
/// its calls of them go), quoted as an identifier.
pub(super) const SCHEMA_OF_THE_STORE: &str = "\
SELECT pg_catalog.quote_ident(n.nspname) \
  FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace \
 WHERE p.oid = 'tower_idempotency_now()'::pg_catalog.regprocedure";

/// A statement of the store written out in SQL (not a call of one of its functions), sent
/// prepared by name ([`PostgresStore::run_named`]): planning such a statement is most of what
/// it costs the database, and a prepared one is planned once per server connection.
///
/// Its text names every table, function, operator and type with its schema: the store's
/// own, written in where the text says `{s}` ([`Rendered`]), and `pg_catalog`. What it means
/// therefore does not depend on the connection's `search_path`, and the message that runs it
/// needs no `search_path` setting of its own (which would cost every message a setting and a
/// new lookup of the path): an application schema ahead of the store's on the path, with a
/// table, a function or an operator named like the ones the statement uses, changes nothing
/// (`tests/postgres.rs`); stores of two schemas have statements of two texts, under two
/// names.
pub(super) struct Bare {
    /// Its place in [`BARE`] and in [`Rendered`].
    pub(super) id: usize,
    /// The statement, its values as `$1`…`$n`, the store's schema as `{s}`.
    pub(super) text: &'static str,
    /// The SQL types of `$1`…`$n`.
    pub(super) params: &'static [&'static str],
    /// Whether it can wait for a row lock (another transaction writing the key's row), so
    /// that its message sets the store's `lock_timeout`.
    pub(super) locks: bool,
    /// Whether it reads the table, so that its plan could be a scan (an `INSERT … VALUES`
    /// cannot).
    pub(super) scans: bool,
    /// Whether its commit may return before its WAL is flushed (`synchronous_commit = off`):
    /// only a statement whose effect every later commit that depends on it makes durable
    /// ([`LEASE_INSERT`]).
    pub(super) unflushed: bool,
}

/// Every [`Bare`] statement, at its `id`.
pub(super) const BARE: [&Bare; 5] = [
    &READ,
    &INSERT,
    &LEASE_INSERT,
    &COMPLETE_BARE,
    &COMPLETE_BARE_WAKE,
];

/// The [`Bare`] statements of one store, its schema written in, each with the name it is
/// prepared under ([`prepared_name`]), in the order of [`BARE`].
#[derive(Debug)]
pub(super) struct Rendered {
    pub(super) statements: Vec<(String, String)>,
    /// The purges of the store's expired records and of its waiters' registrations past
    /// their time, its schema written in ([`PURGE`], [`PURGE_WAITING`]).
    pub(super) purge: String,
    pub(super) purge_waiting: String,
}

impl Rendered {
    /// The statements of the store whose schema, quoted as an identifier, is `schema`.
    pub(super) fn new(schema: &str) -> Self {
        let statements = BARE
            .iter()
            .map(|bare| {
                let text = bare.text.replace("{s}", schema);
                let name = prepared_name(&text, bare.params);
                (text, name)
            })
            .collect();
        Self {
            statements,
            purge: PURGE.replace("{s}", schema),
            purge_waiting: PURGE_WAITING.replace("{s}", schema),
        }
    }

    /// The text and the name of `bare`.
    pub(super) fn get(&self, bare: &Bare) -> Result<(&str, &str), StoreError> {
        self.statements
            .get(bare.id)
            .map(|(text, name)| (text.as_str(), name.as_str()))
            .ok_or_else(|| StoreError::backend("a statement of the store is not rendered"))
    }
}

/// The read alone, for [`ClaimStrategy::Adaptive`], [`ClaimStrategy::ReadFirst`] and
/// [`ClaimStrategy::InsertFirst`] with prepared statements ([`PostgresStore::with_prepared_statements`]): a call of the function
/// that reads the record in the store's own schema. Otherwise [`READ`].
pub(super) const READ_CALL: &str = "SELECT * FROM tower_idempotency_plain_read($1, $2, $3, $6)";

/// `{s}.tower_idempotency_now() + $n ms`, as [`Bare`] statements write it.
macro_rules! now_plus_ms {
    ($n:literal) => {
        concat!(
            "({s}.tower_idempotency_now() OPERATOR(pg_catalog.+) ($",
            $n,
            "::pg_catalog.float8 OPERATOR(pg_catalog.*) interval '1 millisecond'))"
        )
    };
}

/// The read alone, for [`ClaimStrategy::ReadFirst`], [`ClaimStrategy::InsertFirst`] and
/// [`ClaimStrategy::Adaptive`]: a bare `SELECT` by key (it takes no lock, so it needs no lock
/// bound), with the columns [`decide`] reads. `$1` scope, `$2` key, `$3` fingerprint.
pub(super) const READ: Bare = Bare {
    id: 0,
    params: &["text", "text", "bytea"],
    locks: false,
    scans: true,
    unflushed: false,
    text: "\
SELECT k.fingerprint, k.lease_token, \
       k.expires_at OPERATOR(pg_catalog.<=) {s}.tower_idempotency_now() AS expired, \
       (k.expires_at OPERATOR(pg_catalog.<=) {s}.tower_idempotency_now() \
        OR (k.lease_token IS NOT NULL \
            AND k.lease_expires_at OPERATOR(pg_catalog.<=) {s}.tower_idempotency_now() \
            AND k.fingerprint OPERATOR(pg_catalog.=) $3)) AS claimable, \
       (pg_catalog.date_part('epoch', \
            k.lease_expires_at OPERATOR(pg_catalog.-) {s}.tower_idempotency_now()) \
        OPERATOR(pg_catalog.*) 1000)::pg_catalog.int8 AS lease_left_ms, \
       k.response_status, k.response_headers, k.response_body \
  FROM {s}.tower_idempotency_keys AS k \
 WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2",
};

/// The insert alone, for [`ClaimStrategy::Adaptive`], [`ClaimStrategy::ReadFirst`] and
/// [`ClaimStrategy::InsertFirst`] with prepared statements ([`PostgresStore::with_prepared_statements`]), a call of the
/// function that bounds its own lock wait: the new record's token, or `NULL` when the key
/// exists.
pub(super) const INSERT_CALL: &str =
    "SELECT tower_idempotency_plain_insert($1, $2, $3, $4, $5, $6) AS inserted";

/// The insert alone, sent prepared by name: one row with the new record's token (`$6`, from
/// [`unrepeatable_token`]), or none when the key exists. It waits for a concurrent insert
/// of the same key to commit or roll back (a transactional-mode request holds its row for as
/// long as its handler runs), so its message bounds the wait.
pub(super) const INSERT: Bare = Bare {
    id: 1,
    params: &["text", "text", "bytea", "bigint", "bigint", "bigint"],
    locks: true,
    scans: false,
    unflushed: false,
    text: concat!(
        "INSERT INTO {s}.tower_idempotency_keys AS k \
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at) \
VALUES ($1, $2, $3, $6, ",
        now_plus_ms!("4"),
        ", ",
        now_plus_ms!("5"),
        ") ON CONFLICT (scope, key) DO NOTHING RETURNING k.lease_token AS inserted"
    ),
};

/// The insert of a phased-mode claim ([`PostgresStore::claim_lease`]): [`INSERT`],
/// committed without waiting for its WAL flush.
pub(super) const LEASE_INSERT: Bare = Bare {
    id: 2,
    unflushed: true,
    ..INSERT
};

/// The completion's `UPDATE`: stores the answer while `$3` (the token) holds the record,
/// living `$4` ms from now; `$5` status, `$6` headers, `$7` body. One row per record changed.
macro_rules! complete_update {
    () => {
        concat!(
            "UPDATE {s}.tower_idempotency_keys AS k \
   SET lease_token = NULL, lease_expires_at = NULL, \
       completed_at = {s}.tower_idempotency_now(), expires_at = ",
            now_plus_ms!("4"),
            ", response_status = $5, response_headers = $6, response_body = $7 \
 WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
   AND k.lease_token OPERATOR(pg_catalog.=) $3 \
RETURNING 1 AS changed"
        )
    };
}

/// The completion of plain mode, sent prepared by name, when nobody is woken
/// ([`PostgresStore::with_notifications`]`(false)`): a row when it stored the answer, none
/// when the token no longer holds the record.
pub(super) const COMPLETE_BARE: Bare = Bare {
    id: 3,
    params: &[
        "text", "text", "bigint", "bigint", "bigint", "bytea", "bytea",
    ],
    locks: true,
    scans: true,
    unflushed: false,
    text: complete_update!(),
};

/// [`COMPLETE_BARE`], also waking the key's waiters (`$8`, the key's hash) when it stored the
/// answer: a `NOTIFY` only when a waiter registered the hash (one primary-key probe of the
/// small table of waiters otherwise).
pub(super) const COMPLETE_BARE_WAKE: Bare = Bare {
    id: 4,
    params: &[
        "text", "text", "bigint", "bigint", "bigint", "bytea", "bytea", "bigint",
    ],
    locks: true,
    scans: true,
    unflushed: false,
    text: concat!(
        "WITH done AS (",
        complete_update!(),
        "), woken AS (\
SELECT pg_catalog.pg_notify('tower_idempotency', w.hash::pg_catalog.text) \
  FROM {s}.tower_idempotency_waiting AS w \
 WHERE w.hash OPERATOR(pg_catalog.=) $8 \
   AND w.until OPERATOR(pg_catalog.>) {s}.tower_idempotency_now() \
   AND EXISTS (SELECT FROM done)) \
SELECT d.changed FROM done AS d, (SELECT pg_catalog.count(*) FROM woken) AS n"
    ),
};

/// A lease token no claim lost in a crash can have handed out before: 62 random bits above
/// bit 62, so never one of the sequence's tokens either.
///
/// The sequence cannot give that promise to a claim whose commit does not wait for its WAL
/// flush: a crash that loses the claim's commit loses the sequence's advance with it, and
/// the server hands the same number out again after the restart, to the request that claims
/// the key anew while the first still runs and holds that number.
pub(super) fn unrepeatable_token() -> Result<i64, StoreError> {
    let random = getrandom::u64().map_err(|e| StoreError::Backend(Box::new(e)))?;
    // `random >> 2` < 2^62, so the sum is in 2^62..2^63: a positive `i64`.
    i64::try_from((random >> 2) | (1 << 62)).map_err(|e| StoreError::Backend(Box::new(e)))
}

/// Takes over a record that is expired or whose lease ran out. The condition is checked
/// again on the row's latest version, so of two requests taking over at once, one wins; the
/// other gets `NULL` and claims again.
pub(super) const TAKEOVER: &str =
    "SELECT tower_idempotency_plain_takeover($1, $2, $3, $4, $5, $6) AS lease_token";

/// Stores the answer while `$3` (the token) holds the record, with prepared statements
/// ([`PostgresStore::with_prepared_statements`]; otherwise [`COMPLETE_BARE`]): `$4` time to
/// live (ms), `$5` status, `$6` headers, `$7` body, `$8` lock timeout (ms). Returns the rows
/// changed.
pub(super) const COMPLETE: &str = "SELECT tower_idempotency_plain_complete(\
     $1, $2, $3, $4, $5::smallint, $6, $7, $8) AS changed";

/// [`COMPLETE`], also waking the key's waiters: `$9` the key's hash.
pub(super) const COMPLETE_WAKE: &str = "SELECT tower_idempotency_plain_complete(\
     $1, $2, $3, $4, $5::smallint, $6, $7, $8, $9) AS changed";

/// Deletes the record while `$3` (the token) holds it; `$4` lock timeout (ms).
pub(super) const RELEASE: &str =
    "SELECT tower_idempotency_plain_release($1, $2, $3, $4) AS changed";

/// [`RELEASE`], also waking the key's waiters: `$5` the key's hash.
pub(super) const RELEASE_WAKE: &str =
    "SELECT tower_idempotency_plain_release($1, $2, $3, $4, $5) AS changed";

/// Extends the lease `$3` (the token) holds by `$4` ms; `$5` lock timeout (ms).
pub(super) const RENEW: &str =
    "SELECT tower_idempotency_plain_renew($1, $2, $3, $4, $5) AS changed";

/// Deletes up to `$1` expired records, oldest first, found by walking the `expires_at` index
/// and deleted by their row addresses (locked, so they cannot move). Written as a join on
/// the key, or without the order, the statement let Postgres scan the table instead (a hash
/// join, or a bare `LIMIT` when many records have expired), reading again, batch after
/// batch, the pages of the rows the batches before deleted, which stay until a `VACUUM`: a
/// backlog took quadratic time, and one batch could outlast the statement timeout
/// (`tests/plans.rs`).
///
/// It names every table, function, operator and type with the store's schema (`{s}`) or
/// `pg_catalog`, as the [`Bare`] statements do: an application's table named like the
/// store's, ahead on the connection's path, is never the one purged.
pub(super) const PURGE: &str = "
DELETE FROM {s}.tower_idempotency_keys
 WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY(
       SELECT ctid FROM {s}.tower_idempotency_keys
        WHERE expires_at OPERATOR(pg_catalog.<=) {s}.tower_idempotency_now()
        ORDER BY expires_at
        LIMIT $1::pg_catalog.int8
          FOR UPDATE SKIP LOCKED))";

/// Deletes the waiting duplicates' registrations past their time, named as [`PURGE`] names
/// its objects.
pub(super) const PURGE_WAITING: &str = "
DELETE FROM {s}.tower_idempotency_waiting
 WHERE until OPERATOR(pg_catalog.<=) {s}.tower_idempotency_now()";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bare_statement_sits_at_its_id_and_names_the_stores_objects_with_its_schema() {
        for (i, bare) in BARE.iter().enumerate() {
            assert_eq!(bare.id, i, "{}", bare.text);
            // As many parameter types as the text has placeholders.
            let highest = (1..=9)
                .rev()
                .find(|n| bare.text.contains(&format!("${n}")))
                .unwrap_or(0);
            assert_eq!(bare.params.len(), highest, "{}", bare.text);
            assert!(!bare.text.contains("search_path"), "{}", bare.text);
            for (at, _) in bare.text.match_indices("tower_idempotency_") {
                assert!(
                    bare.text[..at].ends_with("{s}."),
                    "an object of the store named without its schema: {}",
                    &bare.text[at..]
                );
            }
        }
        let rendered = Rendered::new("\"a schema\"");
        let (text, name) = rendered.get(&READ).unwrap();
        assert!(
            text.contains("FROM \"a schema\".tower_idempotency_keys"),
            "{text}"
        );
        assert_eq!(name, prepared_name(text, READ.params));
        assert_ne!(name, Rendered::new("other").get(&READ).unwrap().1);
    }
}
