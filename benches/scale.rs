//! Scale benchmark of [`PostgresStore`]: does a big table slow the store down, and does
//! purging expired keys hurt the requests running meanwhile?
//!
//! ```text
//! cargo bench --bench scale -- [--rows 10000000] [--expired 1000000] [--ops 20000]
//!                              [--concurrency 8] [--clients 16] [--seconds 20] [--warmup 2]
//!                              [--batches 1000,5000] [--purge-duty 1.0] [--prewarm]
//! ```
//!
//! In a fresh schema (migrated with [`PostgresStore::migrate`], dropped at the end), straight
//! through the [`Store`] trait (no HTTP):
//!
//! 1. **Empty table.** `--ops` first requests (`claim` of a new key, then `complete`: the
//!    store's part of a first request through the layer) by `--concurrency` tasks, each
//!    timed; then `--ops` replays (`claim` of a completed key: one of the keys just
//!    completed, at random).
//! 2. **Bulk load.** `--rows` completed records with small bodies, `--expired` of them
//!    expired (`expires_at` 1 to 2 hours ago), the others live (expiring 2 to 24 hours from
//!    now, as records written over the last day with a 24 h TTL; none expires during the
//!    run), with UUID-shaped keys in
//!    random order, loaded by `INSERT … SELECT … FROM generate_series` in chunks of a million;
//!    then `VACUUM ANALYZE` and `CHECKPOINT`.
//! 3. **Full table.** The same first requests and replays (replays of bulk-loaded live keys,
//!    at random: most are not in Postgres's buffers), compared with step 1. For both steps
//!    it also reports what an operation cost the database: WAL records, full-page images and
//!    bytes (`pg_stat_wal`, the whole cluster) and the keys table's buffer reads and hits
//!    (`pg_statio_all_tables`), read after an 11 s pause so every backend has reported.
//!    With `--prewarm`, the table and its primary key are loaded into shared buffers
//!    (`pg_prewarm`) before steps 1 and 3: on a server whose `shared_buffers` holds them,
//!    this measures the table's size alone, without the cold reads of a fresh load.
//! 4. **Purge.** For each `--batches` size: `--clients` tasks send first requests back to
//!    back; once for `--seconds` without purging (the baseline), then while
//!    [`Store::purge_expired`] runs to completion on a connection of its own. Reported: the
//!    throughput during the purge against the baseline, the longest single request that
//!    overlapped the purge, how long the purge took and how many rows it deleted (checked
//!    against `--expired`), the CPU its Postgres backend used and how busy the machine was
//!    (`/proc`). Before the second and later batch sizes, `--expired` new expired
//!    records are loaded (after a `VACUUM` of the first purge's dead rows).
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it makes a smoke run of about a
//! second on a few thousand rows. `DATABASE_URL` selects the server (default the local one).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, PostgresStore, Store, StoredResponse,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The layer's defaults: lease 30 s, TTL 24 h.
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// How long to wait for every backend's statistics to reach the shared counters: a backend
/// that went idle less than a second after its last report waits 10 s
/// (`PGSTAT_IDLE_INTERVAL`) before the next.
const STATS_FLUSH: Duration = Duration::from_secs(11);

/// Rows per bulk `INSERT … SELECT` statement.
const CHUNK: u64 = 1_000_000;

// ---------------------------------------------------------------------------------------
// Arguments
// ---------------------------------------------------------------------------------------

struct Args {
    rows: u64,
    expired: u64,
    ops: usize,
    concurrency: usize,
    clients: usize,
    seconds: Duration,
    warmup: Duration,
    batches: Vec<usize>,
    /// `PostgresStore::with_purge_duty_cycle` for the purge (1.0: batches back to back).
    purge_duty: f64,
    /// Load the keys table and its primary key into shared buffers (`pg_prewarm`) before
    /// the empty-table and the full-table measurements.
    prewarm: bool,
    /// `false` in the smoke run: no `CHECKPOINT` (it would wait for a neighbour's writes) and
    /// no pause for Postgres's statistics to be flushed.
    measuring: bool,
}

