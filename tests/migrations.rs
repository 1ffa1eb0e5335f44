//! `migrate()` on a fresh schema, on a schema made by the thirteen migrations that the one
//! schema migration replaces (kept as fixtures in `tests/fixtures/old_migrations/`), and on
//! histories it must refuse.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use support::{Calls, PgSchema, read, req};
use tower::{Layer, ServiceExt};
use tower_idempotency::inbox::{Delivery, Inbox};
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, IdempotencyLayer, PostgresStore,
    Store, StoreError,
};

/// The history table as `migrate()` creates it.
const HISTORY_TABLE: &str = "CREATE TABLE tower_idempotency_migrations (
             version     bigint      PRIMARY KEY,
             description text        NOT NULL,
             checksum    bytea       NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now()
         )";

/// The one-time reset that the docs of `PostgresStore::migrate` give for a schema `migrate()`
/// refuses: every object of the store in the connection's first schema.
const RESET: &str = r"
DROP TABLE IF EXISTS tower_idempotency_keys, tower_idempotency_waiting,
    tower_idempotency_processed_messages, tower_idempotency_positions,
    tower_idempotency_message_failures, tower_idempotency_processed_messages_daily,
    tower_idempotency_migrations;
DROP SEQUENCE IF EXISTS tower_idempotency_lease_token_seq;
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
              WHERE n.nspname = current_schema() AND p.proname LIKE 'tower\_idempotency\_%'
    LOOP
        EXECUTE format('DROP FUNCTION %s', f);
    END LOOP;
END
$$;
";

/// Every object of the store's schema, as `migrate()` documents them.
const FUNCTIONS: &[&str] = &[
    "tower_idempotency_claim_tx(bigint,text,text,bytea)",
    "tower_idempotency_complete_tx(text,text,text,bigint,smallint,bytea,bytea)",
    "tower_idempotency_complete_tx(text,text,text,bigint,smallint,bytea,bytea,bigint)",
    "tower_idempotency_insert_key(text,text,bytea,bigint,bigint)",
    "tower_idempotency_now()",
    "tower_idempotency_phase_complete(text,text,bigint,bigint,smallint,bytea,bytea,tid,bigint)",
    "tower_idempotency_phase_held(text,text,bigint)",
    "tower_idempotency_phase_record(text,text,bigint,bytea,bigint,tid,bytea)",
    "tower_idempotency_plain_claim(text,text,bytea,bigint,bigint,bigint)",
    "tower_idempotency_plain_complete(text,text,bigint,bigint,smallint,bytea,bytea,bigint)",
    "tower_idempotency_plain_complete(text,text,bigint,bigint,smallint,bytea,bytea,bigint,bigint)",
    "tower_idempotency_plain_insert(text,text,bytea,bigint,bigint,bigint)",
    "tower_idempotency_plain_read(text,text,bytea,bigint)",
    "tower_idempotency_plain_release(text,text,bigint,bigint)",
    "tower_idempotency_plain_release(text,text,bigint,bigint,bigint)",
    "tower_idempotency_plain_renew(text,text,bigint,bigint,bigint)",
    "tower_idempotency_plain_takeover(text,text,bytea,bigint,bigint,bigint)",
    "tower_idempotency_record_message(text,text,bigint)",
    "tower_idempotency_record_message(text,text,bigint,text,bigint)",
    "tower_idempotency_wake(bigint)",
];

