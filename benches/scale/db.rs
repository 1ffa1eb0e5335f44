//! The database side: [`Db`], the fresh schema with the store's pool and the purge's
//! connection (maintenance, counts, sizes, `pg_prewarm`), Postgres's cumulative WAL and
//! buffer counters ([`DbCounters`], [`PerOp`]), and the bulk load of completed records
//! ([`bulk_load`], step 1).

use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::keys::{the_answer, the_fingerprint};
use crate::{BoxError, common};

/// Rows per bulk `INSERT … SELECT` statement.
const CHUNK: u64 = 1_000_000;

pub(crate) struct Db {
    pub(crate) schema: String,
    admin: PgPool,
    /// The store's pool (`--concurrency` or `--clients` connections, whichever is more).
    pub(crate) pool: PgPool,
    /// One connection of its own for the purge.
    pub(crate) purge_pool: PgPool,
}

impl Db {
    pub(crate) async fn new(pool_size: u32) -> Result<Db, BoxError> {
        let (admin, schema, opts) = common::fresh_schema("scale").await?;
        let connect = |size: u32| {
            PgPoolOptions::new()
                .max_connections(size)
                .min_connections(size)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(opts.clone())
        };
        let pool = connect(pool_size).await?;
        let purge_pool = connect(1).await?;
        Ok(Db {
            schema,
            admin,
            pool,
            purge_pool,
        })
    }

    /// Runs `sql` on the schema's pool (maintenance statements: VACUUM, CHECKPOINT …).
    pub(crate) async fn exec(&self, sql: &'static str) -> Result<(), BoxError> {
        sqlx::raw_sql(sql).execute(&self.pool).await?;
        Ok(())
    }

    async fn scalar(&self, sql: &'static str) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar(sql).fetch_one(&self.pool).await?)
    }

    pub(crate) async fn expired_count(&self) -> Result<u64, BoxError> {
        let n = self
            .scalar("SELECT count(*) FROM tower_idempotency_keys WHERE expires_at <= now()")
            .await?;
        Ok(u64::try_from(n)?)
    }

    pub(crate) async fn row_count(&self) -> Result<u64, BoxError> {
        let n = self
            .scalar("SELECT count(*) FROM tower_idempotency_keys")
            .await?;
        Ok(u64::try_from(n)?)
    }

    /// Sizes of the table and of its two indexes, in MiB.
    pub(crate) async fn sizes(&self) -> Result<String, BoxError> {
        let (heap, pkey, exp): (i64, i64, i64) = sqlx::query_as(
            "SELECT pg_table_size('tower_idempotency_keys'),
                    pg_relation_size('tower_idempotency_keys_pkey'),
                    pg_relation_size('tower_idempotency_keys_expires_at')",
        )
        .fetch_one(&self.pool)
        .await?;
        let mib = |b: i64| b / (1024 * 1024);
        Ok(format!(
            "table {} MiB, primary key {} MiB, expires_at index {} MiB",
            mib(heap),
            mib(pkey),
            mib(exp)
        ))
    }

    /// `VACUUM ANALYZE`, then (in a measuring run) `CHECKPOINT`, so each measurement starts
    /// from the same clean state: no hint bits left to set, no dirty buffers to flush.
    pub(crate) async fn settle(&self, checkpoint: bool) -> Result<Duration, BoxError> {
        let t = Instant::now();
        self.exec("VACUUM ANALYZE tower_idempotency_keys").await?;
        if checkpoint {
            self.exec("CHECKPOINT").await?;
        }
        Ok(t.elapsed())
    }

    /// Loads the keys table and its primary key into shared buffers with `pg_prewarm` (the
    /// extension is created in the benchmark's schema, and dropped with it); prints what it
    /// loaded against `shared_buffers`.
    pub(crate) async fn prewarm(&self) -> Result<(), BoxError> {
        self.exec("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            .await?;
        // Where the extension lives: here, or wherever an earlier run left it.
        let (ext_schema,): (String,) = sqlx::query_as(
            "SELECT n.nspname::text FROM pg_extension AS e \
               JOIN pg_namespace AS n ON n.oid = e.extnamespace \
              WHERE e.extname = 'pg_prewarm'",
        )
        .fetch_one(&self.pool)
        .await?;
        let ext = ext_schema.replace('"', "\"\"");
        let (blocks,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT \"{ext}\".pg_prewarm('tower_idempotency_keys'::regclass) \
                  + \"{ext}\".pg_prewarm('tower_idempotency_keys_pkey'::regclass)"
        )))
        .fetch_one(&self.pool)
        .await?;
        let buffers = self
            .scalar("SELECT setting::bigint FROM pg_settings WHERE name = 'shared_buffers'")
            .await?;
        println!(
            "  pg_prewarm: {blocks} blocks of the table and its primary key, shared_buffers \
             {buffers} blocks{}",
            if blocks > buffers {
                " (they do not fit: most were evicted again)"
            } else {
                ""
            }
        );
        Ok(())
    }

    /// Cumulative WAL and buffer counters (see [`DbCounters`]).
    pub(crate) async fn counters(&self) -> Result<DbCounters, BoxError> {
        let (wal_records, wal_fpi, wal_bytes): (i64, i64, i64) =
            sqlx::query_as("SELECT wal_records, wal_fpi, wal_bytes::bigint FROM pg_stat_wal")
                .fetch_one(&self.pool)
                .await?;
        let (read, hit): (i64, i64) = sqlx::query_as(
            "SELECT coalesce(heap_blks_read, 0) + coalesce(idx_blks_read, 0),
                    coalesce(heap_blks_hit, 0) + coalesce(idx_blks_hit, 0)
               FROM pg_statio_all_tables
              WHERE schemaname = $1 AND relname = 'tower_idempotency_keys'",
        )
        .bind(&self.schema)
        .fetch_one(&self.pool)
        .await?;
        Ok(DbCounters {
            wal_records,
            wal_fpi,
            wal_bytes,
            read,
            hit,
        })
    }

    /// The process ID of the purge connection's server backend.
    pub(crate) async fn purge_backend_pid(&self) -> Result<u32, BoxError> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&self.purge_pool)
            .await?;
        Ok(u32::try_from(pid)?)
    }

    pub(crate) async fn drop_schema(self) {
        self.pool.close().await;
        self.purge_pool.close().await;
        let sql = format!("DROP SCHEMA {} CASCADE", self.schema);
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.admin)
            .await
        {
            eprintln!("could not drop schema {}: {e}", self.schema);
        }
        self.admin.close().await;
    }
}