const USAGE: &str = "usage: cargo bench --bench scale -- [--rows N] [--expired N] [--ops N] \
[--concurrency N] [--clients N] [--seconds S] [--warmup S] [--batches N,N…] [--purge-duty F] \
[--prewarm]";

fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it:
    // then a smoke run of about a second.
    let measuring = argv.iter().any(|a| a == "--bench");
    let mut args = if measuring {
        Args {
            rows: 10_000_000,
            expired: 1_000_000,
            ops: 20_000,
            concurrency: 8,
            clients: 16,
            seconds: Duration::from_secs(20),
            warmup: Duration::from_secs(2),
            batches: vec![1000, 5000],
            purge_duty: 1.0,
            prewarm: false,
            measuring: true,
        }
    } else {
        println!("test mode (no --bench): a smoke run; `cargo bench --bench scale` measures");
        Args {
            rows: 3000,
            expired: 300,
            ops: 200,
            concurrency: 4,
            clients: 4,
            seconds: Duration::from_millis(200),
            warmup: Duration::from_millis(50),
            batches: vec![64],
            purge_duty: 1.0,
            prewarm: false,
            measuring: false,
        }
    };
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let num = |v: &str| -> Result<u64, String> {
            v.replace('_', "")
                .parse::<u64>()
                .map_err(|_| format!("not a number: {v}"))
        };
        let positive = |v: &str| -> Result<usize, String> {
            num(v)
                .ok()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("not a positive number: {v}"))
        };
        let secs = |v: &str| -> Result<Duration, String> {
            v.parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| format!("not a number of seconds: {v}"))
        };
        match arg.as_str() {
            "--bench" => {}
            "--rows" => args.rows = num(&value(&arg)?)?,
            "--expired" => args.expired = num(&value(&arg)?)?,
            "--ops" => args.ops = positive(&value(&arg)?)?,
            "--concurrency" => args.concurrency = positive(&value(&arg)?)?,
            "--clients" => args.clients = positive(&value(&arg)?)?,
            "--seconds" => args.seconds = secs(&value(&arg)?)?,
            "--warmup" => args.warmup = secs(&value(&arg)?)?,
            "--batches" => {
                args.batches = value(&arg)?
                    .split(',')
                    .map(positive)
                    .collect::<Result<_, _>>()?;
            }
            "--purge-duty" => {
                let v = value(&arg)?;
                args.purge_duty = v
                    .parse::<f64>()
                    .ok()
                    .filter(|d| (0.01..=1.0).contains(d))
                    .ok_or_else(|| format!("--purge-duty takes 0.01 to 1.0, not {v}"))?;
            }
            "--prewarm" => args.prewarm = true,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if args.expired >= args.rows {
        return Err(format!(
            "--expired ({}) must be below --rows ({})",
            args.expired, args.rows
        ));
    }
    Ok(args)
}

// ---------------------------------------------------------------------------------------
// Keys, fingerprint, answer
// ---------------------------------------------------------------------------------------

/// A UUID-shaped key (what clients usually send): the first 16 bytes of SHA-256(`seed`),
/// as Postgres writes them with `left(encode(sha256(…), 'hex'), 32)::uuid::text`.
fn uuid_key(seed: &str) -> String {
    let d = Sha256::digest(seed.as_bytes());
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The key of bulk-loaded record `i`.
fn bulk_key(i: u64) -> IdempotencyKey {
    IdempotencyKey::parse(&uuid_key(&format!("bulk-{i}"))).unwrap()
}

/// Every request of the benchmark has this fingerprint (the bulk-loaded records too).
fn the_fingerprint() -> Fingerprint {
    Fingerprint::from_bytes(Sha256::digest(b"tower-idempotency scale bench").into())
}

/// The stored answer of a first request: `201`, a content type, a small JSON body.
fn the_answer() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from_static(br#"{"id":4711,"status":"created","received":1024}"#),
    )
}

// ---------------------------------------------------------------------------------------
// Schema and bulk load
// ---------------------------------------------------------------------------------------

struct Db {
    schema: String,
    admin: PgPool,
    /// The store's pool (`--concurrency` or `--clients` connections, whichever is more).
    pool: PgPool,
    /// One connection of its own for the purge.
    purge_pool: PgPool,
}

