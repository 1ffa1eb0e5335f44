//! The shared runner: the command line ([`Args`], [`parse_args`]), the four steps in order
//! ([`run`]: bulk load, empty against full table, the cost per operation, purge) and the
//! report ([`print_report`]).

use std::time::Duration;

use tower_idempotency::PostgresStore;

use crate::BoxError;
use crate::db::PerOp;
use crate::db::{Db, bulk_load};
use crate::ops::{Row, Side, compare, cores, measure_costs};
use crate::purge::{PurgeRun, purge_run};

pub(crate) struct Args {
    pub(crate) rows: u64,
    pub(crate) expired: u64,
    pub(crate) ops: usize,
    /// How many alternating rounds the empty and the full table's `ops` are split into.
    pub(crate) rounds: usize,
    pub(crate) concurrency: usize,
    pub(crate) clients: usize,
    pub(crate) seconds: Duration,
    pub(crate) warmup: Duration,
    pub(crate) batches: Vec<usize>,
    /// `PostgresStore::with_purge_duty_cycle` for the purge (1.0: batches back to back).
    pub(crate) purge_duty: f64,
    /// Load the keys table and its primary key into shared buffers (`pg_prewarm`) before
    /// the empty-table and the full-table measurements.
    pub(crate) prewarm: bool,
    /// `false` in the smoke run: no `CHECKPOINT` (it would wait for a neighbour's writes) and
    /// no pause for Postgres's statistics to be flushed.
    pub(crate) measuring: bool,
}

const USAGE: &str = "usage: cargo bench --bench scale -- [--rows N] [--expired N] [--ops N] \
[--rounds N] [--concurrency N] [--clients N] [--seconds S] [--warmup S] [--batches N,N…] [--purge-duty F] \
[--prewarm]";

pub(crate) fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it:
    // then a smoke run of about a second.
    let measuring = argv.iter().any(|a| a == "--bench");
    let mut args = if measuring {
        Args {
            rows: 10_000_000,
            expired: 1_000_000,
            ops: 20_000,
            rounds: 5,
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
            rounds: 2,
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
            "--rounds" => args.rounds = positive(&value(&arg)?)?,
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
// The steps and the report
// ---------------------------------------------------------------------------------------

pub(crate) struct Report {
    rows_compared: Vec<Row>,
    /// What a first request and a replay cost the database: empty table, full table.
    costs: [(PerOp, PerOp); 2],
    load_time: Duration,
    settle_time: Duration,
    rows: u64,
    sizes: String,
    pub(crate) purges: Vec<PurgeRun>,
}

/// The steps in order. `small` is the empty table's schema, `db` the full one's.
pub(crate) async fn run(small: &Db, db: &Db, args: &Args) -> Result<Report, BoxError> {
    let empty = Side {
        name: "empty",
        db: small,
        store: PostgresStore::new(small.pool.clone()),
        live: None,
    };
    let full = Side {
        name: "full",
        db,
        store: PostgresStore::new(db.pool.clone()),
        live: Some((args.expired, args.rows)),
    };
    empty.store.migrate().await?;
    full.store.migrate().await?;

    println!(
        "bulk load: {} rows, {} of them expired",
        args.rows, args.expired
    );
    let load_time = bulk_load(db, 0, args.rows, args.expired).await?;
    small.settle(args.measuring).await?;
    let settle_time = db.settle(args.measuring).await?;
    if args.prewarm {
        small.prewarm().await?;
        db.prewarm().await?;
    }
    let rows = db.row_count().await?;
    let sizes = db.sizes().await?;
    println!(
        "  {rows} rows in {:.1} s; VACUUM ANALYZE + CHECKPOINT {:.1} s; {sizes}",
        load_time.as_secs_f64(),
        settle_time.as_secs_f64()
    );

    println!(
        "empty and full table ({} rows), {} alternating rounds:",
        args.rows, args.rounds
    );
    let rows_compared = compare(&empty, &full, args).await?;
    let cost_ops = (args.ops / 10).max(10);
    println!("what an operation costs the database ({cost_ops} of each per table):");
    let mut costs = Vec::with_capacity(2);
    for side in [&empty, &full] {
        let (first, replay) = measure_costs(side, args, cost_ops).await?;
        println!("  {} first request {}", side.name, first.line());
        println!("  {} replay        {}", side.name, replay.line());
        costs.push((first, replay));
    }
    let costs: [(PerOp, PerOp); 2] = costs
        .try_into()
        .map_err(|_| "one cost measurement per table")?;

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
        purges.push(purge_run(db, &full.store, args, batch, expected).await?);
    }
    Ok(Report {
        rows_compared,
        costs,
        load_time,
        settle_time,
        rows,
        sizes,
        purges,
    })
}

pub(crate) fn print_report(args: &Args, r: &Report) {
    println!();
    println!(
        "Store operations, {} timed per row on each table in {} alternating rounds (each \
         round's after {} untimed), {} concurrent tasks; the full table has {} rows ({} \
         expired), loaded in {:.0} s (VACUUM ANALYZE + CHECKPOINT {:.0} s): {}",
        args.ops,
        args.rounds,
        ((args.ops / args.rounds).max(1) / 20).max(10),
        args.concurrency,
        r.rows,
        args.expired,
        r.load_time.as_secs_f64(),
        r.settle_time.as_secs_f64(),
        r.sizes
    );
    println!();
    println!(
        "| operation | empty p50 ms | empty p99 ms | full p50 ms | full p99 ms | p50 ratio | p50 ratio by round | p99 ratio | empty ops/s | full ops/s | target p50 ≤ 1.2 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|");
    for row in &r.rows_compared {
        let (e, f) = (&row.empty, &row.full);
        let (p50, p99) = (f.ms(0.5) / e.ms(0.5), f.ms(0.99) / e.ms(0.99));
        let rounds: Vec<String> = row.round_ratios.iter().map(|q| format!("{q:.3}")).collect();
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {p50:.3} | {} | {p99:.3} | {:.0} | {:.0} | {} |",
            row.name,
            e.ms(0.5),
            e.ms(0.99),
            f.ms(0.5),
            f.ms(0.99),
            rounds.join(" "),
            e.per_second(),
            f.per_second(),
            if p50 <= 1.2 { "met" } else { "missed" }
        );
    }
    println!();
    println!(
        "What each operation cost the database (WAL: the whole cluster; buffers: the keys \
         table and its indexes, read = not in shared buffers; replays on the full table are of \
         old keys):"
    );
    println!();
    println!(
        "| operation | table | WAL records | full-page images | WAL bytes | buffers read | buffers hit |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    let [(ef, er), (ff, fr)] = &r.costs;
    for (name, table, c) in [
        ("first request", "empty", ef),
        ("first request", "full", ff),
        ("replay", "empty", er),
        ("replay", "full", fr),
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
        "| batch | req/s without | req/s during | ratio (≥ 0.9) | p99 ms without | p99 ms during | max ms without | max ms during (≤ 100) | purge took s | purge backend cores | machine busy cores without / during | failed requests without / during | deleted | expected |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|");
    for p in &r.purges {
        let ratio = p.during.throughput / p.baseline.throughput;
        println!(
            "| {} | {:.0} | {:.0} | {ratio:.3} {} | {:.3} | {:.3} | {:.3} | {:.3} {} | {:.2} | {} | {} / {} | {} / {} | {} | {} |",
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
            p.baseline.failed,
            p.during.failed,
            p.deleted,
            p.expected,
        );
    }
}
