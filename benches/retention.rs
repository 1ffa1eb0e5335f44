//! Retention of an inbox at scale: the batched purge of the plain table against dropping a
//! day's partition of the daily one.
//!
//! ```text
//! cargo bench --bench retention -- [--messages 10000000] [--days 10] [--batch 10000]
//!                                  [--workers 4] [--seconds 5]
//! ```
//!
//! In a fresh schema (dropped at the end), `--messages` IDs are bulk-loaded into each layout,
//! spread evenly over `--days` days (the plain table by `processed_at`, the daily one by
//! `day`), then `VACUUM ANALYZE` and `CHECKPOINT`. Then, for each layout in turn, the oldest
//! day (a `--days`th of the IDs) is removed: `Inbox::purge_older_than` in `--batch` batches,
//! and `DailyInbox::maintain` with a retention a day shorter (a concurrent detach and a
//! drop). Printed for each: how long the removal took, the WAL it wrote (`pg_current_wal_lsn`
//! before and after: the whole cluster), the table's size after, and the deliveries per
//! second that `--workers` tasks processed on that layout while it ran, against the same
//! load for `--seconds` just before (new IDs, each in its own transaction).
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it makes a smoke run on
//! 20,000 IDs. `DATABASE_URL` selects the server (default the local one).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tower_idempotency::inbox::{DailyInbox, Inbox};

const DAY: Duration = Duration::from_secs(86_400);

struct Args {
    messages: u64,
    days: u64,
    batch: usize,
    workers: usize,
    seconds: u64,
}

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let bench = argv.iter().any(|a| a == "--bench");
    let get = |name: &str, default: u64| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .map_or(default, |v| v.parse().unwrap())
    };
    let messages = get("--messages", if bench { 10_000_000 } else { 20_000 });
    Args {
        messages,
        days: get("--days", 10),
        batch: usize::try_from(get("--batch", 10_000)).unwrap(),
        workers: usize::try_from(get("--workers", 4)).unwrap(),
        seconds: get("--seconds", if bench { 5 } else { 1 }),
    }
}

async fn exec(pool: &PgPool, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

async fn wal(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn size(pool: &PgPool, table: &str) -> String {
    // A partitioned table has no storage of its own: its partitions' sizes are summed.
    sqlx::query_scalar(
        "SELECT pg_size_pretty(pg_total_relation_size($1::regclass) + coalesce((
                SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass)
                 WHERE relid <> $1::regclass), 0)::bigint)",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Deliveries of new IDs by a few tasks, to one layout, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    started: Instant,
}

impl Load {
    fn start(
        plain: &Inbox,
        daily: &DailyInbox,
        use_daily: bool,
        workers: usize,
        tag: &str,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let tasks = (0..workers)
            .map(|w| {
                let (plain, daily, stop, done) =
                    (plain.clone(), daily.clone(), stop.clone(), done.clone());
                let tag = tag.to_owned();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let id = format!("{tag}-{w}-{n}");
                        let work = async |_: &mut PgConnection| Ok::<_, sqlx::Error>(());
                        if use_daily {
                            let _ = daily
                                .process("bench", &id, SystemTime::now(), work)
                                .await
                                .unwrap();
                        } else {
                            let _ = plain.process("bench", &id, work).await.unwrap();
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Load {
            stop,
            done,
            tasks,
            started: Instant::now(),
        }
    }

    /// Stops the load; its deliveries per second.
    async fn stop(self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64();
        for t in self.tasks {
            t.await.unwrap();
        }
        self.done.load(Ordering::Relaxed) as f64 / secs
    }
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let schema = format!("ti_bench_retention_{}", std::process::id());
    let admin = PgPool::connect(&url).await.unwrap();
    exec(&admin, format!("CREATE SCHEMA {schema}")).await;
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(args.workers + 2).unwrap())
        .connect_with(options)
        .await
        .unwrap();
    let plain = Inbox::new(pool.clone());
    plain.migrate().await.unwrap();
    let daily = DailyInbox::new(pool.clone(), DAY * u32::try_from(args.days).unwrap()).unwrap();
    daily.maintain().await.unwrap();

    let started = Instant::now();
    let chunk = 1_000_000u64.min(args.messages);
    let mut from = 1;
    while from <= args.messages {
        let to = (from + chunk - 1).min(args.messages);
        let days = args.days;
        // Hours past midnight, so no ID sits on a day's boundary.
        exec(&pool, format!(
            "INSERT INTO tower_idempotency_processed_messages (consumer, message_id, processed_at)
             SELECT 'bench', md5(n::text) || n,
                    date_trunc('day', now()) - (n % {days}) * interval '1 day' + interval '1 hour'
               FROM generate_series({from}, {to}) n;
             INSERT INTO tower_idempotency_processed_messages_daily (consumer, message_id, day, processed_at)
             SELECT 'bench', md5(n::text) || n, current_date - (n % {days})::integer,
                    date_trunc('day', now()) - (n % {days}) * interval '1 day' + interval '1 hour'
               FROM generate_series({from}, {to}) n;"
        )).await;
        from = to + 1;
    }
    exec(
        &pool,
        "VACUUM ANALYZE tower_idempotency_processed_messages".into(),
    )
    .await;
    exec(
        &pool,
        "VACUUM ANALYZE tower_idempotency_processed_messages_daily".into(),
    )
    .await;
    exec(&pool, "CHECKPOINT".into()).await;
    println!(
        "loaded {} IDs over {} days into each layout in {:.0?}; plain {}, daily {}",
        args.messages,
        args.days,
        started.elapsed(),
        size(&pool, "tower_idempotency_processed_messages").await,
        size(&pool, "tower_idempotency_processed_messages_daily").await,
    );

    println!(
        "{:<28} {:>10} {:>12} {:>10} {:>14} {:>14}",
        "removal of the oldest day", "took", "WAL", "size after", "deliveries/s", "before"
    );
    for use_daily in [false, true] {
        let layout = if use_daily { "daily" } else { "plain" };
        let load = Load::start(
            &plain,
            &daily,
            use_daily,
            args.workers,
            &format!("{layout}-base"),
        );
        tokio::time::sleep(Duration::from_secs(args.seconds)).await;
        let before = load.stop().await;
        let load = Load::start(
            &plain,
            &daily,
            use_daily,
            args.workers,
            &format!("{layout}-during"),
        );
        let wal_before = wal(&pool).await;
        let started = Instant::now();
        let retention = DAY * u32::try_from(args.days - 1).unwrap();
        let what = if use_daily {
            let shorter = DailyInbox::new(pool.clone(), retention).unwrap();
            let m = shorter.maintain().await.unwrap();
            format!("daily: drop {} partition", m.dropped.len())
        } else {
            let n = plain.purge_older_than(retention, args.batch).await.unwrap();
            format!("plain: purge {n} IDs")
        };
        let took = started.elapsed();
        let wal_after = wal(&pool).await;
        let during = load.stop().await;
        let table = if use_daily {
            "tower_idempotency_processed_messages_daily"
        } else {
            "tower_idempotency_processed_messages"
        };
        println!(
            "{:<28} {:>10.2?} {:>9.1} MB {:>10} {:>14.0} {:>14.0}",
            what,
            took,
            (wal_after - wal_before) as f64 / 1e6,
            size(&pool, table).await,
            during,
            before
        );
    }
    pool.close().await;
    exec(&admin, format!("DROP SCHEMA {schema} CASCADE")).await;
}
