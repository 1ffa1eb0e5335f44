//! The store's schema migrations, applied by [`migrate`]
//! ([`PostgresStore::migrate`](crate::PostgresStore::migrate)).
//!
//! Each migration is a file in `migrations/`, embedded here with its version. [`migrate`]
//! applies those a schema has not recorded, in one transaction under an advisory lock, and
//! records each in `tower_idempotency_migrations` with the SHA-256 of its SQL; a recorded
//! migration whose checksum is not the shipped file's is refused, never applied again.
//!
//! # Adding a migration
//!
//! Migrations are append-only: once a version is on `main`, its file never changes (its
//! checksum is recorded in every database that ran it), and a change to the schema is a new
//! file with the next version, added to [`MIGRATIONS`]. A migration runs inside the
//! transaction, so it applies whole or not at all.
//!
//! An index on a table that may be large (the keys, an inbox) is not built inside that
//! transaction: the build would block the table's writes for its whole length, and
//! `CREATE INDEX CONCURRENTLY` cannot run in a transaction at all. It is a documented manual
//! step instead, with no migration that runs outside the transaction: the migration says
//! `CREATE INDEX IF NOT EXISTS <name> …`, and the release's CHANGELOG entry gives the
//! `CREATE INDEX CONCURRENTLY IF NOT EXISTS <name> …` to run by hand (psql, in the store's
//! schema) before the release is deployed. The migration then finds the index and does
//! nothing; where the step was skipped it builds the index itself, correct but blocking
//! writes meanwhile. A concurrent build that failed leaves an invalid index under the name,
//! which `IF NOT EXISTS` would take for done, so such a migration also checks
//! `pg_index.indisvalid` and raises, naming the index to drop and build again.
//!
//! # Schemas made by the thirteen earlier migrations
//!
//! Earlier builds of the crate made the schema of `migrations/0001_schema.sql` (less what it
//! leaves out as unused) in thirteen migrations, versions 1 to 13; their SQL is kept for the
//! tests in `tests/fixtures/old_migrations/`. A history that records exactly those thirteen,
//! each with its checksum ([`OLD_MIGRATIONS`]), is taken over: `tidy_old_migrations.sql`
//! brings the schema to version 1's, and version 1's row replaces theirs, in the same
//! transaction. A history with only some of them, or with a checksum that matches nothing this
//! crate knows, is refused with the way out: see
//! [`PostgresStore::migrate`](crate::PostgresStore::migrate).

use std::fmt::Write as _;

use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::error::StoreError;

/// The crate's migrations, applied in order by [`migrate`]: version, description, SQL.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    SCHEMA,
    (
        2,
        "phase leases",
        include_str!("../../../migrations/0002_phase_leases.sql"),
    ),
    (
        3,
        "daily inbox floor",
        include_str!("../../../migrations/0003_daily_floor.sql"),
    ),
];

/// The schema, version 1: what a schema that ran [`OLD_MIGRATIONS`] is brought to.
const SCHEMA: (i64, &str, &str) = (
    1,
    "schema",
    include_str!("../../../migrations/0001_schema.sql"),
);

/// The thirteen migrations that version 1 replaces: version and the SHA-256 (hex) of its SQL.
const OLD_MIGRATIONS: [(i64, &str); 13] = [
    (
        1,
        "bd09e51073b2b6a364e2e201d0774d79ee470db10cc6bfd9f2ff800d15b4ed4c",
    ),
    (
        2,
        "1c1db8b327976b804e38c42edf7dd631dc8d5aa86909f849c90117e5dcaaaa2b",
    ),
    (
        3,
        "d60d9e3f35c9ca73d06cfa6d7963a12f460c2366adaa7e508d116d4dd83a2078",
    ),
    (
        4,
        "6c670eb0e7c2a23368ce69a46afb8af7b0376ef0fa4d53bf9ef81473ee7d1b76",
    ),
    (
        5,
        "bd7cb3bdbb425f57d704bd691cadf2ffa5e81e82dd642f9ba1c6a0c9e58c8390",
    ),
    (
        6,
        "0e1098a3afa5562e2919c57823982e7373792a1fb50cbb77b41e43fa0bc3efe7",
    ),
    (
        7,
        "74b95d3a5e7a398262f63d1df6ff1127076e612af0c68cf87f06ecc132b96a5c",
    ),
    (
        8,
        "30c969816b6a34446f9f33dddaec33505be4fc47511f5da1c04765cb2b6a05ec",
    ),
    (
        9,
        "7ed52366033f6bf1a564e45085519aa3c9833d2a544e9b88ffcf741c92ea062e",
    ),
    (
        10,
        "0921f78cf7565dd727ec76dcc26bc5224facba9ecd00fdc53899be568b4e1ee8",
    ),
    (
        11,
        "7246b6692d9178af4520002378f54d6b09f2758213f3c116f6fb7f634d06218f",
    ),
    (
        12,
        "79eb56c0c310d25bd85e98edc06a4b6815a84a251bb33495f5469d0da588720b",
    ),
    (
        13,
        "0a40d46b01c1215ad2aa3483129ba4a2b1a75c84ffabeaf879c3596d19118659",
    ),
];