/// Postgres's cumulative counters: WAL (`pg_stat_wal`, the whole cluster) and the keys
/// table's buffer accesses (`pg_statio_all_tables`, heap and indexes): `read` = not in
/// shared buffers (read from the OS), `hit` = found there.
#[derive(Clone, Copy)]
pub(crate) struct DbCounters {
    wal_records: i64,
    wal_fpi: i64,
    wal_bytes: i64,
    read: i64,
    hit: i64,
}

/// What each operation of a phase cost the database, on average.
pub(crate) struct PerOp {
    pub(crate) wal_records: f64,
    pub(crate) wal_fpi: f64,
    pub(crate) wal_bytes: f64,
    pub(crate) read: f64,
    pub(crate) hit: f64,
}

impl DbCounters {
    pub(crate) fn per_op(&self, before: &DbCounters, ops: usize) -> PerOp {
        let n = ops.max(1) as f64;
        let d = |a: i64, b: i64| (a - b) as f64 / n;
        PerOp {
            wal_records: d(self.wal_records, before.wal_records),
            wal_fpi: d(self.wal_fpi, before.wal_fpi),
            wal_bytes: d(self.wal_bytes, before.wal_bytes),
            read: d(self.read, before.read),
            hit: d(self.hit, before.hit),
        }
    }
}

impl PerOp {
    pub(crate) fn line(&self) -> String {
        format!(
            "per op: WAL {:.1} records, {:.2} full-page images, {:.0} bytes; keys table \
             buffers: {:.2} read from the OS, {:.1} hit",
            self.wal_records, self.wal_fpi, self.wal_bytes, self.read, self.hit
        )
    }
}

/// Completed records `from..to`; those below `live_from` expired 1 to 2 hours ago, the others
/// expire 2 to 24 hours from now (written over the last day with a 24 h TTL; none expires
/// during a run). The key of
/// record `i` is [`bulk_key`]`(i)`, so the keys arrive in random order, as UUIDs do.
const BULK_INSERT: &str = "
INSERT INTO tower_idempotency_keys
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at, created_at,
        completed_at, response_status, response_headers, response_body)
SELECT '', left(encode(sha256(convert_to('bulk-' || i, 'UTF8')), 'hex'), 32)::uuid::text,
       $1, NULL, NULL, e.expires_at, e.expires_at - interval '24 hours',
       e.expires_at - interval '24 hours', 201, $2,
       convert_to('{\"id\":' || i || ',\"status\":\"created\",\"received\":1024}', 'UTF8')
  FROM generate_series($3::bigint, $4::bigint - 1) AS i,
       LATERAL (SELECT CASE WHEN i < $5::bigint
                            THEN now() - interval '1 hour' - (i % 3600) * interval '1 second'
                            ELSE now() + interval '2 hours' + (i % 79200) * interval '1 second'
                       END AS expires_at) AS e";

/// Loads records `from..to` (those below `live_from` expired) in chunks of [`CHUNK`].
pub(crate) async fn bulk_load(
    db: &Db,
    from: u64,
    to: u64,
    live_from: u64,
) -> Result<Duration, BoxError> {
    let fp = the_fingerprint();
    let headers = the_answer().encode_headers();
    let t = Instant::now();
    let mut start = from;
    while start < to {
        let end = to.min(start + CHUNK);
        sqlx::query(BULK_INSERT)
            .bind(&fp.as_bytes()[..])
            .bind(&headers)
            .bind(i64::try_from(start)?)
            .bind(i64::try_from(end)?)
            .bind(i64::try_from(live_from)?)
            .execute(&db.pool)
            .await?;
        if to - from > CHUNK {
            println!(
                "  loaded {end} of {to} rows ({:.0} s)",
                t.elapsed().as_secs_f64()
            );
        }
        start = end;
    }
    Ok(t.elapsed())
}