impl Db {
    async fn new(pool_size: u32) -> Result<Db, BoxError> {
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
    async fn exec(&self, sql: &'static str) -> Result<(), BoxError> {
        sqlx::raw_sql(sql).execute(&self.pool).await?;
        Ok(())
    }

    async fn scalar(&self, sql: &'static str) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar(sql).fetch_one(&self.pool).await?)
    }

    async fn expired_count(&self) -> Result<u64, BoxError> {
        let n = self
            .scalar("SELECT count(*) FROM tower_idempotency_keys WHERE expires_at <= now()")
            .await?;
        Ok(u64::try_from(n)?)
    }

    async fn row_count(&self) -> Result<u64, BoxError> {
        let n = self
            .scalar("SELECT count(*) FROM tower_idempotency_keys")
            .await?;
        Ok(u64::try_from(n)?)
    }

    /// Sizes of the table and of its two indexes, in MiB.
    async fn sizes(&self) -> Result<String, BoxError> {
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
    async fn settle(&self, checkpoint: bool) -> Result<Duration, BoxError> {
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
    async fn prewarm(&self) -> Result<(), BoxError> {
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
    async fn counters(&self) -> Result<DbCounters, BoxError> {
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
    async fn purge_backend_pid(&self) -> Result<u32, BoxError> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&self.purge_pool)
            .await?;
        Ok(u32::try_from(pid)?)
    }

    async fn drop_schema(self) {
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
struct DbCounters {
    wal_records: i64,
    wal_fpi: i64,
    wal_bytes: i64,
    read: i64,
    hit: i64,
}

/// What each operation of a phase cost the database, on average.
struct PerOp {
    wal_records: f64,
    wal_fpi: f64,
    wal_bytes: f64,
    read: f64,
    hit: f64,
}

impl DbCounters {
    fn per_op(&self, before: &DbCounters, ops: usize) -> PerOp {
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
    fn line(&self) -> String {
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
async fn bulk_load(db: &Db, from: u64, to: u64, live_from: u64) -> Result<Duration, BoxError> {
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

// ---------------------------------------------------------------------------------------
// Store operations
// ---------------------------------------------------------------------------------------

/// The store's part of a first request through the layer: claim a new key, complete it.
async fn first_request(store: &PostgresStore, key: &IdempotencyKey) -> Result<(), BoxError> {
    let outcome = store
        .claim(ClaimRequest {
            scope: "",
            key,
            fingerprint: the_fingerprint(),
            lease: LEASE,
            ttl: TTL,
        })
        .await?;
    let ClaimOutcome::Acquired { token, .. } = outcome else {
        return Err(format!("claiming new key {key}: {outcome:?}").into());
    };
    if !store.complete("", key, token, &the_answer(), TTL).await? {
        return Err(format!("completing {key}: the token no longer holds it").into());
    }
    Ok(())
}

/// A replay: the claim of a completed key.
async fn replay(store: &PostgresStore, key: &IdempotencyKey) -> Result<(), BoxError> {
    let outcome = store
        .claim(ClaimRequest {
            scope: "",
            key,
            fingerprint: the_fingerprint(),
            lease: LEASE,
            ttl: TTL,
        })
        .await?;
    match outcome {
        ClaimOutcome::Completed(_) => Ok(()),
        other => Err(format!("replaying {key}: {other:?}").into()),
    }
}

/// Latencies of a batch of operations, in microseconds, sorted.
struct Latencies {
    us: Vec<u32>,
    wall: Duration,
}

impl Latencies {
    fn new(mut us: Vec<u32>, wall: Duration) -> Self {
        us.sort_unstable();
        Self { us, wall }
    }

    /// The latency at quantile `q` (nearest rank), in milliseconds.
    fn ms(&self, q: f64) -> f64 {
        let Some(last) = self.us.len().checked_sub(1) else {
            return f64::NAN;
        };
        // `q` is in [0, 1], so the rank is in [0, last].
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((last as f64) * q).round() as usize;
        f64::from(self.us[rank.min(last)]) / 1000.0
    }

    fn max_ms(&self) -> f64 {
        self.us
            .last()
            .map_or(f64::NAN, |us| f64::from(*us) / 1000.0)
    }

    fn per_second(&self) -> f64 {
        self.us.len() as f64 / self.wall.as_secs_f64()
    }

    fn line(&self) -> String {
        format!(
            "{:>7.0} ops/s  p50 {:>6.3} ms  p99 {:>6.3} ms  max {:>7.3} ms  ({} ops)",
            self.per_second(),
            self.ms(0.50),
            self.ms(0.99),
            self.max_ms(),
            self.us.len()
        )
    }
}

/// A number of cores with two decimals, or `–`.
fn cores(c: Option<f64>) -> String {
    c.map_or_else(|| "–".to_owned(), |c| format!("{c:.2}"))
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs `ops` operations (`op(i)` for i in `0..ops`) on `concurrency` tasks, each timed,
/// after `warmup` untimed ones (`op(ops..ops + warmup)`).
async fn timed<F, Fut>(
    ops: usize,
    warmup: usize,
    concurrency: usize,
    op: F,
) -> Result<Latencies, BoxError>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    for phase in [Phase::Warmup, Phase::Measured] {
        let (range, count) = match phase {
            Phase::Warmup => (ops, warmup),
            Phase::Measured => (0, ops),
        };
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = Vec::with_capacity(concurrency);
        for _ in 0..concurrency {
            let (op, next) = (op.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut us = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok::<_, BoxError>(us);
                    }
                    let t = Instant::now();
                    op(range + i).await?;
                    us.push(micros(t.elapsed()));
                }
            }));
        }
        let mut all = Vec::with_capacity(count);
        for task in tasks {
            all.extend(task.await??);
        }
        if matches!(phase, Phase::Measured) {
            return Ok(Latencies::new(all, started.elapsed()));
        }
    }
    unreachable!("the measured phase returns")
}

#[derive(Clone, Copy)]
enum Phase {
    Warmup,
    Measured,
}

/// First requests and replays, timed.
struct OpStats {
    first: Latencies,
    replay: Latencies,
    first_db: PerOp,
    replay_db: PerOp,
}

async fn measure_ops(
    db: &Db,
    store: &PostgresStore,
    args: &Args,
    tag: &'static str,
    replay_keys: ReplayKeys,
) -> Result<OpStats, BoxError> {
    let warmup = (args.ops / 20).max(10);
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let before = flushed.await?;
    let s = store.clone();
    let first = timed(args.ops, warmup, args.concurrency, move |i| {
        let s = s.clone();
        async move {
            let key = IdempotencyKey::parse(&uuid_key(&format!("{tag}-new-{i}")))?;
            first_request(&s, &key).await
        }
    })
    .await?;
    println!("  first requests: {}", first.line());
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let middle = flushed.await?;
    let first_db = middle.per_op(&before, args.ops + warmup);
    println!("    {}", first_db.line());
    let s = store.clone();
    let replay = timed(args.ops, warmup, args.concurrency, move |i| {
        let s = s.clone();
        async move {
            let key = match replay_keys {
                // One of the keys the first requests above completed (measured or warm-up).
                ReplayKeys::JustCompleted { count } => {
                    let j = pick(i, count);
                    IdempotencyKey::parse(&uuid_key(&format!("{tag}-new-{j}")))?
                }
                ReplayKeys::Bulk { from, to } => {
                    let n = usize::try_from(to - from)?;
                    bulk_key(from + u64::try_from(pick(i, n))?)
                }
            };
            replay(&s, &key).await
        }
    })
    .await?;
    println!("  replays:        {}", replay.line());
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let replay_db = flushed.await?.per_op(&middle, args.ops + warmup);
    println!("    {}", replay_db.line());
    Ok(OpStats {
        first,
        replay,
        first_db,
        replay_db,
    })
}

/// Which completed keys the replays pick from.
#[derive(Clone, Copy)]
enum ReplayKeys {
    /// `{tag}-new-0 …`: the first requests' keys.
    JustCompleted { count: usize },
    /// Bulk-loaded live records `from..to`.
    Bulk { from: u64, to: u64 },
}

/// A pseudo-random index below `n` for operation `i` (a multiplicative hash).
fn pick(i: usize, n: usize) -> usize {
    let h = u64::try_from(i)
        .unwrap_or(0)
        .wrapping_add(1)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let h = h ^ (h >> 29);
    usize::try_from(h % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// Load with and without a purge
// ---------------------------------------------------------------------------------------

/// One timed request of the closed-loop load: when it started and ended.
struct Sample {
    start: Instant,
    end: Instant,
}

/// `clients` tasks sending first requests back to back until `stop` is set.
fn start_load(
    store: &PostgresStore,
    clients: usize,
    tag: String,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Result<Vec<Sample>, BoxError>>> {
    (0..clients)
        .map(|c| {
            let (store, tag, stop) = (store.clone(), tag.clone(), stop.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let key = IdempotencyKey::parse(&uuid_key(&format!("{tag}-{c}-{seq}")))?;
                    let start = Instant::now();
                    first_request(&store, &key).await?;
                    samples.push(Sample {
                        start,
                        end: Instant::now(),
                    });
                }
                Ok(samples)
            })
        })
        .collect()
}

async fn finish_load(
    tasks: Vec<tokio::task::JoinHandle<Result<Vec<Sample>, BoxError>>>,
) -> Result<Vec<Sample>, BoxError> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// The load in a window: throughput (requests that ended in it) and the latencies of the
/// requests that overlapped it.
struct Window {
    throughput: f64,
    lat: Latencies,
    /// How many cores the whole machine kept busy in the window.
    busy_cores: Option<f64>,
}

fn window(samples: &[Sample], from: Instant, to: Instant, busy: Option<Duration>) -> Window {
    let ended = samples
        .iter()
        .filter(|s| s.end >= from && s.end < to)
        .count();
    let overlapping: Vec<u32> = samples
        .iter()
        .filter(|s| s.start < to && s.end > from)
        .map(|s| micros(s.end - s.start))
        .collect();
    let span = to - from;
    Window {
        throughput: ended as f64 / span.as_secs_f64(),
        lat: Latencies::new(overlapping, span),
        busy_cores: busy.map(|b| b.as_secs_f64() / span.as_secs_f64()),
    }
}

/// Busy time of the whole machine so far: `/proc/stat`'s `cpu` line less idle and iowait, in
/// clock ticks (taken as 100 per second, Linux's `USER_HZ`). `None` off Linux.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some(Duration::from_millis((total - idle) * 10))
}

/// CPU time a process has used so far (`/proc/PID/schedstat`). `None` off Linux.
fn process_cpu(pid: u32) -> Option<Duration> {
    let ns = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(Duration::from_nanos(ns))
}

fn since(after: Option<Duration>, before: Option<Duration>) -> Option<Duration> {
    Some(after?.saturating_sub(before?))
}

struct PurgeRun {
    batch: usize,
    baseline: Window,
    during: Window,
    took: Duration,
    /// CPU time of the purge's Postgres backend.
    purge_cpu: Option<Duration>,
    deleted: u64,
    expected: u64,
    left: u64,
}

async fn purge_run(
    db: &Db,
    store: &PostgresStore,
    args: &Args,
    batch: usize,
    expected: u64,
) -> Result<PurgeRun, BoxError> {
    // Without purging: `--seconds` after `--warmup`.
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = start_load(store, args.clients, format!("base{batch}"), stop.clone());
    tokio::time::sleep(args.warmup).await;
    let (from, busy_from) = (Instant::now(), machine_busy());
    tokio::time::sleep(args.seconds).await;
    let (to, busy_to) = (Instant::now(), machine_busy());
    stop.store(true, Ordering::Relaxed);
    let baseline = window(
        &finish_load(tasks).await?,
        from,
        to,
        since(busy_to, busy_from),
    );
    println!(
        "  batch {batch}: without purge: {:>7.0} req/s  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms; \
         machine busy {} cores",
        baseline.throughput,
        baseline.lat.ms(0.5),
        baseline.lat.ms(0.99),
        baseline.lat.max_ms(),
        cores(baseline.busy_cores)
    );

    // The same load while the purge runs to completion (its own connection).
    let purger = PostgresStore::new(db.purge_pool.clone()).with_purge_duty_cycle(args.purge_duty);
    let purge_pid = db.purge_backend_pid().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = start_load(store, args.clients, format!("purge{batch}"), stop.clone());
    tokio::time::sleep(args.warmup).await;
    let (from, busy_from, cpu_from) = (Instant::now(), machine_busy(), process_cpu(purge_pid));
    let deleted = purger.purge_expired(batch).await?;
    let (to, busy_to, cpu_to) = (Instant::now(), machine_busy(), process_cpu(purge_pid));
    stop.store(true, Ordering::Relaxed);
    let during = window(
        &finish_load(tasks).await?,
        from,
        to,
        since(busy_to, busy_from),
    );
    let took = to - from;
    let purge_cpu = since(cpu_to, cpu_from);
    let left = db.expired_count().await?;
    println!(
        "  batch {batch}: during purge:  {:>7.0} req/s  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms; \
         machine busy {} cores; purge {:.2} s using {} cores, {deleted} rows deleted (expected \
         {expected}, {left} expired left)",
        during.throughput,
        during.lat.ms(0.5),
        during.lat.ms(0.99),
        during.lat.max_ms(),
        cores(during.busy_cores),
        took.as_secs_f64(),
        cores(purge_cpu.map(|c| c.as_secs_f64() / took.as_secs_f64())),
    );
    Ok(PurgeRun {
        batch,
        baseline,
        during,
        took,
        purge_cpu,
        deleted,
        expected,
        left,
    })
}

// ---------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------

struct Report {
    empty: OpStats,
    full: OpStats,
    load_time: Duration,
    settle_time: Duration,
    rows: u64,
    sizes: String,
    purges: Vec<PurgeRun>,
}

async fn run(db: &Db, args: &Args) -> Result<Report, BoxError> {
    let store = PostgresStore::new(db.pool.clone());
    store.migrate().await?;
    db.settle(args.measuring).await?;
    if args.prewarm {
        db.prewarm().await?;
    }

    println!("empty table:");
    let empty = measure_ops(
        db,
        &store,
        args,
        "empty",
        ReplayKeys::JustCompleted { count: args.ops },
    )
    .await?;

    println!(
        "bulk load: {} rows, {} of them expired",
        args.rows, args.expired
    );
    db.exec("TRUNCATE tower_idempotency_keys").await?;
    let load_time = bulk_load(db, 0, args.rows, args.expired).await?;
    let settle_time = db.settle(args.measuring).await?;
    if args.prewarm {
        db.prewarm().await?;
    }
    let rows = db.row_count().await?;
    let sizes = db.sizes().await?;
    println!(
        "  {rows} rows in {:.1} s; VACUUM ANALYZE + CHECKPOINT {:.1} s; {sizes}",
        load_time.as_secs_f64(),
        settle_time.as_secs_f64()
    );

    println!("full table ({} rows):", args.rows);
    let full = measure_ops(
        db,
        &store,
        args,
        "full",
        ReplayKeys::Bulk {
            from: args.expired,
            to: args.rows,
        },
    )
    .await?;

    let mut purges = Vec::new();
    let mut next_row = args.rows;
    for (n, &batch) in args.batches.iter().enumerate() {
        if n > 0 {
            // Expire as many records again: VACUUM the previous purge's dead rows first.
            bulk_load(
                db,
                next_row,
                next_row + args.expired,
                next_row + args.expired,
            )
            .await?;
            next_row += args.expired;
        }
        db.settle(args.measuring).await?;
        let expected = db.expired_count().await?;
        if expected != args.expired {
            return Err(format!(
                "{expected} expired rows before the purge, not {}",
                args.expired
            )
            .into());
        }
        println!(
            "purge, batch {batch}, duty cycle {}: {expected} expired rows",
            args.purge_duty
        );
        purges.push(purge_run(db, &store, args, batch, expected).await?);
    }
    Ok(Report {
        empty,
        full,
        load_time,
        settle_time,
        rows,
        sizes,
        purges,
    })
}

fn print_report(args: &Args, r: &Report) {
    println!();
    println!(
        "Store operations, {} timed per row after {} untimed, {} concurrent tasks; the full \
         table has {} rows ({} expired), loaded in {:.0} s (VACUUM ANALYZE + CHECKPOINT \
         {:.0} s): {}",
        args.ops,
        (args.ops / 20).max(10),
        args.concurrency,
        r.rows,
        args.expired,
        r.load_time.as_secs_f64(),
        r.settle_time.as_secs_f64(),
        r.sizes
    );
    println!();
    println!(
        "| operation | empty p50 ms | empty p99 ms | full p50 ms | full p99 ms | p50 ratio | p99 ratio | empty ops/s | full ops/s | target |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for (name, e, f) in [
        (
            "first request (claim + complete)",
            &r.empty.first,
            &r.full.first,
        ),
        ("replay (claim)", &r.empty.replay, &r.full.replay),
    ] {
        let (p50, p99) = (f.ms(0.5) / e.ms(0.5), f.ms(0.99) / e.ms(0.99));
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {p50:.2} | {p99:.2} | {:.0} | {:.0} | ≤ 1.2: {} |",
            e.ms(0.5),
            e.ms(0.99),
            f.ms(0.5),
            f.ms(0.99),
            e.per_second(),
            f.per_second(),
            if p50 <= 1.2 && p99 <= 1.2 {
                "met"
            } else {
                "missed"
            }
        );
    }
    println!();
    println!(
        "What each operation cost the database (WAL: the whole cluster; buffers: the keys \
         table and its indexes, read = not in shared buffers):"
    );
    println!();
    println!(
        "| operation | table | WAL records | full-page images | WAL bytes | buffers read | buffers hit |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (name, table, c) in [
        ("first request", "empty", &r.empty.first_db),
        ("first request", "full", &r.full.first_db),
        ("replay", "empty", &r.empty.replay_db),
        ("replay", "full", &r.full.replay_db),
    ] {
        println!(
            "| {name} | {table} | {:.1} | {:.2} | {:.0} | {:.2} | {:.1} |",
            c.wal_records, c.wal_fpi, c.wal_bytes, c.read, c.hit
        );
    }
    println!();
    println!(
        "Purge of {} expired rows among {} while {} clients send first requests ({} s without \
         the purge, after {} s warm-up):",
        args.expired,
        r.rows,
        args.clients,
        args.seconds.as_secs_f64(),
        args.warmup.as_secs_f64()
    );
    println!();
    println!(
        "| batch | req/s without | req/s during | ratio (≥ 0.9) | p99 ms without | p99 ms during | max ms without | max ms during (≤ 100) | purge took s | purge backend cores | machine busy cores without / during | deleted | expected |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|");
    for p in &r.purges {
        let ratio = p.during.throughput / p.baseline.throughput;
        println!(
            "| {} | {:.0} | {:.0} | {ratio:.3} {} | {:.3} | {:.3} | {:.3} | {:.3} {} | {:.2} | {} | {} / {} | {} | {} |",
            p.batch,
            p.baseline.throughput,
            p.during.throughput,
            if ratio >= 0.9 { "met" } else { "missed" },
            p.baseline.lat.ms(0.99),
            p.during.lat.ms(0.99),
            p.baseline.lat.max_ms(),
            p.during.lat.max_ms(),
            if p.during.lat.max_ms() <= 100.0 {
                "met"
            } else {
                "missed"
            },
            p.took.as_secs_f64(),
            cores(p.purge_cpu.map(|c| c.as_secs_f64() / p.took.as_secs_f64())),
            cores(p.baseline.busy_cores),
            cores(p.during.busy_cores),
            p.deleted,
            p.expected,
        );
    }
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(async {
        let size = u32::try_from(args.concurrency.max(args.clients))?;
        let db = Db::new(size).await?;
        println!("schema {}", db.schema);
        let report = run(&db, &args).await;
        db.drop_schema().await;
        report
    });
    match result {
        Ok(report) => {
            print_report(&args, &report);
            let wrong: Vec<_> = report
                .purges
                .iter()
                .filter(|p| p.deleted != p.expected || p.left != 0)
                .collect();
            if wrong.is_empty() {
                std::process::ExitCode::SUCCESS
            } else {
                for p in wrong {
                    eprintln!(
                        "batch {}: the purge deleted {} rows, expected {}; {} expired left",
                        p.batch, p.deleted, p.expected, p.left
                    );
                }
                std::process::ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("scale: failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