/// Brings a schema that ran all of [`OLD_MIGRATIONS`] to [`SCHEMA`].
const TIDY_OLD_MIGRATIONS: &str = include_str!("tidy_old_migrations.sql");

/// The advisory lock taken while migrating, so that app instances starting together apply
/// each migration once. (The bytes of "towidem1".)
const MIGRATION_LOCK: i64 = 0x746f_7769_6465_6d31;

/// What a schema's history says.
#[derive(Debug, PartialEq, Eq)]
enum History {
    /// Nothing but migrations of [`MIGRATIONS`] (or later ones, of a newer build): apply the
    /// missing ones.
    Current,
    /// All of [`OLD_MIGRATIONS`] and nothing else: tidy, then record [`SCHEMA`].
    Old,
    /// A history [`migrate`] does not take over.
    Refused(Refusal),
}

/// Why [`migrate`] refuses a schema's history.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// Some of [`OLD_MIGRATIONS`] and nothing else: the versions recorded.
    PartlyOld(Vec<i64>),
    /// Some of [`OLD_MIGRATIONS`] with some of [`MIGRATIONS`].
    Mixed,
    /// A migration recorded with a checksum that matches none this crate knows.
    Unknown(i64),
}

impl Refusal {
    /// The error's message: what the history holds, and the way out.
    fn message(&self, schema: &str) -> String {
        let reset = format!(
            "drop the store's tables, sequence and functions in schema \"{schema}\" (the \
             statements are in the docs of PostgresStore::migrate; the keys' records and the \
             inbox's processed message IDs go with them) and run migrate() again"
        );
        match self {
            Refusal::PartlyOld(versions) => format!(
                "schema \"{schema}\" records migrations {} of the 13 that earlier builds of \
                 tower-idempotency applied, not all of them; this build replaces them by one \
                 migration and takes over only a schema that ran all 13. Nothing was changed. \
                 Either run migrate() of a tower-idempotency build that still has the 13 \
                 migrations, then this one; or {reset}",
                versions_text(versions)
            ),
            Refusal::Mixed => format!(
                "schema \"{schema}\" records some of the 13 migrations of earlier builds of \
                 tower-idempotency together with the migration that replaces them: its history \
                 was edited. Nothing was changed. {reset}",
                reset = capitalized(&reset)
            ),
            Refusal::Unknown(version) => format!(
                "version {version} of the store's schema is recorded in schema \"{schema}\" with a checksum that \
                 matches no SQL this version of tower-idempotency knows: the schema was made by \
                 another build, or its SQL was edited. Nothing was changed. Migrate it with the \
                 build that made it, or {reset}"
            ),
        }
    }
}

/// Reads a schema's history: each recorded version with its checksum.
fn read_history(applied: &[(i64, Vec<u8>)]) -> History {
    let is_old = |(version, checksum): &(i64, Vec<u8>)| {
        OLD_MIGRATIONS
            .iter()
            .any(|(v, c)| v == version && hex(checksum) == *c)
    };
    let shipped = |version: i64| {
        MIGRATIONS
            .iter()
            .find(|(v, _, _)| *v == version)
            .map(|(_, _, sql)| Sha256::digest(sql.as_bytes()))
    };
    let old = applied.iter().filter(|m| is_old(m)).count();
    if old > 0 {
        return match applied.iter().find(|m| !is_old(m)) {
            None if old == OLD_MIGRATIONS.len() => History::Old,
            None => {
                let mut versions: Vec<i64> = applied.iter().map(|(v, _)| *v).collect();
                versions.sort_unstable();
                History::Refused(Refusal::PartlyOld(versions))
            }
            Some((version, checksum))
                if shipped(*version).is_some_and(|c| c.as_slice() == checksum.as_slice()) =>
            {
                History::Refused(Refusal::Mixed)
            }
            Some((version, _)) => History::Refused(Refusal::Unknown(*version)),
        };
    }
    for (version, checksum) in applied {
        if shipped(*version).is_some_and(|c| c.as_slice() != checksum.as_slice()) {
            return History::Refused(Refusal::Unknown(*version));
        }
    }
    History::Current
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 * bytes.len());
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// `1–5` for consecutive versions (sorted, each once), `1, 3, 4` otherwise.
fn versions_text(versions: &[i64]) -> String {
    match (versions.first(), versions.last()) {
        (Some(first), Some(last))
            if versions.len() > 1
                && i64::try_from(versions.len()).is_ok_and(|n| last - first + 1 == n) =>
        {
            format!("{first}–{last}")
        }
        _ => versions
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// `text` with its first letter in upper case.
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// Applies the crate's migrations on `pool`: see
/// [`PostgresStore::migrate`](crate::PostgresStore::migrate).
pub(crate) async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    // READ COMMITTED whatever the connection's default: each statement after the lock must
    // see what an instance that held the lock before committed (under REPEATABLE READ the
    // snapshot would date from the lock's own statement, before the other's commit).
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await?;
    // Inside the transaction, a pooler keeps the server connection to this client: unnamed
    // statements (`persistent(false)`) are safe there, named ones would outlive it.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS tower_idempotency_migrations (
             version     bigint      PRIMARY KEY,
             description text        NOT NULL,
             checksum    bytea       NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now()
         )",
    )
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    let mut applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM tower_idempotency_migrations")
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
    match read_history(&applied) {
        History::Current => {}
        History::Old => {
            sqlx::raw_sql(TIDY_OLD_MIGRATIONS).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM tower_idempotency_migrations")
                .persistent(false)
                .execute(&mut *tx)
                .await?;
            let (version, description, sql) = SCHEMA;
            let checksum = Sha256::digest(sql.as_bytes()).to_vec();
            record(&mut tx, version, description, &checksum).await?;
            tracing::info!(
                version,
                description,
                "tidied a schema made by the earlier tower-idempotency builds' 13 migrations into \
                 the one schema file"
            );
            applied = vec![(version, checksum)];
        }
        History::Refused(refusal) => {
            let (schema,): (String,) = sqlx::query_as("SELECT current_schema()::text")
                .persistent(false)
                .fetch_one(&mut *tx)
                .await?;
            return Err(StoreError::Schema(refusal.message(&schema)));
        }
    }
    for &(version, description, sql) in MIGRATIONS {
        if applied.iter().any(|(v, _)| *v == version) {
            // read_history checked its checksum.
            continue;
        }
        let checksum = Sha256::digest(sql.as_bytes()).to_vec();
        sqlx::raw_sql(sql).execute(&mut *tx).await?;
        record(&mut tx, version, description, &checksum).await?;
        tracing::info!(version, description, "applied tower-idempotency migration");
    }
    tx.commit().await?;
    Ok(())
}