/// The tables (`r`; `p`: partitioned), indexes (`i`; `I`: of a partitioned table) and
/// sequences (`S`) of the schema.
const RELATIONS: &[&str] = &[
    "I tower_idempotency_processed_messages_daily_pkey",
    "S tower_idempotency_lease_token_seq",
    "i tower_idempotency_daily_floor_pkey",
    "i tower_idempotency_keys_expires_at",
    "i tower_idempotency_keys_phased",
    "i tower_idempotency_keys_pkey",
    "i tower_idempotency_message_failures_parked",
    "i tower_idempotency_message_failures_pkey",
    "i tower_idempotency_migrations_pkey",
    "i tower_idempotency_positions_pkey",
    "i tower_idempotency_processed_messages_pkey",
    "i tower_idempotency_processed_messages_processed_at",
    "i tower_idempotency_waiting_pkey",
    "p tower_idempotency_processed_messages_daily",
    "r tower_idempotency_daily_floor",
    "r tower_idempotency_keys",
    "r tower_idempotency_message_failures",
    "r tower_idempotency_migrations",
    "r tower_idempotency_positions",
    "r tower_idempotency_processed_messages",
    "r tower_idempotency_waiting",
];

/// Everything Postgres holds for the objects of `schema`, one line per object, sorted, with
/// the schema's name written `<schema>`: each function (signature, settings, full definition,
/// privileges, comment), each relation, column (type, nullability, default), constraint,
/// index and sequence. Run on `pool`, whose connections have `schema` on their search_path.
async fn catalog(pool: &PgPool, schema: &str) -> Vec<String> {
    let lines: Vec<String> = sqlx::query_scalar(
        "WITH s AS (SELECT oid FROM pg_namespace WHERE nspname = $1)
         SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid)
                || ') settings ' || coalesce(array_to_string(p.proconfig, ' | '), '')
                || ' acl ' || coalesce(p.proacl::text, '')
                || ' comment ' || coalesce(obj_description(p.oid, 'pg_proc'), '')
                || E'\n' || pg_get_functiondef(p.oid)
           FROM pg_proc AS p JOIN s ON p.pronamespace = s.oid
         UNION ALL
         SELECT 'relation ' || c.relname || ' kind ' || c.relkind::text
                || ' acl ' || coalesce(c.relacl::text, '')
                || ' comment ' || coalesce(obj_description(c.oid, 'pg_class'), '')
                || ' partitioned by ' || coalesce(pg_get_partkeydef(c.oid), '')
           FROM pg_class AS c JOIN s ON c.relnamespace = s.oid
         UNION ALL
         SELECT 'column ' || c.relname || ' ' || a.attnum || ' ' || a.attname || ' '
                || format_type(a.atttypid, a.atttypmod) || ' not null ' || a.attnotnull
                || ' default ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
                || ' comment ' || coalesce(col_description(c.oid, a.attnum), '')
           FROM pg_class AS c JOIN s ON c.relnamespace = s.oid
           JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           LEFT JOIN pg_attrdef AS d ON d.adrelid = c.oid AND d.adnum = a.attnum
          WHERE c.relkind IN ('r', 'p')
         UNION ALL
         SELECT 'constraint ' || c.relname || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
           FROM pg_constraint AS k JOIN pg_class AS c ON c.oid = k.conrelid
           JOIN s ON c.relnamespace = s.oid
         UNION ALL
         SELECT 'index ' || pg_get_indexdef(i.indexrelid)
           FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
           JOIN s ON c.relnamespace = s.oid
         UNION ALL
         SELECT 'sequence ' || c.relname || ' ' || format_type(q.seqtypid, NULL) || ' start '
                || q.seqstart || ' increment ' || q.seqincrement || ' min ' || q.seqmin
                || ' max ' || q.seqmax || ' cache ' || q.seqcache || ' cycle ' || q.seqcycle
           FROM pg_sequence AS q JOIN pg_class AS c ON c.oid = q.seqrelid
           JOIN s ON c.relnamespace = s.oid
         ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(!lines.is_empty(), "nothing in schema {schema}");
    lines
        .into_iter()
        .map(|line| line.replace(schema, "<schema>"))
        .collect()
}

