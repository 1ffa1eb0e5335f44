//! The store's schema migrations, applied by [`migrate`]
//! ([`PostgresStore::migrate`](crate::PostgresStore::migrate)).

use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::error::StoreError;

/// The crate's migrations, applied in order by [`PostgresStore::migrate`].
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "create keys",
        include_str!("../../../migrations/0001_create_keys.sql"),
    ),
    (
        2,
        "create processed messages",
        include_str!("../../../migrations/0002_create_processed_messages.sql"),
    ),
    (
        3,
        "transactional claim function",
        include_str!("../../../migrations/0003_transactional_claim.sql"),
    ),
    (
        4,
        "claim function",
        include_str!("../../../migrations/0004_claim_function.sql"),
    ),
    (
        5,
        "transactional claim at every isolation level",
        include_str!("../../../migrations/0005_transactional_claim_v2.sql"),
    ),
    (
        6,
        "plain mode's statements as functions",
        include_str!("../../../migrations/0006_plain_functions.sql"),
    ),
    (
        7,
        "the keys duplicates wait for",
        include_str!("../../../migrations/0007_waiting.sql"),
    ),
    (
        8,
        "lookups by key whatever the statistics say",
        include_str!("../../../migrations/0008_lookups_by_key.sql"),
    ),
    (
        9,
        "the transactional claim after a purge deleted the record it waited for",
        include_str!("../../../migrations/0009_claim_tx_after_a_purge.sql"),
    ),
    (
        10,
        "the functions resolve names in their own schema",
        include_str!("../../../migrations/0010_pinned_search_path.sql"),
    ),
    (
        11,
        "recovery points of phased mode, and leased claims of messages",
        include_str!("../../../migrations/0011_phases_and_leased_messages.sql"),
    ),
    (
        12,
        "plain mode's claim and completion, each one function",
        include_str!("../../../migrations/0012_lean_plain_functions.sql"),
    ),
    (
        13,
        "positions and failed attempts of message consumers",
        include_str!("../../../migrations/0013_consumer_positions_and_failures.sql"),
    ),
];

/// The advisory lock taken while migrating, so that app instances starting together apply
/// each migration once. (The bytes of "towidem1".)
const MIGRATION_LOCK: i64 = 0x746f_7769_6465_6d31;

/// Applies the crate's migrations (the keys table and the inbox table) on `pool`.
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
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM tower_idempotency_migrations")
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
    for &(version, description, sql) in MIGRATIONS {
        let checksum = Sha256::digest(sql.as_bytes()).to_vec();
        match applied.iter().find(|(v, _)| *v == version) {
            Some((_, c)) if *c == checksum => continue,
            Some(_) => {
                return Err(StoreError::Schema(format!(
                    "migration {version} ({description}) was applied with different SQL"
                )));
            }
            None => {}
        }
        sqlx::raw_sql(sql).execute(&mut *tx).await?;
        sqlx::query(
            "INSERT INTO tower_idempotency_migrations (version, description, checksum)
             VALUES ($1, $2, $3)",
        )
        .bind(version)
        .bind(description)
        .bind(checksum)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        tracing::info!(version, description, "applied tower-idempotency migration");
    }
    tx.commit().await?;
    Ok(())
}