/// Records a migration as applied.
async fn record(
    tx: &mut sqlx::PgConnection,
    version: i64,
    description: &str,
    checksum: &[u8],
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO tower_idempotency_migrations (version, description, checksum)
         VALUES ($1, $2, $3)",
    )
    .bind(version)
    .bind(description)
    .bind(checksum)
    .persistent(false)
    .execute(tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn old(versions: std::ops::RangeInclusive<i64>) -> Vec<(i64, Vec<u8>)> {
        versions
            .map(|v| {
                let (_, c) = OLD_MIGRATIONS[usize::try_from(v - 1).unwrap()];
                let bytes = (0..32)
                    .map(|i| u8::from_str_radix(&c[2 * i..2 * i + 2], 16).unwrap())
                    .collect();
                (v, bytes)
            })
            .collect()
    }

    fn current() -> Vec<(i64, Vec<u8>)> {
        MIGRATIONS
            .iter()
            .map(|(v, _, sql)| (*v, Sha256::digest(sql.as_bytes()).to_vec()))
            .collect()
    }

    #[test]
    fn histories_are_read_by_version_and_checksum() {
        assert_eq!(read_history(&[]), History::Current);
        assert_eq!(read_history(&current()), History::Current);
        // A later migration of a newer build is left alone.
        let mut newer = current();
        newer.push((99, vec![0; 32]));
        assert_eq!(read_history(&newer), History::Current);
        assert_eq!(read_history(&old(1..=13)), History::Old);
        assert_eq!(
            read_history(&old(1..=5)),
            History::Refused(Refusal::PartlyOld(vec![1, 2, 3, 4, 5]))
        );
        let mut edited = old(1..=13);
        edited[6].1[0] ^= 1;
        assert_eq!(read_history(&edited), History::Refused(Refusal::Unknown(7)));
        let mut mixed = current();
        mixed.extend(old(2..=13));
        assert_eq!(read_history(&mixed), History::Refused(Refusal::Mixed));
        let mut changed = current();
        changed[0].1 = vec![0];
        assert_eq!(
            read_history(&changed),
            History::Refused(Refusal::Unknown(1))
        );
    }

    #[test]
    fn versions_read_as_a_range_when_consecutive() {
        assert_eq!(versions_text(&[1, 2, 3, 4, 5]), "1–5");
        assert_eq!(versions_text(&[1, 3, 4]), "1, 3, 4");
        assert_eq!(versions_text(&[2]), "2");
    }

    #[test]
    fn every_refusal_names_the_schema_and_the_reset() {
        for refusal in [
            Refusal::PartlyOld(vec![1, 2]),
            Refusal::Mixed,
            Refusal::Unknown(3),
        ] {
            let msg = refusal.message("app");
            assert!(msg.contains("schema \"app\""), "{msg}");
            assert!(msg.contains("rop the store's tables"), "{msg}");
            assert!(msg.contains("PostgresStore::migrate"), "{msg}");
        }
    }
}