/// The functions of `schema` (name and argument types) and its relations (kind and name).
/// Run on a pool whose connections have `schema` on their search_path.
async fn objects(pool: &PgPool, schema: &str) -> (Vec<String>, Vec<String>) {
    let functions = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text
           FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
          WHERE n.nspname = $1 ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap();
    let relations = sqlx::query_scalar(
        "SELECT c.relkind::text || ' ' || c.relname
           FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
          WHERE n.nspname = $1 ORDER BY c.relkind::text COLLATE \"C\", c.relname",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap();
    (functions, relations)
}

/// The recorded history: version, description, checksum, and when it was applied.
type History = Vec<(i64, String, Vec<u8>, String)>;

async fn history(pool: &PgPool) -> History {
    sqlx::query_as(
        "SELECT version, description, checksum, applied_at::text
           FROM tower_idempotency_migrations ORDER BY version",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The history without the times, to compare two schemas' histories.
fn entries(history: &History) -> Vec<(i64, String, Vec<u8>)> {
    history
        .iter()
        .map(|(v, d, c, _)| (*v, d.clone(), c.clone()))
        .collect()
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The SQL files of `dir`, in the order of their names.
fn sql_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension() == Some("sql".as_ref()))
        .collect();
    files.sort();
    files
}

/// Applies the first `count` of the old migrations in the pool's schema and records each
/// with its version and checksum, as the crate's `migrate()` did before they were replaced.
async fn migrate_old(pool: &PgPool, count: usize) {
    let files = sql_files(&root().join("tests/fixtures/old_migrations"));
    assert_eq!(files.len(), 13, "{files:?}");
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql(HISTORY_TABLE)
        .execute(&mut *tx)
        .await
        .unwrap();
    for file in &files[..count] {
        let name = file.file_stem().unwrap().to_str().unwrap();
        let (number, description) = name.split_once('_').unwrap();
        let sql = std::fs::read_to_string(file).unwrap();
        sqlx::raw_sql(AssertSqlSafe(sql.clone()))
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO tower_idempotency_migrations (version, description, checksum)
             VALUES ($1, $2, $3)",
        )
        .bind(number.parse::<i64>().unwrap())
        .bind(description.replace('_', " "))
        .bind(Sha256::digest(sql.as_bytes()).to_vec())
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

/// Every row of the store's tables, as text, in a fixed order.
async fn rows(pool: &PgPool) -> Vec<String> {
    let mut all = Vec::new();
    for table in [
        "tower_idempotency_keys",
        "tower_idempotency_processed_messages",
        "tower_idempotency_positions",
        "tower_idempotency_waiting",
    ] {
        let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT '{table} ' || t::text FROM {table} AS t ORDER BY 1"
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        all.extend(rows);
    }
    all
}

fn claim_request(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: "",
        key,
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

/// A schema migrated by `migrate()`, a pool on it, and its [`catalog`].
async fn fresh_schema() -> (PgSchema, PgPool, Vec<String>) {
    let fresh = PgSchema::new().await;
    let pool = fresh.pool(2).await;
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    let catalog = catalog(&pool, &fresh.name).await;
    (fresh, pool, catalog)
}

fn schema_error(result: Result<(), StoreError>) -> String {
    match result {
        Err(StoreError::Schema(msg)) => msg,
        other => panic!("expected StoreError::Schema, got {other:?}"),
    }
}

/// The files of `migrations/` in order, each with its version (the number its name starts
/// with), the description `migrate()` records, and the SHA-256 of its SQL.
fn shipped() -> Vec<(i64, String, Vec<u8>)> {
    let files = sql_files(&root().join("migrations"));
    let descriptions = ["schema", "phase leases", "daily inbox floor"];
    assert_eq!(files.len(), descriptions.len(), "{files:?}");
    files
        .iter()
        .zip(descriptions)
        .map(|(file, description)| {
            let name = file.file_name().unwrap().to_str().unwrap();
            let version = name.split('_').next().unwrap().parse().unwrap();
            let sql = std::fs::read(file).unwrap();
            (
                version,
                description.to_owned(),
                Sha256::digest(&sql).to_vec(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_fresh_schema_is_the_shipped_migrations_and_migrating_again_changes_nothing() {
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    let first = catalog(&pool, &schema.name).await;
    let recorded = history(&pool).await;

    // Every file in migrations/, recorded with its version and checksum, in order.
    let shipped = shipped();
    assert_eq!(shipped.iter().map(|m| m.0).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(entries(&recorded), shipped);
    // Exactly the documented objects: none that nothing calls.
    let (functions, relations) = objects(&pool, &schema.name).await;
    assert_eq!(functions, FUNCTIONS);
    assert_eq!(relations, RELATIONS);

    store.migrate().await.unwrap();
    Inbox::new(pool.clone()).migrate().await.unwrap();
    assert_eq!(catalog(&pool, &schema.name).await, first);
    assert_eq!(history(&pool).await, recorded);
    pool.close().await;
    schema.drop_schema().await;
}

/// A schema at an earlier version (here version 1, applied with another tool and recorded)
/// takes the later migrations and ends exactly as a fresh one; the files applied in order by
/// another tool make the same objects.
#[tokio::test]
async fn a_schema_at_an_earlier_version_takes_the_later_migrations() {
    let (fresh, _fresh_pool, expected) = fresh_schema().await;

    let by_hand = PgSchema::new().await;
    let pool = by_hand.pool(2).await;
    for file in sql_files(&root().join("migrations")) {
        let sql = std::fs::read_to_string(file).unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    // Less the history table, which only migrate() keeps.
    let without_history = |lines: &[String]| -> Vec<String> {
        lines
            .iter()
            .filter(|l| !l.contains("tower_idempotency_migrations"))
            .cloned()
            .collect()
    };
    assert_eq!(
        catalog(&pool, &by_hand.name).await,
        without_history(&expected)
    );

    let earlier = PgSchema::new().await;
    let pool = earlier.pool(2).await;
    let first = &sql_files(&root().join("migrations"))[0];
    let sql = std::fs::read_to_string(first).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE tower_idempotency_migrations (
             version bigint PRIMARY KEY, description text NOT NULL, checksum bytea NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (version, description, checksum) = shipped().remove(0);
    sqlx::query(
        "INSERT INTO tower_idempotency_migrations (version, description, checksum) \
         VALUES ($1, $2, $3)",
    )
    .bind(version)
    .bind(description)
    .bind(checksum)
    .execute(&pool)
    .await
    .unwrap();
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    assert_eq!(catalog(&pool, &earlier.name).await, expected);
    assert_eq!(entries(&history(&pool).await), shipped());
    for schema in [fresh, by_hand, earlier] {
        schema.drop_schema().await;
    }
}

#[tokio::test]
async fn a_schema_made_by_the_old_migrations_becomes_the_fresh_schema_and_keeps_its_rows() {
    let (fresh, fresh_pool, expected) = fresh_schema().await;
    let expected_history = entries(&history(&fresh_pool).await);

    let old = PgSchema::new().await;
    let pool = old.pool(4).await;
    migrate_old(&pool, 13).await;
    let before = catalog(&pool, &old.name).await;
    assert_ne!(before, expected, "the old migrations leave another schema");
    // Rows of every kind, written by this version of the store on the old schema: a
    // completed key, a key in progress, a processed message and a consumer's position.
    let store = PostgresStore::new(pool.clone());
    let calls = Calls::default();
    let svc = IdempotencyLayer::new(store.clone()).layer(support::handler(calls.clone()));
    let first = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("done"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 201);
    let held = IdempotencyKey::parse("held").unwrap();
    let ClaimOutcome::Acquired { .. } = store.claim(claim_request(&held)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let inbox = Inbox::new(pool.clone());
    let work = async |_: &mut PgConnection| Ok::<_, std::io::Error>(());
    assert!(matches!(
        inbox.process("c", "m1", work).await.unwrap(),
        Delivery::Processed(())
    ));
    sqlx::query("SELECT tower_idempotency_record_message('c', 'm2', 1000, 'order-1', 5)")
        .execute(&pool)
        .await
        .unwrap();
    let kept = rows(&pool).await;
    assert_eq!(kept.len(), 5, "{kept:#?}");

    store.migrate().await.unwrap();
    assert_eq!(catalog(&pool, &old.name).await, expected);
    assert_eq!(entries(&history(&pool).await), expected_history);
    assert_eq!(rows(&pool).await, kept);
    // Migrating again changes nothing.
    let recorded = history(&pool).await;
    store.migrate().await.unwrap();
    assert_eq!(catalog(&pool, &old.name).await, expected);
    assert_eq!(history(&pool).await, recorded);

    // The kept records work as before: a replay, a key still in flight, a duplicate message.
    let again = read(
        svc.oneshot(req("POST", "/pay", Some("done"), "b"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(calls.total(), 1);
    assert!(matches!(
        store.claim(claim_request(&held)).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    let work = async |_: &mut PgConnection| Ok::<_, std::io::Error>(());
    assert!(matches!(
        inbox.process("c", "m1", work).await.unwrap(),
        Delivery::Duplicate
    ));
    pool.close().await;
    fresh_pool.close().await;
    old.drop_schema().await;
    fresh.drop_schema().await;
}

#[tokio::test]
async fn a_schema_with_only_some_of_the_old_migrations_is_refused_with_the_fix() {
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    migrate_old(&pool, 5).await;
    let before = catalog(&pool, &schema.name).await;
    let recorded = history(&pool).await;

    let msg = schema_error(PostgresStore::new(pool.clone()).migrate().await);
    for needle in [
        "migrations 1–5 of the 13",
        &format!("\"{}\"", schema.name),
        "run migrate() of a tower-idempotency build that still has the 13 migrations",
        "drop the store's tables, sequence and functions",
        "PostgresStore::migrate",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in: {msg}");
    }
    // Nothing changed.
    assert_eq!(catalog(&pool, &schema.name).await, before);
    assert_eq!(history(&pool).await, recorded);

    // The reset the message points to, then migrate() makes the schema.
    sqlx::raw_sql(RESET).execute(&pool).await.unwrap();
    assert_eq!(objects(&pool, &schema.name).await, (vec![], vec![]));
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    let (functions, relations) = objects(&pool, &schema.name).await;
    assert_eq!(functions, FUNCTIONS);
    assert_eq!(relations, RELATIONS);
    pool.close().await;
    schema.drop_schema().await;
}

#[tokio::test]
async fn a_recorded_checksum_that_matches_no_known_migration_is_refused() {
    // The schema migration recorded with other SQL.
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("UPDATE tower_idempotency_migrations SET checksum = sha256('edited')")
        .execute(&pool)
        .await
        .unwrap();
    let before = catalog(&pool, &schema.name).await;
    let msg = schema_error(store.migrate().await);
    for needle in [
        "version 1 of the store's schema is recorded",
        "matches no SQL this version of tower-idempotency knows",
        &format!("\"{}\"", schema.name),
        "drop the store's tables, sequence and functions",
        "PostgresStore::migrate",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in: {msg}");
    }
    assert_eq!(catalog(&pool, &schema.name).await, before);
    pool.close().await;
    schema.drop_schema().await;

    // All thirteen old migrations, one of them recorded with other SQL: not taken over.
    let schema = PgSchema::new().await;
    let pool = schema.pool(2).await;
    migrate_old(&pool, 13).await;
    sqlx::query(
        "UPDATE tower_idempotency_migrations SET checksum = sha256('edited') WHERE version = 7",
    )
    .execute(&pool)
    .await
    .unwrap();
    let before = catalog(&pool, &schema.name).await;
    let recorded = history(&pool).await;
    let msg = schema_error(PostgresStore::new(pool.clone()).migrate().await);
    assert!(
        msg.contains("version 7 of the store's schema is recorded"),
        "{msg}"
    );
    assert!(msg.contains("drop the store's tables"), "{msg}");
    assert_eq!(catalog(&pool, &schema.name).await, before);
    assert_eq!(history(&pool).await, recorded);
    pool.close().await;
    schema.drop_schema().await;
}
